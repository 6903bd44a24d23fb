// The shadow run behind JITFUSE_VERIFY: the unfused program of the same sequence, bound to the caller's
// inputs and parameters and to scratch outputs, run group by group beside the fused one and compared on
// the host (a debugging mode: it synchronises the stream and allocates synchronously).
#include "exec/run/verify.hpp"

#include <cmath>
#include <cstring>

#include "common/error.hpp"
#include "common/log.hpp"
#include "exec/run/executor.hpp"

namespace jitfuse::exec {
namespace {

// IEEE half and bfloat16 bits to double (the float64 oracle stays out of the shipped library).
double half_bits(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? std::ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : std::ldexp(1024 + m, e - 25);
  return s ? -v : v;
}
double bf16_bits(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

double to_double(const unsigned char* p, ops::DType dt) {
  switch (dt) {
    case ops::DType::f32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case ops::DType::f16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return half_bits(h);
    }
    case ops::DType::bf16: {
      uint16_t h;
      std::memcpy(&h, p, 2);
      return bf16_bits(h);
    }
    default: return 0;
  }
}

// DESIGN's tolerances; fp32 GEMMs take fp16's (TF32-class accumulation orders differ between epilogues).
std::pair<double, double> tolerance(ops::DType dt, bool gemm) {
  switch (dt) {
    case ops::DType::f32: return gemm ? std::pair{1e-3, 1e-5} : std::pair{1.3e-6, 1e-5};
    case ops::DType::f16: return {1e-3, 1e-5};
    default: return {1.6e-2, 1e-5};
  }
}

}  // namespace

void VerifyLog::note_skip(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& s : skipped)
    if (s == why) return;
  skipped.push_back(why);
  log().warn("JITFUSE_VERIFY: {}", why);
}

Shadow::Shadow(std::shared_ptr<const Prepared> fused, std::shared_ptr<const Prepared> reference, VerifyLog& log,
               Runtime& rt)
    : fused_(std::move(fused)), ref_(std::move(reference)), log_(log), rt_(rt) {
  ptr_.assign(ref_->program->buffers.size(), nullptr);
}

Shadow::~Shadow() {
  if (auto* d = cuda::try_driver())
    for (void* p : owned_) d->cuMemFree(reinterpret_cast<CUdeviceptr>(p));
}

void* Shadow::scratch(size_t bytes) {
  CUdeviceptr p = 0;
  cuda::check(cuda::driver().cuMemAlloc(&p, std::max<size_t>(bytes, 256)), "cuMemAlloc(JITFUSE_VERIFY)");
  owned_.push_back(reinterpret_cast<void*>(p));
  return owned_.back();
}

// Both directions: the pass's arena (and, forward, the saved block) as one scratch allocation each, laid
// out as the reference program says; the parameters are the fused run's; the backward's gradients scratch.
void Shadow::bind_pass(bool forward, const std::vector<void*>& fused_ptr) {
  const Layout& L = ref_->layout;
  const Program& f = *fused_->program;
  char* arena = static_cast<char*>(scratch(forward ? L.fwd_arena : L.bwd_arena));
  char* sav = forward ? static_cast<char*>(scratch(L.saved_bytes)) : nullptr;
  const Storage arena_at = forward ? Storage::fwd_arena : Storage::bwd_arena;
  for (const auto& b : L.buffers) {
    const size_t id = static_cast<size_t>(b.id);
    if (b.storage == arena_at) ptr_[id] = arena + b.offset;
    if (forward && b.storage == Storage::saved_block) ptr_[id] = sav + b.offset;
    if (!forward && b.role == BufferRole::grad) ptr_[id] = scratch(b.bytes);
    if (b.role == BufferRole::param)
      for (const auto& fb : f.buffers)
        if (fb.role == BufferRole::param && fb.op == b.op && fb.key == b.key) ptr_[id] = fused_ptr[fb.id];
  }
}

