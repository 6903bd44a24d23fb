// The executor: a prepared program's calls. A step is a resolved cuBLASLt call or a generated kernel with
// its arguments bound to buffer ids; nothing here knows rules, ops or names.
#include "exec/run/executor.hpp"

#include <algorithm>
#include <cstring>
#include <optional>
#include <tuple>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/text.hpp"
#include "cuda/peers.hpp"
#include "exec/run/all_to_all.hpp"
#include "exec/run/fp8/update.hpp"
#include "exec/run/routes.hpp"

namespace jitfuse::exec {
namespace {

// `pool`: the device's stream-ordered pool, resolved at prepare (Prepared::temp_pool), so that a call with
// the default allocator asks the driver nothing but the allocation.
void* alloc_bytes(const Allocator& a, CUmemoryPool pool, CUstream s, size_t bytes) {
  bytes = std::max<size_t>(bytes, 16);
  if (a.alloc) {
    void* p = a.alloc(bytes, s, a.user);
    if (!p) fail(Status::out_of_memory, "the caller's allocator returned null for {} bytes", bytes);
    return p;
  }
  CUdeviceptr p = 0;
  cuda::check(cuda::driver().cuMemAllocFromPoolAsync(&p, bytes, pool, s), "cuMemAllocFromPoolAsync");
  return reinterpret_cast<void*>(p);
}

// One stream-ordered allocation, freed (stream-ordered) on scope exit unless released.
class Block {
 public:
  Block(const Allocator& a, CUmemoryPool pool, CUstream s, size_t bytes) : a_(a), s_(s), bytes_(bytes) {
    if (bytes) p_ = alloc_bytes(a, pool, s, bytes);
  }
  ~Block() { free_block(a_, s_, p_, bytes_); }
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

void place(const Layout& layout, Storage storage, char* base, std::vector<void*>& ptr) {
  for (const auto& b : layout.buffers)
    if (b.storage == storage && b.first >= 0) ptr[static_cast<size_t>(b.id)] = base + b.offset;
}

// The call's parameters (and gradients) into their buffers, by the slots prepare resolved.
template <class T>
void bind_slots(const Program& p, const std::vector<SlotBind>& binds, const std::vector<T>& given,
                std::vector<void*>& ptr, bool grads) {
  for (const auto& sb : binds) {
    const void* v = sb.slot >= 0 && static_cast<size_t>(sb.slot) < given.size() ? given[static_cast<size_t>(sb.slot)]
                                                                                 : nullptr;
    if (!v) {
      const Buffer& b = p.buffer(sb.buffer);
      if (grads)
        fail(Status::invalid_argument, "{}: no buffer for the gradient of '{}' was passed",
             p.ops.at(static_cast<size_t>(b.op)).label(), b.key);
      fail(Status::invalid_argument, "{}: parameter '{}' was not passed", p.ops.at(static_cast<size_t>(b.op)).label(),
           b.key);
    }
    ptr[static_cast<size_t>(sb.buffer)] = const_cast<void*>(v);
  }
}

void bind_state(const Prepared& pp, std::vector<void*>& ptr) {
  for (const auto& [id, v] : pp.sequence_state) ptr[static_cast<size_t>(id)] = v;
}

// The forward's first step: the call's Philox state into the program's copy (which the backward reads),
// as stream-ordered copies or memsets (both capture as graph nodes).
void copy_rng(const RngSource& rng, void* dst, CUstream stream) {
  const auto& d = cuda::driver();
  const auto to = reinterpret_cast<CUdeviceptr>(dst);
  if (rng.state) {
    cuda::check(d.cuMemcpyDtoDAsync(to, reinterpret_cast<CUdeviceptr>(rng.state), 16, stream),
                "cuMemcpyDtoDAsync(rng state)");
    return;
  }
  const uint64_t v[2] = {rng.seed, rng.offset};
  uint32_t w[4];
  std::memcpy(w, v, 16);
  for (int i = 0; i < 4; ++i)
    cuda::check(d.cuMemsetD32Async(to + 4u * static_cast<unsigned>(i), w[i], 1, stream), "cuMemsetD32Async(rng state)");
}

template <class T>
void bind_list(const std::vector<int>& ids, const std::vector<T>& given, std::vector<void*>& ptr) {
  for (size_t k = 0; k < ids.size() && k < given.size(); ++k)
    if (ids[k] >= 0) ptr[static_cast<size_t>(ids[k])] = const_cast<void*>(static_cast<const void*>(given[k]));
}

// How a dropless grouped linear's experts run (JITFUSE_GROUPED_GEMM): one cuBLASLt call per expert ("lt"), one
// cuBLAS grouped call for all ("cublas"), or by the number of experts with rows ("auto", the default: measured in
// docs/benchmarks.md).
enum class GroupedGemm { automatic, lt, cublas };
GroupedGemm grouped_gemm_choice() {
  static const GroupedGemm choice = [] {
    const std::optional<std::string> v = env::get("JITFUSE_GROUPED_GEMM");
    if (!v || v->empty() || *v == "auto") return GroupedGemm::automatic;
    if (*v == "lt") return GroupedGemm::lt;
    if (*v == "cublas") return GroupedGemm::cublas;
    log().warn("JITFUSE_GROUPED_GEMM='{}' is not auto, lt or cublas: using auto", text::shorten(*v, 40));
    return GroupedGemm::automatic;
  }();
  return choice;
}
// auto: from this many experts with rows, one grouped call (H200, bf16: per-expert cuBLASLt calls won at 8 experts,
// 30.2 against 55.4 ms, and 64, 7.09 against 8.19; the grouped call at 128, 7.58 against 9.22; docs/benchmarks.md).
constexpr int kGroupedMinExperts = 96;

// cuBLAS's grouped kernels read 16-byte vectors: every pointer and leading dimension must allow them (a
// misaligned one faults the kernel, as device run 6 showed); otherwise the per-expert cuBLASLt calls.
bool grouped_aligned(const std::vector<cuda::GroupedOperands>& groups, const cuda::GemmCall& c, size_t esz) {
  auto ok = [](const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; };
  if ((static_cast<size_t>(c.n) * esz) % 16 || (static_cast<size_t>(c.k) * esz) % 16) return false;
  for (const auto& g : groups)
    if (!ok(g.a) || !ok(g.b) || !ok(g.d)) return false;
  return true;
}

// A dropless grouped linear's GEMM of one kind over every expert's rows this call (GemmStep::route); `c` has the
// operands' base pointers. An empty expert writes nothing but its dW_g (zero, unless accumulating); fwd and dgrad
// zero the rows past every expert's.
void run_routed_gemm(Runtime& rt, const GemmStep& g, cuda::GemmCall c, const int32_t* route, CUstream stream) {
  const int64_t e = g.route_experts, used = route[2 * e];
  const size_t esz = static_cast<size_t>(ops::dtype_bytes(c.dtype));
  const auto& d = cuda::driver();
  auto at = [&](auto* p, int64_t row, int64_t x) {  // operand p at expert x's rows (row > 0) or weight (row 0)
    return p + static_cast<size_t>(row ? route[e + x] * row : x * g.route_weight) * esz;
  };
  std::vector<cuda::GroupedOperands> groups;
  for (int64_t x = 0; x < e; ++x) {
    auto* dx = at(static_cast<char*>(c.d), g.d_row, x);
    if (route[x] > 0) {
      groups.push_back({route[x], at(static_cast<const char*>(c.a), g.a_row, x),
                        at(static_cast<const char*>(c.b), g.b_row, x), dx});
    } else if (c.kind == cuda::GemmKind::wgrad && c.beta == 0.f) {
      cuda::check(d.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(dx), 0, static_cast<size_t>(g.route_weight) * esz,
                                    stream), "cuMemsetD8Async(empty expert's dW)");
    }
  }
  const GroupedGemm how = grouped_gemm_choice();
  if ((how == GroupedGemm::cublas ||
       (how == GroupedGemm::automatic && static_cast<int64_t>(groups.size()) >= kGroupedMinExperts)) &&
      grouped_aligned(groups, c, esz)) {
    rt.blas->gemm_grouped(c, groups, stream);
  } else {
    for (const auto& grp : groups) rt.blas->gemm_rows(cuda::group_call(c, grp), stream);
  }
  if (c.kind != cuda::GemmKind::wgrad && used < c.m)
    cuda::check(d.cuMemsetD8Async(reinterpret_cast<CUdeviceptr>(static_cast<char*>(c.d) + static_cast<size_t>(used * g.d_row) * esz),
                                  0, static_cast<size_t>((c.m - used) * g.d_row) * esz, stream),
                "cuMemsetD8Async(rows past the experts')");
}

void run_gemm(Runtime& rt, const GemmStep& g, const PreparedStep& st, const std::vector<void*>& ptr, CUstream stream,
              HostRoutes& routes) {
  auto at = [&](int id) -> void* { return id >= 0 ? ptr[static_cast<size_t>(id)] : nullptr; };
  cuda::GemmCall c = g.call;
  for (int i = 0; i < kGemmOperands; ++i) {
    const auto o = static_cast<GemmOperand>(i);
    set_operand(c, o, at(g.operand(o)));
  }
  // A row block: offsets in elements of each operand's own type (an FP8 GEMM's A and B are codes of one byte;
  // its D is the call's dtype: row blocks never write FP8 outputs).
  const auto esz = [&](ops::DType t) { return static_cast<size_t>(ops::dtype_bytes(t)); };
  if (g.a_offset) c.a = static_cast<const char*>(c.a) + static_cast<size_t>(g.a_offset) * esz(c.fp8 ? c.fp8->a : c.dtype);
  if (g.b_offset) c.b = static_cast<const char*>(c.b) + static_cast<size_t>(g.b_offset) * esz(c.fp8 ? c.fp8->b : c.dtype);
  if (g.d_offset) c.d = static_cast<char*>(c.d) + static_cast<size_t>(g.d_offset) * esz(c.dtype);
  if (g.routed()) return run_routed_gemm(rt, g, c, routes.get(g, ptr, stream), stream);
  if (!st.use_fallback) return rt.blas->gemm(c, stream, st.plan.get());
  // prepare found no BGRADB algorithm for this problem: the plain wgrad, then db = ones^T dy.
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
  rt.blas->column_sums(c.dtype, c.m, c.n, c.a, at(g.ones), db, c.workspace, stream);
}

// While the calling thread enqueues into a stream that is capturing a CUDA graph, lets it make calls the
// capture mode would refuse (cudaStreamCaptureModeRelaxed for this thread only), as a late module load
// needs; restores the thread's mode on scope exit. No-op outside a capture.
class RelaxCapture {
 public:
  explicit RelaxCapture(CUstream stream) {
    if (!cuda::stream_capturing(stream)) return;
    mode_ = CU_STREAM_CAPTURE_MODE_RELAXED;
    active_ = cuda::driver().cuThreadExchangeStreamCaptureMode(&mode_) == CUDA_SUCCESS;
  }
  ~RelaxCapture() {
    if (active_) cuda::driver().cuThreadExchangeStreamCaptureMode(&mode_);
  }
  RelaxCapture(const RelaxCapture&) = delete;
  RelaxCapture& operator=(const RelaxCapture&) = delete;
  bool capturing() const { return active_; }

