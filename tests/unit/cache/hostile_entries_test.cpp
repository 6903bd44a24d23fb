// Cache entries replaced by hostile files: a FIFO, a 64 GiB sparse file, a header whose lengths do not fit
// the file. They are refused before their body is read, quarantined with one warning, the disk tier stays
// on, and `jitfuse cache ls/stats/verify` neither hang nor abort.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include "cache/disk_io.hpp"
#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

// Compiles request 1 into `dir`; returns its entry path.
std::string one_entry(const std::string& dir) {
  FakeCompiler fc;
  KernelCache c(Config{dir});
  c.get_or_compile(make_request(1), fc.fn());
  return entry_path(dir, cache_key(make_request(1)));
}

void make_fifo(const std::string& path) {
  ::unlink(path.c_str());
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
}

void make_sparse(const std::string& path, off_t size) {
  ::unlink(path.c_str());
  int fd = ::open(path.c_str(), O_CREAT | O_WRONLY, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, size) == 0);
  ::close(fd);
}

// A fresh cache finds `path` damaged: it recompiles, warns once naming `why`, quarantines the file and
// keeps its disk tier.
void check_quarantined(const std::string& dir, const std::string& path, const std::string& why) {
  LogCapture cap;
  FakeCompiler fc;
  KernelCache c(Config{dir});
  Origin o{};
  auto e = c.get_or_compile(make_request(1), fc.fn(), &o);
  CHECK(o == Origin::compiled);
  CHECK(e->cubin == expected_cubin(make_request(1)));
  CHECK(c.disk_enabled());
  auto w = cap.warnings();
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::Contains(path) && Catch::Contains(why) && Catch::Contains("quarantine"));
  CHECK(quarantined_count(dir) == 1);
  KernelCache again(Config{dir});
  again.get_or_compile(make_request(1), fc.fn(), &o);
  CHECK(o == Origin::disk);
}

}  // namespace

TEST_CASE("hostile entries: a FIFO is quarantined, never opened for a blocking read", "[cache][untrusted]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c"), path = one_entry(dir);
  make_fifo(path);
  auto infos = list_entries(dir);  // verify reads every entry: must not hang
  REQUIRE(infos.size() == 1);
  CHECK_THAT(infos[0].problem, Catch::Contains(path) && Catch::Contains("it is a FIFO, not a regular file"));
  infos = scan_entries(dir, false);
  REQUIRE(infos.size() == 1);
  CHECK_THAT(infos[0].problem, Catch::Contains("it is a FIFO, not a regular file"));
  CHECK_THROWS_WITH(read_entry(dir, infos[0].key.substr(0, 8)), Catch::Contains("it is a FIFO"));
  check_quarantined(dir, path, "it is a FIFO, not a regular file");
}

TEST_CASE("hostile entries: a 64 GiB sparse entry is refused by size, the disk tier stays on", "[cache][untrusted]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c"), path = one_entry(dir);
  make_sparse(path, off_t(64) << 30);
  auto infos = list_entries(dir);
  REQUIRE(infos.size() == 1);
  CHECK_THAT(infos[0].problem, Catch::Contains("68719476736 bytes, more than the 268435456 bytes a cache file may have"));
  check_quarantined(dir, path, "68719476736 bytes");
}

TEST_CASE("hostile entries: lengths are checked against the header before the body is read", "[cache][untrusted]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c"), path = one_entry(dir);
  std::string bytes = read_all(path);
  SECTION("a cubin length claiming more than the file holds") {
    // Patch the cubin length (the last u64 before cubin + checksum) to 2^40.
    Entry e = parse_entry(bytes, path);
    size_t at = bytes.size() - 32 - e.cubin.size() - 8;
    for (int i = 0; i < 8; ++i) bytes[at + i] = char((uint64_t(1) << 40) >> (8 * i));
    write_all(path, bytes);
    ::chmod(path.c_str(), 0600);
    auto infos = list_entries(dir);
    REQUIRE(infos.size() == 1);
    CHECK_THAT(infos[0].problem, Catch::Contains("the cubin field claims 1099511627776 bytes"));
    check_quarantined(dir, path, "the cubin field claims 1099511627776 bytes");
  }
  SECTION("200 MiB of trailing bytes (under the cap): refused from the header, not by reading it all") {
    bytes.resize(bytes.size() + (200u << 20), '\0');
    write_all(path, bytes);
    ::chmod(path.c_str(), 0600);
    std::string refused;
    auto got = read_entry_file(path, true, &refused);
    CHECK_FALSE(got.has_value());
    CHECK_THAT(refused, Catch::Contains("bytes for the 32-byte checksum"));
    check_quarantined(dir, path, "bytes for the 32-byte checksum");
  }
  SECTION("a metadata length of 2^60 in the header is damage for `ls`, not an allocation") {
    for (int i = 0; i < 8; ++i) bytes[84 + i] = char((uint64_t(1) << 60) >> (8 * i));
    write_all(path, bytes);
    auto infos = scan_entries(dir, false);
    REQUIRE(infos.size() == 1);
    CHECK_THAT(infos[0].problem, Catch::Contains("the meta field claims 1152921504606846976 bytes"));
  }
}

#ifdef JF_CLI_PATH
TEST_CASE("cli: cache ls, stats, verify and show with a FIFO and a sparse giant neither hang nor abort",
          "[cache][cli][untrusted]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  std::vector<std::string> paths;
  {
    KernelCache c(Config{dir});
    for (int i = 0; i < 3; ++i) paths.push_back(entry_path(dir, c.get_or_compile(make_request(i), fc.fn())->key));
  }
  make_fifo(paths[0]);
  make_sparse(paths[1], off_t(64) << 30);
  for (const std::string& cmd : {"ls", "stats", "verify", "ls --json", "verify --json"}) {
    const std::string out = tmp.sub("out"), err = tmp.sub("err");
    // `timeout` turns a hang into exit 124 instead of a test that never ends.
    std::string line = fmt::format("JITFUSE_CACHE_DIR='{}' timeout 30 '{}' cache {} >'{}' 2>'{}'", dir, JF_CLI_PATH,
                                   cmd, out, err);
    int st = std::system(line.c_str());
    INFO("jitfuse cache " << cmd << "\nstdout: " << read_all(out) << "\nstderr: " << read_all(err));
    REQUIRE(WIFEXITED(st));
    int code = WEXITSTATUS(st);
    CHECK(code != 124);
    CHECK_THAT(read_all(err), !Catch::Contains("internal error") && !Catch::Contains("bad_alloc"));
    if (std::string(cmd).rfind("verify", 0) == 0) {
      CHECK(code == 1);
      CHECK_THAT(read_all(out), Catch::Contains("it is a FIFO, not a regular file") &&
                                    Catch::Contains("68719476736 bytes, more than"));
    } else {
      CHECK(code == 0);
    }
  }
}
#endif
