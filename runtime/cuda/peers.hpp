// The peer workspace of a communicator: one device buffer per rank, exported with CUDA IPC and mapped by every
// other rank of the group (over NVLink; never multicast), in which a one-shot all-reduce kernel stages its
// input and raises its flags (templates/skeletons/peer.cuh, docs/parallel.md). Made once per communicator, by
// every rank at the same point of its calls (the first prepare of a program with such a kernel): a collective
// on the communicator exchanges the handles and agrees on the outcome, so either every rank maps every other
// rank's buffer or none does and the programs take their NCCL path.
#pragma once
#include <cuda.h>

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace jitfuse::cuda {

class Communicator;

// The workspace layout (each rank's buffer): flags [kPeerMaxBlocks][kMaxPeers] u32, this rank's epochs
// [kPeerMaxBlocks][kMaxPeers] u32, the jf_peers table, then the staging buffer: two regions of kPeerBlockBytes per
// block (codegen::peer_rows_fit says which inputs fit: decode and short prefill, e.g. 128 tokens of hidden 8192 in
// fp32, 256 in bf16; larger ones take NCCL's all-reduce).
inline constexpr size_t kPeerFlagsOffset = 0, kPeerEpochsOffset = 8192, kPeerTableOffset = 12288,
                        kPeerDataOffset = 16384;
inline constexpr size_t kPeerStagingBytes = 2 * 128 * 32768;

class PeerWorkspace {
 public:
  // Every rank of `comm` calls it at once (a collective on the communicator, on a private stream, synchronised).
  // Null when some rank cannot map another's buffer (`why` says which and why, as every rank sees it).
  static std::unique_ptr<PeerWorkspace> create(const Communicator& comm, std::string* why);
  ~PeerWorkspace();
  PeerWorkspace(const PeerWorkspace&) = delete;
  PeerWorkspace& operator=(const PeerWorkspace&) = delete;

  CUdeviceptr table() const { return own_ + kPeerTableOffset; }  // the jf_peers a kernel takes

 private:
  PeerWorkspace() = default;
  CUdeviceptr own_ = 0;
  std::vector<CUdeviceptr> mapped_;  // by rank; 0 for this rank (its own_) and for those not mapped
};

}  // namespace jitfuse::cuda