namespace {
// The two directions' observers: which of the shadow's steps a fused call's events run.
class ForwardWatch final : public CallObserver {
 public:
  ForwardWatch(Shadow& s, const ForwardArgs& fa) : s_(s), fa_(fa) {}
  void bound(const std::vector<void*>& ptr) override { s_.begin_forward(fa_, ptr); }
  void group(int g, bool before, const std::vector<void*>& ptr, CUstream stream) override {
    if (before)
      s_.forward_input(g, ptr, stream);
    else
      s_.forward_group(g, ptr, stream);
  }

 private:
  Shadow& s_;
  const ForwardArgs& fa_;
};

class BackwardWatch final : public CallObserver {
 public:
  BackwardWatch(Shadow& s, const BackwardArgs& ba) : s_(s), ba_(ba) {}
  void bound(const std::vector<void*>& ptr) override { s_.begin_backward(ba_, ptr); }
  void group(int g, bool before, const std::vector<void*>& ptr, CUstream stream) override {
    if (before)
      s_.backward_input(g, ptr, stream);
    else
      s_.backward_group(g, ptr, stream);
  }

 private:
  Shadow& s_;
  const BackwardArgs& ba_;
};
}  // namespace

std::unique_ptr<CallObserver> Shadow::forward_observer(const ForwardArgs& fa) {
  return std::make_unique<ForwardWatch>(*this, fa);
}

std::unique_ptr<CallObserver> Shadow::backward_observer(const BackwardArgs& ba) {
  return std::make_unique<BackwardWatch>(*this, ba);
}

void Shadow::begin_forward(const ForwardArgs& fa, const std::vector<void*>& fused_ptr) {
  const Program& r = *ref_->program;
  const Program& f = *fused_->program;
  bind_pass(true, fused_ptr);
  // The same Philox state: the fused forward copies it in before its first step.
  if (r.rng >= 0 && f.rng >= 0) ptr_[static_cast<size_t>(r.rng)] = fused_ptr[static_cast<size_t>(f.rng)];
  ptr_[static_cast<size_t>(r.input)] = const_cast<void*>(fa.input);
  ptr_[static_cast<size_t>(r.output)] = scratch(r.buffer(r.output).bytes);
  for (size_t k = 0; k < r.extra_in.size(); ++k)
    if (r.extra_in[k] >= 0) ptr_[static_cast<size_t>(r.extra_in[k])] = const_cast<void*>(fa.extra_in.at(k));
  for (int id : r.extra_out)
    if (id >= 0) ptr_[static_cast<size_t>(id)] = scratch(r.buffer(id).bytes);
}

void Shadow::run_ops(bool forward, int b, int e, CUstream stream) {
  // The unfused plan has one group per op: its group index is the op index.
  StepFilter filter;
  filter.group_begin = b;
  filter.group_end = e;
  run_steps(*ref_, rt_, forward, ptr_, stream, {}, filter);
}

