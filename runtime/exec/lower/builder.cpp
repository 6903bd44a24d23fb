// The program builder: buffers by role, saved context by (op, codegen::Key), GEMM and kernel steps with their
// arguments bound to buffer ids once, so the executor never looks anything up by name.
#include "exec/lower/builder.hpp"

#include <algorithm>

#include "common/error.hpp"

namespace jitfuse::exec {

using codegen::Arg;

Builder::Builder(Program& p, const std::string& seq) : p_(p), seq_(seq) {
  const int n = static_cast<int>(p.ops.size());
  act_.assign(n + 1, -1);
  grad_.assign(n + 1, -1);
  p.values.assign(n + 1, -1);
  p.gradients.assign(n + 1, -1);
  p.channel_grads.assign(n, -1);
}

void Builder::begin_group(bool forward, int gi, const fuser::Group& g) {
  end_side_lifetimes();
  forward_ = forward;
  group_ = gi;
  g_ = g;
}

size_t Builder::dtype_bytes_of(int64_t rows, int64_t cols) const {
  return static_cast<size_t>(rows) * static_cast<size_t>(cols) * static_cast<size_t>(ops::dtype_bytes(p_.recipe.dtype));
}

int Builder::add(Buffer b) {
  b.id = static_cast<int>(p_.buffers.size());
  if (b.bytes == 0 && b.rows >= 0) b.bytes = static_cast<size_t>(b.rows * b.cols) * ops::dtype_bytes(b.dtype);
  p_.buffers.push_back(std::move(b));
  return p_.buffers.back().id;
}

int Builder::caller(BufferRole role, const std::string& name, int op, int slot, ops::DType dt, int64_t rows,
                    int64_t cols) {
  Buffer b;
  b.role = role;
  b.storage = Storage::caller;
  b.name = name;
  b.op = op;
  b.slot = slot;
  b.dtype = dt;
  b.rows = rows;
  b.cols = cols;
  return add(b);
}

int Builder::keyed(int id, Key key) {
  p_.buffers.at(static_cast<size_t>(id)).key = codegen::key_name(key);
  return id;
}

int Builder::act(int i) {
  auto& id = act_.at(static_cast<size_t>(i));
  if (id >= 0) return id;
  const int n = static_cast<int>(p_.ops.size());
  const auto& shape = i < n ? p_.ops[i].in : p_.ops[n - 1].out;
  const int64_t rows = ops::rows_of(shape), cols = ops::cols_of(shape);
  if (i == 0) {
    id = p_.input = caller(BufferRole::input, "input", -1, -1, p_.recipe.dtype, rows, cols);
  } else if (i == n) {
    id = p_.output = caller(BufferRole::output, "output", -1, -1, fp8::output_dtype(p_.recipe, p_.ops[n - 1].kind),
                            rows, cols);
  } else {
    Buffer b;
    b.role = BufferRole::activation;
    b.storage = Storage::fwd_arena;
    b.name = "act" + std::to_string(i);
    b.op = i;
    b.dtype = p_.recipe.dtype;
    b.rows = rows;
    b.cols = cols;
    id = add(b);
  }
  p_.values[static_cast<size_t>(i)] = id;
  return id;
}

int Builder::grad_of(int i) {
  auto& id = grad_.at(static_cast<size_t>(i));
  if (id >= 0) return id;
  const int n = static_cast<int>(p_.ops.size());
  const auto& shape = i < n ? p_.ops[i].in : p_.ops[n - 1].out;
  const int64_t rows = ops::rows_of(shape), cols = ops::cols_of(shape);
  if (i == 0) {
    id = p_.grad_input = caller(BufferRole::grad_input, "grad_input", -1, -1, p_.recipe.dtype, rows, cols);
  } else if (i == n) {
    id = p_.grad_output = caller(BufferRole::grad_output, "grad_output", -1, -1, p_.recipe.dtype, rows, cols);
  } else {
    Buffer b;
    b.role = BufferRole::gradient;
    b.storage = Storage::bwd_arena;
    b.name = "grad" + std::to_string(i);
    b.op = i;
    b.dtype = p_.recipe.dtype;
    b.rows = rows;
    b.cols = cols;
    id = add(b);
  }
  p_.gradients[static_cast<size_t>(i)] = id;
  return id;
}

int Builder::param(int op, Key key) {
  const auto k = std::make_pair(op, key);
  if (auto it = params_.find(k); it != params_.end()) return it->second;
  const std::string name = codegen::key_name(key);
  for (const auto& prm : p_.ops.at(static_cast<size_t>(op)).params)
    if (prm.name == name)
      return params_[k] = keyed(caller(BufferRole::param, "op" + std::to_string(op) + "." + name, op, -1,
                                       p_.recipe.dtype, ops::rows_of(prm.shape), ops::cols_of(prm.shape)),
                                key);
  fail(Status::internal, "{} has no parameter '{}'", p_.ops[op].label(), name);
}

int Builder::grad(int op, Key key) {
  const auto k = std::make_pair(op, key);
  if (auto it = grads_.find(k); it != grads_.end()) return it->second;
  const Buffer prm = p_.buffer(param(op, key));
  return grads_[k] = keyed(caller(BufferRole::grad, "grad op" + std::to_string(op) + "." + codegen::key_name(key), op,
                                  -1, prm.dtype, prm.rows, prm.cols),
                           key);
}

// The four caller tensors of add_extra_input / make_extra_output ops, by role: one accessor, one table.
int Builder::extra(BufferRole role, int op) {
  struct Kind {
    BufferRole role;
    const char* name;
    std::vector<int> Program::*ids;
  };
  static constexpr Kind kKinds[] = {{BufferRole::extra_in, "extra_input", &Program::extra_in},
                                    {BufferRole::extra_out, "extra_output", &Program::extra_out},
                                    {BufferRole::grad_extra_out, "grad_extra_output", &Program::grad_extra_out},
                                    {BufferRole::grad_extra_in, "grad_extra_input", &Program::grad_extra_in}};
  const Kind* k = nullptr;
  for (const auto& e : kKinds)
    if (e.role == role) k = &e;
  if (!k) fail(Status::internal, "no extra tensor of role {}", role_name(role));
  auto key = std::make_pair(op, role);
  if (auto it = extra_.find(key); it != extra_.end()) return it->second;
  const auto& o = p_.ops.at(static_cast<size_t>(op));
  if (const int routed = channel_route(role, o); routed != kNotRouted) return routed;
  // An op's own extra input (cross_entropy's labels, moe's indices and probabilities) has its own dtype and shape,
  // read as scalars; so has its gradient (moe_unpermute's dprobs).
  const bool own = (role == BufferRole::extra_in || role == BufferRole::grad_extra_in) && o.extra_input;
  const ops::Shape& shape = own ? o.extra_input->shape : o.out;
  const int id = caller(role, std::string(k->name) + "[" + std::to_string(o.extra_slot) + "]", op, o.extra_slot,
                        own ? o.extra_input->dtype : p_.recipe.dtype, ops::rows_of(shape), ops::cols_of(shape));
  if (own) p_.buffers[static_cast<size_t>(id)].needs_align16 = false;
  auto& ids = p_.*(k->ids);
  if (static_cast<int>(ids.size()) <= o.extra_slot) ids.resize(o.extra_slot + 1, -1);
  ids[static_cast<size_t>(o.extra_slot)] = id;
  return extra_[key] = id;
}

// Channels (docs/ops.md#channels): a reader's value and gradient are its source's (the fork's buffers, or
// the caller's channel's first reader's); a hidden fork's value and gradient are the program's own buffers.
int Builder::channel_route(BufferRole role, const ops::Op& o) {
  const bool reader = o.family == ops::Family::add_extra_input && o.channel_src >= 0 && o.channel_src != o.index;
  if (reader) {
    const auto& src = p_.ops.at(static_cast<size_t>(o.channel_src));
    if (src.family != ops::Family::make_extra_output) return extra(role, src.index);  // the caller's channel
    if (role == BufferRole::extra_in) return extra(BufferRole::extra_out, src.index);
    if (role == BufferRole::grad_extra_in) return channel_grad(src.index);
  }
  if (o.family == ops::Family::make_extra_output && o.extra_slot < 0) {  // a hidden channel
    if (role == BufferRole::grad_extra_out) return channel_grad(o.index);
    if (role == BufferRole::extra_out)
      return extra_[std::make_pair(o.index, role)] = channel_buffer(o, BufferRole::activation, Storage::fwd_arena,
                                                                    "channel ");
  }
  return kNotRouted;
}

// A buffer of fork `o`'s channel: its value (forward arena) or its gradient (backward arena).
int Builder::channel_buffer(const ops::Op& o, BufferRole role, Storage storage, const char* prefix) {
  Buffer b;
  b.role = role;
  b.storage = storage;
  b.name = prefix + o.channel;
  b.op = o.index;
  b.dtype = p_.recipe.dtype;
  b.rows = ops::rows_of(o.in);
  b.cols = ops::cols_of(o.in);
  return add(b);
}

// The gradient a channel's readers write (the last one) and add into (the others), which its fork reads.
int Builder::channel_grad(int fork) {
  int& id = p_.channel_grads.at(static_cast<size_t>(fork));
  if (id < 0) id = channel_buffer(p_.ops.at(static_cast<size_t>(fork)), BufferRole::gradient, Storage::bwd_arena,
                                  "grad channel ");
  return id;
}

bool Builder::pass_through_grad(int i) {
  const auto& o = p_.ops.at(static_cast<size_t>(i));
  if (forward_ || o.family != ops::Family::add_extra_input || o.channel_src < 0 || o.grad_accumulate) return false;
  const int fork = o.channel_src;
  const auto& src = p_.ops.at(static_cast<size_t>(fork));
  if (src.family != ops::Family::make_extra_output || src.channel_readers != 1) return false;  // the only reader
  int& channel = p_.channel_grads.at(static_cast<size_t>(fork));
  if (grad_.at(static_cast<size_t>(i)) >= 0 || channel >= 0) return false;
  const int id = grad_of(i + 1);
  grad_[static_cast<size_t>(i)] = id;
  p_.gradients[static_cast<size_t>(i)] = id;
  channel = id;
  return true;
}

bool Builder::pass_through(int i) {
  const int n = static_cast<int>(p_.ops.size());
  auto& ids = forward_ ? act_ : grad_;
  auto& table = forward_ ? p_.values : p_.gradients;
  const int from = forward_ ? i : i + 1, to = forward_ ? i + 1 : i;
  if ((forward_ && to == n) || (!forward_ && to == 0) || ids.at(static_cast<size_t>(to)) >= 0) return false;
  const int id = forward_ ? act(from) : grad_of(from);
  ids[static_cast<size_t>(to)] = id;
  table[static_cast<size_t>(to)] = id;
  return true;
}

void Builder::comm(const CommStep& c, const std::string& what) {
  Step s;
  s.kind = Step::Kind::comm;
  s.group = group_;
  s.what = what;
  s.comm = c;
  push(std::move(s));
}

void Builder::place_last(int stream, std::vector<int> waits) {
  auto& steps = forward_ ? p_.forward : p_.backward;
  if (steps.empty()) fail(Status::internal, "place_last: no step yet");
  steps.back().stream = stream;
  steps.back().waits = std::move(waits);
  if (stream != 0 && side_first_ < 0) side_first_ = static_cast<int>(steps.size()) - 1;
  if (stream != 0 && steps.back().kind == Step::Kind::comm)
    for (int id : {steps.back().comm.send, steps.back().comm.recv})
      if (id >= 0) side_buffers_.push_back(id);
}

// A side-stream step may run at any time between the group's first side-stream step (where the side stream forks
// from the caller's) and the group's last step (the join): the arena packer must not hand its buffers to any step
// of the group in that span — a copy engine writing a gathered buffer while an earlier GEMM's workspace still
// occupies those bytes — so they live over all of it.
void Builder::end_side_lifetimes() {
  const int last = static_cast<int>(steps()) - 1;
  for (int id : side_buffers_) {
    auto& b = p_.buffers.at(static_cast<size_t>(id));
    b.first = b.first < 0 ? side_first_ : std::min(b.first, side_first_);
    b.last = std::max(b.last, last);
  }
  side_buffers_.clear();
  side_first_ = -1;
}

int Builder::fp8_state(int op, fp8::Operand operand, fp8::Part part) {
  auto key = std::make_tuple(op, operand, part);
  if (auto it = state_.find(key); it != state_.end()) return it->second;
  const int64_t len = part == fp8::Part::history ? std::max(1, p_.recipe.amax_history) : 1;
  const std::string tensor = fp8::name(operand);
  const std::string name = "op" + std::to_string(op) + "." + (tensor.empty() ? "" : tensor + ".") + fp8::name(part);
  const int id = caller(BufferRole::recipe_state, name, op, -1, ops::DType::f32, 1, len);
  p_.buffers[static_cast<size_t>(id)].key = fp8::name(part);  // bound by (fp8_operand, fp8_part), typed
  p_.buffers[static_cast<size_t>(id)].fp8_operand = operand;
  p_.buffers[static_cast<size_t>(id)].fp8_part = part;
  return state_[key] = id;
}

Builder::Fp8Operand& Builder::fp8_operand(int lin, fp8::Operand operand) {
  using fp8::Operand;
  auto key = std::make_pair(lin, operand);
  if (auto it = fp8_.find(key); it != fp8_.end()) return it->second;
  const auto& o = p_.ops.at(static_cast<size_t>(lin));
  int64_t rows = 0, cols = 0;
  switch (operand) {
    case Operand::input: rows = ops::rows_of(o.in), cols = ops::cols_of(o.in); break;
    case Operand::grad_output: rows = ops::rows_of(o.out), cols = ops::cols_of(o.out); break;
    case Operand::weight: rows = ops::cols_of(o.out), cols = ops::cols_of(o.in); break;
    case Operand::none: fail(Status::internal, "{}: an FP8 copy needs an operand", o.label());
  }
  // fp8_block: every operand E4M3 (TransformerEngine's Float8BlockScaling), per-block scales.
  const bool block = p_.recipe.is_block();
  const ops::DType dt = operand == Operand::grad_output && !block ? ops::DType::e5m2 : ops::DType::e4m3;
  const bool weight = operand == Operand::weight;
  const Storage row_at = weight ? Storage::persistent : forward_ ? Storage::fwd_arena : Storage::bwd_arena;
  // The input's transposed copy is what the wgrad reads: it and the scale_inv both copies share are saved.
  const Storage col_at = weight                     ? Storage::persistent
                         : operand == Operand::input ? Storage::saved_block
                                                     : Storage::bwd_arena;
  auto make = [&](fp8::Part part, Storage at, int64_t r, int64_t c, ops::DType d) {
    Buffer b;
    b.role = BufferRole::fp8;
    b.storage = at;
    b.key = std::string(fp8::name(operand)) + "." + fp8::name(part);
    b.name = "op" + std::to_string(lin) + "." + b.key;
    b.op = lin;
    b.fp8_operand = operand;
    b.fp8_part = part;
    b.dtype = d;
    b.rows = r;
    b.cols = c;
    return add(b);
  };
  Fp8Operand f;
  f.rows = rows;
  f.cols = cols;
  f.row = make(fp8::Part::row, row_at, rows, cols, dt);
  if (p_.training) f.col = make(fp8::Part::col, col_at, cols, rows, dt);
  if (!block) {
    f.scale_inv = make(fp8::Part::scale_inv, p_.training ? col_at : row_at, 1, 1, ops::DType::f32);
    p_.buffers[static_cast<size_t>(f.scale_inv)].needs_align16 = false;
  } else if (weight) {  // one scale per 128 x 128 block: [rows/128, cols/128], and its transpose, each row
    // padded to a multiple of 4 scales (the leading dimension cuBLASLt reads them with; block_cast.cuh)
    const int64_t rb = (rows + 127) / 128, cb = (cols + 127) / 128;
    auto pad4 = [](int64_t v) { return (v + 3) / 4 * 4; };
    f.scale_inv = make(fp8::Part::scale_inv, row_at, pad4(rb), pad4(cb), ops::DType::f32);
    if (p_.training) f.col_scale_inv = make(fp8::Part::col_scale_inv, col_at, pad4(cb), pad4(rb), ops::DType::f32);
  } else {  // 1x128 blocks along the columns [cols/128, rows]; 128x1 along the rows [rows/128, cols]
    f.scale_inv = make(fp8::Part::scale_inv, p_.training ? col_at : row_at, (cols + 127) / 128, rows, ops::DType::f32);
    if (p_.training) f.col_scale_inv = make(fp8::Part::col_scale_inv, col_at, (rows + 127) / 128, cols, ops::DType::f32);
  }
  return fp8_[key] = f;
}

int Builder::rng_state() {
  if (p_.rng >= 0) return p_.rng;
  Buffer b;
  b.role = BufferRole::rng_state;
  // The backward's regenerated masks read the forward's state, so training keeps it in the saved block.
  b.storage = p_.training ? Storage::saved_block : Storage::fwd_arena;
  b.name = "rng {seed, offset}";
  b.dtype = ops::DType::f32;
  b.rows = 1;
  b.cols = 4;
  b.bytes = 16;
  b.needs_align16 = false;
  b.key = "rng";
  p_.rng = add(b);
  // Written before the first step: no arena scratch of an earlier step may share its bytes.
  p_.buffers[static_cast<size_t>(p_.rng)].first = 0;
  return p_.rng;
}

size_t Builder::saved_size(int op, Key key) const {
  const auto& o = p_.ops.at(static_cast<size_t>(op));
  const int64_t rows = ops::rows_of(o.in), cols = ops::cols_of(o.in);
  if (key == Key::mean || key == Key::rstd) return static_cast<size_t>(rows) * 4;
  if (key == Key::mask) return static_cast<size_t>(rows * ((cols + 7) / 8));
  if (key == Key::output) return dtype_bytes_of(ops::rows_of(o.out), ops::cols_of(o.out));
  return dtype_bytes_of(rows, cols);
}

int Builder::saved_new(int op, Key key, ops::DType dtype, int64_t rows, int64_t cols, size_t bytes) {
  const char* name = codegen::key_name(key);
  if (!p_.training) fail(Status::internal, "an inference program saves no context ({} '{}')", p_.ops[op].label(), name);
  Buffer b;
  b.role = BufferRole::saved_context;
  b.storage = Storage::saved_block;
  b.name = "op" + std::to_string(op) + "." + name;
  b.op = op;
  b.dtype = dtype;
  b.rows = rows;
  b.cols = cols;
  b.bytes = bytes;
  b.key = name;
  b.needs_align16 = key != Key::mask;
  int id = add(b);
  saved_[{op, key}] = id;
  return id;
}

void Builder::save_alias(int op, Key key, int id) {
  if (!p_.training) return;
  auto& b = p_.buffers.at(static_cast<size_t>(id));
  if (b.storage == Storage::fwd_arena) b.storage = Storage::saved_block;  // must outlive the forward call
  saved_[{op, key}] = id;
}

void Builder::boundary_saves(int b, int e) {
  if (!p_.training) return;
  for (int i = b; i < e; ++i)
    for (auto k : p_.ops[i].saved) {
      // An FP8 linear's wgrad reads the transposed FP8 copy of its input (saved by the cast), not this.
      if (k == ops::SavedKind::input && i == b && !(p_.recipe.is_fp8() && p_.ops[i].family == ops::Family::linear))
        save_alias(i, Key::input, act(b));
      if (k == ops::SavedKind::output && i + 1 == e) save_alias(i, Key::output, act(e));
    }
}

void Builder::forget_saved(int op, Key key) { saved_.erase({op, key}); }

int Builder::saved_context(int op, Key key) const {
  auto it = saved_.find({op, key});
  if (it == saved_.end())
    fail(Status::internal, "{}: saved context '{}' missing: the forward group did not save what this backward needs",
         p_.ops.at(static_cast<size_t>(op)).label(), codegen::key_name(key));
  return it->second;
}

void Builder::provide_saved(int op, Key key, int id) { saved_[{op, key}] = id; }

void Builder::alias_saved(int grad, int op, Key key) {
  const int saved = saved_context(op, key);
  const Buffer& g = p_.buffer(grad);
  const Buffer& s = p_.buffer(saved);
  if ((g.role != BufferRole::grad_input && g.role != BufferRole::grad) || s.storage != Storage::saved_block ||
      g.bytes != s.bytes || g.dtype != s.dtype)
    return;
  p_.grad_aliases.push_back({grad, saved});
}

int Builder::temp(const std::string& name, ops::DType dtype, int64_t rows, int64_t cols, size_t bytes) {
  Buffer b;
  b.role = BufferRole::temp;
  b.storage = forward_ ? Storage::fwd_arena : Storage::bwd_arena;
  b.name = name;
  b.dtype = dtype;
  b.rows = rows;
  b.cols = cols;
  b.bytes = bytes;
  return add(b);
}

void Builder::touch(int id) {
  if (id < 0) return;
  auto& b = p_.buffers.at(static_cast<size_t>(id));
  const int step = static_cast<int>((forward_ ? p_.forward : p_.backward).size());
  if (b.first < 0) b.first = step;
  b.last = std::max(b.last, step);
}

GemmStep Builder::linear_gemm(int lin, cuda::GemmKind kind) const {
  const auto& o = p_.ops.at(static_cast<size_t>(lin));
  GemmStep g;
  g.call.kind = kind;
  g.call.m = ops::rows_of(o.in);
  g.call.k = ops::cols_of(o.in);
  g.call.n = ops::cols_of(o.out);
  g.call.dtype = p_.recipe.dtype;
  g.call.weight_t = o.family == ops::Family::linear && o.weight_in_out();
  return g;
}

void Builder::gemm(const GemmStep& g, const std::string& what) {
  if (g.b2 >= 0) return split_gemm(g, what);
  Step s;
  s.kind = Step::Kind::gemm;
  s.group = group_;
  s.what = what;
  s.gemm = g;
  // The workspace lives for this step only: the packer lays every GEMM's workspace over the same bytes.
  s.gemm.workspace = temp("cublaslt workspace", ops::DType::f32, -1, 0, cuda::kGemmWorkspace);
  if (g.d_amax >= 0)  // the FP8 output's state: rolled by the pass's batched update
    batch_.entries.push_back({static_cast<int>(steps()), g.d_amax, g.d_history, g.d_scale, g.d_scale_inv});
  push(std::move(s));
}

// A split_weight linear's GEMM as two over the outputs' halves (row stride: the whole output): fwd writes
// y[:, :n/2] = x W^T and y[:, n/2:] = x W2^T; dgrad dx = dy[:, :n/2] W + dy[:, n/2:] W2 (the second with
// beta = 1); wgrad dW = dy[:, :n/2]^T x and dW2 = dy[:, n/2:]^T x. No epilogue (legality keeps rules that fuse
// one off such a linear).
void Builder::split_gemm(const GemmStep& g, const std::string& what) {
  if (g.call.epilogue != cuda::Epilogue::none || g.call.fp8 || g.call.batch != 1 || g.call.n % 2 != 0)
    fail(Status::internal, "{}: a split_weight linear's GEMMs take no epilogue, FP8 or batch", what);
  GemmStep first = g;
  first.b2 = -1;
  first.call.ldy = g.call.ldy > g.call.n ? g.call.ldy : g.call.n;
  first.call.n = g.call.n / 2;
  GemmStep second = first;
  const int64_t half = first.call.n;
  switch (g.call.kind) {
    case cuda::GemmKind::fwd: second.b = g.b2; second.d_offset += half; break;
    case cuda::GemmKind::dgrad:
      second.b = g.b2;
      second.a_offset += half;
      second.call.beta = 1.f;  // dx += dy[:, n/2:] W2
      second.c = -1;
      break;
    case cuda::GemmKind::wgrad: second.d = g.b2; second.a_offset += half; break;
  }
  gemm(first, what + " (first half: weight)");
  gemm(second, what + " (second half: weight2)");
}

void Builder::note_last(const std::string& text) {
  auto& steps = forward_ ? p_.forward : p_.backward;
  if (!steps.empty()) steps.back().what += "; " + text;
}

void Builder::push(Step s) {
  for (int id : s.buffers()) touch(id);
  (forward_ ? p_.forward : p_.backward).push_back(std::move(s));
}

void Builder::end_pass() {
  end_side_lifetimes();
  if (!batch_.entries.empty()) {
    const auto& steps = forward_ ? p_.forward : p_.backward;
    if (std::none_of(batch_.entries.begin(), batch_.entries.end(), [&](const Fp8UpdateStep::Entry& e) {
          return steps[static_cast<size_t>(e.step)].kind == Step::Kind::kernel;
        }))
      fail(Status::internal, "FP8 GEMM outputs to update in a pass without a batched cast (whose module holds the "
           "batch kernel)");
    batch_.batched = true;
    Step s;
    s.kind = Step::Kind::fp8_update;
    s.group = -1;
    s.what = fmt::format("FP8 recipe-state update of the pass ({} state(s), one launch per {})", batch_.entries.size(),
                         codegen::kFp8Batch);
    s.fp8_update = std::move(batch_);
    push(std::move(s));
  }
  batch_ = Fp8UpdateStep{};
}

void Builder::mark_weight_casts(size_t from) {
  auto& steps = forward_ ? p_.forward : p_.backward;
  for (size_t i = from; i < steps.size(); ++i) steps[i].weight_cast = true;
}

void Builder::mark_peer_path(size_t from, int path) {
  auto& steps = forward_ ? p_.forward : p_.backward;
  for (size_t i = from; i < steps.size(); ++i) steps[i].peer_path = path;
}

nlohmann::json Builder::kernel_meta(int b, const char* pass) const {
  nlohmann::json kinds = nlohmann::json::array();
  for (int i = b; i < g_.end; ++i) kinds.push_back(p_.ops[i].kind);
  return {{"rule", rule_or_unfused()},
          {"ops", kinds},
          {"recipe", ops::recipe_name(p_.recipe.kind)},
          {"shape", "?x" + std::to_string(ops::cols_of(p_.ops[b].in))},
          {"sequence", seq_},
          {"pass", pass}};
}

// How argument `a` of kernel `ks` binds: to a buffer of this program (made here if new) or a per-launch value.
KArg Builder::bind_arg(const Arg& a, KernelStep& ks, int in, int out, fp8::Operand fp8_tensor) {
  const bool own_state = fp8_tensor == fp8::Operand::none;  // a quantize op's cast
  KArg k;
  switch (a.role) {
    case Arg::Role::in: k.buffer = in; break;
    case Arg::Role::out: k.buffer = out; break;
    case Arg::Role::param: k.buffer = param(a.op, a.key); break;
    case Arg::Role::saved:
      if (a.writes && saved_.count({a.op, a.key})) {
        k.buffer = saved_.at({a.op, a.key});  // declared by the lowering itself (its own dtype and size)
      } else if (a.writes) {
        const auto& o = p_.ops[a.op];
        const bool stats = a.key == Key::mean || a.key == Key::rstd, mask = a.key == Key::mask;
        const bool output = a.key == Key::output;
        k.buffer = saved_new(a.op, a.key, stats ? ops::DType::f32 : p_.recipe.dtype,
                             ops::rows_of(output ? o.out : o.in),
                             stats ? 1 : mask ? (ops::cols_of(o.in) + 7) / 8 : ops::cols_of(output ? o.out : o.in),
                             saved_size(a.op, a.key));
      } else {
        k.buffer = saved_context(a.op, a.key);
      }
      break;
    case Arg::Role::extra_in: k.buffer = extra_in(a.op); break;
    case Arg::Role::extra_out: k.buffer = extra_out(a.op); break;
    case Arg::Role::grad_extra_out:
      k.buffer = a.key == Key::channel ? channel_grad(a.op) : grad_extra_out(a.op);
      break;
    case Arg::Role::grad_extra_in: k.buffer = grad_extra_in(a.op); break;
    case Arg::Role::partials: {
      // fp32 [parts, width]; parts is known once the launch shape is (lay_out, layout.hpp).
      int64_t width = 0;
      for (const auto& f : ks.gen.finalize)
        if (f.op == a.op && f.key == a.key) width = f.cols;
      k.buffer = temp("partials op" + std::to_string(a.op) + "." + codegen::key_name(a.key), ops::DType::f32, -1, width);
      for (size_t i = 0; i < ks.gen.finalize.size(); ++i) {
        const auto& f = ks.gen.finalize[i];
        if (f.op == a.op && f.key == a.key)
          ks.finalize.push_back({k.buffer, grad(f.op, f.key), f.cols, f.kernel, f.slot, f.count, static_cast<int>(i)});
      }
      break;
  }
    case Arg::Role::rows: k.kind = KArg::Kind::rows; break;
    case Arg::Role::peers: k.kind = KArg::Kind::peers; break;
    case Arg::Role::staged:  // staged tensor j: the slot the j-th other rank (in rank order) fills
      if (a.slot < 0 || a.slot + 1 >= p_.world_size)
        fail(Status::internal, "staged tensor {} of a group of {} ranks", a.slot, p_.world_size);
      k.kind = KArg::Kind::staging;
      k.value = static_cast<uint64_t>(a.slot < p_.rank ? a.slot : a.slot + 1);
      break;
    case Arg::Role::seed:
      k.kind = KArg::Kind::u64_const;
      k.value = p_.ops[a.op].attrs["seed"].get<uint64_t>();
      break;
    case Arg::Role::rng: k.buffer = rng_state(); break;
    case Arg::Role::parts: k.kind = KArg::Kind::int_const; break;  // filled per launch (KernelLaunch::parts)
    case Arg::Role::fp8_scale: k.buffer = fp8_state(a.op, fp8_tensor, fp8::Part::scale); break;
    case Arg::Role::fp8_scale_inv:
      // A quantize op's cast reports to its state; an operand's cast to the FP8 tensor's own scale_inv.
      k.buffer = own_state ? fp8_state(a.op, fp8_tensor, fp8::Part::scale_inv)
                           : fp8_operand(a.op, fp8_tensor).scale_inv;
      break;
    case Arg::Role::fp8_amax:
      if (a.writes) {
        k.buffer = ks.amax_partials = temp("amax partials op" + std::to_string(a.op), ops::DType::f32, -1, 1);
      } else {
        k.buffer = fp8_state(a.op, fp8_tensor, fp8::Part::history);
      }
      break;
    case Arg::Role::fp8_colwise: k.buffer = fp8_operand(a.op, fp8_tensor).col; break;
    case Arg::Role::fp8_colwise_scale_inv: k.buffer = fp8_operand(a.op, fp8_tensor).col_scale_inv; break;
  }
  return k;
}

namespace {
// Groups a kernel step's finalize follow-ups into one launch per finalize kernel, its gradients in slot
// order; a gradient missing from its launch is a codegen/builder mismatch, refused here rather than per call.
std::vector<FinalizeStep> finalize_launches(const KernelStep& ks) {
  using F = codegen::Finalize;
  std::vector<FinalizeStep> out;
  for (const auto& f : ks.finalize) {
    if (f.slot != 0) continue;
    if (f.count < 1 || f.count > F::kMaxCount)
      fail(Status::internal, "kernel {}: finalize {} has {} gradients (at most {})", ks.gen.kernel, f.key, f.count,
           F::kMaxCount);
    FinalizeStep l;
    l.kernel = f.key;
    l.index = f.index;
    l.count = f.count;
    l.cols = f.cols;
    l.pairs.assign(2 * static_cast<size_t>(f.count), -1);
    int have = 0;
    for (const auto& o : ks.finalize)
      if (o.key == f.key && o.slot >= 0 && o.slot < f.count && l.pairs[2 * static_cast<size_t>(o.slot)] < 0) {
        l.pairs[2 * static_cast<size_t>(o.slot)] = o.partials;
        l.pairs[2 * static_cast<size_t>(o.slot) + 1] = o.grad;
        ++have;
      }
    if (have != f.count)
      fail(Status::internal, "kernel {}: finalize {} has {} of its {} gradients", ks.gen.kernel, f.key, have, f.count);
    out.push_back(std::move(l));
  }
  return out;
}
}  // namespace

void Builder::kernel(const codegen::KernelSpec& spec, const nlohmann::json& meta, int in, int out, int64_t rows,
                     const std::string& what) {
  auto ks = std::make_shared<KernelStep>();
  ks->spec = spec;
  ks->meta = meta;
  ks->gen = codegen::generate(spec);
  ks->rows = rows;
  if (const int d = received_rows_of(rows); d >= 0) {
    ks->rows_route = saved_context(d, Key::route);
    ks->rows_route_total = 2 * (p_.ops[static_cast<size_t>(d)].route_experts / p_.world_size);
  }
  // codegen spells the operand a cast writes; here it is typed once.
  const auto operand = spec.fp8 ? fp8::parse_operand(spec.fp8->tensor) : fp8::Operand::none;
  if (!operand) fail(Status::internal, "kernel {}: unknown FP8 operand '{}'", ks->gen.kernel, spec.fp8->tensor);
  const fp8::Operand fp8_tensor = *operand;
  for (const Arg& a : ks->gen.args) ks->args.push_back(bind_arg(a, *ks, in, out, fp8_tensor));
  const int q = spec.fp8 ? spec.fp8->op : -1;
  Step s;
  s.kind = Step::Kind::kernel;
  s.group = group_;
  s.what = what;
  s.kernel = ks;
  push(std::move(s));
  follow_ups(*ks, q, fp8_tensor);
}

int Builder::received_rows_of(int64_t rows) const {
  const auto& ops = p_.ops;
  for (int i = g_.begin; i < g_.end; ++i) {
    const ops::Family f = ops[static_cast<size_t>(i)].family;
    if (f == ops::Family::make_extra_output || f == ops::Family::add_extra_input || f == ops::Family::comm ||
        f == ops::Family::moe)
      return -1;
  }
  int combined = 0, dispatch = -1;
  for (int i = g_.begin - 1; i >= 0 && dispatch < 0; --i) {
    const std::string& k = ops[static_cast<size_t>(i)].kind;
    if (k == "moe_combine") ++combined;
    if (k == "moe_dispatch" && combined-- == 0) dispatch = i;
  }
  if (dispatch < 0 || !ops[static_cast<size_t>(dispatch)].route_packed ||
      rows != ops::rows_of(ops[static_cast<size_t>(dispatch)].out))
    return -1;
  for (size_t j = static_cast<size_t>(g_.end); j < ops.size(); ++j)
    if (ops[j].kind == "moe_combine" && ops[j].route_op == dispatch) return dispatch;
  return -1;
}

// The steps after kernel step `ks` (the last one added): one launch per finalize kernel, and its FP8
// recipe-state update (right after it, or an entry of the pass's batch).
void Builder::follow_ups(const KernelStep& ks, int q, fp8::Operand fp8_tensor) {
  const int at = static_cast<int>(steps()) - 1;
  for (auto& f : finalize_launches(ks)) {
    Step s;
    s.kind = Step::Kind::finalize;
    s.group = group_;
    s.what = fmt::format("column sums of {} ({} gradient(s))", ks.gen.kernel, f.count);
    f.kernel_step = at;
    s.finalize = std::move(f);
    push(std::move(s));
  }
  if (ks.gen.fp8_update.empty()) return;
  const bool own_state = fp8_tensor == fp8::Operand::none;  // a quantize op's cast
  Fp8UpdateStep::Entry e{at, ks.amax_partials, fp8_state(q, fp8_tensor, fp8::Part::history),
                         fp8_state(q, fp8_tensor, fp8::Part::scale), -1};
  if (ks.gen.fp8_batched) {  // a cast writes its own scale_inv
    batch_.history_len = std::max(1, p_.recipe.amax_history);
    batch_.entries.push_back(e);
    return;
  }
  // An operand's update kernel takes no scale_inv (the cast wrote the copy's own); a quantize op's does.
  if (own_state) e.scale_inv = fp8_state(q, fp8_tensor, fp8::Part::scale_inv);
  Step s;
  s.kind = Step::Kind::fp8_update;
  s.group = group_;
  s.what = fmt::format("FP8 recipe-state update after {}", ks.gen.kernel);
  s.fp8_update.history_len = std::max(1, p_.recipe.amax_history);
  s.fp8_update.entries.push_back(e);
  push(std::move(s));
}

}  // namespace jitfuse::exec
