// Faults: damaged entries are quarantined and recompiled with one warning; unusable or unsafe
// directories fall back to memory only with one warning; a dead lock holder does not block anyone.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>

#include <future>

#include "cache/disk_io.hpp"
#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

// Compiles request 1 into `dir`, damages its file with `damage`, then checks that a fresh cache
// quarantines it, recompiles, warns once with `why`, and leaves a good entry behind.
void check_recovers(const std::function<void(std::string&)>& damage, const std::string& why) {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto req = make_request(1);
  FakeCompiler fc;
  {
    KernelCache c(Config{dir});
    c.get_or_compile(req, fc.fn());
  }
  const std::string path = entry_path(dir, cache_key(req));
  std::string bytes = read_all(path);
  damage(bytes);
  write_all(path, bytes);
  ::chmod(path.c_str(), 0600);

  LogCapture cap;
  KernelCache c(Config{dir});
  Origin o{};
  auto e = c.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::compiled);
  CHECK(fc.calls == 2);
  CHECK(e->cubin == expected_cubin(req));
  auto w = cap.warnings();
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::Contains(why) && Catch::Contains("quarantine") && Catch::Contains(path));
  CHECK(quarantined_count(dir) == 1);
  auto infos = list_entries(dir);
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].problem.empty());
  CHECK(c.disk_enabled());

  KernelCache again(Config{dir});
  again.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::disk);
  CHECK(fc.calls == 2);
}

}  // namespace

TEST_CASE("truncated entry is quarantined and recompiled", "[cache][faults]") {
  check_recovers([](std::string& b) { b.resize(b.size() / 2); }, "truncated");
  check_recovers([](std::string& b) { b.clear(); }, "bad magic");
}

TEST_CASE("flipped byte is quarantined and recompiled", "[cache][faults]") {
  check_recovers([](std::string& b) { b[b.size() - 40] ^= 0x01; }, "checksum mismatch");
}

TEST_CASE("wrong format version is quarantined and recompiled", "[cache][faults]") {
  check_recovers([](std::string& b) { b[8] = 9; }, "format version 9");
}

TEST_CASE("bad magic is quarantined and recompiled", "[cache][faults]") {
  check_recovers([](std::string& b) { b.replace(0, 8, "NOTJFKAA"); }, "bad magic");
}

TEST_CASE("entry holding another key is not loaded", "[cache][faults]") {
  check_recovers(
      [](std::string& b) {
        Entry e = parse_entry(b, "x");
        e.key = std::string(64, 'a');
        b = serialize_entry(e);
      },
      "holds key aaaa");
}

TEST_CASE("unwritable directory: memory only, one warning", "[cache][faults]") {
  TempDir tmp;
  FakeCompiler fc;
  SECTION("a path under a regular file (works even as root)") {
    write_all(tmp.sub("file"), "x");
    LogCapture cap;
    KernelCache c(Config{tmp.sub("file/cache")});
    CHECK_FALSE(c.disk_enabled());
    for (int i = 0; i < 3; ++i) CHECK(c.get_or_compile(make_request(i), fc.fn())->cubin == expected_cubin(make_request(i)));
    CHECK(c.get_or_compile(make_request(0), fc.fn()) != nullptr);
    CHECK(fc.calls == 3);
    auto w = cap.warnings();
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0], Catch::Contains("memory only") && Catch::Contains(tmp.sub("file")));
  }
  SECTION("a read-only directory") {
    if (::geteuid() == 0) {
      WARN("running as root: chmod cannot make a directory unwritable for root; checked via the other sections");
      return;
    }
    const std::string dir = tmp.sub("ro");
    { KernelCache c(Config{dir}); }  // create the layout, then take write permission away
    ::chmod((dir + "/v" + std::to_string(kFormatVersion)).c_str(), 0500);
    LogCapture cap;
    KernelCache c(Config{dir});
    CHECK_FALSE(c.disk_enabled());
    for (int i = 0; i < 3; ++i) c.get_or_compile(make_request(i), fc.fn());
    CHECK(fc.calls == 3);
    REQUIRE(cap.warnings().size() == 1);
    CHECK_THAT(cap.warnings()[0], Catch::Contains("memory only"));
  }
  SECTION("writes start failing after startup") {
    // A regular file where a shard directory should go makes the write fail mid-run, as a full
    // or read-only filesystem would; the cache must switch to memory only, warning once.
    const std::string dir = tmp.sub("late");
    KernelCache c(Config{dir});
    REQUIRE(c.disk_enabled());
    LogCapture cap;
    for (int i = 0; i < 4; ++i)
      write_all(io::Layout{dir}.shard_dir(cache_key(make_request(i))), "not a dir");
    for (int i = 0; i < 4; ++i) {
      Origin o{};
      CHECK(c.get_or_compile(make_request(i), fc.fn(), &o)->cubin == expected_cubin(make_request(i)));
      CHECK(o == Origin::compiled);
    }
    CHECK_FALSE(c.disk_enabled());
    auto w = cap.warnings();
    REQUIRE(w.size() == 1);
    CHECK_THAT(w[0], Catch::Contains("disabled") && Catch::Contains("memory only"));
    CHECK(c.get_or_compile(make_request(2), fc.fn()) != nullptr);
    CHECK(fc.calls == 4);
  }
}