 private:
  CUstreamCaptureMode mode_ = CU_STREAM_CAPTURE_MODE_GLOBAL;
  bool active_ = false;
};

// The scalar variant of a step, for a call with a tensor that is not 16-byte aligned: the one prepare
// loaded, or, for a vector-capable step prepared without it (Variants::needed), compiled (or read from the
// cache) and loaded now, once per step and thread-safely. Also inside a CUDA-graph capture: compiling and
// loading are host work plus a module load, which the capture does not record; only the launch is.
const Variant& scalar_variant(const Prepared& pp, Runtime& rt, const KernelStep& k, const PreparedStep& st,
                              const std::vector<void*>& ptr, CUstream stream) {
  if (st.scalar.kernel || !st.late) return st.scalar;
  return st.late->get([&] {
    std::string tensor = "?";
    for (int id : k.align_buffers)
      if (!aligned16(ptr[static_cast<size_t>(id)])) {
        tensor = pp.program->buffer(id).name;
        break;
      }
    RelaxCapture relax(stream);
    log().info("kernel {}: tensor '{}' is not 16-byte aligned: loading the kernel's scalar variant (once){}",
               k.gen.kernel, tensor, relax.capturing() ? ", inside a CUDA-graph capture" : "");
    Variant v;
    try {
      v.kernel = &rt.kernels->load(k.gen, k.spec, pp.target, k.meta, false);
      v.launch = late_scalar_launch(pp.layout, k, pp.device.sm_count, v.kernel->blocks_per_sm);
    } catch (const Error& e) {
      fail(e.status(), "kernel {}: tensor '{}' is not 16-byte aligned, so the call needs the kernel's scalar "
           "variant, which could not be loaded (pass 16-byte aligned tensors, or prepare with "
           "JITFUSE_ALL_VARIANTS=1 to load it up front): {}", k.gen.kernel, tensor, e.what());
    }
    return v;
  });
}

// Launches kernel step `k` and returns the variant it launched (what its finalize and FP8 update steps use).
// KernelStep::rows_route: the rows an expert-parallel kernel runs over this call.
int64_t rows_now(const KernelStep& k, const HostRoutes& routes) {
  if (k.rows_route < 0) return k.rows;
  const auto* r = routes.find(k.rows_route);
  if (!r || k.rows_route_total >= static_cast<int64_t>(r->size())) return k.rows;
  return std::min<int64_t>(k.rows, (*r)[static_cast<size_t>(k.rows_route_total)]);
}

const Variant& run_kernel(const Prepared& pp, Runtime& rt, const KernelStep& k, const PreparedStep& st,
                          const std::vector<void*>& ptr, CUstream stream, const HostRoutes& routes) {
  const auto& d = cuda::driver();
  bool vec = k.spec.vec;
  for (int id : k.align_buffers) vec = vec && aligned16(ptr[static_cast<size_t>(id)]);
  const Variant& v = vec ? st.vec : scalar_variant(pp, rt, k, st, ptr, stream);
  if (!v.kernel) fail(Status::internal, "kernel {} was not prepared", k.gen.kernel);
  const KernelLaunch& L = v.launch;
  // The argument values and cuLaunchKernel's pointers to them: on the stack (this call's own, so concurrent
  // calls share nothing), on the heap only for a kernel of more than kInline arguments.
  union Slot {
    void* p;
    uint64_t u64;
    int64_t i64;
    int i;
  };
  constexpr size_t kInline = 64;
  const size_t n = k.args.size();
  Slot inline_vals[kInline];
  void* inline_params[kInline];
  std::unique_ptr<Slot[]> heap_vals;
  std::unique_ptr<void*[]> heap_params;
  Slot* vals = inline_vals;
  void** kparams = inline_params;
  if (n > kInline) {
    heap_vals.reset(new Slot[n]);
    heap_params.reset(new void*[n]);
    vals = heap_vals.get();
    kparams = heap_params.get();
  }
  for (size_t i = 0; i < n; ++i) {
    const KArg& a = k.args[i];
    switch (a.kind) {
      case KArg::Kind::buffer: vals[i].p = ptr[static_cast<size_t>(a.buffer)]; kparams[i] = &vals[i].p; break;
      case KArg::Kind::rows: vals[i].i64 = rows_now(k, routes); kparams[i] = &vals[i].i64; break;
      case KArg::Kind::u64_const: vals[i].u64 = a.value; kparams[i] = &vals[i].u64; break;
      case KArg::Kind::int_const: vals[i].i = L.parts; kparams[i] = &vals[i].i; break;
      case KArg::Kind::peers: kparams[i] = const_cast<void*>(pp.peers); break;  // the struct's bytes
      case KArg::Kind::staging:
        if (!pp.staging) fail(Status::internal, "a kernel reads the peer staging, which this program has not");
        vals[i].u64 = pp.staging->slot(pp.staging->rank(), static_cast<int>(a.value));
        kparams[i] = &vals[i].u64;
        break;
    }
  }
  cuda::check(d.cuLaunchKernel(v.kernel->fn, L.gx, L.gy, 1, L.bx, L.by, 1, 0, stream, n ? kparams : nullptr, nullptr),
              "cuLaunchKernel");
  return v;
}

// One finalize kernel's launch: the partial rows its kernel step's launch `v` wrote, summed into the gradients.
void run_finalize(const FinalizeStep& f, const Variant& v, const std::vector<void*>& ptr, CUstream stream) {
  using F = codegen::Finalize;
  void* pairs[2 * F::kMaxCount] = {};
  int np = v.launch.parts, acc = 0;
  void* fp[2 * F::kMaxCount + 2];
  for (int i = 0; i < 2 * f.count; ++i) {
    pairs[i] = ptr[static_cast<size_t>(f.pairs[static_cast<size_t>(i)])];
    fp[i] = &pairs[i];
  }
  fp[2 * f.count] = &np;
  fp[2 * f.count + 1] = &acc;
  const unsigned grid = static_cast<unsigned>((f.cols + F::kCols - 1) / F::kCols);
  cuda::check(cuda::driver().cuLaunchKernel(v.kernel->finalize[static_cast<size_t>(f.index)], grid,
                                            static_cast<unsigned>(f.count), 1, F::kThreads, 1, 1, 0, stream, fp, nullptr),
              "cuLaunchKernel(finalize)");
}

// What each step of a pass launched in this call: a kernel step's variant, a GEMM's mark; null: not run.
// On the stack for the programs of any real model (kInline steps), else on the heap.
class Launched {
 public:
  explicit Launched(size_t n) : at_(n <= kInline ? inline_ : (heap_ = std::make_unique<const Variant*[]>(n)).get()) {
    std::fill(at_, at_ + n, nullptr);
  }
  const Variant*& operator[](size_t i) { return at_[i]; }
  HostRoutes routes;  // the expert rows the pass's dropless grouped GEMMs read (exec/run/routes.hpp)