void Shadow::compare(const char* pass, int gi, const std::string& tensor, const void* fused, const void* ref,
                     int buffer, bool gemm, CUstream stream) {
  if (failed_ || !fused || !ref) return;
  const Buffer& b = ref_->program->buffer(buffer);
  const auto& d = cuda::driver();
  std::vector<unsigned char> hf(b.bytes), hr(b.bytes);
  // On the stream that wrote them (pageable destination: the async copies complete by the synchronise).
  cuda::check(d.cuMemcpyDtoHAsync(hf.data(), reinterpret_cast<CUdeviceptr>(fused), b.bytes, stream), "cuMemcpyDtoHAsync");
  cuda::check(d.cuMemcpyDtoHAsync(hr.data(), reinterpret_cast<CUdeviceptr>(ref), b.bytes, stream), "cuMemcpyDtoHAsync");
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(JITFUSE_VERIFY)");
  const size_t es = static_cast<size_t>(ops::dtype_bytes(b.dtype));
  const size_t n = b.bytes / es;
  auto [rtol, atol] = tolerance(b.dtype, gemm);
  // As the float64 check does (tools/harness/check.cpp): relative to |value| + the tensor's rms, and each op of
  // the unfused chain may round its output once more than the fused kernel does.
  const auto& grp = (std::string(pass) == "forward" ? fused_->program->plan.forward : fused_->program->plan.backward)
                        .at(static_cast<size_t>(gi));
  const double k = static_cast<double>(std::max(1, grp.end - grp.begin));
  rtol *= k;
  atol *= k;
  double ss = 0;
  for (size_t i = 0; i < n; ++i) {
    const double y = to_double(&hr[i * es], b.dtype);
    if (std::isfinite(y)) ss += y * y;
  }
  const double rms = n ? std::sqrt(ss / static_cast<double>(n)) : 0.0;
  double worst = 0, worst_err = 0, worst_ref = 0;
  size_t bad = 0, at = 0;
  for (size_t i = 0; i < n; ++i) {
    const double x = to_double(&hf[i * es], b.dtype), y = to_double(&hr[i * es], b.dtype);
    const double err = std::fabs(x - y), tol = atol + rtol * (std::fabs(y) + rms);
    const double ratio = std::isfinite(err) ? err / tol : INFINITY;
    if (!(ratio <= 1.0)) ++bad;
    if (!(ratio <= worst)) {
      worst = ratio;
      worst_err = err;
      worst_ref = y;
      at = i;
    }
  }
  const auto& g = grp;
  std::lock_guard<std::mutex> lock(log_.mu);
  ++log_.tensors_compared;
  if (bad == 0) return;
  failed_ = true;
  ++log_.failures;
  std::string msg = fmt::format(
      "{} group [{}, {}) rule '{}': {} differs from the unfused ops in {} of {} elements; worst at element {}: "
      "|fused - unfused| = {:.4g} (unfused {:.6g}), {:.3g}x the tolerance (rtol {:.3g}, atol {:.3g}, on |unfused| + rms)",
      pass, g.begin, g.end, g.rule, tensor, bad, n, at, worst_err, worst_ref, worst, rtol, atol);
  if (log_.first.empty()) {
    log_.first = msg;
    log().error("JITFUSE_VERIFY: {}", msg);
  }
}

// The unfused ops start from the fused run's value at the group's input, copied before the fused group runs.
void Shadow::forward_input(int gi, const std::vector<void*>& fused_ptr, CUstream stream) {
  const Program& f = *fused_->program;
  const auto& g = f.plan.forward.at(static_cast<size_t>(gi));
  if (g.begin == 0) return;  // the first group reads the caller's input itself
  copy_in(f.values[static_cast<size_t>(g.begin)], ref_->program->values[static_cast<size_t>(g.begin)], fused_ptr,
          stream);
}

void Shadow::backward_input(int gi, const std::vector<void*>& fused_ptr, CUstream stream) {
  const Program& f = *fused_->program;
  const Program& r = *ref_->program;
  const auto& g = f.plan.backward.at(static_cast<size_t>(gi));
  if (g.rule.empty()) return;
  // A fork in the group reads its channel's gradient, which readers in groups the shadow does not run
  // (unfused ones, pass-throughs) produced: the fused run's, as its other input.
  for (int i = g.begin; i < g.end; ++i) {
    const int fc = f.channel_grads[static_cast<size_t>(i)], rc = r.channel_grads[static_cast<size_t>(i)];
    if (fc >= 0 && rc >= 0 && r.buffer(rc).storage != Storage::caller && fused_ptr[static_cast<size_t>(fc)] &&
        ptr_[static_cast<size_t>(rc)])  // never into a caller's tensor (a pass-through's grad_output)
      copy_in(fc, rc, fused_ptr, stream);
  }
  if (g.end == static_cast<int>(f.ops.size())) return;  // grad_output is the caller's
  copy_in(f.gradients[static_cast<size_t>(g.end)], r.gradients[static_cast<size_t>(g.end)], fused_ptr, stream);
}

void Shadow::copy_in(int fused_id, int ref_id, const std::vector<void*>& fused_ptr, CUstream stream) {
  cuda::check(cuda::driver().cuMemcpyDtoDAsync(reinterpret_cast<CUdeviceptr>(ptr_[ref_id]),
                                               reinterpret_cast<CUdeviceptr>(fused_ptr[fused_id]),
                                               ref_->program->buffer(ref_id).bytes, stream),
              "cuMemcpyDtoDAsync(JITFUSE_VERIFY)");
}

