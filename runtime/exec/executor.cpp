// The executor: prepare a program (compile + load every variant, lay out for the device), then run its
// steps. A step is a resolved cuBLASLt call or a generated kernel with its arguments bound to buffer ids;
// nothing here knows rules, ops or names.
#include "exec/executor.hpp"

#include <algorithm>
#include <thread>

#include "common/error.hpp"
#include "common/log.hpp"

namespace jitfuse::exec {
namespace {

void* alloc_bytes(const Allocator& a, CUstream s, size_t bytes) {
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

void free_bytes(const Allocator& a, CUstream s, void* p, size_t bytes) {
  if (!p) return;
  if (a.free) {
    a.free(p, std::max<size_t>(bytes, 16), s, a.user);
    return;
  }
  if (auto* d = cuda::try_driver()) d->cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), s);
}

// One stream-ordered allocation, freed (stream-ordered) on scope exit unless released.
class Block {
 public:
  Block(const Allocator& a, CUstream s, size_t bytes) : a_(a), s_(s), bytes_(bytes) {
    if (bytes) p_ = alloc_bytes(a, s, bytes);
  }
  ~Block() { free_bytes(a_, s_, p_, bytes_); }
  Block(const Block&) = delete;
  Block& operator=(const Block&) = delete;
  char* get() const { return static_cast<char*>(p_); }
  void* release() {
    void* p = p_;
    p_ = nullptr;
    return p;
  }

