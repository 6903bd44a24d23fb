// Forward and backward execution of a compiled plan: buffer management for group boundaries and
// saved context, argument binding for generated kernels, and the cuBLASLt calls of GEMM groups.
#include <algorithm>
#include <cstring>

#include "common/error.hpp"
#include "common/log.hpp"
#include "exec/executor.hpp"

namespace jitfuse::exec {
namespace {

using ops::Family;
using K = rules::Impl::Kind;

// Temporary and saved buffers of one call, from the caller's stream-ordered allocator.
class Buffers {
 public:
  Buffers(const Allocator& a, CUstream s) : a_(a), s_(s) {}
  ~Buffers() {
    for (auto& [p, n] : temps_) free_one(a_, s_, p, n);
  }
  void* temp(size_t bytes) {
    void* p = alloc_one(a_, s_, bytes);
    temps_.emplace_back(p, bytes);
    return p;
  }
  // Moves buffers referenced by `keep` out of the temporaries (they now belong to a saved context).
  void adopt_into(SavedContext& saved) {
    std::vector<std::pair<void*, size_t>> rest;
    for (auto& t : temps_) {
      bool kept = false;
      for (auto& [k, p] : saved.tensors) kept |= p == t.first;
      (kept ? saved.owned : rest).push_back(t);
    }
    temps_ = rest;
  }
  static void* alloc_one(const Allocator& a, CUstream s, size_t bytes) {
    bytes = std::max<size_t>(bytes, 16);
    if (a.alloc) {
      void* p = a.alloc(bytes, s, a.user);
      if (!p) fail(Status::out_of_memory, "the caller's allocator returned null for {} bytes", bytes);
      return p;
    }
    CUdeviceptr p = 0;
    cuda::check(cuda::driver().cuMemAllocFromPoolAsync(&p, bytes, cuda::temp_pool(), s), "cuMemAllocFromPoolAsync");
    return reinterpret_cast<void*>(p);
  }
  static void free_one(const Allocator& a, CUstream s, void* p, size_t bytes) {
    if (a.free) {
      a.free(p, bytes, s, a.user);
      return;
    }
    if (auto* d = cuda::try_driver()) d->cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), s);
  }

 private:
  Allocator a_;
  CUstream s_;
  std::vector<std::pair<void*, size_t>> temps_;
};

size_t elt(const CompiledPlan& cp) { return static_cast<size_t>(ops::dtype_bytes(cp.recipe.dtype)); }
size_t bytes_of(const CompiledPlan& cp, const ops::Shape& s) { return static_cast<size_t>(ops::numel(s)) * elt(cp); }

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

struct Binder {
  const CompiledPlan& cp;
  const ParamMap& params;
  const GradMap* grads = nullptr;
  SavedContext* saved = nullptr;
  Buffers& buf;
  const ForwardArgs* fa = nullptr;
  const BackwardArgs* ba = nullptr;
  uint64_t rng_offset = 0;

  const Fp8State& fp8(int op) const {
    if (fa) {
      auto it = fa->fp8.find(op);
      if (it != fa->fp8.end()) return it->second;
    }
    fail(Status::internal, "{}: no FP8 recipe state", cp.ops[op].label());
  }
  const void* param(int op, const std::string& name) const {
    auto it = params.find({op, name});
    if (it == params.end() || !it->second)
      fail(Status::invalid_argument, "{}: parameter '{}' is not bound (jf_sequence_bind_param)", cp.ops[op].label(), name);
    return it->second;
  }
  void* grad(int op, const std::string& name) const {
    auto it = grads->find({op, name});
    if (it == grads->end() || !it->second)
      fail(Status::invalid_argument, "{}: the gradient of '{}' has no buffer (jf_sequence_bind_grad)", cp.ops[op].label(), name);
    return it->second;
  }
  void* saved_read(int op, const std::string& name) const {
    auto it = saved->tensors.find({op, name});
    if (it == saved->tensors.end())
      fail(Status::internal, "{}: saved context '{}' missing: the forward group did not save what this backward needs",
           cp.ops[op].label(), name);
    return it->second;
  }
  size_t saved_bytes(int op, const std::string& name) const {
    const auto& o = cp.ops[op];
    int64_t rows = ops::rows_of(o.in), cols = ops::cols_of(o.in);
    if (name == "mean" || name == "rstd") return static_cast<size_t>(rows) * 4;
    if (name == "mask") return static_cast<size_t>(rows * ((cols + 7) / 8));
    if (name == "output") return bytes_of(cp, o.out);
    return bytes_of(cp, o.in);
  }
  void* saved_write(int op, const std::string& name) {
    if (!saved) fail(Status::internal, "a forward kernel saves context but no saved context was requested");
    void* p = buf.temp(saved_bytes(op, name));
    saved->tensors[{op, name}] = p;
    return p;
  }
};

