// Cache key derivation: pinned for a fixed request, sensitive to every keyed field, blind to meta;
// plus the environment configuration (directory defaults, JITFUSE_CACHE_MAX_BYTES parsing).
#include <catch2/catch.hpp>

#include <cstdlib>
#include <set>

#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"
#include "support/scoped_env.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using jitfuse::test::ScopedEnv;

namespace {

KernelRequest base_request() {
  KernelRequest r;
  r.source = "extern \"C\" __global__ void k(float* y) { y[threadIdx.x] = 1.0f; }\n";
  r.options = {"--std=c++17", "--gpu-architecture=sm_90a"};
  r.arch = "sm_90a";
  r.nvrtc_version = "13.0";
  r.meta = {{"rule", "r"}, {"shape", {128, 256}}};
  return r;
}

}  // namespace

TEST_CASE("cache key is pinned for a fixed request", "[cache][key]") {
  // Changing this value means every user's cache is invalidated: do it only with a format bump.
  // Independently reproduced with Python hashlib over the length-prefixed fields (see docs/cache.md).
  CHECK(cache_key(base_request()) == "19d8b4ed2bac3b110fe8c380d62916c3cd6611c706fe7cf5efcf7eed2ef12a50");
  CHECK(cache_key(base_request()) == cache_key(base_request()));
}

TEST_CASE("cache key changes with every keyed field", "[cache][key]") {
  const std::string k0 = cache_key(base_request());
  std::set<std::string> keys{k0};
  auto differs = [&](const KernelRequest& r) {
    std::string k = cache_key(r);
    CHECK(k.size() == 64);
    CHECK(k != k0);
    keys.insert(k);
  };
  {
    auto r = base_request();
    r.source += " ";
    differs(r);
  }
  {
    auto r = base_request();
    r.options.push_back("-lineinfo");
    differs(r);
  }
  {
    auto r = base_request();
    std::swap(r.options[0], r.options[1]);  // order is part of what NVRTC sees
    differs(r);
  }
  {
    auto r = base_request();
    r.options = {"--std=c++17 --gpu-architecture=sm_90a"};  // joined != split: length prefixes
    differs(r);
  }
  {
    auto r = base_request();
    r.nvrtc_version = "13.1";
    differs(r);
  }
  {
    auto r = base_request();
    r.arch = "sm_90";  // the suffix matters: sm_90a code does not run everywhere sm_90 does
    differs(r);
  }
  {
    auto r = base_request();
    r.arch = "";
    r.nvrtc_version = "sm_90a13.0";  // moving bytes between fields must not collide
    differs(r);
  }
  CHECK(keys.size() == 8);
}

TEST_CASE("cache key ignores descriptive meta and splits options unambiguously", "[cache][key]") {
  auto a = base_request();
  auto b = base_request();
  b.meta = {{"rule", "something else"}, {"created", "now"}};
  CHECK(cache_key(a) == cache_key(b));

  auto c = base_request();
  auto d = base_request();
  c.options = {"ab", "c"};
  d.options = {"a", "bc"};
  CHECK(cache_key(c) != cache_key(d));
  c.options = {""};
  d.options = {};
  CHECK(cache_key(c) != cache_key(d));
}

TEST_CASE("JITFUSE_CACHE_MAX_BYTES parsing", "[cache][key]") {
  CHECK(parse_byte_count("0", "X") == 0);
  CHECK(parse_byte_count("1048576", "X") == 1048576);
  CHECK(parse_byte_count("512K", "X") == 512ull << 10);
  CHECK(parse_byte_count("3m", "X") == 3ull << 20);
  CHECK(parse_byte_count("2G", "X") == 2ull << 30);
  CHECK(parse_byte_count("2GiB", "X") == 2ull << 30);
  CHECK(parse_byte_count("1TB", "X") == 1ull << 40);
  for (const char* bad : {"", "abc", "-1", "1.5G", "10 G", "12Q", "99999999999999999999", "20000000T"}) {
    INFO(bad);
    try {
      parse_byte_count(bad, "JITFUSE_CACHE_MAX_BYTES");
      FAIL("accepted a bad byte count");
    } catch (const Error& e) {
      CHECK(e.status() == Status::invalid_argument);
      CHECK_THAT(e.what(), Catch::Contains("JITFUSE_CACHE_MAX_BYTES"));
    }
  }
}

TEST_CASE("config_from_env: directory defaults and a bad max-bytes value", "[cache][key]") {
  ScopedEnv max("JITFUSE_CACHE_MAX_BYTES", nullptr);
  {
    ScopedEnv d("JITFUSE_CACHE_DIR", "/some/where");
    ScopedEnv x("XDG_CACHE_HOME", "/xdg");
    CHECK(config_from_env().dir == std::optional<std::string>("/some/where"));
  }
  {
    ScopedEnv d("JITFUSE_CACHE_DIR", nullptr);
    ScopedEnv x("XDG_CACHE_HOME", "/xdg");
    CHECK(config_from_env().dir == std::optional<std::string>("/xdg/jitfuse"));
  }
  {
    ScopedEnv d("JITFUSE_CACHE_DIR", nullptr);
    ScopedEnv x("XDG_CACHE_HOME", "relative/ignored");
    ScopedEnv h("HOME", "/home/u");
    CHECK(config_from_env().dir == std::optional<std::string>("/home/u/.cache/jitfuse"));
  }
  {
    ScopedEnv d("JITFUSE_CACHE_DIR", nullptr);
    ScopedEnv x("XDG_CACHE_HOME", nullptr);
    ScopedEnv h("HOME", nullptr);
    CHECK_FALSE(config_from_env().dir.has_value());
  }
  {
    ScopedEnv m("JITFUSE_CACHE_MAX_BYTES", "64M");
    CHECK(config_from_env().max_bytes == 64ull << 20);
  }
  {
    ScopedEnv m("JITFUSE_CACHE_MAX_BYTES", "lots");
    CHECK_THROWS_WITH(config_from_env(), Catch::Contains("JITFUSE_CACHE_MAX_BYTES='lots'"));
  }
}
