// The peer buffers (cuda/peers.hpp): allocation, the handle exchange and agreement over NCCL; the one-shot
// all-reduce's workspace and table; the copy-engine collectives' staging.
#include "cuda/peers.hpp"

#include <chrono>
#include <cstdint>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"
#include "cuda/nccl.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::cuda {
namespace {

// What each rank tells the others: its buffer's IPC handle and whether it could export one.
struct Offer {
  CUipcMemHandle handle;
  int32_t ok;
  int32_t pad;
  uint64_t bytes;  // the size every rank must have asked for (a slot larger at one rank would be written past)
};

static_assert(sizeof(PeerTable) == 8 * codegen::kMaxPeers * 2 + 16);
static_assert(kPeerFlagsOffset + codegen::kPeerMaxBlocks * codegen::kMaxPeers * 4 <= kPeerEpochsOffset);
static_assert(kPeerEpochsOffset + codegen::kPeerMaxBlocks * codegen::kMaxPeers * 4 <= kPeerDataOffset);
static_assert(kPeerStagingPerRank == 2 * codegen::kPeerMaxBlocks * codegen::kPeerBlockBytes);

// A private stream, synchronised and destroyed on every way out.
class OwnStream {
 public:
  OwnStream() { check(driver().cuStreamCreate(&s_, CU_STREAM_NON_BLOCKING), "cuStreamCreate"); }
  ~OwnStream() {
    if (!s_) return;
    driver().cuStreamSynchronize(s_);
    driver().cuStreamDestroy(s_);
  }
  OwnStream(const OwnStream&) = delete;
  OwnStream& operator=(const OwnStream&) = delete;
  CUstream get() const { return s_; }
  void sync(const char* what) const { check(driver().cuStreamSynchronize(s_), what); }