// Binds and launches one generated kernel (+ its finalize kernels) over [b, e) with in/out given.
void launch(const CompiledPlan& cp, Runtime& rt, const KernelStep& ks, Binder& bd, const void* in, void* out,
            int64_t rows, CUstream stream) {
  const auto& d = cuda::driver();
  const auto& args = (ks.vec ? ks.vec : ks.scalar)->gen.args;
  // Resolve pointers first: their alignment picks the vector or scalar variant.
  std::vector<void*> ptrs(args.size(), nullptr);
  std::vector<std::pair<size_t, int64_t>> partial_sizes;
  bool all_aligned = true;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    const ops::Op* op = a.op >= 0 ? &cp.ops[a.op] : nullptr;
    void* p = nullptr;
    switch (a.role) {
      case codegen::Arg::Role::in: p = const_cast<void*>(in); break;
      case codegen::Arg::Role::out: p = out; break;
      case codegen::Arg::Role::param: p = const_cast<void*>(bd.param(a.op, a.name)); break;
      case codegen::Arg::Role::saved: p = a.writes ? bd.saved_write(a.op, a.name) : bd.saved_read(a.op, a.name); break;
      case codegen::Arg::Role::extra_in: p = const_cast<void*>(bd.fa->extra_in.at(op->extra_slot)); break;
      case codegen::Arg::Role::extra_out: p = bd.fa->extra_out.at(op->extra_slot); break;
      case codegen::Arg::Role::grad_extra_out: p = const_cast<void*>(bd.ba->grad_extra_out.at(op->extra_slot)); break;
      case codegen::Arg::Role::grad_extra_in: p = bd.ba->grad_extra_in.at(op->extra_slot); break;
      case codegen::Arg::Role::fp8_scale: ptrs[i] = bd.fp8(a.op).scale; continue;
      case codegen::Arg::Role::fp8_scale_inv: ptrs[i] = bd.fp8(a.op).scale_inv; continue;
      case codegen::Arg::Role::fp8_amax:
        // Written: per-block partials, sized with the grid below. Read: current scaling's amax_history[0].
        if (!a.writes) ptrs[i] = bd.fp8(a.op).history;
        continue;
      default: continue;  // partials and scalars below
    }
    if (a.name != "mask" && !aligned16(p)) all_aligned = false;
    ptrs[i] = p;
  }
  const LoadedKernel* lk = ks.vec;
  if (!(ks.spec.vec && all_aligned)) {
    std::lock_guard<std::mutex> lock(cp.mu);
    auto& mks = const_cast<KernelStep&>(ks);
    if (!mks.scalar) {
      auto spec = ks.spec;
      spec.vec = false;
      mks.scalar = &rt.kernels->load(spec, cp.target, ks.meta);
    }
    lk = mks.scalar;
  }
  const auto& L = lk->gen.launch;
  unsigned gx, gy = 1, bx = static_cast<unsigned>(L.bx), by = static_cast<unsigned>(L.by);
  // Persistent kernels (per-block partials) get the blocks that fit on the device at once; the others
  // one block per row slab (see codegen::Launch::persistent).
  const int64_t resident = static_cast<int64_t>(cp.device.sm_count) * lk->blocks_per_sm;
  if (ks.spec.skeleton == codegen::Skeleton::rownorm) {
    const int64_t cap = L.persistent ? resident : int64_t{0x7fffffff};
    gx = static_cast<unsigned>(std::clamp<int64_t>(rows, 1, cap));
  } else {
    gx = static_cast<unsigned>(L.grid_x);
    int64_t slab = static_cast<int64_t>(L.by) * L.rows_per_thread_iter;
    int64_t want = (rows + slab - 1) / slab;
    int64_t cap = L.persistent ? std::max<int64_t>(1, resident / std::max<int64_t>(1, L.grid_x)) : 65535;
    gy = static_cast<unsigned>(std::clamp<int64_t>(want, 1, std::min<int64_t>(cap, 65535)));
  }
  const int parts = static_cast<int>(ks.spec.skeleton == codegen::Skeleton::rownorm ? gx : gy);
  void* amax_part = nullptr;  // FP8: one partial amax per block
  int amax_parts = 0;
  // Scalars and partials.
  std::vector<int64_t> i64s(args.size());
  std::vector<uint64_t> u64s(args.size());
  std::vector<void*> kparams(args.size());
  std::map<std::string, void*> partials;
  for (size_t i = 0; i < args.size(); ++i) {
    const auto& a = args[i];
    switch (a.role) {
      case codegen::Arg::Role::rows: i64s[i] = rows; kparams[i] = &i64s[i]; continue;
      case codegen::Arg::Role::seed:
        u64s[i] = cp.ops[a.op].attrs["seed"].get<uint64_t>(); kparams[i] = &u64s[i]; continue;
      case codegen::Arg::Role::offset: u64s[i] = bd.rng_offset; kparams[i] = &u64s[i]; continue;
      case codegen::Arg::Role::fp8_amax:
        if (a.writes) {
          amax_parts = static_cast<int>(gx * gy);
          amax_part = ptrs[i] = bd.buf.temp(static_cast<size_t>(amax_parts) * sizeof(float));
        }
        break;
      case codegen::Arg::Role::partials: {
        int64_t width = 0;
        for (auto& f : lk->gen.finalize)
          if (f.op == a.op && f.name == a.name) width = f.cols;
        ptrs[i] = bd.buf.temp(static_cast<size_t>(parts) * static_cast<size_t>(width) * 4);
        partials[std::to_string(a.op) + "." + a.name] = ptrs[i];
        break;
      }
      default: break;
    }
    kparams[i] = &ptrs[i];
  }
  cuda::check(d.cuLaunchKernel(lk->fn, gx, gy, 1, bx, by, 1, 0, stream, kparams.data(), nullptr), "cuLaunchKernel");
  for (auto& f : lk->gen.finalize) {
    std::string k = std::to_string(f.op) + "." + f.name;
    void* part = partials.at(k);
    void* g = bd.grad(f.op, f.name);
    int np = parts, acc = 0;
    void* fp[] = {&part, &g, &np, &acc};
    unsigned grid = static_cast<unsigned>((f.cols + 255) / 256);
    cuda::check(d.cuLaunchKernel(lk->finalize.at(k), grid, 1, 1, 256, 1, 1, 0, stream, fp, nullptr),
                "cuLaunchKernel(finalize)");
  }
  if (lk->fp8_update) {
    // Reduce the partials: into amax_history[0] (current scaling's amax pass), or into the history with
    // the scale update (delayed scaling).
    const Fp8State& st = bd.fp8(ks.spec.fp8->op);
    void* hist = st.history;
    void* scale = st.scale;
    void* scale_inv = st.scale_inv;
    int len = st.len;
    void* up[] = {&amax_part, &amax_parts, &hist, &len, &scale, &scale_inv};
    cuda::check(d.cuLaunchKernel(lk->fp8_update, 1, 1, 1, 1024, 1, 1, 0, stream, up, nullptr),
                "cuLaunchKernel(fp8 update)");
  }
}

