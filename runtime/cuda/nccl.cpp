// Loading NCCL with dlopen, and the communicator jitfuse's comm steps run on.
#include "cuda/nccl.hpp"

#include <dlfcn.h>

#include <vector>

#include "common/env.hpp"
#include "common/error.hpp"
#include "common/text.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"
#include "cuda/peers.hpp"

namespace jitfuse::cuda {
namespace {

struct Loaded {
  Nccl n;
  std::string why;
  bool ok = false;
};

Loaded load() {
  Loaded l;
  std::vector<std::string> tries;
  if (auto p = env::get("JITFUSE_NCCL_LIBRARY"); p && !p->empty()) {
    if (p->size() > 4096 || (*p)[0] != '/') {
      l.why = "JITFUSE_NCCL_LIBRARY must be an absolute path to libnccl.so.2, not '" + text::shorten(*p) + "'";
      return l;
    }
    tries.push_back(*p);
  } else {
    tries = {"libnccl.so.2", "/usr/local/cuda/lib64/libnccl.so.2"};
  }
  void* h = nullptr;
  std::string errors;
  for (const auto& t : tries) {
    h = dlopen(t.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (h) {
      l.n.path = t;
      break;
    }
    const char* e = dlerror();
    errors += (errors.empty() ? "" : "; ") + t + ": " + text::shorten(e ? e : "not found");
  }
  if (!h) {
    l.why = "NCCL is not installed (" + errors + "); install NCCL (PyTorch's nvidia-nccl wheel or the CUDA "
            "toolkit's) or set JITFUSE_NCCL_LIBRARY";
    return l;
  }
#define JF_STR2(x) #x
#define JF_STR(x) JF_STR2(x)
#define JF_NCCL_FN(name)                                                                           \
  l.n.name = reinterpret_cast<decltype(l.n.name)>(dlsym(h, JF_STR(name)));                          \
  if (!l.n.name) {                                                                                  \
    l.why = l.n.path + " lacks " JF_STR(name) ": jitfuse needs NCCL >= 2.19";                        \
    return l;                                                                                       \
  }
#include "cuda/nccl_fns.inc"
#undef JF_NCCL_FN
  if (l.n.ncclGetVersion(&l.n.version) != ncclSuccess) {
    l.why = l.n.path + ": ncclGetVersion failed";
    return l;
  }
  l.ok = true;
  return l;
}

const Loaded& loaded() {
  static Loaded l = load();
  return l;
}

}  // namespace

const Nccl* try_nccl(std::string* why) {
  const Loaded& l = loaded();
  if (!l.ok && why) *why = l.why;
  return l.ok ? &l.n : nullptr;
}

const Nccl& nccl() {
  const Loaded& l = loaded();
  if (!l.ok) fail(Status::unsupported, "tensor parallelism needs NCCL: {}", l.why);
  return l.n;
}

void check_nccl(ncclResult_t r, const char* call) {
  if (r == ncclSuccess) return;
  const Nccl& n = nccl();
  const char* last = n.ncclGetLastError(nullptr);
  fail(Status::cuda_error, "{} failed: {}{}{}", call, n.ncclGetErrorString(r), last && *last ? ": " : "",
       text::shorten(last ? last : ""));
}

ncclDataType_t nccl_dtype(ops::DType dt) {
  switch (dt) {
    case ops::DType::f32: return ncclFloat32;
    case ops::DType::f16: return ncclFloat16;
    case ops::DType::bf16: return ncclBfloat16;
    case ops::DType::e4m3:
    case ops::DType::e5m2:
    case ops::DType::i32:
    case ops::DType::i64:
      // Only sums are reduced, and FP8 codes do not sum: comm steps move the recipe dtype.
      break;
  }
  fail(Status::unsupported, "NCCL collectives of {} are not supported", ops::dtype_name(dt));
}

std::shared_ptr<Communicator> Communicator::create(const ncclUniqueId& id, int world_size, int rank) {
  if (world_size < 1 || rank < 0 || rank >= world_size)
    fail(Status::invalid_argument, "rank {} of world size {}: the rank is 0 to world size - 1", rank, world_size);
  const Nccl& n = nccl();
  std::shared_ptr<Communicator> c(new Communicator());
  c->device_ = current_ordinal();
  check_nccl(n.ncclCommInitRank(&c->comm_, world_size, id, rank), "ncclCommInitRank");
  c->world_ = world_size;
  c->rank_ = rank;
  c->owned_ = true;
  return c;
}

std::shared_ptr<Communicator> Communicator::wrap(ncclComm_t comm) {
  if (!comm) fail(Status::invalid_argument, "the ncclComm_t is null");
  const Nccl& n = nccl();
  std::shared_ptr<Communicator> c(new Communicator());
  c->comm_ = comm;
  check_nccl(n.ncclCommCount(comm, &c->world_), "ncclCommCount");
  check_nccl(n.ncclCommUserRank(comm, &c->rank_), "ncclCommUserRank");
  check_nccl(n.ncclCommCuDevice(comm, &c->device_), "ncclCommCuDevice");
  return c;
}

ncclUniqueId Communicator::unique_id() {
  ncclUniqueId id{};
  check_nccl(nccl().ncclGetUniqueId(&id), "ncclGetUniqueId");
  return id;
}

Communicator::~Communicator() {
  peers_.reset();  // its buffers before the communicator
  staging_.reset();
  if (owned_ && comm_)
    if (const Nccl* n = try_nccl()) n->ncclCommDestroy(comm_);
}

const void* Communicator::peer_table(CUstream caller, std::string* why) {
  const auto off = env::get("JITFUSE_PEER_ALLREDUCE");
  if (off && env::falsy(*off)) {
    if (why) *why = "JITFUSE_PEER_ALLREDUCE=0";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (!peers_tried_) {
    if (stream_capturing(caller)) {
      if (why) *why = "the first call is being captured into a CUDA graph (run one call before capturing)";
      return nullptr;
    }
    peers_tried_ = true;
    peers_ = PeerWorkspace::create(*this, &peers_why_);
    if (!peers_) jitfuse::log().warn("group of {} ranks: the all-reduce + norm kernels take NCCL's all-reduce: {}", world_, peers_why_);
  }
  if (!peers_ && why) *why = peers_why_;
  return peers_ ? static_cast<const void*>(&peers_->table()) : nullptr;
}

std::shared_ptr<const PeerStaging> Communicator::peer_staging(size_t slot_bytes, std::string* why) {
  const auto off = env::get("JITFUSE_PEER_COPY");
  if (off && env::falsy(*off)) {
    if (why) *why = "JITFUSE_PEER_COPY=0";
    return nullptr;
  }
  std::lock_guard<std::mutex> lock(peers_mu_);
  if (staging_why_.empty() && (!staging_ || staging_->slot_bytes() < slot_bytes)) {
    std::shared_ptr<const PeerStaging> made = PeerStaging::create(*this, slot_bytes, &staging_why_);
    if (made) {
      staging_ = std::move(made);
    } else {
      staging_.reset();
      if (staging_why_.empty()) staging_why_ = "the staging could not be made";
      jitfuse::log().warn("group of {} ranks: the sequence-parallel collectives take NCCL's way: {}", world_, staging_why_);
    }
  }
  if (!staging_ && why) *why = staging_why_;
  return staging_;
}

}  // namespace jitfuse::cuda
