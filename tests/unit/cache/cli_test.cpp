// Runs the built `jitfuse` binary (JF_CLI_PATH) against a temp cache populated through KernelCache:
// listings, JSON forms, show/verify/stats/prune/clear, and the exit codes scripts rely on.
#include <catch2/catch.hpp>

#include <sys/wait.h>

#include <set>

#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

#ifdef JF_CLI_PATH

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

struct Run {
  int code = -1;
  std::string out, err;
};

// `env` is a prefix of shell assignments, e.g. "JITFUSE_CACHE_DIR=/x".
Run run_cli(const TempDir& tmp, const std::string& args, const std::string& env = "") {
  const std::string out = tmp.sub("cli.out"), err = tmp.sub("cli.err");
  std::string cmd = fmt::format("{} '{}' {} >'{}' 2>'{}'", env, JF_CLI_PATH, args, out, err);
  int st = std::system(cmd.c_str());
  Run r;
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  r.out = read_all(out);
  r.err = read_all(err);
  return r;
}

// Three entries with known metadata, plus one disk hit on entry 0.
std::vector<std::string> populate(const std::string& dir) {
  FakeCompiler fc;
  std::vector<std::string> keys;
  {
    KernelCache c(Config{dir});
    for (int i = 0; i < 3; ++i) keys.push_back(c.get_or_compile(make_request(i), fc.fn())->key);
  }
  KernelCache again(Config{dir});
  again.get_or_compile(make_request(0), fc.fn());
  return keys;
}

}  // namespace

TEST_CASE("cli: cache ls, text and json", "[cache][cli]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto keys = populate(dir);
  const std::string env = "JITFUSE_CACHE_DIR='" + dir + "'";

  Run r = run_cli(tmp, "cache ls", env);
  INFO(r.err);
  REQUIRE(r.code == 0);
  for (int i = 0; i < 3; ++i) {
    CHECK_THAT(r.out, Catch::Contains(keys[i].substr(0, 12)));
    CHECK_THAT(r.out, Catch::Contains("bias_gelu_" + std::to_string(i)));
    CHECK_THAT(r.out, Catch::Contains("8192x" + std::to_string(4096 + i)));
  }
  CHECK_THAT(r.out, Catch::Contains("KEY") && Catch::Contains("LAST USED") && Catch::Contains("bias+gelu") &&
                        Catch::Contains("sm_90a") && Catch::Contains("bf16") && Catch::Contains("12 ms"));
  CHECK_THAT(r.out, !Catch::Contains(keys[0].substr(0, 13)));  // prefixes are 12 characters

  r = run_cli(tmp, "cache ls --json", env);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  REQUIRE(j.size() == 3);
  std::set<std::string> listed;
  for (auto& e : j) {
    listed.insert(e["key"].get<std::string>());
    CHECK(e["meta"]["arch"] == "sm_90a");
  }
  CHECK(listed == std::set<std::string>(keys.begin(), keys.end()));
  CHECK(j[0]["key"] == keys[0]);  // most recently used first: entry 0 just had a disk hit
  CHECK(j[0]["hits"] == 1);

  // --dir overrides the environment.
  r = run_cli(tmp, "cache ls --json --dir '" + dir + "'", "JITFUSE_CACHE_DIR=/nonexistent/jf");
  REQUIRE(r.code == 0);
  CHECK(nlohmann::json::parse(r.out).size() == 3);
  r = run_cli(tmp, "cache ls --json", "JITFUSE_CACHE_DIR=/nonexistent/jf");
  REQUIRE(r.code == 0);
  CHECK(nlohmann::json::parse(r.out).empty());
}

