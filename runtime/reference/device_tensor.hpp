// A device buffer viewed as a DLTensor, for the GPU check and the benchmarks: owns its memory, can be
// offset by one element (misaligned runs), poisoned with NaN, filled from doubles, read back.
#pragma once
#include <string>
#include <vector>

#include <dlpack/dlpack.h>

#include "cuda/driver.hpp"
#include "ops/op.hpp"

namespace jitfuse::reference {

// Host <-> device copies of the harness, the CLI's checks and the tests: complete for every stream of the
// current context when they return (see device_tensor.cpp), never racing work on a non-blocking stream.
void host_to_device(CUdeviceptr dst, const void* src, size_t bytes);
void device_to_host(void* dst, CUdeviceptr src, size_t bytes);

class DeviceTensor {
 public:
  DeviceTensor(const ops::Shape& shape, const std::string& dtype, bool misalign = false);
  ~DeviceTensor();
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;

  DLTensor* dl() { return &t_; }
  CUdeviceptr ptr() const { return base_ + t_.byte_offset; }
  size_t bytes() const { return bytes_; }
  void upload(const std::vector<uint8_t>& b);
  void upload_values(const std::vector<double>& v);  // encoded to the dtype
  void poison();                                     // all-ones bytes: NaN in fp32, fp16 and bf16
  std::vector<uint8_t> download() const;
  std::vector<double> download_values() const;

 private:
  CUdeviceptr base_ = 0;
  size_t bytes_ = 0;
  std::string dtype_;
  std::vector<int64_t> shape_;
  DLTensor t_{};
};

}  // namespace jitfuse::reference
