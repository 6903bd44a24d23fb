// NCCL, loaded at run time (dlopen) so that libjitfuse builds, loads and runs on one GPU without it:
// $JITFUSE_NCCL_LIBRARY, else libnccl.so.2 through the loader (the copy PyTorch's nvidia-nccl wheel already
// loaded into the process, or the system's), else the CUDA toolkit's. A Communicator wraps one ncclComm_t —
// the host's (borrowed) or one jitfuse created from a unique id (owned) — and runs the comm steps of a
// program on the caller's stream (docs/parallel.md).
#pragma once
#include <cuda.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "ops/recipe.hpp"

namespace jitfuse::cuda {

class PeerWorkspace;
class PeerStaging;

struct Nccl {
#define JF_NCCL_FN(name) decltype(&::name) name = nullptr;
#include "cuda/nccl_fns.inc"
#undef JF_NCCL_FN
  int version = 0;  // NCCL_VERSION_CODE of the loaded library (22809: 2.28.9)
  std::string path;
};

// The loaded NCCL, or nullptr; `why` says what is missing and what to do.
const Nccl* try_nccl(std::string* why = nullptr);
const Nccl& nccl();  // throws Error(unsupported) naming the problem

// Throws Error(cuda_error) "<call> failed: <NCCL's error string> (<its last error>)" unless r == ncclSuccess.
void check_nccl(ncclResult_t r, const char* call);

// NCCL's type for a tensor dtype (E4M3 needs NCCL >= 2.24; the caller checks the version).
ncclDataType_t nccl_dtype(ops::DType dt);

class Communicator {
 public:
  // A new communicator: rank `rank` of `world_size` ranks that share `id` (from unique_id()), on the
  // calling thread's current device. Every rank calls it at once (it blocks until all joined).
  static std::shared_ptr<Communicator> create(const ncclUniqueId& id, int world_size, int rank);
  // The host's ncclComm_t, borrowed: the host keeps it alive while jitfuse uses it and destroys it.
  static std::shared_ptr<Communicator> wrap(ncclComm_t comm);
  static ncclUniqueId unique_id();
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  ncclComm_t comm() const { return comm_; }
  int world_size() const { return world_; }
  int rank() const { return rank_; }
  int device() const { return device_; }  // the CUDA device ordinal the communicator runs on
  bool owned() const { return owned_; }

  // The jf_peers table (the bytes of a kernel's by-value parameter) of the group's peer workspace
  // (cuda/peers.hpp), made on the first call: a collective, so every rank asks at the same point of its calls
  // (the first prepare of a program with a one-shot all-reduce). Null where the programs take their NCCL path
  // instead: JITFUSE_PEER_ALLREDUCE=0, `caller` capturing a CUDA graph (asked again later), or a rank that
  // cannot map another's buffer (`why` says so; not asked again).
  const void* peer_table(CUstream caller, std::string* why = nullptr);
  // The copy-engine collectives' staging (cuda/peers.hpp) with slots of at least `slot_bytes`: made on the
  // first call and again, larger, when a call asks for more (a collective each time, so every rank asks at the
  // same point of its calls: a program's prepare); a staging handed out earlier stays valid. Null where the
  // programs take NCCL's collectives instead: JITFUSE_PEER_COPY=0, or a rank that cannot map another's
  // buffer (`why` says so; not asked again).
  std::shared_ptr<const PeerStaging> peer_staging(size_t slot_bytes, std::string* why = nullptr);

 private:
  Communicator() = default;
  ncclComm_t comm_ = nullptr;
  int world_ = 1, rank_ = 0, device_ = 0;
  bool owned_ = false;
  std::mutex peers_mu_;
  std::unique_ptr<PeerWorkspace> peers_;
  bool peers_tried_ = false;
  std::string peers_why_;
  std::shared_ptr<const PeerStaging> staging_;
  std::string staging_why_;  // set once a staging could not be made
};

// Ends an NCCL group however the scope is left (an exception between start and end included).
class NcclGroup {
 public:
  NcclGroup() { check_nccl(nccl().ncclGroupStart(), "ncclGroupStart"); }
  ~NcclGroup() {
    if (open_) nccl().ncclGroupEnd();  // leaving by an exception: that error is the one reported
  }
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  void end() {
    open_ = false;
    check_nccl(nccl().ncclGroupEnd(), "ncclGroupEnd");
  }

 private:
  bool open_ = true;
};

}  // namespace jitfuse::cuda