TEST_CASE("cli: cache show", "[cache][cli]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto keys = populate(dir);
  const std::string d = " --dir '" + dir + "'";

  Run r = run_cli(tmp, "cache show " + keys[1].substr(0, 10) + d);
  INFO(r.err);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains(keys[1]) && Catch::Contains("bias_gelu_1") && Catch::Contains("nvrtc_version") &&
                        Catch::Contains(entry_path(dir, keys[1])));

  r = run_cli(tmp, "cache show " + keys[1] + " --json" + d);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["key"] == keys[1]);
  CHECK(j["meta"]["rule"] == "bias_gelu_1");
  CHECK(j["cubin_bytes"] == expected_cubin(make_request(1)).size());
  // The fake CUBIN is no ELF file a reader can walk: said, nothing made up (real CUBINs: nvrtc tier,
  // [cubin_info]).
  CHECK(j["resources"]["kernels"].empty());
  CHECK(j["resources"]["error"] == "not a 64-bit little-endian ELF file");
  r = run_cli(tmp, "cache show " + keys[1] + d);
  CHECK_THAT(r.out, Catch::Contains("resources") && Catch::Contains("(not read: not a 64-bit little-endian ELF file)"));

  r = run_cli(tmp, "cache show " + keys[2] + " --source" + d);
  REQUIRE(r.code == 0);
  CHECK(r.out == make_request(2).source);

  r = run_cli(tmp, "cache show " + keys[2] + " --ptx" + d);
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("no PTX") && Catch::Contains("CUBIN"));

  r = run_cli(tmp, "cache show " + keys[2] + " --sass" + d, "PATH=/nonexistent");
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("cuobjdump"));

  // A stand-in cuobjdump checks what it is given: "-sass" and a file holding the CUBIN.
  std::filesystem::create_directory(tmp.sub("bin"));
  write_all(tmp.sub("bin/cuobjdump"),
            "#!/bin/sh\n[ \"$1\" = -sass ] || exit 9\ncmp -s \"$2\" \"$JF_EXPECT\" || exit 8\n"
            "echo \"FAKE SASS $2\"\n");
  ::chmod(tmp.sub("bin/cuobjdump").c_str(), 0755);
  write_all(tmp.sub("expected.cubin"), expected_cubin(make_request(2)));
  r = run_cli(tmp, "cache show " + keys[2] + " --sass" + d,
              "PATH='" + tmp.sub("bin") + ":/usr/bin:/bin' JF_EXPECT='" + tmp.sub("expected.cubin") + "'");
  CHECK(r.code == 0);
  REQUIRE_THAT(r.out, Catch::StartsWith("FAKE SASS ") && Catch::Contains(".cubin"));
  std::string temp = r.out.substr(10, r.out.find('\n') - 10);
  CHECK_FALSE(std::filesystem::exists(temp));  // the temp file is cleaned up
  r = run_cli(tmp, "cache show " + keys[1] + " --sass" + d,
              "PATH='" + tmp.sub("bin") + ":/usr/bin:/bin' JF_EXPECT='" + tmp.sub("expected.cubin") + "'");
  CHECK(r.code != 0);  // cuobjdump failed (wrong CUBIN): reported, not hidden
  CHECK_THAT(r.err, Catch::Contains("-sass failed"));

  r = run_cli(tmp, "cache show " + keys[2] + " --source --ptx" + d);
  CHECK(r.code != 0);

  std::string missing(64, '0');
  if (std::find(keys.begin(), keys.end(), missing) == keys.end()) {
    r = run_cli(tmp, "cache show " + missing + d);
    CHECK(r.code != 0);
    CHECK_THAT(r.err, Catch::Contains("no kernel cache entry matches"));
  }
  r = run_cli(tmp, "cache show not-hex" + d);
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("not a cache key"));
}

