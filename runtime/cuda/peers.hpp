// The peer workspace of a communicator: one device buffer per rank, exported with CUDA IPC and mapped by every
// other rank of the group (over NVLink; never multicast), in which a one-shot all-reduce kernel stages its
// input and raises its flags (templates/skeletons/peer.cuh, docs/parallel.md). Made once per communicator, by
// every rank at the same point of its calls (the first prepare of a program with such a kernel): a collective
// on the communicator exchanges the handles and agrees on the outcome, so either every rank maps every other
// rank's buffer or none does and the programs take their NCCL path.
#pragma once
#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace jitfuse::cuda {

class Communicator;

// The workspace layout (each rank's buffer): flags [kPeerMaxBlocks][kMaxPeers] u32, this rank's epochs
// [kPeerMaxBlocks][kMaxPeers] u32, then the staging buffer: per block, per epoch parity, per source rank a slot of
// kPeerBlockBytes (codegen::peer_rows_fit says which inputs fit: decode and short prefill, e.g. 128 tokens of hidden
// 8192 in fp32, 256 in bf16; larger ones take NCCL's all-reduce). 8 MiB of staging per rank of the group.
inline constexpr size_t kPeerFlagsOffset = 0, kPeerEpochsOffset = 8192, kPeerDataOffset = 16384;
inline constexpr size_t kPeerStagingPerRank = 2 * 128 * 32768;

// templates/skeletons/peer.cuh's jf_peers, as a kernel takes it by value (64-bit pointers).
struct PeerTable {
  uint64_t data[8];
  uint64_t flags[8];
  uint64_t epochs;
  int32_t rank, world;
};

// Every rank's buffer of `bytes`, mapped by every other rank (the handle exchange and agreement above), its
// first `zero_bytes` zeroed and `ones` u32 from byte `ones_at` set to 1 (on every way out: nothing leaks).
class PeerMapping {
 public:
  static std::unique_ptr<PeerMapping> create(const Communicator& comm, size_t bytes, size_t zero_bytes,
                                             size_t ones_at, size_t ones, std::string* why);
  ~PeerMapping();
  PeerMapping(const PeerMapping&) = delete;
  PeerMapping& operator=(const PeerMapping&) = delete;
  CUdeviceptr base(int rank) const { return bases_.at(static_cast<size_t>(rank)); }  // as this process maps it
  int rank() const { return rank_; }
  int world() const { return static_cast<int>(bases_.size()); }

 private:
  PeerMapping() = default;
  CUdeviceptr own_ = 0;
  int rank_ = 0;
  std::vector<CUdeviceptr> mapped_;  // by rank; 0 for this rank (its own_) and for those not mapped
  std::vector<CUdeviceptr> bases_;   // by rank: own_ or mapped_
};

class PeerWorkspace {
 public:
  // Every rank of `comm` calls it at once (a collective on the communicator, on a private stream, synchronised).
  // Null when some rank cannot map another's buffer (`why` says which and why, as every rank sees it).
  static std::unique_ptr<PeerWorkspace> create(const Communicator& comm, std::string* why);
  ~PeerWorkspace() = default;
  PeerWorkspace(const PeerWorkspace&) = delete;
  PeerWorkspace& operator=(const PeerWorkspace&) = delete;

  const PeerTable& table() const { return table_; }  // the jf_peers a kernel takes (its parameter's bytes)

 private:
  PeerWorkspace() = default;
  std::unique_ptr<PeerMapping> map_;
  PeerTable table_{};
};

// The staging of the collectives by copy engines (exec/lower/impl/joint_overlap_collective.cpp, "copy"): each
// rank's buffer holds a slot of `slot_bytes` per source rank, into which that rank's copy engine pushes rows
// (partial sums this rank owns, or the source's shard of a gather: cuMemcpyDtoDAsync over NVLink, no SM), a flag per
// source rank (raised by the source after its copy: cuStreamWriteValue32 into this buffer; lowered here once the
// slot was read) and an ack per destination rank (raised by the destination once it read the slot this rank
// filled; lowered here before the next copy into it): a one-message channel per ordered pair of ranks. Flags start at 0, acks at 1. Every value written is a constant,
// so a CUDA graph replays the protocol as it is. Made by every rank at once (a collective on the communicator).
class PeerStaging {
 public:
  static constexpr size_t kFlagsOffset = 0, kAcksOffset = 256, kDataOffset = 4096;
  static std::unique_ptr<PeerStaging> create(const Communicator& comm, size_t slot_bytes, std::string* why);
  // Waits (at most kTeardownWait) until every other rank's ack in this rank's buffer is up again — each took
  // what this rank pushed it last, and an ack after a take is the last write a peer makes into this buffer — so
  // no peer writes into freed memory; a rank that stopped mid-program leaves its ack down: a warning, then freed.
  ~PeerStaging();
  PeerStaging(const PeerStaging&) = delete;
  PeerStaging& operator=(const PeerStaging&) = delete;
  static constexpr int kTeardownWaitMs = 5000;
  size_t slot_bytes() const { return slot_bytes_; }
  int rank() const { return map_->rank(); }
  int world() const { return map_->world(); }
  // In rank `owner`'s buffer: the slot rank `src` fills, the flag `src` raises, the ack `dst` raises.
  CUdeviceptr slot(int owner, int src) const {
    return map_->base(owner) + kDataOffset + slot_bytes_ * static_cast<size_t>(src);
  }
  CUdeviceptr flag(int owner, int src) const { return map_->base(owner) + kFlagsOffset + 4 * static_cast<size_t>(src); }
  CUdeviceptr ack(int owner, int dst) const { return map_->base(owner) + kAcksOffset + 4 * static_cast<size_t>(dst); }

 private:
  PeerStaging() = default;
  std::unique_ptr<PeerMapping> map_;
  size_t slot_bytes_ = 0;
};

}  // namespace jitfuse::cuda
