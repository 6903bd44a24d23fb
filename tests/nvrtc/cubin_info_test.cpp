// cuda::read_cubin_resources on CUBINs NVRTC compiles here (no GPU): registers, stack frame and static
// shared memory per entry point, as ptxas recorded them; and on damaged CUBINs (every truncation, byte
// flips): an error or partial figures, never a crash (the ASan build runs this tier).
#include <catch2/catch.hpp>

#include <random>

#include "common/little_endian.hpp"
#include "cuda/cubin_info.hpp"
#include "cuda/nvrtc.hpp"

using namespace jitfuse;

namespace {

// Three entry points with known resource shapes: a light one under a tight launch bound, one whose
// dynamically indexed local array must live in the stack frame, one with 4 KiB of static shared memory.
constexpr const char* kSource = R"(
extern "C" __global__ void __launch_bounds__(1024, 2) light(float* o, const float* a) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  o[i] = a[i] * 2.f;
}
extern "C" __global__ void framed(float* o, const int* idx, int n) {
  float local[64];
  for (int k = 0; k < 64; ++k) local[k] = o[k] * k;
  float s = 0.f;
  for (int k = 0; k < n; ++k) s += local[idx[k] & 63];
  o[threadIdx.x] = s;
}
extern "C" __global__ void shared_sum(float* o, const float* a) {
  __shared__ float tile[1024];
  tile[threadIdx.x] = a[threadIdx.x];
  __syncthreads();
  o[threadIdx.x] = tile[1023 - threadIdx.x];
}
)";

std::string cubin() {
  static const std::string bin = [] {
    const cuda::NvrtcTarget t = cuda::target_for("sm_90a");
    REQUIRE_FALSE(t.ptx);
    return cuda::compile(kSource, "cubin_info_test.cu", {}, t.options()).binary;
  }();
  return bin;
}

const cuda::KernelResources& find(const cuda::CubinResources& r, const std::string& name) {
  for (const auto& k : r.kernels)
    if (k.name == name) return k;
  FAIL("no entry point " << name);
  static cuda::KernelResources none;
  return none;
}

}  // namespace

TEST_CASE("read_cubin_resources reads registers, stack frame and static shared memory", "[nvrtc][cubin_info]") {
  const auto r = cuda::read_cubin_resources(cubin());
  INFO(r.error);
  REQUIRE(r.error.empty());
  REQUIRE(r.kernels.size() == 3);
  const auto& light = find(r, "light");
  CHECK(light.registers > 0);
  CHECK(light.registers <= 32);  // 1024 threads x 2 blocks: at most 32 registers fit an SM's 64K
  CHECK(light.frame_bytes == 0);
  CHECK(light.static_shared_bytes == 0);
  const auto& framed = find(r, "framed");
  CHECK(framed.registers > 0);
  CHECK(framed.frame_bytes >= 64 * 4);  // the indexed array lives in local memory
  const auto& sh = find(r, "shared_sum");
  // The section's size: the 4 KiB tile, plus the 1 KiB sm_80+ reserves for the system on this arch.
  CHECK(sh.static_shared_bytes >= 4096);
  CHECK(sh.static_shared_bytes <= 4096 + 1024);
  CHECK(sh.frame_bytes == 0);
}

TEST_CASE("read_cubin_resources survives damaged CUBINs", "[nvrtc][cubin_info]") {
  const std::string good = cubin();
  CHECK_FALSE(cuda::read_cubin_resources("").error.empty());
  CHECK(cuda::read_cubin_resources("#include <x>\nnot a cubin").error == "not an ELF file");
  size_t errors = 0;
  for (size_t n = 0; n < good.size(); ++n) {  // every truncation
    const auto r = cuda::read_cubin_resources(std::string_view(good).substr(0, n));
    errors += !r.error.empty();
    for (const auto& k : r.kernels) CHECK(k.registers <= 255);
  }
  CHECK(errors > good.size() / 2);  // most truncations cut the section table (at the end): reported
  // Sections whose bytes are read, declared NOBITS (as .nv.shared.* legitimately are) with an offset past
  // the end: refused, not read.
  for (const char* victim : {".symtab", ".nv.info"}) {
    std::string bad = good;
    const uint64_t shoff = load_le(bad, 0x28, 8), shnum = load_le(bad, 0x3C, 2), shstrndx = load_le(bad, 0x3E, 2);
    const uint64_t str_off = load_le(bad, shoff + shstrndx * 64 + 0x18, 8);
    bool patched = false;
    for (uint64_t i = 0; i < shnum; ++i) {
      const uint64_t h = shoff + i * 64;
      if (std::string(bad.c_str() + str_off + load_le(bad, h, 4)) != victim) continue;
      bad[h + 4] = 8, bad[h + 5] = bad[h + 6] = bad[h + 7] = 0;  // SHT_NOBITS
      for (int b = 0; b < 8; ++b) bad[h + 0x18 + b] = static_cast<char>(b < 7 ? 0xff : 0x0f);  // offset far away
      patched = true;
    }
    INFO(victim);
    REQUIRE(patched);
    const auto r = cuda::read_cubin_resources(bad);
    CHECK_THAT(r.error, Catch::Contains("has no bytes in the file"));
  }
  std::mt19937 rng(20261126);
  for (int trial = 0; trial < 2000; ++trial) {  // byte flips anywhere, headers included
    std::string bad = good;
    for (int k = 0; k < 4; ++k) bad[rng() % bad.size()] ^= static_cast<char>(1 + rng() % 255);
    const auto r = cuda::read_cubin_resources(bad);
    CHECK(r.kernels.size() <= 64);
  }
}
