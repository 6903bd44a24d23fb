// prepare: a Program made ready on the current device (prepare.hpp). Loads kernels, chooses cuBLASLt
// algorithms, lays out with real occupancies; writes only the Prepared it returns.
#include "exec/run/prepare.hpp"

#include <limits>
#include <thread>

#include "cache/disk_store.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace jitfuse::exec {
namespace {

// Scratch operands for timing a GEMM's candidate algorithms at prepare (cuda::Blas::prepare). Problems
// whose operands and workspace exceed JITFUSE_GEMM_TUNING_MAX_BYTES (default 256 MiB, allocated for the
// duration of the prepare and freed with the tuner) keep the heuristic's first choice: large GEMMs are
// where it is reliable (H100, the MLP 8192 x 4096 -> 16384 -> 4096 fwd+bwd, GEMMs of 0.4-0.7 GiB: 9.42 /
// 9.45 ms untuned, 9.38 / 9.44 ms tuned with a 1 GiB cap, run #9 of 2026-11-24), and prepare should not
// take hundreds of MiB from the host's allocator's device by default.
class GemmTuner {
 public:
  static constexpr uint64_t kDefaultMaxBytes = uint64_t{256} << 20;
  GemmTuner() : enabled_(env::get("JITFUSE_GEMM_TUNING").value_or("1") != "0") {
    if (auto m = env::get("JITFUSE_GEMM_TUNING_MAX_BYTES"); m && !m->empty()) {
      max_bytes_ = cache::parse_byte_count(*m, "JITFUSE_GEMM_TUNING_MAX_BYTES");
      if (max_bytes_ == 0) max_bytes_ = std::numeric_limits<uint64_t>::max();
    }
  }
  ~GemmTuner() {
    if (auto* d = cuda::try_driver()) {
      if (block_) d->cuMemFree(block_);
      if (stream_) d->cuStreamDestroy(stream_);
    }
  }
  GemmTuner(const GemmTuner&) = delete;
  GemmTuner& operator=(const GemmTuner&) = delete;
  CUstream stream() const { return stream_; }

