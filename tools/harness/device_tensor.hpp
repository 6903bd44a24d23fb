// A device buffer viewed as a DLTensor, for the GPU check and the benchmarks: owns its memory, can be
// offset by one element (misaligned runs), poisoned with NaN, filled from doubles, read back.
#pragma once
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "cuda/driver.hpp"
#include "ops/op.hpp"

namespace jitfuse::harness {

// Host <-> device copies of the harness, the CLI's checks and the tests, on `stream`: the stream of the work
// that reads what is uploaded or wrote what is downloaded (nullptr: the legacy default stream, which the C
// ABI's calls with a null stream use). Both are complete when they return (see device_tensor.cpp).
void host_to_device(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream);
void device_to_host(void* dst, CUdeviceptr src, size_t bytes, CUstream stream);

class DeviceTensor {
 public:
  DeviceTensor(const ops::Shape& shape, const std::string& dtype, bool misalign = false);
  ~DeviceTensor();
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  DLTensor* dl() { return &t_; }
  CUdeviceptr ptr() const { return base_ + t_.byte_offset; }
  size_t bytes() const { return bytes_; }
  // Every copy on the stream the tensor's work runs on (host_to_device, device_to_host).
  void upload(const std::vector<uint8_t>& b, CUstream stream);
  // Encoded to the dtype ("int64" / "int32": integers, exact below 2^53).
  void upload_values(const std::vector<double>& v, CUstream stream);
  void poison(CUstream stream);  // all-ones bytes: NaN in fp32, fp16 and bf16
  std::vector<uint8_t> download(CUstream stream) const;
  std::vector<double> download_values(CUstream stream) const;

 private:
  CUdeviceptr base_ = 0;
  size_t bytes_ = 0;
  std::string dtype_;
  std::vector<int64_t> shape_;
  DLTensor t_{};
};

}  // namespace jitfuse::harness
