// The entry file format: byte-for-byte against the committed golden file, an independent decode of
// that file, round trips, and detection of every truncation and every single flipped byte.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "cache/disk_store.hpp"
#include "cache/sha256.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

const std::string kGolden = std::string(JF_SOURCE_DIR) + "/tests/golden/cache/entry_v2.jfk";

// Fixed inputs; timestamps come from here, so serialization is fully deterministic.
Entry golden_entry() {
  Entry e;
  e.key = "3f2a9c0d41b7e8a6c5d4e3f2a1b0c9d8e7f6a5b4c3d2e1f0a9b8c7d6e5f40312";
  e.meta = {{"rule", "bias_gelu"},
            {"ops", {"bias", "gelu"}},
            {"recipe", "bf16"},
            {"dtypes", {{"in", "bf16"}, {"out", "bf16"}}},
            {"shape", {8192, 4096}},
            {"arch", "sm_90a"},
            {"nvrtc_version", "13.0"},
            {"options", {"--std=c++17", "--gpu-architecture=sm_90a"}},
            {"compile_ms", 123.5},
            {"created", "2026-01-02T03:04:05Z"},
            {"last_used", "2026-01-02T03:04:05Z"},
            {"hits", 0}};
  e.source = "// y = gelu_tanh(x + b)\nextern \"C\" __global__ void bias_gelu(float* y) {}\n";
  e.cubin = std::string("\x7f" "ELF\x02\x01\x01\0\0\xff\xfe\0\0", 13);  // 13 bytes, as pinned in the golden file
  return e;
}

uint64_t le(const std::string& b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(b[at + i])) << (8 * i);
  return v;
}

}  // namespace

TEST_CASE("entry serialization matches the golden file byte for byte", "[cache][format]") {
  std::string bytes = serialize_entry(golden_entry());
  if (const char* u = std::getenv("JITFUSE_UPDATE_GOLDEN"); u && std::string(u) == "1") {
    write_all(kGolden, bytes);
    WARN("rewrote " << kGolden);
  }
  std::string golden = read_all(kGolden);
  REQUIRE(!golden.empty());
  CHECK(bytes.size() == golden.size());
  CHECK(bytes == golden);  // a change here needs kFormatVersion bumped (see disk_store.hpp)
  CHECK(serialize_entry(golden_entry()) == bytes);  // deterministic
}

TEST_CASE("golden file decodes independently of the parser", "[cache][format]") {
  // Walks the documented layout by hand, so the parser and serializer cannot drift together.
  std::string b = read_all(kGolden);
  REQUIRE(b.size() > 100);
  CHECK(b.substr(0, 8) == "JFKENTRY");
  CHECK(le(b, 8, 4) == kFormatVersion);
  size_t pos = 12;
  std::vector<std::string> fields;
  for (int i = 0; i < 4; ++i) {
    uint64_t n = le(b, pos, 8);
    pos += 8;
    REQUIRE(pos + n <= b.size());
    fields.push_back(b.substr(pos, n));
    pos += n;
  }
  REQUIRE(b.size() == pos + 32);
  Entry g = golden_entry();
  CHECK(fields[0] == g.key);
  CHECK(nlohmann::json::parse(fields[1]) == g.meta);
  CHECK(fields[1].find("\"arch\":\"sm_90a\"") != std::string::npos);
  CHECK(fields[1].front() == '{');
  CHECK(fields[2] == g.source);
  CHECK(fields[3] == g.cubin);
  Digest d = sha256(std::string_view(b).substr(0, pos));
  CHECK(std::memcmp(d.data(), b.data() + pos, 32) == 0);
}

TEST_CASE("golden file parses back to the fixed entry", "[cache][format]") {
  Entry e = parse_entry(read_all(kGolden), kGolden);
  Entry g = golden_entry();
  CHECK(e.key == g.key);
  CHECK(e.meta == g.meta);
  CHECK(e.source == g.source);
  CHECK(e.cubin == g.cubin);
}

TEST_CASE("entry round trip keeps every byte", "[cache][format]") {
  Entry e = golden_entry();
  e.source = std::string(100000, 'x') + std::string("\0\n\r\xff", 4);
  e.cubin.clear();
  for (int i = 0; i < 70000; ++i) e.cubin.push_back(static_cast<char>(i * 31));
  e.meta["unicode"] = "µs ✓";
  Entry back = parse_entry(serialize_entry(e), "mem");
  CHECK(back.key == e.key);
  CHECK(back.meta == e.meta);
  CHECK(back.source == e.source);
  CHECK(back.cubin == e.cubin);

  Entry empty = golden_entry();
  empty.source.clear();
  empty.cubin.clear();
  empty.meta = nlohmann::json::object();
  Entry back2 = parse_entry(serialize_entry(empty), "mem");
  CHECK(back2.source.empty());
  CHECK(back2.cubin.empty());
  CHECK(back2.meta == nlohmann::json::object());
}

TEST_CASE("every truncation and every flipped byte is detected", "[cache][format]") {
  const std::string good = serialize_entry(golden_entry());
  for (size_t n = 0; n < good.size(); ++n) {
    INFO("truncated to " << n << " bytes");
    CHECK_THROWS_AS(parse_entry(good.substr(0, n), "t"), Error);
  }
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    INFO("flipped byte " << i);
    CHECK_THROWS_AS(parse_entry(bad, "f"), Error);
  }
  CHECK_THROWS_WITH(parse_entry(good + "x", "extra"), Catch::Contains("after the checksum"));
}

TEST_CASE("parse errors say what is wrong and where", "[cache][format]") {
  std::string good = serialize_entry(golden_entry());
  try {
    parse_entry("ELF garbage that is long enough to not be short", "/x/y.jfk");
    FAIL("parsed garbage");
  } catch (const Error& e) {
    CHECK(e.status() == Status::io_error);
    CHECK_THAT(e.what(), Catch::Contains("/x/y.jfk") && Catch::Contains("bad magic"));
  }
  std::string next = good;  // a newer build's entry
  next[8] = static_cast<char>(kFormatVersion + 1);
  CHECK_THROWS_WITH(parse_entry(next, "v"), Catch::Contains(fmt::format("format version {}", kFormatVersion + 1)) &&
                                                Catch::Contains(fmt::format("reads version {}", kFormatVersion)));
  CHECK_THROWS_WITH(parse_entry(good.substr(0, good.size() - 10), "t"), Catch::Contains("truncated"));
  std::string flipped = good;
  flipped[good.size() - 40] ^= 1;  // inside the cubin: only the checksum can notice
  CHECK_THROWS_WITH(parse_entry(flipped, "c"), Catch::Contains("checksum mismatch"));
  Entry bad_key = golden_entry();
  bad_key.key = "not-a-key";
  CHECK_THROWS_AS(serialize_entry(bad_key), Error);
}

TEST_CASE("an entry of the previous format version is refused, naming both versions", "[cache][format]") {
  std::string old = serialize_entry(golden_entry());
  const uint32_t v = kFormatVersion - 1;
  for (int i = 0; i < 4; ++i) old[8 + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  CHECK_THROWS_WITH(parse_entry(old, "old.jfk"),
                    Catch::Contains(fmt::format("entry format version {}, this build reads version {}", v, kFormatVersion)));
}