// The GEMM of a linear op in row-major terms (x [m,k], W [n,k]); callers add operands and epilogue.
cuda::GemmCall linear_gemm(const CompiledPlan& cp, const ops::Op& lin, cuda::GemmKind kind) {
  cuda::GemmCall c;
  c.kind = kind;
  c.m = ops::rows_of(lin.in);
  c.k = ops::cols_of(lin.in);
  c.n = ops::cols_of(lin.out);
  c.dtype = cp.recipe.dtype;
  return c;
}

// A column of m ones in the recipe's dtype (for Blas::column_sums).
void* ones_column(const CompiledPlan& cp, int64_t m, Buffers& buf, CUstream stream) {
  void* ones = buf.temp(static_cast<size_t>(m) * elt(cp));
  const auto& d = cuda::driver();
  const auto p = reinterpret_cast<CUdeviceptr>(ones);
  const size_t n = static_cast<size_t>(m);
  switch (cp.recipe.dtype) {
    case ops::DType::f32: cuda::check(d.cuMemsetD32Async(p, 0x3F800000u, n, stream), "cuMemsetD32Async"); break;
    case ops::DType::f16: cuda::check(d.cuMemsetD16Async(p, 0x3C00u, n, stream), "cuMemsetD16Async"); break;
    default: cuda::check(d.cuMemsetD16Async(p, 0x3F80u, n, stream), "cuMemsetD16Async"); break;
  }
  return ones;
}

