// Many processes, one empty cache directory, the same kernels: each key must be compiled exactly
// once across all of them, every entry must verify, and every process must succeed.
#include <catch2/catch.hpp>

#include <signal.h>
#include <sys/wait.h>

#include <map>

#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

namespace {

// Runs in a forked child; returns its exit code (0: every result correct).
int child_main(int start_fd, const std::string& dir, const std::string& log_path,
               const std::vector<KernelRequest>& reqs) {
  char c;
  while (::read(start_fd, &c, 1) > 0) {
  }  // EOF once the parent has forked everyone: all start together
  try {
    KernelCache cache(Config{dir});
    if (!cache.disk_enabled()) return 3;
    CompileFn compile = [&](const KernelRequest& r) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      std::string line = std::to_string(::getpid()) + " " + cache_key(r) + "\n";
      int fd = ::open(log_path.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0600);
      if (fd < 0 || ::write(fd, line.data(), line.size()) != ssize_t(line.size())) return CompileResult{};
      ::close(fd);
      return CompileResult{expected_cubin(r), "", 50};
    };
    auto out = cache.get_or_compile_all(reqs, compile, 3);
    for (size_t i = 0; i < reqs.size(); ++i)
      if (!out[i] || out[i]->cubin != expected_cubin(reqs[i]) || out[i]->source != reqs[i].source) return 4;
    return 0;
  } catch (...) {
    return 5;
  }
}

}  // namespace

TEST_CASE("stress: 8 processes share one cache directory", "[cache][stress]") {
  TempDir tmp;
  const std::string dir = tmp.sub("cache");
  const std::string log_path = tmp.sub("compile.log");
  std::vector<KernelRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(make_request(100 + i));
  // Different orders per process would also work; the same order maximises contention.

  int start[2];
  REQUIRE(::pipe(start) == 0);
  std::vector<pid_t> pids;
  for (int p = 0; p < 8; ++p) {
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::close(start[1]);
      ::_exit(child_main(start[0], dir, log_path, reqs));
    }
    pids.push_back(pid);
  }
  ::close(start[0]);
  ::close(start[1]);  // go

  // Reap with a deadline so a deadlock fails the test instead of hanging it.
  auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  std::map<pid_t, int> status;
  while (status.size() < pids.size() && std::chrono::steady_clock::now() < deadline) {
    for (pid_t pid : pids) {
      int st = 0;
      if (!status.count(pid) && ::waitpid(pid, &st, WNOHANG) == pid) status[pid] = st;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  for (pid_t pid : pids)
    if (!status.count(pid)) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  REQUIRE(status.size() == pids.size());
  for (auto& [pid, st] : status) {
    INFO("child " << pid);
    CHECK(WIFEXITED(st));
    CHECK(WEXITSTATUS(st) == 0);
  }

  std::map<std::string, int> compiles;
  std::istringstream log(read_all(log_path));
  for (std::string pid, key; log >> pid >> key;) ++compiles[key];
  CHECK(compiles.size() == reqs.size());
  for (auto& r : reqs) {
    INFO("key " << cache_key(r));
    CHECK(compiles[cache_key(r)] == 1);
  }

  auto infos = list_entries(dir);
  CHECK(infos.size() == reqs.size());
  for (auto& i : infos) {
    INFO(i.path);
    CHECK(i.problem.empty());
  }
  CHECK(quarantined_count(dir) == 0);
}