TEST_CASE("cli: cache stats and verify, including a damaged entry", "[cache][cli]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto keys = populate(dir);
  const std::string d = " --dir '" + dir + "'";

  Run r = run_cli(tmp, "cache stats --json" + d);
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  uint64_t bytes = 0;
  for (auto& e : list_entries(dir)) bytes += e.bytes;
  CHECK(j["entries"] == 3);
  CHECK(j["bytes"] == bytes);
  CHECK(j["hits"] == 1);
  CHECK(j["quarantined"] == 0);
  r = run_cli(tmp, "cache stats" + d);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("entries      3") && Catch::Contains("quarantined  0"));

  r = run_cli(tmp, "cache verify" + d);
  CHECK(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("checked 3 entries") && Catch::Contains("0 damaged"));

  // Flip one byte of entry 1's CUBIN.
  std::string path = entry_path(dir, keys[1]);
  std::string b = read_all(path);
  b[b.size() - 36] ^= 0x20;
  write_all(path, b);
  r = run_cli(tmp, "cache verify" + d);
  CHECK(r.code == 1);
  CHECK_THAT(r.out, Catch::Contains("DAMAGED") && Catch::Contains(keys[1].substr(0, 12)) &&
                        Catch::Contains("checksum mismatch") && Catch::Contains("1 damaged"));
  CHECK_THAT(r.out, !Catch::Contains("DAMAGED  " + keys[0].substr(0, 12)));
  r = run_cli(tmp, "cache verify --json" + d);
  CHECK(r.code == 1);
  j = nlohmann::json::parse(r.out);
  CHECK(j["checked"] == 3);
  REQUIRE(j["damaged"].size() == 1);
  CHECK(j["damaged"][0]["key"] == keys[1]);

  // Using it quarantines it; stats then counts it.
  {
    FakeCompiler fc;
    KernelCache c(Config{dir});
    c.get_or_compile(make_request(1), fc.fn());
    CHECK(fc.calls == 1);
  }
  r = run_cli(tmp, "cache stats --json" + d);
  CHECK(nlohmann::json::parse(r.out)["quarantined"] == 1);
  CHECK(run_cli(tmp, "cache verify" + d).code == 0);
}

TEST_CASE("cli: cache prune and clear", "[cache][cli]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  auto keys = populate(dir);
  for (int i = 0; i < 3; ++i) age_file(entry_path(dir, keys[i]), 1000 - 100 * i);  // 0 oldest, 2 newest
  // ...but entry 0 had a disk hit just now, so 1 is the least recently used.
  const std::string d = " --dir '" + dir + "'";
  uint64_t one = list_entries(dir)[0].bytes;

  Run r = run_cli(tmp, "cache prune --max-bytes " + std::to_string(2 * one + 50) + " --json" + d);
  INFO(r.err);
  REQUIRE(r.code == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j["entries"] == 2);
  CHECK(j["removed_bytes"].get<uint64_t>() > 0);
  CHECK_FALSE(std::filesystem::exists(entry_path(dir, keys[1])));
  CHECK(std::filesystem::exists(entry_path(dir, keys[0])));

  r = run_cli(tmp, "cache prune --max-bytes lots" + d);
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("--max-bytes"));
  CHECK(run_cli(tmp, "cache prune" + d).code != 0);  // --max-bytes is required

  r = run_cli(tmp, "cache clear" + d);
  REQUIRE(r.code == 0);
  CHECK_THAT(r.out, Catch::Contains("removed 2 entries"));
  CHECK(list_entries(dir).empty());
  r = run_cli(tmp, "cache clear --json" + d);
  CHECK(nlohmann::json::parse(r.out)["removed"] == 0);
}

TEST_CASE("cli: a bad JITFUSE_CACHE_MAX_BYTES is a clear error", "[cache][cli]") {
  TempDir tmp;
  Run r = run_cli(tmp, "cache stats", "JITFUSE_CACHE_DIR='" + tmp.sub("c") + "' JITFUSE_CACHE_MAX_BYTES=lots");
  CHECK(r.code != 0);
  CHECK_THAT(r.err, Catch::Contains("JITFUSE_CACHE_MAX_BYTES"));
}

#endif  // JF_CLI_PATH
