// Op stages as code: what each stage kind does to a chunk, forward and backward. The math of each
// op lives in its template functor; this file only wires loads, stores, saves and reductions.
#include "stages.hpp"

#include <cmath>
#include <stdexcept>

namespace jitfuse::codegen::detail {
namespace {

uint32_t keep_threshold(double p) {
  double t = std::floor((1.0 - p) * 4294967296.0);
  return t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
}

void comment(Writer& w, const Stage& s, const char* dir) {
  w.line("// op {} {} ({}): {}", s.op, comment_text(s.op_kind), dir, comment_text(s.math));
}

std::string saved_ptr(Args& args, int op, Key what, bool writes) {
  std::string name = fmt::format("s{}_{}", op, key_name(what));
  args.ptr(Arg::Role::saved, op, what, name, "ST", writes);
  return name;
}

std::string mask_index(const ChunkCtx& c) {
  // Rows padded to whole bytes; chunk columns start at multiples of 8, so a chunk is one byte.
  return fmt::format("({}) * {} + ({}) / 8", c.row, (c.width + 7) / 8, c.col);
}

void dropout_bits(Writer& w, Args& args, const Stage& s, const ChunkCtx& c) {
  args.scalar(Arg::Role::seed, s.op, "seed", fmt::format("seed{}", s.op), "jf_u64");
  // The call's Philox state {seed, offset} is read from device memory when the kernel runs, so a
  // replayed CUDA graph draws from whatever the host wrote there; the op's seed is mixed into the key.
  args.ptr(Arg::Role::rng, -1, "rng", "rng", "jf_u64", false);
  w.line("const jf_u32 bits = jf_dropout_bits8({}, n, seed{} ^ rng[0], rng[1], {}u);", c.base, s.op,
         keep_threshold(s.dropout_p));
}

// Loads 8 elements of `ptr` at the chunk into a local named `var`, or binds `var` to the preloaded copy.
void load_elems(Writer& w, const ChunkCtx& c, const std::string& ptr, const char* var) {
  if (c.preloaded) {
    auto it = c.preloaded->find(ptr);
    if (it != c.preloaded->end()) {
      w.line("const float (&{})[8] = {};", var, it->second);
      return;
    }
  }
  w.line("float {}[8];", var);
  w.line("jf_load8<DT, JF_VEC>({} + {}, {}, n);", ptr, c.base, var);
}

// var += the chunk of `ptr` (a residual forward, an extra output's grad backward).
void add_loaded(Writer& w, const ChunkCtx& c, const std::string& ptr, const std::string& var) {
  w.line("{{");
  w.open();
  load_elems(w, c, ptr, "t");
  w.line("#pragma unroll");
  w.line("for (int e = 0; e < 8; ++e) {}[e] += t[e];", var);
  w.close();
  w.line("}}");
}

bool unary_needs_saved(const Stage& s) { return !(s.functor == "jf_op_identity" || s.functor == "jf_op_scale"); }

}  // namespace

std::vector<std::string> chain_reads(const std::vector<Stage>& stages, Direction dir) {
  std::vector<std::string> out;
  for (const auto& s : stages) {
    if (dir == Direction::forward && s.kind == Stage::Kind::extra_add) out.push_back(fmt::format("e{}", s.op));
    if (dir == Direction::forward && s.kind == Stage::Kind::staged_add) out.push_back(fmt::format("st{}", s.slot));
    if (dir == Direction::backward && s.kind == Stage::Kind::extra_tap) out.push_back(fmt::format("geo{}", s.op));
    if (dir == Direction::backward && s.kind == Stage::Kind::unary && unary_needs_saved(s))
      out.push_back(fmt::format("s{}_{}", s.op, s.saved_is_output ? "output" : "input"));
  }
  return out;
}

std::string declare_accumulator(Args& args, Setup& setup, int op, Key param, int64_t width,
                                const std::string& col_off, const std::string& half) {
  std::string part = fmt::format("part{}_{}", op, key_name(param));
  args.ptr(Arg::Role::partials, op, param, part, "float", true);
  std::string var = fmt::format("acc{}_{}{}", op, key_name(param), half);
  setup.pre_loop.line("float {}[8] = {{0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f}};", var);
  setup.accs.push_back({var, part, width, col_off});
  bool have = false;
  for (auto& f : setup.finalize) have |= f.op == op && f.key == param;
  if (!have) setup.finalize.push_back({"", op, param, width});
  return var;
}

void emit_pre_loop(Writer& w, const Setup& setup) {
  const std::string& pre = setup.pre_loop.str();
  size_t start = 0;
  while (start < pre.size()) {
    size_t end = pre.find('\n', start);
    w.line("{}", pre.substr(start, end - start));
    start = end + 1;
  }
}

void emit_chunk_prologue(Writer& w, const Setup& setup, const std::string& fp8_setup, int bx, int64_t cols) {
  w.line("const int c0 = (blockIdx.x * {} + threadIdx.x) * 8;", bx);
  w.line("const bool active = c0 < {};", cols);
  w.line("const int n = active ? min(8, {} - c0) : 0;", cols);
  emit_pre_loop(w, setup);
  w.raw(fp8_setup);
}

void emit_stage_fwd(Writer& w, Args& args, Setup& setup, const Stage& s, const ChunkCtx& c) {
  const std::string& v = c.var;
  comment(w, s, "forward");
  switch (s.kind) {
    case Stage::Kind::normalize: {
      // The statistics come from the norm's stats kernel (saved mean / rstd, fp32 per row).
      const std::string rs = fmt::format("s{}_rstd", s.op), mu = fmt::format("s{}_mean", s.op);
      args.ptr(Arg::Role::saved, s.op, Key::rstd, rs, "float", false);
      if (!s.norm_rms) args.ptr(Arg::Role::saved, s.op, Key::mean, mu, "float", false);
      const std::string gw = fmt::format("p{}_weight", s.op), bw = fmt::format("p{}_bias", s.op);
      args.ptr(Arg::Role::param, s.op, Key::weight, gw, "ST", false);
      if (!s.norm_rms) args.ptr(Arg::Role::param, s.op, Key::bias, bw, "ST", false);
      // gamma (+ 1) and beta of the thread's columns, loaded once before the row loop (the bias cache's way).
      const std::string gc = fmt::format("g{}{}", s.op, c.half), bc = fmt::format("bb{}{}", s.op, c.half);
      setup.pre_loop.line("float {}[8];", gc);
      setup.pre_loop.line("if (active) jf_load8<DT, JF_VEC>({} + {} + c0, {}, n);", gw, c.col_off, gc);
      if (s.norm_zero_centered) setup.pre_loop.line("for (int e = 0; e < 8; ++e) {}[e] += 1.f;", gc);
      if (!s.norm_rms) {
        setup.pre_loop.line("float {}[8];", bc);
        setup.pre_loop.line("if (active) jf_load8<DT, JF_VEC>({} + {} + c0, {}, n);", bw, c.col_off, bc);
      }
      w.line("{{");
      w.open();
      w.line("const float jf_rs = {}[{}]{};", rs, c.row, s.norm_rms ? "" : fmt::format(", jf_mu = {}[{}]", mu, c.row));
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] = {}jf_rs * {}[e]{};", v, s.norm_rms ? v + "[e] * " : "(" + v + "[e] - jf_mu) * ",
             gc, s.norm_rms ? "" : fmt::format(" + {}[e]", bc));
      w.close();
      w.line("}}");
      break;
    }
    case Stage::Kind::unary:
      if (s.save_input) w.line("jf_store8<DT, JF_VEC>({} + {}, {}, n);", saved_ptr(args, s.op, Key::input, true), c.base, v);
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] = {}::fwd({}[e]{});", v, s.functor, v, consts_suffix(s.consts));
      if (s.save_output)
        w.line("jf_store8<DT, JF_VEC>({} + {}, {}, n);", saved_ptr(args, s.op, Key::output, true), c.base, v);
      break;
    case Stage::Kind::bias: {
      std::string p = fmt::format("p{}_bias", s.op);
      args.ptr(Arg::Role::param, s.op, Key::bias, p, "ST", false);
      std::string cache = fmt::format("b{}{}", s.op, c.half);
      setup.pre_loop.line("float {}[8];", cache);
      setup.pre_loop.line("if (active) jf_load8<DT, JF_VEC>({} + {} + c0, {}, n);", p, c.col_off, cache);
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] += {}[e];", v, cache);
      break;
    }
    case Stage::Kind::extra_add:
    case Stage::Kind::staged_add: {  // a caller's extra input, or a block another rank staged here
      const bool staged = s.kind == Stage::Kind::staged_add;
      std::string p = staged ? fmt::format("st{}", s.slot) : fmt::format("e{}", s.op);
      if (staged) args.staged(s.op, s.slot, p, "ST"); else args.ptr(Arg::Role::extra_in, s.op, "extra", p, "ST", false);
      add_loaded(w, c, p, v);
      break;
    }
    case Stage::Kind::extra_tap: {
      std::string p = fmt::format("eo{}", s.op);
      args.ptr(Arg::Role::extra_out, s.op, "extra", p, "ST", true);
      w.line("jf_store8<DT, JF_VEC>({} + {}, {}, n);", p, c.base, v);
      break;
    }
    case Stage::Kind::dropout: {
      w.line("{{");
      w.open();
      dropout_bits(w, args, s, c);
      if (s.dropout_save_mask) {
        args.ptr(Arg::Role::saved, s.op, Key::mask, fmt::format("s{}_mask", s.op), "unsigned char", true);
        w.line("s{}_mask[{}] = (unsigned char)bits;", s.op, mask_index(c));
      }
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] = ((bits >> e) & 1u) ? {}[e] * {} : 0.f;", v, v,
             num(1.0 / (1.0 - s.dropout_p)));
      w.close();
      w.line("}}");
      break;
    }
  }
}