 private:
  static constexpr size_t kInline = 256;
  const Variant* inline_[kInline];
  std::unique_ptr<const Variant*[]> heap_;
  const Variant** at_;
};
const Variant kGemmRan{};  // a GEMM's partials: one float

// An FP8 recipe-state update: per cast right after it, or the pass's batch of those whose steps ran.
void run_fp8_update(const Fp8UpdateStep& u, Launched& launched, const std::vector<void*>& ptr, CUstream stream) {
  auto f = [&](int id) { return id >= 0 ? static_cast<float*>(ptr[static_cast<size_t>(id)]) : nullptr; };
  fp8::UpdateBatch batch;
  for (const auto& e : u.entries) {
    const Variant* by = launched[static_cast<size_t>(e.step)];
    if (!by) continue;  // its step did not run in this call
    fp8::UpdateEntry x;
    x.partials = f(e.partials);
    x.count = by == &kGemmRan ? 1 : static_cast<int>(by->launch.gx * by->launch.gy);
    x.history = f(e.history);
    x.scale = f(e.scale);
    x.scale_inv = f(e.scale_inv);
    // A cast's module holds the update kernel (batched: one format and margin per pass, so any cast's).
    CUfunction fn = by == &kGemmRan ? nullptr : by->kernel->fp8_update;
    if (!u.batched) return fp8::launch_update(fn, x, u.history_len, stream);
    batch.add(fn, u.history_len, x);
  }
  batch.launch(stream);
}

}  // namespace

namespace {
// Buffer `id`'s element `offset` (elements of `dtype`) as a device address: where a comm step sends from or
// receives into.
CUdeviceptr element_at(const std::vector<void*>& ptr, int id, int64_t offset, ops::DType dtype) {
  return reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(id)]) +
         static_cast<CUdeviceptr>(offset) * static_cast<CUdeviceptr>(ops::dtype_bytes(dtype));
}