  // Points `call`'s operands at zeroed scratch of the step's buffer sizes; false: do not tune this one.
  bool bind(const Program& p, const GemmStep& g, cuda::GemmCall& call) {
    if (!enabled_) return false;
    auto bytes = [&](int id) { return id >= 0 ? round256(p.buffer(id).bytes) : 0; };
    // The operands cuBLASLt reads or writes with their sizes; FP8 scale and amax pointers one float each
    // (fp8_block's scale tensors their size; zeros, fine for timing). The workspace comes last.
    size_t need = cuda::kGemmWorkspace;
    for (int i = 0; i < kGemmOperands; ++i) {
      const auto o = static_cast<GemmOperand>(i);
      if (scratch(o)) need += is_scalar(o) ? (call.fp8 ? std::max<size_t>(256, bytes(g.operand(o))) : 0) : bytes(g.operand(o));
    }
    if (need > max_bytes_) return false;
    const auto& d = cuda::driver();
    if (need > bytes_) {
      if (block_) d.cuMemFree(block_);
      block_ = 0;
      bytes_ = 0;
      if (d.cuMemAlloc(&block_, need) != CUDA_SUCCESS) return false;  // no room: the heuristic's choice
      bytes_ = need;
    }
    if (!stream_) cuda::check(d.cuStreamCreate(&stream_, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
    cuda::check(d.cuMemsetD8Async(block_, 0, need, stream_), "cuMemsetD8Async");
    size_t at = 0;
    for (int i = 0; i < kGemmOperands; ++i) {
      const auto o = static_cast<GemmOperand>(i);
      if (!scratch(o) || (is_scalar(o) && !call.fp8)) continue;
      const int id = g.operand(o);
      set_operand(call, o, id >= 0 ? reinterpret_cast<void*>(block_ + at) : nullptr);
      at += is_scalar(o) ? std::max<size_t>(256, bytes(id)) : bytes(id);  // fp8_block's scales: whole tensors
    }
    call.workspace = reinterpret_cast<void*>(block_ + at);
    return true;
  }

 private:
  static size_t round256(size_t x) { return (x + 255) / 256 * 256; }
  // The operands cuBLASLt itself reads or writes (the workspace comes last; the executor's are not the GEMM's).
  static bool scratch(GemmOperand o) { return is_scalar(o) || gemm_operand(o).kind == GemmOperandKind::tensor; }
  // FP8 scale_inv, scale and amax pointers: one float each.
  static bool is_scalar(GemmOperand o) {
    const auto k = gemm_operand(o).kind;
    return k == GemmOperandKind::fp8_input || k == GemmOperandKind::fp8_output;
  }
  bool enabled_;
  uint64_t max_bytes_ = kDefaultMaxBytes;
  CUdeviceptr block_ = 0;
  size_t bytes_ = 0;
  CUstream stream_ = nullptr;
};

// Compiles the variants the plan launches (or all of them) in parallel first (the cache dedupes across
// threads and processes), then loads them. A scalar variant left out is loaded by the first call that
// needs it (its LateVariant).
void load_kernels(Prepared& pp, Runtime& rt) {
  const Program& p = *pp.program;
  rt.kernels->prefetch(program_kernels(p), pp.target, std::max(1u, std::min(8u, std::thread::hardware_concurrency())),
                       rt.variants);
  for (const bool fwd : {true, false}) {
    const auto& steps = fwd ? p.forward : p.backward;
    auto& states = fwd ? pp.forward : pp.backward;
    for (size_t i = 0; i < steps.size(); ++i) {
      if (steps[i].kind != Step::Kind::kernel) continue;
      const KernelStep& k = *steps[i].kernel;
      for (bool vector : variants_of(k.spec, rt.variants))
        (vector ? states[i].vec : states[i].scalar).kernel = &rt.kernels->load(k.gen, k.spec, pp.target, k.meta, vector);
      if (k.spec.vec && !states[i].scalar.kernel) states[i].late = std::make_unique<LateVariant>();
    }
  }
}

// cuBLASLt's algorithm for one GEMM, chosen now for 256-byte aligned operands (the arenas, the saved block,
// cudaMalloc and PyTorch's allocator give that; a call with a less aligned tensor looks its own up). A
// BGRADB problem without an algorithm takes the fallback: the plain wgrad, then db = ones^T dy.
void plan_gemm(const Program& p, const Step& s, PreparedStep& st, Runtime& rt, GemmTuner& tuner) {
  const GemmStep& g = s.gemm;
  cuda::GemmCall call = g.call;
  auto* aligned = reinterpret_cast<void*>(uintptr_t{256});
  for (int i = 0; i < kGemmOperands; ++i)
    if (g.operand(static_cast<GemmOperand>(i)) >= 0 && static_cast<GemmOperand>(i) != GemmOperand::workspace)
      set_operand(call, static_cast<GemmOperand>(i), aligned);
  st.plan = tuner.bind(p, g, call) ? rt.blas->plan(call, tuner.stream()) : rt.blas->plan(call);
  if (st.plan) return;
  if (!g.bias_grad_fallback)
    fail(Status::unsupported, "cuBLASLt has no algorithm for {} ({}x{}x{}, {})", s.what, g.call.m, g.call.n,
         g.call.k, cuda::epilogue_name(g.call.epilogue));
  st.use_fallback = true;
  auto plain = call;
  plain.epilogue = cuda::Epilogue::none;
  plain.bias = nullptr;
  rt.blas->prepare(plain);
  cuda::GemmCall sums;  // Blas::column_sums: db = ones^T dy
  sums.kind = cuda::GemmKind::wgrad;
  sums.m = call.m;
  sums.n = call.n;
  sums.k = 1;
  sums.dtype = call.dtype;
  sums.a = sums.b = sums.d = aligned;
  rt.blas->prepare(sums);
  log().debug("{}: no BGRADB algorithm; the bias gradient takes a separate GEMM", s.what);
}

}  // namespace

const Variant& LateVariant::get(const std::function<Variant()>& make) const {
  if (const Variant* v = ready_.load(std::memory_order_acquire)) return *v;
  std::lock_guard<std::mutex> lock(mu_);
  if (const Variant* v = ready_.load(std::memory_order_relaxed)) return *v;
  owned_ = std::make_unique<Variant>(make());
  ready_.store(owned_.get(), std::memory_order_release);
  return *owned_;
}

SideStream::~SideStream() {
  const cuda::Driver* d = cuda::try_driver();
  if (!d) return;
  for (auto* evs : {&forward, &backward})
    for (CUevent e : *evs)
      if (e) d->cuEventDestroy(e);
  if (fork) d->cuEventDestroy(fork);
  if (stream) d->cuStreamDestroy(stream);
}

namespace {
std::shared_ptr<SideStream> make_side_stream(const Program& p) {
  bool any = false;
  for (const auto* steps : {&p.forward, &p.backward})
    for (const auto& s : *steps) any |= s.stream != 0;
  if (!any) return nullptr;
  const auto& d = cuda::driver();
  auto side = std::make_shared<SideStream>();
  cuda::check(d.cuStreamCreate(&side->stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate(side stream)");
  cuda::check(d.cuEventCreate(&side->fork, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  for (const bool fwd : {true, false}) {
    auto& evs = fwd ? side->forward : side->backward;
    evs.resize((fwd ? p.forward : p.backward).size(), nullptr);
    for (auto& e : evs) cuda::check(d.cuEventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate");
  }
  return side;
}
}  // namespace

std::shared_ptr<const Prepared> prepare(std::shared_ptr<const Program> program, Runtime& rt, PrepareWith with) {
  auto pp = std::make_shared<Prepared>();
  pp->program = std::move(program);
  const Program& p = *pp->program;
  pp->device = cuda::current_device();
  pp->target = target_for_arch(pp->device.arch());
  if (p.has_comm()) {  // before anything is compiled or loaded
    const auto& c = with.comm;
    if (!c)
      fail(Status::invalid_argument, "the program runs collectives on group '{}' but the sequence has no "
           "communicator: hand it one first (jf_sequence_set_comm; Python: jitfuse.torch.set_process_group)", p.group);
    if (c->world_size() != p.world_size || c->rank() != p.rank)
      fail(Status::internal, "program planned for rank {} of {}, communicator is rank {} of {}", p.rank, p.world_size,
           c->rank(), c->world_size());
    if (c->device() != pp->device.ordinal)
      fail(Status::invalid_argument, "group '{}': the communicator runs on device {}, the current device is {}: make "
           "its device current before calling", p.group, c->device(), pp->device.ordinal);
    pp->comm = c;
    // The one-shot all-reduce kernels' way, if any: every rank decides the same (the same program and GPU model).
    bool any = false, fit = true;
    size_t slot_bytes = 0;  // the copy-engine collectives' largest push
    for (const auto* steps : {&p.forward, &p.backward})
      for (const Step& s : *steps) {
        if (s.peer_path <= 0) continue;
        if (s.kind == Step::Kind::comm && s.comm.op == Collective::peer_push)
          slot_bytes = std::max(slot_bytes, static_cast<size_t>(s.comm.count) * ops::dtype_bytes(s.comm.dtype));
        if (s.kind != Step::Kind::kernel || s.kernel->spec.peers == 0) continue;
        any = true;
        const auto& spec = s.kernel->spec;
        fit = fit && codegen::peer_rows_fit(s.kernel->rows, spec.cols * ops::dtype_bytes(p.recipe.dtype),
                                            pp->device.sm_count);
      }
    if (any && fit) pp->peers = c->peer_table(nullptr);
    if (slot_bytes && (!any || pp->peers)) pp->staging = c->peer_staging(slot_bytes);
    const bool ready = (any || slot_bytes) && (!any || pp->peers) && (!slot_bytes || pp->staging);
    pp->peer_path = ready ? 1 : -1;
  }
  pp->forward.resize(p.forward.size());
  pp->backward.resize(p.backward.size());
  pp->side = make_side_stream(p);
  load_kernels(*pp, rt);
  GemmTuner tuner;
  for (const bool fwd : {true, false}) {
    const auto& steps = fwd ? p.forward : p.backward;
    auto& states = fwd ? pp->forward : pp->backward;
    for (size_t i = 0; i < steps.size(); ++i)
      if (steps[i].kind == Step::Kind::gemm) plan_gemm(p, steps[i], states[i], rt, tuner);
  }
  DeviceModel dev;
  dev.arch = pp->device.arch();
  dev.sm_count = pp->device.sm_count;
  dev.estimated = false;
  pp->layout = lay_out(p, dev, [&](bool fwd, size_t i) {
    const PreparedStep& st = pp->steps(fwd)[i];
    return Occupancy{st.vec.kernel ? st.vec.kernel->blocks_per_sm : 0,
                     st.scalar.kernel ? st.scalar.kernel->blocks_per_sm : 0};
  });
  for (const bool fwd : {true, false}) {
    auto& states = fwd ? pp->forward : pp->backward;
    const auto& launches = fwd ? pp->layout.forward : pp->layout.backward;
    for (size_t i = 0; i < states.size(); ++i) {
      states[i].vec.launch = launches[i].vec;
      states[i].scalar.launch = launches[i].scalar;
    }
  }
  // Each parameter and gradient buffer's slot in a call's arrays, resolved once.
  for (const auto& b : p.buffers) {
    if (b.role != BufferRole::param && b.role != BufferRole::grad) continue;
    (b.role == BufferRole::param ? pp->params : pp->grads).push_back({b.id, param_slot(p.ops, b.op, b.key)});
  }
  pp->sequence_state = std::move(with.sequence_state.buffers);
  pp->weight_copies = std::move(with.sequence_state.weights);
  pp->temp_pool = cuda::temp_pool();
  pp->reference = std::move(with.reference);
  return pp;
}

}  // namespace jitfuse::exec