void emit_stage_bwd(Writer& w, Args& args, Setup& setup, const Stage& s, const ChunkCtx& c) {
  const std::string& g = c.var;
  comment(w, s, "backward");
  switch (s.kind) {
    case Stage::Kind::staged_add:
      throw std::invalid_argument("codegen: a staged_add stage runs in the forward only");
    case Stage::Kind::normalize:
      throw std::invalid_argument("codegen: a normalize stage runs in the forward only (the norm's backward is "
                                  "the rownorm skeleton's)");
    case Stage::Kind::unary: {
      bool needs_saved = unary_needs_saved(s);
      w.line("{{");
      w.open();
      if (needs_saved) load_elems(w, c, saved_ptr(args, s.op, s.saved_is_output ? Key::output : Key::input, false), "s");
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] = {}::bwd({}, {}[e]{});", g, s.functor, needs_saved ? "s[e]" : "0.f",
             g, consts_suffix(s.consts));
      w.close();
      w.line("}}");
      break;
    }
    case Stage::Kind::bias: {
      std::string acc = declare_accumulator(args, setup, s.op, Key::bias, c.width, c.col_off, c.half);
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] += {}[e];", acc, g);
      break;
    }
    case Stage::Kind::extra_add: {
      std::string p = fmt::format("gei{}", s.op);
      args.ptr(Arg::Role::grad_extra_in, s.op, "extra", p, "ST", true);
      if (!s.grad_accumulate) {
        w.line("jf_store8<DT, JF_VEC>({} + {}, {}, n);", p, c.base, g);
        break;
      }
      // Another reader of the channel wrote its gradient first (the backward runs readers last to first).
      w.line("{{");
      w.open();
      w.line("float t[8];");
      w.line("jf_load8<DT, JF_VEC>({} + {}, t, n);", p, c.base);
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) t[e] += {}[e];", g);
      w.line("jf_store8<DT, JF_VEC>({} + {}, t, n);", p, c.base);
      w.close();
      w.line("}}");
      break;
    }
    case Stage::Kind::extra_tap: {
      std::string p = fmt::format("geo{}", s.op);
      args.ptr(Arg::Role::grad_extra_out, s.op, "extra", p, "ST", false);
      add_loaded(w, c, p, g);
      if (s.grad_two_parts) {
        std::string q = fmt::format("gch{}", s.op);
        args.ptr(Arg::Role::grad_extra_out, s.op, Key::channel, q, "ST", false);
        add_loaded(w, c, q, g);
      }
      break;
    }
    case Stage::Kind::dropout: {
      w.line("{{");
      w.open();
      if (s.dropout_regenerate) {
        dropout_bits(w, args, s, c);
      } else {
        args.ptr(Arg::Role::saved, s.op, Key::mask, fmt::format("s{}_mask", s.op), "unsigned char", false);
        w.line("const jf_u32 bits = s{}_mask[{}];", s.op, mask_index(c));
      }
      w.line("#pragma unroll");
      w.line("for (int e = 0; e < 8; ++e) {}[e] = ((bits >> e) & 1u) ? {}[e] * {} : 0.f;", g, g,
             num(1.0 / (1.0 - s.dropout_p)));
      w.close();
      w.line("}}");
      break;
    }
  }
}