// The copy-engine collectives' steps (Collective::peer_push, peer_wait, peer_ack, peer_take; cuda::PeerStaging):
// stream memory operations and one copy, no kernel.
void run_peer_step(const Prepared& pp, const CommStep& c, const std::vector<void*>& ptr, CUstream stream) {
  const cuda::PeerStaging* st = pp.staging.get();
  if (!st) fail(Status::internal, "a copy-engine collective step without the peer staging");
  const auto& d = cuda::driver();
  const int me = st->rank(), world = st->world();
  switch (c.op) {
    case Collective::peer_push: {
      const size_t bytes = static_cast<size_t>(c.count) * ops::dtype_bytes(c.dtype);
      if (c.root < 0 || c.root >= world || c.root == me || bytes > st->slot_bytes())
        fail(Status::internal, "peer_push to rank {} of {} bytes (staging slots of {})", c.root, bytes, st->slot_bytes());
      const CUdeviceptr src = element_at(ptr, c.send, c.send_offset, c.dtype);
      // The destination read what this rank pushed last (its ack), then the copy, then its flag.
      cuda::check(d.cuStreamWaitValue32(stream, st->ack(me, c.root), 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32(ack)");
      cuda::check(d.cuStreamWriteValue32(stream, st->ack(me, c.root), 0, 0), "cuStreamWriteValue32(ack)");
      cuda::check(d.cuMemcpyDtoDAsync(st->slot(c.root, me), src, bytes, stream), "cuMemcpyDtoDAsync(peer push)");
      cuda::check(d.cuStreamWriteValue32(stream, st->flag(c.root, me), 1, 0), "cuStreamWriteValue32(flag)");
      return;
    }
    case Collective::peer_wait:
      for (int q = 0; q < world; ++q)
        if (q != me)
          cuda::check(d.cuStreamWaitValue32(stream, st->flag(me, q), 1, CU_STREAM_WAIT_VALUE_EQ),
                      "cuStreamWaitValue32(flag)");
      return;
    case Collective::peer_ack:
      for (int q = 0; q < world; ++q) {
        if (q == me) continue;
        cuda::check(d.cuStreamWriteValue32(stream, st->flag(me, q), 0, 0), "cuStreamWriteValue32(flag)");
        cuda::check(d.cuStreamWriteValue32(stream, st->ack(q, me), 1, 0), "cuStreamWriteValue32(ack)");
      }
      return;
    case Collective::peer_take: {
      const size_t bytes = static_cast<size_t>(c.count) * ops::dtype_bytes(c.dtype);
      const CUdeviceptr dst = element_at(ptr, c.recv, c.recv_offset, c.dtype);
      if (c.root == me) {  // this rank's own rows: a local copy
        cuda::check(d.cuMemcpyDtoDAsync(dst, element_at(ptr, c.send, c.send_offset, c.dtype), bytes, stream),
                    "cuMemcpyDtoDAsync(own rows)");
        return;
      }
      if (c.root < 0 || c.root >= world || bytes > st->slot_bytes())
        fail(Status::internal, "peer_take from rank {} of {} bytes (staging slots of {})", c.root, bytes, st->slot_bytes());
      cuda::check(d.cuStreamWaitValue32(stream, st->flag(me, c.root), 1, CU_STREAM_WAIT_VALUE_EQ), "cuStreamWaitValue32(flag)");
      cuda::check(d.cuMemcpyDtoDAsync(dst, st->slot(me, c.root), bytes, stream), "cuMemcpyDtoDAsync(peer take)");
      cuda::check(d.cuStreamWriteValue32(stream, st->flag(me, c.root), 0, 0), "cuStreamWriteValue32(flag)");
      cuda::check(d.cuStreamWriteValue32(stream, st->ack(c.root, me), 1, 0), "cuStreamWriteValue32(ack)");
      return;
    }
    default: fail(Status::internal, "run_peer_step: not a peer step");
  }
}

void run_comm(const Prepared& pp, const CommStep& c, const std::vector<void*>& ptr, CUstream stream,
              HostRoutes& routes) {
  if (!pp.comm) fail(Status::internal, "a comm step without a communicator");
  if (c.op == Collective::all_to_all) return run_all_to_all(*pp.comm, c, ptr, stream, routes);
  if (c.op == Collective::peer_push || c.op == Collective::peer_wait || c.op == Collective::peer_ack ||
      c.op == Collective::peer_take)
    return run_peer_step(pp, c, ptr, stream);
  const cuda::Nccl& n = cuda::nccl();
  const auto* send = reinterpret_cast<const void*>(element_at(ptr, c.send, c.send_offset, c.dtype));
  auto* recv = reinterpret_cast<void*>(element_at(ptr, c.recv, c.recv_offset, c.dtype));
  const auto count = static_cast<size_t>(c.count);
  const ncclDataType_t dt = cuda::nccl_dtype(c.dtype);
  ncclComm_t comm = pp.comm->comm();
  switch (c.op) {
    case Collective::all_gather:
      return cuda::check_nccl(n.ncclAllGather(send, recv, count, dt, comm, stream), "ncclAllGather");
    case Collective::reduce_scatter:
      return cuda::check_nccl(n.ncclReduceScatter(send, recv, count, dt, ncclSum, comm, stream), "ncclReduceScatter");
    case Collective::all_reduce:
      return cuda::check_nccl(n.ncclAllReduce(send, recv, count, dt, ncclSum, comm, stream), "ncclAllReduce");
    case Collective::broadcast:
      return cuda::check_nccl(n.ncclBroadcast(send, recv, count, dt, c.root, comm, stream), "ncclBroadcast");
    case Collective::reduce:
      return cuda::check_nccl(n.ncclReduce(send, recv, count, dt, ncclSum, c.root, comm, stream), "ncclReduce");
    case Collective::all_to_all:
    case Collective::peer_push:
    case Collective::peer_wait:
    case Collective::peer_ack:
    case Collective::peer_take: break;  // above
  }
}
}  // namespace

void free_block(const Allocator& a, CUstream s, void* p, size_t bytes) {
  if (!p) return;
  if (a.free) {
    a.free(p, std::max<size_t>(bytes, 16), s, a.user);
    return;
  }
  if (auto* d = cuda::try_driver()) d->cuMemFreeAsync(reinterpret_cast<CUdeviceptr>(p), s);
}

namespace {
// One step on stream `on`; records what it launched in `launched[i]` (a skipped weight cast: nothing).
void run_step(const Prepared& pp, Runtime& rt, const Step& s, const PreparedStep& st, Launched& launched, size_t i,
              const std::vector<void*>& ptr, CUstream on, const StepFilter& filter) {
  if (s.weight_cast && filter.skip_weight_casts) return;  // the persistent FP8 copy of an unchanged weight is valid
  if (s.peer_path != 0 && s.peer_path != pp.peer_path) return;  // the group's other way runs
  switch (s.kind) {
    case Step::Kind::gemm:
      run_gemm(rt, s.gemm, st, ptr, on, launched.routes);
      launched[i] = &kGemmRan;
      return;
    case Step::Kind::comm: return run_comm(pp, s.comm, ptr, on, launched.routes);
    case Step::Kind::kernel: launched[i] = &run_kernel(pp, rt, *s.kernel, st, ptr, on, launched.routes); return;
    case Step::Kind::finalize:
      if (const Variant* v = launched[static_cast<size_t>(s.finalize.kernel_step)]) run_finalize(s.finalize, *v, ptr, on);
      return;
    case Step::Kind::fp8_update: return run_fp8_update(s.fp8_update, launched, ptr, on);
  }
}
}  // namespace

void run_steps(const Prepared& pp, Runtime& rt, bool forward, const std::vector<void*>& ptr, CUstream stream,
               const GroupHook& hook, const StepFilter& filter) {
  const auto& steps = forward ? pp.program->forward : pp.program->backward;
  const auto& states = pp.steps(forward);
  Launched launched(steps.size());
  // Collectives pipelined with GEMMs (docs/parallel.md): a group's side-stream steps fork from the caller's
  // stream at their first step, each step records its event, and the caller's stream joins at the group's end.
  const SideStream* side = pp.side.get();
  const std::vector<CUevent>* events = side ? (forward ? &side->forward : &side->backward) : nullptr;
  const auto& d = cuda::driver();
  bool forked = false;
  for (size_t i = 0; i < steps.size(); ++i) {
    const Step& s = steps[i];
    if (s.group < 0) {  // the pass's batched FP8 update: of the steps that ran
      run_fp8_update(s.fp8_update, launched, ptr, stream);
      continue;
    }
    if (s.group < filter.group_begin || s.group >= filter.group_end) continue;
    if (hook && (i == 0 || steps[i - 1].group != s.group)) hook(s.group, true);
    CUstream on = stream;
    if (s.stream != 0) {
      on = side->stream;
      if (!forked) {
        cuda::check(d.cuEventRecord(side->fork, stream), "cuEventRecord(fork)");
        cuda::check(d.cuStreamWaitEvent(on, side->fork, 0), "cuStreamWaitEvent(fork)");
        forked = true;
      }
    }
    for (int w : s.waits) cuda::check(d.cuStreamWaitEvent(on, (*events)[static_cast<size_t>(w)], 0), "cuStreamWaitEvent");
    run_step(pp, rt, s, states[i], launched, i, ptr, on, filter);
    if (events) cuda::check(d.cuEventRecord((*events)[i], on), "cuEventRecord");
    const bool group_ends = i + 1 == steps.size() || steps[i + 1].group != s.group;
    if (group_ends && forked) {  // the caller's stream waits for the group's side-stream work
      for (size_t j = i + 1; j-- > 0 && steps[j].group == s.group;)
        if (steps[j].stream != 0) {
          cuda::check(d.cuStreamWaitEvent(stream, (*events)[j], 0), "cuStreamWaitEvent(join)");
          break;
        }
      forked = false;
    }
    if (hook && group_ends) hook(s.group, false);
  }
}

ForwardResult run_forward(const std::shared_ptr<const Prepared>& pp, Runtime& rt, const ForwardArgs& fa,
                          CallObserver* observer) {
  const Program& p = *pp->program;
  const bool training = fa.training && p.training;
  std::vector<void*> ptr(p.buffers.size(), nullptr);
  ptr[static_cast<size_t>(p.input)] = const_cast<void*>(fa.input);
  ptr[static_cast<size_t>(p.output)] = fa.output;
  bind_list(p.extra_in, fa.extra_in, ptr);
  bind_list(p.extra_out, fa.extra_out, ptr);
  bind_slots(p, pp->params, fa.params, ptr, false);
  bind_state(*pp, ptr);
  std::optional<Block> arena;
  char* arena_base = static_cast<char*>(fa.workspace);
  const Layout& L = pp->layout;
  if (!arena_base && L.fwd_arena)
    arena_base = arena.emplace(rt.allocator, pp->temp_pool, fa.stream, L.fwd_arena).get();
  std::optional<Block> block;
  char* saved_base = static_cast<char*>(fa.saved);
  if (training && !saved_base && L.saved_bytes)
    saved_base = block.emplace(rt.allocator, pp->temp_pool, fa.stream, L.saved_bytes).get();
  place(L, Storage::fwd_arena, arena_base, ptr);
  if (training) place(L, Storage::saved_block, saved_base, ptr);
  ForwardResult result;
  GroupHook hook;
  if (observer) {
    observer->bound(ptr);
    hook = [&](int g, bool before) { observer->group(g, before, ptr, fa.stream); };
  }
  if (p.rng >= 0) copy_rng(fa.rng, ptr[static_cast<size_t>(p.rng)], fa.stream);
  StepFilter filter;
  filter.skip_weight_casts = fa.weights_unchanged;
  run_steps(*pp, rt, true, ptr, fa.stream, hook, filter);
  if (block) {
    result.saved = block->release();
    result.saved_bytes = L.saved_bytes;
  }
  return result;
}

void run_backward(const Prepared& pp, Runtime& rt, const BackwardArgs& ba, CallObserver* observer) {
  const Program& p = *pp.program;
  if (!p.training) fail(Status::invalid_argument, "a backward needs a program prepared for training");
  std::vector<void*> ptr(p.buffers.size(), nullptr);
  // The forward side: its tensors, parameters, recipe state and saved block.
  ptr[static_cast<size_t>(p.input)] = const_cast<void*>(ba.input);
  ptr[static_cast<size_t>(p.output)] = const_cast<void*>(ba.output);
  bind_list(p.extra_in, ba.extra_in, ptr);
  bind_list(p.extra_out, ba.extra_out, ptr);
  bind_state(pp, ptr);
  place(pp.layout, Storage::saved_block, static_cast<char*>(const_cast<void*>(ba.saved)), ptr);
  ptr[static_cast<size_t>(p.grad_output)] = const_cast<void*>(ba.grad_output);
  ptr[static_cast<size_t>(p.grad_input)] = ba.grad_input;
  bind_list(p.grad_extra_out, ba.grad_extra_out, ptr);
  bind_list(p.grad_extra_in, ba.grad_extra_in, ptr);
  bind_slots(p, pp.params, ba.params, ptr, false);
  bind_slots(p, pp.grads, ba.grads, ptr, true);
  std::optional<Block> arena;
  char* arena_base = static_cast<char*>(ba.workspace);
  if (!arena_base && pp.layout.bwd_arena)
    arena_base = arena.emplace(rt.allocator, pp.temp_pool, ba.stream, pp.layout.bwd_arena).get();
  place(pp.layout, Storage::bwd_arena, arena_base, ptr);
  GroupHook hook;
  if (observer) {
    observer->bound(ptr);
    hook = [&](int g, bool before) { observer->group(g, before, ptr, ba.stream); };
  }
  run_steps(pp, rt, false, ptr, ba.stream, hook);
}

}  // namespace jitfuse::exec
