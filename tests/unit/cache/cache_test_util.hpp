// Shared fixtures for the cache tests: temp directories, sample requests, a fake compiler that
// counts and times its calls, and a capture of the jitfuse logger's warnings.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <spdlog/sinks/ostream_sink.h>

#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace jitfuse::cache::test {

// A fresh mkdtemp directory (mode 0700), removed with everything in it at scope exit.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/jf-cache-test-XXXXXX";
    if (!::mkdtemp(tmpl)) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    // Tests chmod things read-only; give write permission back so removal works for non-root.
    for (auto it = std::filesystem::recursive_directory_iterator(path, ec);
         !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec))
      if (it->is_directory(ec)) ::chmod(it->path().c_str(), 0700);
    ::chmod(path.c_str(), 0700);
    std::filesystem::remove_all(path, ec);
  }
  std::string sub(const std::string& name) const { return path + "/" + name; }
};

inline KernelRequest make_request(int i) {
  KernelRequest r;
  r.source = "extern \"C\" __global__ void k" + std::to_string(i) + "(float* y, const float* x) { y[0] = x[0] * " +
             std::to_string(i) + "; }\n";
  r.options = {"--std=c++17", "-default-device", "--gpu-architecture=sm_90a"};
  r.arch = "sm_90a";
  r.nvrtc_version = "13.0";
  r.meta = {{"rule", "bias_gelu_" + std::to_string(i)},
            {"ops", {"bias", "gelu"}},
            {"recipe", "bf16"},
            {"dtypes", {{"in", "bf16"}, {"out", "bf16"}}},
            {"shape", {8192, 4096 + i}}};
  return r;
}

inline std::string expected_cubin(const KernelRequest& r, size_t pad = 0) {
  // Binary-looking bytes (NUL, 0xff) so the format is exercised as binary, not text.
  return std::string("\x7f" "ELF\0\xff", 6) + r.source + std::string(pad, '\xab');
}

// Counts calls, the peak number running at once, and can sleep to widen race windows.
struct FakeCompiler {
  std::atomic<int> calls{0};
  std::atomic<int> active{0};
  std::atomic<int> max_active{0};
  int sleep_ms = 0;
  size_t pad = 0;
  bool fail = false;

  CompileFn fn() {
    return [this](const KernelRequest& r) {
      int now = ++active;
      for (int m = max_active; now > m && !max_active.compare_exchange_weak(m, now);) {
      }
      ++calls;
      if (sleep_ms) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms));
      --active;
      if (fail || r.source.find("#error") != std::string::npos)
        throw Error(Status::compile_error, "fake compile error in " + r.source.substr(0, 40));
      return CompileResult{expected_cubin(r, pad), "", 12.5};
    };
  }
};

// Adds a sink to jitfuse::log() for the scope; warnings() lists the warning messages seen.
class LogCapture {
 public:
  LogCapture() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(os_)) {
    sink_->set_pattern("%L|%v");
    old_level_ = log().level();
    if (old_level_ > spdlog::level::warn) log().set_level(spdlog::level::warn);
    log().sinks().push_back(sink_);
  }
  ~LogCapture() {
    auto& s = log().sinks();
    s.erase(std::remove(s.begin(), s.end(), sink_), s.end());
    log().set_level(old_level_);
  }
  std::vector<std::string> warnings() {
    std::vector<std::string> out;
    std::istringstream in(os_.str());
    for (std::string line; std::getline(in, line);)
      if (line.rfind("W|", 0) == 0) out.push_back(line.substr(2));
    return out;
  }

 private:
  std::ostringstream os_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
  spdlog::level::level_enum old_level_;
};

inline std::string read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

inline void write_all(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

// Sets an mtime `age_s` seconds in the past (LRU order without sleeping).
inline void age_file(const std::string& path, int age_s) {
  struct timespec ts[2];
  ::clock_gettime(CLOCK_REALTIME, &ts[0]);
  ts[0].tv_sec -= age_s;
  ts[1] = ts[0];
  ::utimensat(AT_FDCWD, path.c_str(), ts, 0);
}

}  // namespace jitfuse::cache::test
