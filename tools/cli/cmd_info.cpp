// `jitfuse version` and `jitfuse doctor`: what this build is and whether this machine can run it (and build
// AOTInductor packages that load: the C++ compiler line).
#include <unistd.h>

#include <cstdio>
#include <filesystem>

#include <nlohmann/json.hpp>

#include "cache/kernel_cache.hpp"
#include "commands.hpp"
#include "common/error.hpp"
#include "cuda/cublaslt.hpp"
#include "cuda/driver.hpp"
#include "cuda/nvrtc.hpp"
#include "jitfuse/jitfuse.h"
#include "rules/rule.hpp"
#include "toolchain.hpp"

namespace jitfuse::cli {
namespace {

nlohmann::json doctor_report() {
  nlohmann::json r;
  r["jitfuse"] = JITFUSE_VERSION_STRING;
  r["abi"] = JF_ABI_VERSION;
  r["nvrtc"] = cuda::nvrtc_version();
  r["cublaslt"] = cuda::Blas::version();
  std::string why;
  if (cuda::try_driver(&why)) {
    int v = cuda::driver_version();
    r["driver"] = std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
    auto dev = cuda::current_device();
    r["gpu"] = {{"name", dev.name}, {"arch", dev.arch()}, {"sms", dev.sm_count}};
  } else {
    r["driver"] = nullptr;
    r["gpu"] = nullptr;
    r["gpu_absent_reason"] = why;
  }
  auto rs = rules::RuleSet::with_builtins();
  r["rules_builtin"] = rs.rules().size();
  auto cfg = cache::config_from_env();
  if (cfg.dir) {
    std::error_code ec;
    std::filesystem::path dir = *cfg.dir;
    std::filesystem::path probe = dir;
    while (!probe.empty() && !std::filesystem::exists(probe, ec)) probe = probe.parent_path();
    r["cache"] = {{"dir", *cfg.dir}, {"exists", std::filesystem::exists(dir, ec)},
                  {"writable", !probe.empty() && access(probe.c_str(), W_OK) == 0},
                  {"max_bytes", cfg.max_bytes}};
  } else {
    r["cache"] = {{"dir", nullptr}, {"writable", false}};
  }
  const auto cxx = check_inductor_cxx();
  r["cxx"] = {{"compiler", cxx.compiler}, {"from_env", cxx.from_env},
              {"libstdcxx", cxx.libstdcxx.empty() ? nlohmann::json() : nlohmann::json(cxx.libstdcxx)},
              {"linker_script", cxx.linker_script}, {"static_parts", cxx.static_parts},
              {"links_libstdcxx_statically", !cxx.static_parts.empty()}};
  return r;
}

// The compiler line: only informative (jitfuse itself needs no C++ compiler at run time), never a failure.
void print_cxx(const nlohmann::json& c) {
  const auto compiler = c["compiler"].get<std::string>();
  const char* from = c["from_env"].get<bool>() ? "$CXX" : "$CXX unset: Inductor's default";
  if (c["libstdcxx"].is_null()) {
    std::printf("C++       %s (%s): not found or no libstdc++.so of its own (AOTInductor packages need a C++ "
                "compiler: set CXX)\n", compiler.c_str(), from);
  } else if (c["links_libstdcxx_statically"].get<bool>()) {
    std::string parts;
    for (const auto& p : c["static_parts"]) parts += (parts.empty() ? "" : ", ") + p.get<std::string>();
    const auto lib = c["libstdcxx"].get<std::string>();
    const bool archive = lib.size() > 2 && lib.compare(lib.size() - 2, 2, ".a") == 0;
    const std::string what = archive ? "links libstdc++ statically (no libstdc++.so; its linker takes " + lib + ")"
                                     : "links part of libstdc++ statically (" + lib + " is a linker script adding " +
                                           parts + ")";
    std::printf("C++       %s (%s): WARNING: %s; AOTInductor packages it builds crash when loaded: set CXX to a GCC "
                "whose libstdc++.so is the shared library, e.g. CXX=/usr/bin/g++ (docs/deploy.md)\n",
                compiler.c_str(), from, what.c_str());
  } else {
    std::printf("C++       %s (%s): links libstdc++ shared (%s), fine for AOTInductor packages\n", compiler.c_str(),
                from, c["libstdcxx"].get<std::string>().c_str());
  }
}

}  // namespace

void add_info_commands(CLI::App& app) {
  auto* version = app.add_subcommand("version", "Print the jitfuse, ABI, NVRTC and cuBLASLt versions");
  version->callback([] {
    std::printf("jitfuse %s (C ABI %d), NVRTC %s, cuBLASLt %s\n", JITFUSE_VERSION_STRING, JF_ABI_VERSION,
                cuda::nvrtc_version().c_str(), cuda::Blas::version().c_str());
  });
  auto* doctor = app.add_subcommand("doctor", "Check driver, NVRTC, cuBLASLt, GPU, rules, the cache directory and the C++ compiler");
  auto json = std::make_shared<bool>(false);
  doctor->add_flag("--json", *json, "Machine-readable output");
  doctor->callback([json] {
    auto r = doctor_report();
    if (*json) {
      std::printf("%s\n", r.dump(2).c_str());
      return;
    }
    std::printf("jitfuse   %s (C ABI %d)\n", r["jitfuse"].get<std::string>().c_str(), JF_ABI_VERSION);
    std::printf("NVRTC     %s\n", r["nvrtc"].get<std::string>().c_str());
    std::printf("cuBLASLt  %s\n", r["cublaslt"].get<std::string>().c_str());
    if (r["gpu"].is_null()) {
      std::printf("driver    none\n");
      std::printf("GPU       no GPU present: %s\n", r["gpu_absent_reason"].get<std::string>().c_str());
      std::printf("          (planning, codegen, NVRTC compilation and warmup --arch still work)\n");
    } else {
      std::printf("driver    CUDA %s\n", r["driver"].get<std::string>().c_str());
      std::printf("GPU       %s, %s, %d SMs\n", r["gpu"]["name"].get<std::string>().c_str(),
                  r["gpu"]["arch"].get<std::string>().c_str(), r["gpu"]["sms"].get<int>());
    }
    std::printf("rules     %zu built-in rules loaded\n", r["rules_builtin"].get<size_t>());
    if (r["cache"]["dir"].is_null())
      std::printf("cache     no directory (set JITFUSE_CACHE_DIR or HOME): memory only\n");
    else
      std::printf("cache     %s (%s)\n", r["cache"]["dir"].get<std::string>().c_str(),
                  r["cache"]["writable"].get<bool>() ? "writable" : "NOT writable: kernels stay in memory");
    print_cxx(r["cxx"]);
  });
}

}  // namespace jitfuse::cli
