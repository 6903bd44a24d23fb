// A device buffer for the GPU tests that launch generated kernels directly (cast_transpose_test,
// moe_test): allocated and poisoned with 0xCD bytes (an unwritten element shows), uploads and downloads on
// the legacy default stream, which every launch of those tests uses.
#pragma once
#include <algorithm>
#include <vector>

#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "harness/device_tensor.hpp"

namespace jitfuse::test {

struct DevBuf {
  CUdeviceptr p = 0;
  size_t bytes = 0;
  explicit DevBuf(size_t n) : bytes(std::max<size_t>(n, 16)) {
    cuda::check(cuda::driver().cuMemAlloc(&p, bytes), "cuMemAlloc");
    cuda::check(cuda::driver().cuMemsetD8Async(p, 0xCD, bytes, nullptr), "cuMemsetD8Async");
  }
  ~DevBuf() { cuda::driver().cuMemFree(p); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  template <typename T>
  void put(const std::vector<T>& v) {
    harness::host_to_device(p, v.data(), v.size() * sizeof(T), nullptr);
  }
  template <typename T>
  std::vector<T> get(size_t n) const {
    std::vector<T> v(n);
    harness::device_to_host(v.data(), p, n * sizeof(T), nullptr);
    return v;
  }
};

}  // namespace jitfuse::test