 private:
  Allocator a_;
  CUstream s_;
  size_t bytes_;
  void* p_ = nullptr;
};

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

void place(const Program& p, Storage storage, char* base, std::vector<void*>& ptr) {
  for (const auto& b : p.buffers)
    if (b.storage == storage && b.first >= 0) ptr[static_cast<size_t>(b.id)] = base + b.offset;
}

void bind_params(const Program& p, const ParamMap& params, const GradMap* grads, std::vector<void*>& ptr) {
  for (const auto& b : p.buffers) {
    if (b.role == BufferRole::param) {
      auto it = params.find({b.op, b.key});
      if (it == params.end() || !it->second)
        fail(Status::invalid_argument, "{}: parameter '{}' is not bound (jf_sequence_bind_param)",
             p.ops.at(static_cast<size_t>(b.op)).label(), b.key);
      ptr[static_cast<size_t>(b.id)] = const_cast<void*>(it->second);
    } else if (b.role == BufferRole::grad && grads) {
      auto it = grads->find({b.op, b.key});
      if (it == grads->end() || !it->second)
        fail(Status::invalid_argument, "{}: the gradient of '{}' has no buffer (jf_sequence_bind_grad)",
             p.ops.at(static_cast<size_t>(b.op)).label(), b.key);
      ptr[static_cast<size_t>(b.id)] = it->second;
    }
  }
}

template <class T>
void bind_list(const std::vector<int>& ids, const std::vector<T>& given, std::vector<void*>& ptr) {
  for (size_t k = 0; k < ids.size() && k < given.size(); ++k)
    if (ids[k] >= 0) ptr[static_cast<size_t>(ids[k])] = const_cast<void*>(static_cast<const void*>(given[k]));
}

void run_gemm(const Prepared& pp, Runtime& rt, const GemmStep& g, const std::vector<void*>& ptr, CUstream stream) {
  auto at = [&](int id) -> void* { return id >= 0 ? ptr[static_cast<size_t>(id)] : nullptr; };
  cuda::GemmCall c = g.call;
  c.a = at(g.a);
  c.b = at(g.b);
  c.c = at(g.c);
  c.d = at(g.d);
  c.bias = at(g.bias);
  c.aux = at(g.aux);
  if (!g.bias_grad_fallback) return rt.blas->gemm(c, stream);
  try {
    rt.blas->gemm(c, stream);
  } catch (const Error& err) {
    if (err.status() != Status::unsupported) throw;
    // No BGRADB algorithm for this problem: the plain wgrad, then db = ones^T dy with a column of ones.
    log().debug("{}; computing the bias gradient with a separate GEMM", err.what());
    void* db = at(g.bias);
    c.epilogue = cuda::Epilogue::none;
    c.bias = nullptr;
    rt.blas->gemm(c, stream);
    const auto& d = cuda::driver();
    const auto ones = reinterpret_cast<CUdeviceptr>(at(g.ones));
    const size_t m = static_cast<size_t>(c.m);
    switch (c.dtype) {
      case ops::DType::f32: cuda::check(d.cuMemsetD32Async(ones, 0x3F800000u, m, stream), "cuMemsetD32Async"); break;
      case ops::DType::f16: cuda::check(d.cuMemsetD16Async(ones, 0x3C00u, m, stream), "cuMemsetD16Async"); break;
      default: cuda::check(d.cuMemsetD16Async(ones, 0x3F80u, m, stream), "cuMemsetD16Async"); break;
    }
    rt.blas->column_sums(c.dtype, c.m, c.n, c.a, at(g.ones), db, stream);
  }
  (void)pp;
}

void run_kernel(const KernelStep& k, const std::vector<void*>& ptr, uint64_t rng_offset, CUstream stream) {
  const auto& d = cuda::driver();
  bool vec = k.spec.vec;
  for (int id : k.align_buffers) vec = vec && aligned16(ptr[static_cast<size_t>(id)]);
  const KernelStep::Variant& v = vec ? k.vec : k.scalar;
  if (!v.kernel) fail(Status::internal, "kernel {} was not prepared", k.gen.kernel);
  const KernelLaunch& L = v.launch;
  const size_t n = k.args.size();
  std::vector<void*> vals(n, nullptr);
  std::vector<uint64_t> u64s(n);
  std::vector<int64_t> i64s(n);
  std::vector<int> ints(n);
  std::vector<void*> kparams(n);
  for (size_t i = 0; i < n; ++i) {
    const KArg& a = k.args[i];
    switch (a.kind) {
      case KArg::Kind::buffer: vals[i] = ptr[static_cast<size_t>(a.buffer)]; kparams[i] = &vals[i]; break;
      case KArg::Kind::rows: i64s[i] = k.rows; kparams[i] = &i64s[i]; break;
      case KArg::Kind::u64_const: u64s[i] = a.value; kparams[i] = &u64s[i]; break;
      case KArg::Kind::rng_offset: u64s[i] = rng_offset; kparams[i] = &u64s[i]; break;
      case KArg::Kind::int_const: ints[i] = L.parts; kparams[i] = &ints[i]; break;
    }
  }
  cuda::check(d.cuLaunchKernel(v.kernel->fn, L.gx, L.gy, 1, L.bx, L.by, 1, 0, stream, kparams.data(), nullptr),
              "cuLaunchKernel");
  for (const auto& f : k.finalize) {
    void* part = ptr[static_cast<size_t>(f.partials)];
    void* g = ptr[static_cast<size_t>(f.grad)];
    int np = L.parts, acc = 0;
    void* fp[] = {&part, &g, &np, &acc};
    const unsigned grid = static_cast<unsigned>((f.cols + 255) / 256);
    cuda::check(d.cuLaunchKernel(v.kernel->finalize.at(f.key), grid, 1, 1, 256, 1, 1, 0, stream, fp, nullptr),
                "cuLaunchKernel(finalize)");
  }
  if (v.kernel->fp8_update) {
    // Reduce the per-block amax partials: into amax_history[0] (current scaling's amax pass), or into the
    // history with the scale update (delayed scaling).
    void* part = ptr[static_cast<size_t>(k.amax_partials)];
    int parts = static_cast<int>(L.gx * L.gy);
    void* hist = ptr[static_cast<size_t>(k.fp8_history)];
    void* scale = ptr[static_cast<size_t>(k.fp8_scale)];
    void* scale_inv = ptr[static_cast<size_t>(k.fp8_scale_inv)];
    int len = k.fp8_len;
    void* up[] = {&part, &parts, &hist, &len, &scale, &scale_inv};
    cuda::check(d.cuLaunchKernel(v.kernel->fp8_update, 1, 1, 1, 1024, 1, 1, 0, stream, up, nullptr),
                "cuLaunchKernel(fp8 update)");
  }
}

}  // namespace

void run_steps(const Prepared& pp, Runtime& rt, const std::vector<Step>& steps, const std::vector<void*>& ptr,
               uint64_t rng_offset, CUstream stream, const GroupHook& hook) {
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (hook && (i == 0 || steps[i - 1].group != s.group)) hook(s.group, true);
    if (s.kind == Step::Kind::gemm)
      run_gemm(pp, rt, s.gemm, ptr, stream);
    else
      run_kernel(*s.kernel, ptr, rng_offset, stream);
    if (hook && (i + 1 == steps.size() || steps[i + 1].group != s.group)) hook(s.group, false);
  }
}

std::shared_ptr<const Prepared> prepare_program(std::shared_ptr<Program> program, Runtime& rt) {
  auto pp = std::make_shared<Prepared>();
  pp->device = cuda::current_device();
  pp->target = target_for_arch(pp->device.arch());
  // Compile every variant in parallel first (the cache dedupes across threads and processes), then load.
  rt.kernels->prefetch(program_kernels(*program), pp->target,
                       std::max(1u, std::min(8u, std::thread::hardware_concurrency())));
  for (auto* steps : {&program->forward, &program->backward})
    for (auto& s : *steps) {
      if (s.kind != Step::Kind::kernel) continue;
      KernelStep& k = *s.kernel;
      if (k.spec.vec) k.vec.kernel = &rt.kernels->load(k.spec, pp->target, k.meta);
      auto scalar = k.spec;
      scalar.vec = false;
      k.scalar.kernel = &rt.kernels->load(scalar, pp->target, k.meta);
    }
  DeviceModel dev;
  dev.arch = pp->device.arch();
  dev.sm_count = pp->device.sm_count;
  dev.estimated = false;
  layout_program(*program, dev);
  pp->program = std::move(program);
  return pp;
}