std::string out_type(const KernelSpec& spec) { return spec.fp8 ? "unsigned char" : "ST"; }

namespace {

const char* format_name(const Fp8Spec& q) { return q.e5m2 ? "E5M2" : "E4M3"; }
const char* e5m2_arg(const Fp8Spec& q) { return q.e5m2 ? "true" : "false"; }

// Arg::name of a recipe-state argument: "scale" for a quantize op, "scale_input" for a linear's input.
std::string state_name(const Fp8Spec& q, const std::string& what) {
  return q.tensor.empty() ? what : what + "_" + q.tensor;
}

// "jf_fp8_scale_of<E5M2>(amax, 2^margin)": the format's max / amax / 2^margin.
std::string scale_call(const Fp8Spec& q, const std::string& amax) {
  return fmt::format("jf_fp8_scale_of<{}>({}, {})", e5m2_arg(q), amax, fp8_margin_pow2(q));
}

}  // namespace

std::string fp8_margin_pow2(const Fp8Spec& q) { return num(std::ldexp(1.0, static_cast<int>(q.margin))); }

std::string fp8_colwise_arg(Args& args, const KernelSpec& spec) {
  const auto& q = *spec.fp8;
  std::string name = fmt::format("q{}_colwise", q.op);
  args.ptr(Arg::Role::fp8_colwise, q.op, state_name(q, "colwise"), name, "unsigned char", true);
  return name;
}