// One routine for both directions: the unfused ops of fused group `gi` run on the same input (forward:
// every group, since the shadow's backward reads the saved context they write), then its results compared:
// forward, the value after the group and its extra outputs; backward, the gradient before it, its
// parameters' gradients and its extra inputs' gradients.
void Shadow::run_group(bool forward, int gi, const std::vector<void*>& fused_ptr, CUstream stream) {
  const Program& f = *fused_->program;
  const Program& r = *ref_->program;
  const auto& g = (forward ? f.plan.forward : f.plan.backward).at(static_cast<size_t>(gi));
  if (!forward && g.rule.empty()) return;
  run_ops(forward, g.begin, g.end, stream);
  if (g.rule.empty()) return;
  bool gemm = false;
  for (int i = g.begin; i < g.end; ++i) gemm |= f.ops[i].family == ops::Family::linear;
  {
    std::lock_guard<std::mutex> lock(log_.mu);
    ++log_.groups_compared;
  }
  const char* pass = forward ? "forward" : "backward";
  const size_t at = static_cast<size_t>(forward ? g.end : g.begin);
  const int fv = (forward ? f.values : f.gradients)[at], rv = (forward ? r.values : r.gradients)[at];
  const std::string what = forward ? (g.end == static_cast<int>(f.ops.size()) ? std::string("output")
                                                                               : fmt::format("the value after op {}", g.end - 1))
                                   : (g.begin == 0 ? std::string("grad_input")
                                                   : fmt::format("the gradient before op {}", g.begin));
  compare(pass, gi, what, fused_ptr[fv], ptr_[rv], rv, gemm, stream);
  for (const auto& rb : r.buffers) {
    if (rb.op < g.begin || rb.op >= g.end) continue;
    if (forward && rb.role == BufferRole::extra_out)
      compare(pass, gi, rb.name, fused_ptr[f.extra_out.at(rb.slot)], ptr_[rb.id], rb.id, gemm, stream);
    if (!forward && rb.role == BufferRole::grad) {
      if (f.ops[rb.op].attrs.contains("accumulate_grad") && f.ops[rb.op].flag("accumulate_grad")) {
        log_.note_skip(f.ops[rb.op].label() + " accumulates its gradient: not compared");
        continue;
      }
      for (const auto& fb : f.buffers)
        if (fb.role == BufferRole::grad && fb.op == rb.op && fb.key == rb.key)
          compare(pass, gi, rb.name, fused_ptr[fb.id], ptr_[rb.id], rb.id, gemm, stream);
    }
    if (!forward && rb.role == BufferRole::grad_extra_in) {
      if (f.ops[rb.op].grad_accumulate) {  // a caller's channel: its readers' sum is complete only at the end
        log_.note_skip(f.ops[rb.op].label() + "'s channel sums several readers' gradients: not compared per group");
        continue;
      }
      compare(pass, gi, rb.name, fused_ptr[f.grad_extra_in.at(rb.slot)], ptr_[rb.id], rb.id, gemm, stream);
    }
  }
}

void Shadow::forward_group(int gi, const std::vector<void*>& fused_ptr, CUstream stream) {
  run_group(true, gi, fused_ptr, stream);
}

void Shadow::begin_backward(const BackwardArgs& ba, const std::vector<void*>& fused_ptr) {
  const Program& r = *ref_->program;
  bind_pass(false, fused_ptr);
  ptr_[static_cast<size_t>(r.grad_output)] = const_cast<void*>(ba.grad_output);
  ptr_[static_cast<size_t>(r.grad_input)] = scratch(r.buffer(r.grad_input).bytes);
  for (size_t k = 0; k < r.grad_extra_out.size(); ++k)
    if (r.grad_extra_out[k] >= 0) ptr_[static_cast<size_t>(r.grad_extra_out[k])] = const_cast<void*>(ba.grad_extra_out.at(k));
  for (int id : r.grad_extra_in)
    if (id >= 0) ptr_[static_cast<size_t>(id)] = scratch(r.buffer(id).bytes);
}

void Shadow::backward_group(int gi, const std::vector<void*>& fused_ptr, CUstream stream) {
  run_group(false, gi, fused_ptr, stream);
}

}  // namespace jitfuse::exec
