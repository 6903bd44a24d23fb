// The CUDA driver API, loaded at run time from libcuda.so.1 so that libjitfuse loads (and NVRTC work,
// the CLI, the cache) on machines without a GPU. Errors carry the failing call and the error's name.
#pragma once
#include <cuda.h>

#include <string>

namespace jitfuse::cuda {

struct Driver {
#define JF_DRIVER_FN(name) decltype(&::name) name = nullptr;
#include "cuda/driver_fns.inc"
#undef JF_DRIVER_FN
};

// The loaded driver with cuInit done, or nullptr when there is none; `why` says what is missing.
const Driver* try_driver(std::string* why = nullptr);
// The loaded driver; throws Error(no_device) naming the problem.
const Driver& driver();

// Throws Error(cuda_error) "<call> failed: CUDA_ERROR_X (<description>)" unless r == CUDA_SUCCESS.
void check(CUresult r, const char* call);

// Whether `stream` is capturing a CUDA graph, counting the legacy stream's "implicit capture" answer (another
// stream captures in global mode) as capturing. Any other error of cuStreamIsCapturing counts as not capturing
// and is returned in `*error` when given (CUDA_SUCCESS otherwise).
bool stream_capturing(CUstream stream, CUresult* error = nullptr);

// The code target of SM version `sm` (90 -> "sm_90a", 80 -> "sm_80"): what kernels compile for and cache
// keys record. The one mapping (devices, the CLI's --arch, explain's arch).
std::string arch_name(int sm);

struct DeviceInfo {
  int ordinal = 0;
  std::string name;
  int major = 0, minor = 0;
  int sm_count = 0;
  std::string arch() const;  // "sm_90a" on Hopper (arch-specific features), else "sm_XY"
  int arch_number() const { return major * 10 + minor; }
};

// The device of the calling thread's current context; if there is none, the primary context of
// device 0 is made current (the one the CUDA runtime and PyTorch use). Never creates a new context.
DeviceInfo current_device();
int driver_version();
// The device ordinal of the current context (making the primary context of device 0 current if none).
int current_ordinal();
// jitfuse's stream-ordered memory pool on the current device, for its temporaries and saved contexts when
// the host sets no allocator. Unlike the device's default pool (release threshold 0: freed memory goes
// back to the driver at every synchronisation, so the next call maps it again), it keeps up to 1 GiB of
// freed memory cached; created on first use, one per device, for the life of the process.
CUmemoryPool temp_pool();

}  // namespace jitfuse::cuda
