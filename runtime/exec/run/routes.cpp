#include "exec/run/routes.hpp"

#include "common/error.hpp"
#include "cuda/driver.hpp"

namespace jitfuse::exec {

const int32_t* HostRoutes::get(const GemmStep& g, const std::vector<void*>& ptr, CUstream stream) {
  if (const auto* known = find(g.route)) return known->data();
  if (cuda::stream_capturing(stream))
    fail(Status::unsupported, "a grouped_linear after a moe_permute with \"layout\": \"packed\" (dropless) reads "
         "how many rows each expert got on the host, which a CUDA graph capture cannot do: capture the expert "
         "block with \"layout\": \"padded\" and a \"capacity\" (fixed shapes, routing on the device)");
  const auto& d = cuda::driver();
  const int64_t e = g.route_experts;
  std::vector<int32_t> v(static_cast<size_t>(2 * e + 1));
  const auto src = reinterpret_cast<CUdeviceptr>(ptr[static_cast<size_t>(g.route)]) + static_cast<CUdeviceptr>(g.route_splits) * 4u;
  cuda::check(d.cuMemcpyDtoHAsync(v.data(), src, v.size() * 4u, stream), "cuMemcpyDtoHAsync(expert rows)");
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(expert rows)");
  for (int64_t x = 0; x < e; ++x)  // the routing kernels' invariant; a violation would be an out-of-bounds GEMM
    if (v[x] < 0 || v[e + x] < 0 || v[e + x + 1] != v[e + x] + v[x] || v[2 * e] > g.call.m)
      fail(Status::internal, "the routing of a grouped_linear is inconsistent at expert {}: {} rows from row {}, "
           "{} rows in all (bound {})", x, v[x], v[e + x], v[2 * e], g.call.m);
  read_.emplace_back(g.route, std::move(v));
  return read_.back().second.data();
}

const std::vector<int32_t>* HostRoutes::find(int route) const {
  for (const auto& r : read_)
    if (r.first == route) return &r.second;
  return nullptr;
}

void HostRoutes::put(int route, std::vector<int32_t> splits_starts) {
  for (auto& r : read_)
    if (r.first == route) {
      r.second = std::move(splits_starts);
      return;
    }
  read_.emplace_back(route, std::move(splits_starts));
}

}  // namespace jitfuse::exec