void emit_out_store(Writer& w, const KernelSpec& spec, const std::string& index, const std::string& var,
                    const std::string& codes) {
  if (!spec.fp8) {
    w.line("jf_store8<DT, JF_VEC>(out + {}, {}, n);", index, var);
    return;
  }
  const auto& q = *spec.fp8;
  w.line("// op {} {}: {}", q.op, q.tensor.empty() ? "quantize" : "cast of the FP8 GEMM " + q.tensor,
         q.amax_only ? "amax of the output (the cast pass follows)" : fmt::format("{} codes of x * scale", format_name(q)));
  if (q.amax_only || q.delayed) w.line("jf_amax8(jf_am, {}, n);", var);
  if (q.amax_only) return;
  if (!codes.empty()) {
    w.line("jf_cvt8_fp8<{}>({}, jf_scale, {});", e5m2_arg(q), var, codes);
    w.line("jf_store8_codes<JF_VEC>(out + {}, {}, n);", index, codes);
  } else {
    w.line("jf_store8_fp8<{}, JF_VEC>(out + {}, {}, jf_scale, n);", e5m2_arg(q), index, var);
  }
}

void emit_fp8_prologue(Writer& w, Args& args, const KernelSpec& spec) {
  if (!spec.fp8) return;
  const auto& q = *spec.fp8;
  const std::string sc = fmt::format("q{}_scale", q.op), si = fmt::format("q{}_scale_inv", q.op),
                    am = fmt::format("q{}_amax", q.op);
  const std::string sc_name = state_name(q, "scale"), si_name = state_name(q, "scale_inv"),
                    am_name = state_name(q, "amax");
  if (q.amax_only) {
    args.ptr(Arg::Role::fp8_amax, q.op, am_name, am, "float", true);
    w.line("float jf_am = 0.f;");
    return;
  }
  if (q.delayed) {
    args.ptr(Arg::Role::fp8_scale, q.op, sc_name, sc, "float", false);
    args.ptr(Arg::Role::fp8_amax, q.op, am_name, am, "float", true);
    w.line("float jf_am = 0.f;");
    w.line("const float jf_scale = {}[0];", sc);
    if (!q.tensor.empty()) {
      // An operand's scale_inv belongs to its FP8 tensor (saved with it), so the cast writes the one it used
      // here; the update kernel after it changes only the recipe state (scale, amax_history).
      args.ptr(Arg::Role::fp8_scale_inv, q.op, si_name, si, "float", true);
      w.line("if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {}[0] = 1.f / jf_scale;", si);
    }
    return;
  }
  args.ptr(Arg::Role::fp8_amax, q.op, am_name, am, "float", false);
  args.ptr(Arg::Role::fp8_scale, q.op, sc_name, sc, "float", true);
  args.ptr(Arg::Role::fp8_scale_inv, q.op, si_name, si, "float", true);
  w.line("const float jf_scale = {};", scale_call(q, am + "[0]"));
  w.line("if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {{ {}[0] = jf_scale; {}[0] = 1.f / jf_scale; }}",
         sc, si);
}