TEST_CASE("a directory writable by others is not used", "[cache][faults]") {
  TempDir tmp;
  const std::string dir = tmp.sub("open");
  std::filesystem::create_directory(dir);
  ::chmod(dir.c_str(), 0777);
  FakeCompiler fc;
  LogCapture cap;
  KernelCache c(Config{dir});
  CHECK_FALSE(c.disk_enabled());
  c.get_or_compile(make_request(1), fc.fn());
  c.get_or_compile(make_request(2), fc.fn());
  CHECK(fc.calls == 2);
  auto w = cap.warnings();
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::Contains("writable by group or others") && Catch::Contains("0777") &&
                       Catch::Contains("a poisoned entry would run foreign code on the GPU"));
  CHECK_FALSE(std::filesystem::exists(dir + "/v" + std::to_string(kFormatVersion)));  // nothing written into it
  CHECK_FALSE(dir_problem(dir).empty());

  ::chmod(dir.c_str(), 0775);  // group-writable is just as bad
  CHECK_THAT(dir_problem(dir), Catch::Contains("writable by group"));
  ::chmod(dir.c_str(), 0755);
  CHECK(dir_problem(dir).empty());
}

TEST_CASE("a directory owned by another user is not used", "[cache][faults]") {
  TempDir tmp;
  std::string dir;
  if (::geteuid() == 0) {
    dir = tmp.sub("theirs");
    std::filesystem::create_directory(dir);
    ::chmod(dir.c_str(), 0700);
    REQUIRE(::chown(dir.c_str(), 65534, 65534) == 0);
  } else {
    dir = "/";  // owned by root, and we are not root
  }
  FakeCompiler fc;
  LogCapture cap;
  KernelCache c(Config{dir});
  CHECK_FALSE(c.disk_enabled());
  c.get_or_compile(make_request(1), fc.fn());
  auto w = cap.warnings();
  REQUIRE(w.size() == 1);
  CHECK_THAT(w[0], Catch::Contains("owned by uid") && Catch::Contains("poisoned entry"));
}

TEST_CASE("an entry file writable by others is not loaded", "[cache][faults]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  auto req = make_request(1);
  { KernelCache(Config{dir}).get_or_compile(req, fc.fn()); }
  ::chmod(entry_path(dir, cache_key(req)).c_str(), 0666);
  LogCapture cap;
  KernelCache c(Config{dir});
  Origin o{};
  c.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::compiled);
  REQUIRE(cap.warnings().size() == 1);
  CHECK_THAT(cap.warnings()[0], Catch::Contains("0666"));
  CHECK(quarantined_count(dir) == 1);
}

TEST_CASE("a dead lock holder does not block the key", "[cache][faults]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto req = make_request(3);
  const std::string key = cache_key(req);
  io::Layout layout{dir};
  io::make_dirs(layout.locks_dir(), 0700);

  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    // The "compiler" process: take the key lock, say so, then hang until killed.
    auto lock = io::FileLock::acquire(layout.lock_path(key), 5);
    char c = lock.held() ? 'y' : 'n';
    [[maybe_unused]] auto n = ::write(ready[1], &c, 1);
    for (;;) ::pause();
  }
  ::close(ready[1]);
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);
  REQUIRE(c == 'y');
  CHECK_FALSE(io::FileLock::try_acquire(layout.lock_path(key)).held());

  FakeCompiler fc;
  KernelCache cache(Config{dir});
  Origin o{};
  auto fut = std::async(std::launch::async, [&] { return cache.get_or_compile(req, fc.fn(), &o); });
  CHECK(fut.wait_for(std::chrono::milliseconds(300)) == std::future_status::timeout);  // waiting on the lock
  CHECK(fc.calls == 0);

  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFSIGNALED(status));
  REQUIRE(fut.wait_for(std::chrono::seconds(10)) == std::future_status::ready);
  CHECK(fut.get()->cubin == expected_cubin(req));
  CHECK(o == Origin::compiled);
  CHECK(fc.calls == 1);
  CHECK(io::FileLock::try_acquire(layout.lock_path(key)).held());
}

TEST_CASE("a process waiting on the lock loads what the holder published", "[cache][faults]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto req = make_request(4);
  { KernelCache warm(Config{dir}); }  // create the layout before forking

  int compiling[2];
  REQUIRE(::pipe(compiling) == 0);
  pid_t child = ::fork();
  REQUIRE(child >= 0);
  if (child == 0) {
    int rc = 1;
    try {
      KernelCache c(Config{dir});
      c.get_or_compile(req, [&](const KernelRequest& r) {
        char x = 'c';
        [[maybe_unused]] auto n = ::write(compiling[1], &x, 1);  // we hold the lock now
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        return CompileResult{expected_cubin(r), "", 300};
      });
      rc = 0;
    } catch (...) {
    }
    ::_exit(rc);
  }
  ::close(compiling[1]);
  char x = 0;
  REQUIRE(::read(compiling[0], &x, 1) == 1);
  ::close(compiling[0]);

  FakeCompiler fc;
  KernelCache c(Config{dir});
  Origin o{};
  auto e = c.get_or_compile(req, fc.fn(), &o);
  int status = 0;
  ::waitpid(child, &status, 0);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(o == Origin::disk);
  CHECK(fc.calls == 0);
  CHECK(e->cubin == expected_cubin(req));
  CHECK(c.stats().misses == 1);
  CHECK(c.stats().disk_hits == 1);
}