// The wgrad GEMM (its `a` is dy) with BGRADB also writing db = column sums of dy; when cuBLASLt has no
// BGRADB algorithm for the problem (dtype, alignment, shape), the plain wgrad and then db = 1^T dy.
void wgrad_with_bias_grad(const CompiledPlan& cp, Runtime& rt, cuda::GemmCall wg, void* db, const ops::Op& bias,
                          Buffers& buf, CUstream stream) {
  wg.epilogue = cuda::Epilogue::bgradb;
  wg.bias = db;
  try {
    rt.blas->gemm(wg, stream);
  } catch (const Error& err) {
    if (err.status() != Status::unsupported) throw;
    log().debug("{}: {}; computing the bias gradient with a separate GEMM", bias.label(), err.what());
    wg.epilogue = cuda::Epilogue::none;
    wg.bias = nullptr;
    rt.blas->gemm(wg, stream);
    rt.blas->column_sums(cp.recipe.dtype, wg.m, wg.n, wg.a, ones_column(cp, wg.m, buf, stream), db, stream);
  }
}

void register_boundary_saves(const CompiledPlan& cp, int b, int e, const std::vector<void*>& val, SavedContext* saved,
                             bool joint_recompute) {
  if (!saved) return;
  for (int i = b; i < e; ++i) {
    for (auto k : cp.ops[i].saved) {
      if (k == ops::SavedKind::input && i == b) saved->tensors[{i, "input"}] = val[b];
      if (k == ops::SavedKind::output && i + 1 == e && !joint_recompute) saved->tensors[{i, "output"}] = val[e];
    }
  }
}

}  // namespace

