// Loading libcuda.so.1 and resolving each entry point to the exact versioned symbol cuda.h declares,
// plus the current-device query.
#include "cuda/driver.hpp"

#include <dlfcn.h>

#include <map>

#include <mutex>

#include "common/error.hpp"

namespace jitfuse::cuda {
namespace {

struct Loaded {
  Driver d;
  std::string why;
  bool ok = false;
};

Loaded load() {
  Loaded l;
  void* h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    l.why = "libcuda.so.1 (the NVIDIA driver) is not installed";
    return l;
  }
  // dlsym the exact symbol cuda.h maps each name to (cuMemAlloc -> cuMemAlloc_v2), so every pointer has
  // the signature its declaration says. cuGetProcAddress would hand out the newest ABI of a name for a
  // CUDA version instead (cuCtxGetDevice -> cuCtxGetDevice_v2 takes another argument).
  bool missing = false;
#define JF_STR2(x) #x
#define JF_STR(x) JF_STR2(x)
#define JF_DRIVER_FN(name)                                                         \
  {                                                                                \
    void* p = dlsym(h, JF_STR(name));                                              \
    if (!p) {                                                                      \
      l.why = "the NVIDIA driver lacks " JF_STR(name) "; update the driver";       \
      missing = true;                                                              \
    }                                                                              \
    l.d.name = reinterpret_cast<decltype(l.d.name)>(p);                            \
  }
#include "cuda/driver_fns.inc"
#undef JF_DRIVER_FN
  if (missing) return l;
  CUresult r = l.d.cuInit(0);
  if (r != CUDA_SUCCESS) {
    const char* name = nullptr;
    l.d.cuGetErrorName(r, &name);
    l.why = std::string("cuInit failed: ") + (name ? name : "?") + " (no usable GPU)";
    return l;
  }
  int count = 0;
  if (l.d.cuDeviceGetCount(&count) != CUDA_SUCCESS || count == 0) {
    l.why = "the driver reports no CUDA device";
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

const Driver* try_driver(std::string* why) {
  const Loaded& l = loaded();
  if (!l.ok && why) *why = l.why;
  return l.ok ? &l.d : nullptr;
}

const Driver& driver() {
  const Loaded& l = loaded();
  if (!l.ok) fail(Status::no_device, "no GPU available: {}", l.why);
  return l.d;
}

bool stream_capturing(CUstream stream, CUresult* error) {
  CUstreamCaptureStatus st = CU_STREAM_CAPTURE_STATUS_NONE;
  const CUresult r = driver().cuStreamIsCapturing(stream, &st);
  if (error) *error = r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT ? CUDA_SUCCESS : r;
  return r == CUDA_ERROR_STREAM_CAPTURE_IMPLICIT || (r == CUDA_SUCCESS && st != CU_STREAM_CAPTURE_STATUS_NONE);
}

void check(CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return;
  const char* name = "CUDA_ERROR_UNKNOWN";
  const char* desc = "";
  if (auto* d = try_driver()) {
    d->cuGetErrorName(r, &name);
    d->cuGetErrorString(r, &desc);
  }
  Status s = r == CUDA_ERROR_OUT_OF_MEMORY ? Status::out_of_memory : Status::cuda_error;
  fail(s, "{} failed: {} ({})", call, name ? name : "?", desc ? desc : "");
}

std::string arch_name(int sm) {
  // sm_90a unlocks Hopper's arch-specific instructions; the CUBIN then runs on exactly this arch.
  if (sm == 90) return "sm_90a";
  return "sm_" + std::to_string(sm);
}

std::string DeviceInfo::arch() const { return arch_name(arch_number()); }

DeviceInfo current_device() {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  check(d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) {
    CUdevice dev0;
    check(d.cuDeviceGet(&dev0, 0), "cuDeviceGet");
    check(d.cuDevicePrimaryCtxRetain(&ctx, dev0), "cuDevicePrimaryCtxRetain");
    check(d.cuCtxSetCurrent(ctx), "cuCtxSetCurrent");
  }
  CUdevice dev;
  check(d.cuCtxGetDevice(&dev), "cuCtxGetDevice");
  DeviceInfo info;
  info.ordinal = static_cast<int>(dev);
  char name[256] = {0};
  check(d.cuDeviceGetName(name, sizeof(name), dev), "cuDeviceGetName");
  info.name = name;
  check(d.cuDeviceGetAttribute(&info.major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev), "cuDeviceGetAttribute");
  check(d.cuDeviceGetAttribute(&info.minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev), "cuDeviceGetAttribute");
  check(d.cuDeviceGetAttribute(&info.sm_count, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute");
  return info;
}

int current_ordinal() {
  const Driver& d = driver();
  CUcontext ctx = nullptr;
  check(d.cuCtxGetCurrent(&ctx), "cuCtxGetCurrent");
  if (!ctx) return current_device().ordinal;
  CUdevice dev;
  check(d.cuCtxGetDevice(&dev), "cuCtxGetDevice");
  return static_cast<int>(dev);
}

int driver_version() {
  int v = 0;
  check(driver().cuDriverGetVersion(&v), "cuDriverGetVersion");
  return v;
}

CUmemoryPool temp_pool() {
  static std::mutex mu;
  static std::map<int, CUmemoryPool> pools;
  const int dev = current_ordinal();
  std::lock_guard<std::mutex> lock(mu);
  auto it = pools.find(dev);
  if (it != pools.end()) return it->second;
  const Driver& d = driver();
  CUmemPoolProps props{};
  props.allocType = CU_MEM_ALLOCATION_TYPE_PINNED;
  props.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  props.location.id = dev;
  CUmemoryPool pool = nullptr;
  check(d.cuMemPoolCreate(&pool, &props), "cuMemPoolCreate");
  cuuint64_t keep = cuuint64_t{1} << 30;
  check(d.cuMemPoolSetAttribute(pool, CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, &keep), "cuMemPoolSetAttribute");
  pools[dev] = pool;
  return pool;
}

}  // namespace jitfuse::cuda