void run_forward(const std::shared_ptr<const Prepared>& pp, Runtime& rt, const ParamMap& params,
                 const ForwardArgs& fa, SavedContext* saved) {
  const Program& p = *pp->program;
  std::vector<void*> ptr(p.buffers.size(), nullptr);
  ptr[static_cast<size_t>(p.input)] = const_cast<void*>(fa.input);
  ptr[static_cast<size_t>(p.output)] = fa.output;
  bind_list(p.extra_in, fa.extra_in, ptr);
  bind_list(p.extra_out, fa.extra_out, ptr);
  bind_params(p, params, nullptr, ptr);
  for (const auto& b : p.buffers) {
    if (b.role != BufferRole::recipe_state) continue;
    auto it = fa.fp8.find(b.op);
    if (it == fa.fp8.end()) fail(Status::internal, "{}: no FP8 recipe state", p.ops.at(static_cast<size_t>(b.op)).label());
    ptr[static_cast<size_t>(b.id)] = b.key == "scale" ? static_cast<void*>(it->second.scale)
                                     : b.key == "scale_inv" ? static_cast<void*>(it->second.scale_inv)
                                                            : static_cast<void*>(it->second.history);
  }
  Block arena(rt.allocator, fa.stream, p.fwd_arena);
  Block block(rt.allocator, fa.stream, saved && p.training ? p.saved_bytes : 0);
  place(p, Storage::fwd_arena, arena.get(), ptr);
  if (saved && p.training) place(p, Storage::saved, block.get(), ptr);
  std::shared_ptr<Shadow> shadow;
  if (rt.verify && pp->reference) {
    if (p.recipe.is_fp8()) {
      rt.verify->note_skip("FP8 recipes are not verified (a shadow run would advance the recipe state twice)");
    } else {
      shadow = std::make_shared<Shadow>(pp, pp->reference, *rt.verify, rt);
      shadow->begin_forward(fa, ptr, p.training);
    }
  }
  GroupHook hook;
  if (shadow)
    hook = [&](int g, bool before) {
      if (before)
        shadow->forward_input(g, ptr, fa.stream);
      else
        shadow->forward_group(g, ptr, fa.rng_offset, fa.stream);
    };
  run_steps(*pp, rt, p.forward, ptr, fa.rng_offset, fa.stream, hook);
  if (saved) {
    saved->shadow = shadow;
    saved->prepared = pp;
    saved->bytes = p.training ? p.saved_bytes : 0;
    saved->block = block.release();
    saved->ptrs = std::move(ptr);
    saved->rng_offset = fa.rng_offset;
    saved->allocator = rt.allocator;
  }
}

void run_backward(const Prepared& pp, Runtime& rt, const ParamMap& params, const GradMap& grads,
                  const SavedContext& saved, const BackwardArgs& ba) {
  const Program& p = *pp.program;
  if (!p.training) fail(Status::invalid_argument, "this saved context comes from an inference forward");
  std::vector<void*> ptr = saved.ptrs;  // the forward side: inputs, outputs, extras, the saved block
  ptr.resize(p.buffers.size(), nullptr);
  ptr[static_cast<size_t>(p.grad_output)] = const_cast<void*>(ba.grad_output);
  ptr[static_cast<size_t>(p.grad_input)] = ba.grad_input;
  bind_list(p.grad_extra_out, ba.grad_extra_out, ptr);
  bind_list(p.grad_extra_in, ba.grad_extra_in, ptr);
  bind_params(p, params, &grads, ptr);
  Block arena(rt.allocator, ba.stream, p.bwd_arena);
  place(p, Storage::bwd_arena, arena.get(), ptr);
  GroupHook hook;
  if (saved.shadow) {
    saved.shadow->begin_backward(ba, ptr);
    hook = [&](int g, bool before) {
      if (before)
        saved.shadow->backward_input(g, ptr, ba.stream);
      else
        saved.shadow->backward_group(g, ptr, saved.rng_offset, ba.stream);
    };
  }
  run_steps(pp, rt, p.backward, ptr, saved.rng_offset, ba.stream, hook);
}

void release_saved(SavedContext& saved, CUstream stream) {
  if (saved.released) return;
  free_bytes(saved.allocator, stream, saved.block, saved.bytes);
  saved.block = nullptr;
  saved.ptrs.clear();
  saved.shadow.reset();
  saved.released = true;
}

}  // namespace jitfuse::exec