void run_forward(const CompiledPlan& cp, Runtime& rt, const ParamMap& params, const ForwardArgs& fa,
                 SavedContext* saved) {
  const int n = static_cast<int>(cp.ops.size());
  Buffers buf(rt.allocator, fa.stream);
  Binder bd{cp, params, nullptr, saved, buf, &fa, nullptr, fa.rng_offset};
  std::vector<void*> val(n + 1, nullptr);
  val[0] = const_cast<void*>(fa.input);
  val[n] = fa.output;
  auto materialize = [&](int i) {
    if (!val[i]) val[i] = buf.temp(bytes_of(cp, cp.ops[i - 1].out));
  };
  for (const auto& ge : cp.fwd) {
    const auto& g = ge.group;
    materialize(g.end);
    if (g.impl.kind == K::joint && g.impl.strategy == "relu_bitmask") {
      // [linear bias relu linear (bias)]: h = relu(x W1^T + b1) with RELU_AUX_BIAS also writing the 1-bit
      // ReLU mask (training), then y = h W2^T (+ b2). Saved: x, h (the inputs of the linears), the mask.
      const int b = g.begin;
      const auto& l1 = cp.ops[b];
      materialize(b + 3);
      cuda::GemmCall c1 = linear_gemm(cp, l1, cuda::GemmKind::fwd);
      c1.a = val[b];
      c1.b = bd.param(b, "weight");
      c1.bias = bd.param(b + 1, "bias");
      c1.d = val[b + 3];
      c1.epilogue = cuda::Epilogue::relu_bias;
      if (saved) {
        c1.epilogue = cuda::Epilogue::relu_aux_bias;
        c1.aux = buf.temp(cuda::relu_mask_bytes(ops::cols_of(l1.out), ops::rows_of(l1.out)));
        saved->tensors[{b + 2, "mask"}] = c1.aux;
        saved->tensors[{b, "input"}] = val[b];
        saved->tensors[{b + 3, "input"}] = val[b + 3];
      }
      rt.blas->gemm(c1, fa.stream);
      cuda::GemmCall c2 = linear_gemm(cp, cp.ops[b + 3], cuda::GemmKind::fwd);
      c2.a = val[b + 3];
      c2.b = bd.param(b + 3, "weight");
      c2.d = val[g.end];
      if (g.end - b == 5) {  // [... linear bias]: the second bias in the epilogue
        c2.epilogue = cuda::Epilogue::bias;
        c2.bias = bd.param(b + 4, "bias");
      }
      rt.blas->gemm(c2, fa.stream);
      continue;
    }
    const bool recompute = g.impl.kind == K::joint && g.impl.strategy == "recompute_linear_output";
    if (ge.gemm_ops > 0) {
      const auto& lin = cp.ops[g.begin];
      int gemm_end = g.begin + (ge.gemm_ops == 1 ? 1 : ge.gemm_ops);
      materialize(gemm_end);
      cuda::GemmCall c = linear_gemm(cp, lin, cuda::GemmKind::fwd);
      c.a = val[g.begin];
      c.b = bd.param(g.begin, "weight");
      c.d = val[gemm_end];
      const std::string& epi = g.impl.kind == K::cublaslt ? g.impl.epilogue : std::string();
      if (epi == "BIAS" || epi == "GELU_AUX_BIAS" || epi == "RELU_BIAS" ||
          (epi == "RESIDUAL" && cp.ops[g.begin + 1].family == Family::bias)) {
        c.bias = bd.param(g.begin + 1, "bias");
        c.epilogue = cuda::Epilogue::bias;
      }
      if (epi == "GELU_AUX_BIAS") {
        c.epilogue = saved ? cuda::Epilogue::gelu_aux_bias : cuda::Epilogue::gelu_bias;
        if (saved) c.aux = bd.saved_write(g.begin + 2, "input");
      }
      if (epi == "RELU_BIAS") c.epilogue = cuda::Epilogue::relu_bias;
      if (epi == "RESIDUAL") {
        const auto& mid = cp.ops[g.begin + 1];
        if (mid.family != Family::bias) c.alpha = static_cast<float>(mid.consts.at(0));
        c.beta = 1.f;
        c.c = fa.extra_in.at(cp.ops[g.begin + 2].extra_slot);
      }
      rt.blas->gemm(c, fa.stream);
      register_boundary_saves(cp, g.begin, gemm_end, val, saved, false);
      if (ge.kernel) {
        launch(cp, rt, *ge.kernel, bd, val[gemm_end], val[g.end], ops::rows_of(cp.ops[gemm_end].in), fa.stream);
        if (!recompute) register_boundary_saves(cp, gemm_end, g.end, val, saved, false);
      }
      if (recompute && saved) saved->tensors.erase({g.begin + 1, "input"});
    } else {
      for (auto* ks : ge.steps())
        launch(cp, rt, *ks, bd, val[g.begin], val[g.end], ops::rows_of(cp.ops[g.begin].in), fa.stream);
      register_boundary_saves(cp, g.begin, g.end, val, saved, false);
    }
  }
  if (saved) {
    saved->rng_offset = fa.rng_offset;
    buf.adopt_into(*saved);
  }
}