void emit_fp8_epilogue(Writer& w, const KernelSpec& spec) {
  if (!spec.fp8 || !(spec.fp8->amax_only || spec.fp8->delayed)) return;
  w.line("jf_amax_flush<JF_VEC>(jf_am, q{}_amax);", spec.fp8->op);
}

void finish(Writer& w, Setup& setup, const Args& args, Generated& g, const KernelSpec& spec) {
  g.scalar_kernel = g.kernel + "_scalar";
  g.vec = spec.vec;
  emit_variants(w, spec, g.kernel, g.scalar_kernel);
  if (spec.fp8 && !spec.fp8->codes_in && (spec.fp8->delayed || spec.fp8->amax_only)) {
    g.fp8_update = g.kernel + "_fp8_update";
    g.fp8_batched = spec.fp8->delayed && !spec.fp8->amax_only && !spec.fp8->tensor.empty();
    w.line("");
    emit_fp8_update(w, g.fp8_update, *spec.fp8);
  }
  // One finalize launch per width: the gradients of the same width share it (blockIdx.y picks one).
  std::vector<bool> done(setup.finalize.size(), false);
  for (size_t i = 0; i < setup.finalize.size(); ++i) {
    if (done[i]) continue;
    std::vector<Finalize*> group;
    for (size_t j = i; j < setup.finalize.size(); ++j)
      if (!done[j] && setup.finalize[j].cols == setup.finalize[i].cols &&
          group.size() < static_cast<size_t>(Finalize::kMaxCount)) {
        group.push_back(&setup.finalize[j]);
        done[j] = true;
      }
    std::string name = g.kernel + "_fin";
    for (size_t s = 0; s < group.size(); ++s)
      name += fmt::format("{}{}_{}", s ? "_" : "", group[s]->op, key_name(group[s]->key));
    for (size_t s = 0; s < group.size(); ++s) {
      group[s]->kernel = name;
      group[s]->slot = static_cast<int>(s);
      group[s]->count = static_cast<int>(group.size());
    }
    w.line("");
    emit_finalize(w, name, group.front()->cols, static_cast<int>(group.size()));
  }
  g.finalize = setup.finalize;
  g.args = args.args();
  g.source = w.str();
}

void emit_accumulator_flush(Writer& w, const Setup& setup, int bx, int by, int64_t cols, const std::string& part_index) {
  if (setup.accs.empty()) return;
  // Every thread of the block sums one column over the block's rows, so the partial row is written
  // with coalesced stores (one thread per column) instead of by one row of threads, 8 columns each.
  w.line("// column sums: reduce the accumulators over the block's rows, one partial row per block");
  w.line("__shared__ float jf_red[{}][{}];", by, bx * 8);
  for (auto& a : setup.accs) {
    w.line("__syncthreads();");
    w.line("#pragma unroll");
    w.line("for (int e = 0; e < 8; ++e) jf_red[threadIdx.y][threadIdx.x * 8 + e] = {}[e];", a.var);
    w.line("__syncthreads();");
    w.line("for (int i = threadIdx.y * {} + threadIdx.x; i < {}; i += {}) {{", bx, bx * 8, bx * by);
    w.open();
    w.line("const int c = blockIdx.x * {} + i;", bx * 8);
    w.line("if (c >= {}) break;", cols);
    w.line("float t = 0.f;");
    w.line("#pragma unroll");
    w.line("for (int y = 0; y < {}; ++y) t += jf_red[y][i];", by);
    w.line("{}[(jf_i64)({}) * {} + {} + c] = t;", a.partial, part_index, a.width, a.col_off);
    w.close();
    w.line("}}");
  }
}

}  // namespace jitfuse::codegen::detail