 private:
  CUstream s_ = nullptr;
};

// The device scratch of the exchange, freed on every way out.
class Scratch {
 public:
  explicit Scratch(size_t bytes) { check(driver().cuMemAlloc(&p_, bytes), "cuMemAlloc(peer exchange)"); }
  ~Scratch() { driver().cuMemFree(p_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  CUdeviceptr get() const { return p_; }

 private:
  CUdeviceptr p_ = 0;
};

std::string error_name(CUresult r) {
  const char* name = nullptr;
  driver().cuGetErrorName(r, &name);
  return name ? name : "CUDA error";
}

}  // namespace

std::unique_ptr<PeerMapping> PeerMapping::create(const Communicator& comm, size_t bytes, size_t zero_bytes,
                                                 size_t ones_at, size_t ones, std::string* why) {
  const int world = comm.world_size(), rank = comm.rank();
  const auto& d = driver();
  const Nccl& n = nccl();
  std::unique_ptr<PeerMapping> m(new PeerMapping());
  m->rank_ = rank;
  m->mapped_.assign(static_cast<size_t>(world), 0);
  OwnStream s;
  Offer mine{};
  std::string problem;
  CUresult r = d.cuMemAlloc(&m->own_, bytes);
  if (r != CUDA_SUCCESS) m->own_ = 0;
  if (r == CUDA_SUCCESS && zero_bytes) r = d.cuMemsetD8Async(m->own_, 0, zero_bytes, s.get());
  if (r == CUDA_SUCCESS && ones) r = d.cuMemsetD32Async(m->own_ + ones_at, 1, ones, s.get());
  if (r == CUDA_SUCCESS) r = d.cuIpcGetMemHandle(&mine.handle, m->own_);
  mine.ok = r == CUDA_SUCCESS;
  mine.bytes = bytes;
  if (!mine.ok) problem = fmt::format("rank {} could not allocate or export its buffer ({} bytes): {}", rank, bytes,
                                      error_name(r));
  // Every rank's offer, then whether every rank mapped every other's (the minimum over ranks).
  Scratch ex(sizeof(Offer) * static_cast<size_t>(world) + 16);
  std::vector<Offer> all(static_cast<size_t>(world));
  const CUdeviceptr slot = ex.get() + sizeof(Offer) * static_cast<size_t>(rank);
  check(d.cuMemcpyHtoDAsync(slot, &mine, sizeof mine, s.get()), "cuMemcpyHtoDAsync(peer offer)");
  check_nccl(n.ncclAllGather(reinterpret_cast<void*>(slot), reinterpret_cast<void*>(ex.get()), sizeof(Offer),
                             ncclUint8, comm.comm(), s.get()), "ncclAllGather(peer offers)");
  check(d.cuMemcpyDtoHAsync(all.data(), ex.get(), sizeof(Offer) * all.size(), s.get()), "cuMemcpyDtoHAsync(peer offers)");
  s.sync("cuStreamSynchronize(peer offers)");
  int32_t mapped = mine.ok;
  for (int p = 0; p < world && mapped; ++p) {
    if (p == rank) continue;
    if (!all[static_cast<size_t>(p)].ok) {
      mapped = 0;
      problem = fmt::format("rank {} could not export its buffer", p);
      break;
    }
    if (all[static_cast<size_t>(p)].bytes != bytes) {
      mapped = 0;
      problem = fmt::format("rank {} asked for a buffer of {} bytes, rank {} for {}: did every rank prepare the same "
                            "programs in the same order?", p, all[static_cast<size_t>(p)].bytes, rank, bytes);
      break;
    }
    r = d.cuIpcOpenMemHandle(&m->mapped_[static_cast<size_t>(p)], all[static_cast<size_t>(p)].handle,
                             CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (r != CUDA_SUCCESS) {
      m->mapped_[static_cast<size_t>(p)] = 0;
      mapped = 0;
      problem = fmt::format("rank {} cannot map rank {}'s buffer ({}: no peer access between the GPUs, or the "
                            "processes may not share CUDA IPC handles)", rank, p, error_name(r));
    }
  }
  const CUdeviceptr agree = ex.get() + sizeof(Offer) * static_cast<size_t>(world);
  check(d.cuMemcpyHtoDAsync(agree, &mapped, sizeof mapped, s.get()), "cuMemcpyHtoDAsync(peer agreement)");
  check_nccl(n.ncclAllReduce(reinterpret_cast<void*>(agree), reinterpret_cast<void*>(agree), 1, ncclInt32, ncclMin,
                             comm.comm(), s.get()), "ncclAllReduce(peer agreement)");
  int32_t everyone = 0;
  check(d.cuMemcpyDtoHAsync(&everyone, agree, sizeof everyone, s.get()), "cuMemcpyDtoHAsync(peer agreement)");
  s.sync("cuStreamSynchronize(peer agreement)");
  if (!everyone) {
    if (why) *why = problem.empty() ? "another rank could not map a peer's buffer (its log says why)" : problem;
    return nullptr;
  }
  m->bases_.resize(static_cast<size_t>(world));
  for (int p = 0; p < world; ++p) m->bases_[static_cast<size_t>(p)] = p == rank ? m->own_ : m->mapped_[static_cast<size_t>(p)];
  return m;
}

PeerMapping::~PeerMapping() {
  const Driver* d = try_driver();
  if (!d) return;
  for (CUdeviceptr p : mapped_)
    if (p) d->cuIpcCloseMemHandle(p);
  if (own_) d->cuMemFree(own_);
}

std::unique_ptr<PeerWorkspace> PeerWorkspace::create(const Communicator& comm, std::string* why) {
  const int world = comm.world_size(), rank = comm.rank();
  if (world < 2 || world > codegen::kMaxPeers) {  // every rank sees the same world size: no exchange needed
    if (why) *why = fmt::format("the group has {} ranks; the peer all-reduce runs on 2 to {}", world, codegen::kMaxPeers);
    return nullptr;
  }
  std::unique_ptr<PeerWorkspace> ws(new PeerWorkspace());
  ws->map_ = PeerMapping::create(comm, kPeerDataOffset + kPeerStagingPerRank * static_cast<size_t>(world),
                                 kPeerDataOffset, 0, 0, why);
  if (!ws->map_) return nullptr;
  PeerTable& t = ws->table_;
  for (int p = 0; p < world; ++p) {
    t.data[p] = ws->map_->base(p) + kPeerDataOffset;
    t.flags[p] = ws->map_->base(p) + kPeerFlagsOffset;
  }
  t.epochs = ws->map_->base(rank) + kPeerEpochsOffset;
  t.rank = rank;
  t.world = world;
  return ws;
}

std::unique_ptr<PeerStaging> PeerStaging::create(const Communicator& comm, size_t slot_bytes, std::string* why) {
  const int world = comm.world_size();
  if (world < 2 || world > codegen::kMaxPeers) {
    if (why) *why = fmt::format("the group has {} ranks; the copy-engine collectives run on 2 to {}", world,
                                codegen::kMaxPeers);
    return nullptr;
  }
  static_assert(kAcksOffset >= kFlagsOffset + 4 * codegen::kMaxPeers && kDataOffset >= kAcksOffset + 4 * codegen::kMaxPeers);
  slot_bytes = (slot_bytes + 255) / 256 * 256;
  std::unique_ptr<PeerStaging> st(new PeerStaging());
  st->slot_bytes_ = slot_bytes;
  st->map_ = PeerMapping::create(comm, kDataOffset + slot_bytes * static_cast<size_t>(world), kDataOffset, kAcksOffset,
                                 codegen::kMaxPeers, why);
  if (!st->map_) return nullptr;
  return st;
}

PeerStaging::~PeerStaging() {
  const Driver* d = try_driver();
  if (!d || !map_) return;
  const int me = map_->rank(), world = map_->world();
  uint32_t acks[codegen::kMaxPeers] = {};
  std::unique_ptr<OwnStream> s;
  try {
    s = std::make_unique<OwnStream>();
  } catch (const Error&) {
    return;  // the context is gone
  }
  for (int waited = 0;; ++waited) {
    if (d->cuMemcpyDtoHAsync(acks, map_->base(me) + kAcksOffset, sizeof acks, s->get()) != CUDA_SUCCESS ||
        d->cuStreamSynchronize(s->get()) != CUDA_SUCCESS)
      return;
    int down = -1;
    for (int q = 0; q < world && down < 0; ++q)
      if (q != me && acks[q] != 1) down = q;
    if (down < 0) return;
    if (waited >= kTeardownWaitMs) {
      jitfuse::log().warn("rank {}: freeing the copy-engine staging although rank {} never took this rank's last "
                          "rows (it stopped mid-program?)", me, down);
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace jitfuse::cuda
