// DeviceTensor: plain cuMemAlloc'd buffers (never managed memory) with DLPack views.
#include "harness/device_tensor.hpp"

#include <cstring>

#include "reference/reference.hpp"

namespace jitfuse::harness {

DeviceTensor::DeviceTensor(const ops::Shape& shape, const std::string& dtype, bool misalign)
    : dtype_(dtype), shape_(shape) {
  const size_t elt = dtype == "int64"                     ? 8
                     : dtype == "fp32" || dtype == "int32" ? 4
                     : dtype == "e4m3" || dtype == "e5m2"  ? 1
                                                           : 2;
  bytes_ = static_cast<size_t>(ops::numel(shape)) * elt;
  cuda::check(cuda::driver().cuMemAlloc(&base_, bytes_ + 16), "cuMemAlloc");
  t_.data = reinterpret_cast<void*>(base_);
  t_.byte_offset = misalign ? elt : 0;
  t_.device = {kDLCUDA, 0};
  t_.ndim = static_cast<int32_t>(shape_.size());
  t_.dtype = dtype == "int64"  ? DLDataType{kDLInt, 64, 1}
             : dtype == "int32" ? DLDataType{kDLInt, 32, 1}
             : dtype == "fp32"  ? DLDataType{kDLFloat, 32, 1}
             : dtype == "fp16" ? DLDataType{kDLFloat, 16, 1}
             : dtype == "e4m3" || dtype == "e5m2" ? DLDataType{kDLUInt, 8, 1}  // FP8 bytes (DLPack < 1.0 has no FP8 code)
                               : DLDataType{kDLBfloat, 16, 1};
  t_.shape = shape_.data();
  t_.strides = nullptr;
}

DeviceTensor::~DeviceTensor() {
  if (auto* d = cuda::try_driver()) d->cuMemFree(base_);
}

// A synchronous cuMemcpyHtoD from pageable memory may return before its DMA reaches the device, and work on
// a CU_STREAM_NON_BLOCKING stream is not ordered after it (issue 26: of 16 concurrent `jitfuse check` runs,
// half read unwritten gradients of the output). So every copy is queued on the stream of the work it feeds
// or follows, and waited for: the host may then free (upload) or read (download) its memory, and an upload
// is complete before any later work, on any stream, starts.
void host_to_device(CUdeviceptr dst, const void* src, size_t bytes, CUstream stream) {
  const auto& d = cuda::driver();
  cuda::check(d.cuMemcpyHtoDAsync(dst, src, bytes, stream), "cuMemcpyHtoDAsync");
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(after an upload)");
}

void device_to_host(void* dst, CUdeviceptr src, size_t bytes, CUstream stream) {
  const auto& d = cuda::driver();
  cuda::check(d.cuMemcpyDtoHAsync(dst, src, bytes, stream), "cuMemcpyDtoHAsync");
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(after a download)");
}

void DeviceTensor::upload(const std::vector<uint8_t>& b, CUstream stream) {
  host_to_device(ptr(), b.data(), std::min(b.size(), bytes_), stream);
}

void DeviceTensor::upload_values(const std::vector<double>& v, CUstream stream) {
  if (dtype_ != "int64" && dtype_ != "int32") return upload(reference::encode(dtype_, v), stream);
  const size_t elt = dtype_ == "int64" ? 8 : 4;  // integers (labels), little-endian two's complement
  std::vector<uint8_t> b(v.size() * elt);
  for (size_t i = 0; i < v.size(); ++i) {
    const int64_t x = static_cast<int64_t>(v[i]);
    const int32_t x32 = static_cast<int32_t>(x);
    std::memcpy(b.data() + i * elt, elt == 8 ? static_cast<const void*>(&x) : static_cast<const void*>(&x32), elt);
  }
  upload(b, stream);
}

void DeviceTensor::poison(CUstream stream) { upload(std::vector<uint8_t>(bytes_, 0xff), stream); }

std::vector<uint8_t> DeviceTensor::download(CUstream stream) const {
  std::vector<uint8_t> b(bytes_);
  device_to_host(b.data(), ptr(), bytes_, stream);
  return b;
}

std::vector<double> DeviceTensor::download_values(CUstream stream) const { return reference::decode(dtype_, download(stream)); }

}  // namespace jitfuse::harness
