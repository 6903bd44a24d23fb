// DeviceTensor: plain cuMemAlloc'd buffers (never managed memory) with DLPack views.
#include "reference/device_tensor.hpp"

#include "reference/reference.hpp"

namespace jitfuse::reference {

DeviceTensor::DeviceTensor(const ops::Shape& shape, const std::string& dtype, bool misalign)
    : dtype_(dtype), shape_(shape) {
  const size_t elt = dtype == "fp32" ? 4 : dtype == "e4m3" || dtype == "e5m2" ? 1 : 2;
  bytes_ = static_cast<size_t>(ops::numel(shape)) * elt;
  cuda::check(cuda::driver().cuMemAlloc(&base_, bytes_ + 16), "cuMemAlloc");
  t_.data = reinterpret_cast<void*>(base_);
  t_.byte_offset = misalign ? elt : 0;
  t_.device = {kDLCUDA, 0};
  t_.ndim = static_cast<int32_t>(shape_.size());
  t_.dtype = dtype == "fp32"   ? DLDataType{kDLFloat, 32, 1}
             : dtype == "fp16" ? DLDataType{kDLFloat, 16, 1}
             : dtype == "e4m3" || dtype == "e5m2" ? DLDataType{kDLUInt, 8, 1}  // FP8 bytes (DLPack < 1.0 has no FP8 code)
                               : DLDataType{kDLBfloat, 16, 1};
  t_.shape = shape_.data();
  t_.strides = nullptr;
}

DeviceTensor::~DeviceTensor() {
  if (auto* d = cuda::try_driver()) d->cuMemFree(base_);
}

void DeviceTensor::upload(const std::vector<uint8_t>& b) {
  cuda::check(cuda::driver().cuMemcpyHtoD(ptr(), b.data(), std::min(b.size(), bytes_)), "cuMemcpyHtoD");
}

void DeviceTensor::upload_values(const std::vector<double>& v) { upload(encode(dtype_, v)); }

void DeviceTensor::poison() { upload(std::vector<uint8_t>(bytes_, 0xff)); }

std::vector<uint8_t> DeviceTensor::download() const {
  std::vector<uint8_t> b(bytes_);
  cuda::check(cuda::driver().cuMemcpyDtoH(b.data(), ptr(), bytes_), "cuMemcpyDtoH");
  return b;
}

std::vector<double> DeviceTensor::download_values() const { return decode(dtype_, download()); }

}  // namespace jitfuse::reference