void run_backward(const CompiledPlan& cp, Runtime& rt, const ParamMap& params, const GradMap& grads,
                  SavedContext& saved, const BackwardArgs& ba) {
  const int n = static_cast<int>(cp.ops.size());
  Buffers buf(rt.allocator, ba.stream);
  Binder bd{cp, params, &grads, &saved, buf, nullptr, &ba, saved.rng_offset};
  std::vector<void*> gv(n + 1, nullptr);
  gv[n] = const_cast<void*>(ba.grad_output);
  gv[0] = ba.grad_input;
  auto materialize = [&](int i) {
    if (!gv[i]) gv[i] = buf.temp(bytes_of(cp, cp.ops[i].in));
  };
  for (auto it = cp.bwd.rbegin(); it != cp.bwd.rend(); ++it) {
    const auto& ge = *it;
    const auto& g = ge.group;
    materialize(g.begin);
    if (ge.gemm_ops == 0) {
      // Rows as the kernel's columns count them: the input layout of the group's first op.
      launch(cp, rt, *ge.kernel, bd, gv[g.end], gv[g.begin], ops::rows_of(cp.ops[g.begin].in), ba.stream);
      continue;
    }
    if (g.impl.kind == K::joint && g.impl.strategy == "relu_bitmask") {
      // dh = relu'(mask) * (dy W2) and db1 = sum_rows dh in the second linear's dgrad (DRELU_BGRAD), its
      // wgrad from the saved h (with BGRADB for b2), then the first linear's dgrad and wgrad from dh.
      const int b = g.begin;
      const auto& l1 = cp.ops[b];
      const auto& l2 = cp.ops[b + 3];
      const void* dy = gv[g.end];
      void* dh = buf.temp(bytes_of(cp, l1.out));
      cuda::GemmCall d2 = linear_gemm(cp, l2, cuda::GemmKind::dgrad);
      d2.a = dy;
      d2.b = bd.param(b + 3, "weight");
      d2.d = dh;
      d2.epilogue = cuda::Epilogue::drelu_bgrad;
      d2.aux = bd.saved_read(b + 2, "mask");
      d2.bias = bd.grad(b + 1, "bias");
      rt.blas->gemm(d2, ba.stream);
      cuda::GemmCall w2 = linear_gemm(cp, l2, cuda::GemmKind::wgrad);
      w2.a = dy;
      w2.b = bd.saved_read(b + 3, "input");
      w2.d = bd.grad(b + 3, "weight");
      w2.beta = l2.flag("accumulate_grad") ? 1.f : 0.f;
      if (g.end - b == 5)
        wgrad_with_bias_grad(cp, rt, w2, bd.grad(b + 4, "bias"), cp.ops[b + 4], buf, ba.stream);
      else
        rt.blas->gemm(w2, ba.stream);
      cuda::GemmCall d1 = linear_gemm(cp, l1, cuda::GemmKind::dgrad);
      d1.a = dh;
      d1.b = bd.param(b, "weight");
      d1.d = gv[b];
      rt.blas->gemm(d1, ba.stream);
      cuda::GemmCall w1 = linear_gemm(cp, l1, cuda::GemmKind::wgrad);
      w1.a = dh;
      w1.b = bd.saved_read(b, "input");
      w1.d = bd.grad(b, "weight");
      w1.beta = l1.flag("accumulate_grad") ? 1.f : 0.f;
      rt.blas->gemm(w1, ba.stream);
      continue;
    }
    const std::string& epi = g.impl.kind == K::cublaslt ? g.impl.epilogue : std::string();
    // The linear op: second in [make_extra_output linear], third in [bias gelu linear (bias)], else first.
    const int li = epi == "DGRAD_ACCUMULATE" ? g.begin + 1 : epi == "DGELU_BGRAD" ? g.begin + 2 : g.begin;
    const auto& lin = cp.ops[li];
    const void* dy = gv[g.end];
    float alpha = 1.f;
    if (epi == "SCALED") alpha = static_cast<float>(cp.ops[g.begin + 1].consts.at(0));
    if (g.impl.kind == K::joint && g.impl.strategy == "recompute_linear_output") {
      // Recompute h = x W^T, then the pointwise backward on it, then the linear's grads from dh.
      cuda::GemmCall c = linear_gemm(cp, lin, cuda::GemmKind::fwd);
      c.a = bd.saved_read(li, "input");
      c.b = bd.param(li, "weight");
      void* h = buf.temp(bytes_of(cp, lin.out));
      c.d = h;
      rt.blas->gemm(c, ba.stream);
      saved.tensors[{li + 1, "input"}] = h;
      void* dh = buf.temp(bytes_of(cp, lin.out));
      launch(cp, rt, *ge.kernel, bd, dy, dh, ops::rows_of(lin.out), ba.stream);
      saved.tensors.erase({li + 1, "input"});
      dy = dh;
    }
    cuda::GemmCall dg = linear_gemm(cp, lin, cuda::GemmKind::dgrad);
    dg.alpha = alpha;
    dg.a = dy;
    dg.b = bd.param(li, "weight");
    dg.d = gv[g.begin];
    if (epi == "DGRAD_ACCUMULATE") {
      dg.beta = 1.f;
      dg.c = ba.grad_extra_out.at(cp.ops[g.begin].extra_slot);
    }
    if (epi == "DGELU_BGRAD") {
      // d(bias input) = gelu'(h) * (dy W) with h = gelu's saved input; db = its column sums.
      dg.epilogue = cuda::Epilogue::dgelu_bgrad;
      dg.aux = bd.saved_read(g.begin + 1, "input");
      dg.bias = bd.grad(g.begin, "bias");
    }
    rt.blas->gemm(dg, ba.stream);
    cuda::GemmCall wg = dg;
    wg.kind = cuda::GemmKind::wgrad;
    wg.epilogue = cuda::Epilogue::none;
    wg.bias = nullptr;
    wg.aux = nullptr;
    wg.a = dy;
    wg.b = bd.saved_read(li, "input");
    wg.d = bd.grad(li, "weight");
    wg.c = nullptr;
    wg.beta = lin.flag("accumulate_grad") ? 1.f : 0.f;
    // A bias right after the linear ([linear bias], [bias gelu linear bias]): db = column sums of dy, taken
    // by the wgrad GEMM that reads dy anyway.
    if (li + 1 < g.end && cp.ops[li + 1].family == Family::bias && (epi == "BGRADB" || epi == "DGELU_BGRAD")) {
      wgrad_with_bias_grad(cp, rt, wg, bd.grad(li + 1, "bias"), cp.ops[li + 1], buf, ba.stream);
      continue;
    }
    rt.blas->gemm(wg, ba.stream);
  }
}

void release_saved(SavedContext& saved, CUstream stream) {
  if (saved.released) return;
  for (auto& [p, nbytes] : saved.owned) {
    if (saved.allocator.free) {
      saved.allocator.free(p, nbytes, stream, saved.allocator.user);
    } else if (auto* d = cuda::try_driver()) {
      d->cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), stream);
    }
  }
  saved.owned.clear();
  saved.tensors.clear();
  saved.released = true;
}

}  // namespace jitfuse::exec
