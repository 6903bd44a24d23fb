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

class PeerWorkspace {
 public:
  // Every rank of `comm` calls it at once (a collective on the communicator, on a private stream, synchronised).
  // Null when some rank cannot map another's buffer (`why` says which and why, as every rank sees it).
  static std::unique_ptr<PeerWorkspace> create(const Communicator& comm, std::string* why);
  ~PeerWorkspace();
  PeerWorkspace(const PeerWorkspace&) = delete;
  PeerWorkspace& operator=(const PeerWorkspace&) = delete;

  const PeerTable& table() const { return table_; }  // the jf_peers a kernel takes (its parameter's bytes)

 private:
  PeerWorkspace() = default;
  CUdeviceptr own_ = 0;
  PeerTable table_{};
  std::vector<CUdeviceptr> mapped_;  // by rank; 0 for this rank (its own_) and for those not mapped
};

}  // namespace jitfuse::cuda
