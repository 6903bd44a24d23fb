// Not a test but a measurement (hidden tag): disk-hit load and memory-hit lookup times for
// realistically sized entries. Run: jf_unit_tests "[cache-timing]"; docs/cache.md quotes it.
#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>

#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

using clock_type = std::chrono::steady_clock;

double us_since(clock_type::time_point t0) {
  return std::chrono::duration<double, std::micro>(clock_type::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

TEST_CASE("cache timing: disk-hit load and memory-hit lookup", "[.][cache-timing]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  // A stitched elementwise kernel's source is tens of KB once templates are inlined; its CUBIN ~100 KB.
  const size_t source_bytes = 24 * 1024, cubin_bytes = 100 * 1024;
  const int n = 200;
  std::vector<KernelRequest> reqs;
  for (int i = 0; i < n; ++i) {
    auto r = make_request(i);
    r.source += std::string(source_bytes - r.source.size(), ' ');
    reqs.push_back(r);
  }
  FakeCompiler fc;
  fc.pad = cubin_bytes;
  {
    KernelCache c(Config{dir});
    for (auto& r : reqs) c.get_or_compile(r, fc.fn());
  }

  auto t0 = clock_type::now();
  KernelCache c(Config{dir});
  double open_us = us_since(t0);

  std::vector<double> disk;
  for (auto& r : reqs) {
    Origin o{};
    auto t = clock_type::now();
    c.get_or_compile(r, fc.fn(), &o);
    disk.push_back(us_since(t));
    REQUIRE(o == Origin::disk);
  }
  std::vector<double> mem;
  for (int rep = 0; rep < 20; ++rep)
    for (auto& r : reqs) {
      Origin o{};
      auto t = clock_type::now();
      c.get_or_compile(r, fc.fn(), &o);
      mem.push_back(us_since(t));
      REQUIRE(o == Origin::memory);
    }
  std::vector<double> key;
  for (auto& r : reqs) {
    auto t = clock_type::now();
    volatile size_t s = cache_key(r).size();
    (void)s;
    key.push_back(us_since(t));
  }
  WARN(fmt::format("entry ~{} KiB (source {} KiB + cubin {} KiB), {} entries, page cache warm\n"
                   "  KernelCache construction (mkdir/stat/probe): {:.1f} us\n"
                   "  disk-hit load (read + sha256 verify + parse + hit sidecar): median {:.1f} us\n"
                   "  memory-hit lookup (key sha256 over the source + map lookup): median {:.2f} us\n"
                   "  of which the key: median {:.2f} us",
                   (source_bytes + cubin_bytes) / 1024, source_bytes / 1024, cubin_bytes / 1024, n, open_us,
                   median(disk), median(mem), median(key)));
  CHECK(fc.calls == n);
}
