// RAII over nvrtcProgram and the compile call; the log is returned on success and attached on failure.
#include "cuda/nvrtc.hpp"

#include <nvrtc.h>

#include <algorithm>
#include <chrono>
#include <memory>

#include "common/error.hpp"

namespace jitfuse::cuda {
namespace {

void check_nvrtc(nvrtcResult r, const char* call) {
  if (r != NVRTC_SUCCESS) fail(Status::compile_error, "{} failed: {}", call, nvrtcGetErrorString(r));
}

struct Program {
  nvrtcProgram p = nullptr;
  ~Program() {
    if (p) nvrtcDestroyProgram(&p);
  }
};

int arch_num(const std::string& arch) {
  std::string digits;
  for (char c : arch)
    if (std::isdigit(static_cast<unsigned char>(c))) digits += c;
  return digits.empty() ? 0 : std::stoi(digits);
}

}  // namespace

std::vector<std::string> NvrtcTarget::options() const {
  std::string a = arch;
  if (ptx) a = "compute_" + arch.substr(3);
  // -minimal: no texture/surface functions, no device runtime (cudaMalloc, device-side launch), no CUDA
  // runtime/driver API types in the implicit preamble. The generated code and the templates use none of
  // them (common.cuh needs no CUDA header); it saves ~5 ms of front end per program and leaves the SASS
  // of every kernel of the transformer layer byte-identical (docs/cache.md, "Cold start").
  return {"--gpu-architecture=" + a, "-default-device", "-std=c++17", "--extra-device-vectorization", "-minimal"};
}

std::vector<std::string> supported_archs() {
  int n = 0;
  check_nvrtc(nvrtcGetNumSupportedArchs(&n), "nvrtcGetNumSupportedArchs");
  std::vector<int> archs(n);
  check_nvrtc(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs");
  std::vector<std::string> out;
  for (int a : archs) out.push_back("sm_" + std::to_string(a));
  return out;
}

NvrtcTarget target_for(const std::string& arch) {
  auto archs = supported_archs();
  int want = arch_num(arch);
  int newest = 0;
  for (auto& a : archs) newest = std::max(newest, arch_num(a));
  if (want <= newest) return {arch, false};
  return {"sm_" + std::to_string(newest), true};
}

std::string nvrtc_version() {
  int major = 0, minor = 0;
  check_nvrtc(nvrtcVersion(&major, &minor), "nvrtcVersion");
  return std::to_string(major) + "." + std::to_string(minor);
}

CompileOutput compile(const std::string& source, const std::string& name,
                      const std::map<std::string, std::string>& headers, const std::vector<std::string>& options) {
  auto t0 = std::chrono::steady_clock::now();
  std::vector<const char*> hdr_src, hdr_names;
  for (auto& [n, s] : headers) {
    hdr_names.push_back(n.c_str());
    hdr_src.push_back(s.c_str());
  }
  Program prog;
  check_nvrtc(nvrtcCreateProgram(&prog.p, source.c_str(), name.c_str(), static_cast<int>(hdr_src.size()),
                                 hdr_src.data(), hdr_names.data()),
              "nvrtcCreateProgram");
  std::vector<const char*> opts;
  for (auto& o : options) opts.push_back(o.c_str());
  nvrtcResult r = nvrtcCompileProgram(prog.p, static_cast<int>(opts.size()), opts.data());
  CompileOutput out;
  size_t log_size = 0;
  nvrtcGetProgramLogSize(prog.p, &log_size);
  if (log_size > 1) {
    out.log.resize(log_size);
    nvrtcGetProgramLog(prog.p, out.log.data());
    out.log.resize(log_size - 1);
  }
  if (r != NVRTC_SUCCESS)
    fail(Status::compile_error, "NVRTC could not compile '{}' ({}). Compiler log:\n{}", name, nvrtcGetErrorString(r),
         out.log);
  bool ptx = std::any_of(options.begin(), options.end(),
                         [](const std::string& o) { return o.find("=compute_") != std::string::npos; });
  size_t size = 0;
  if (ptx) {
    check_nvrtc(nvrtcGetPTXSize(prog.p, &size), "nvrtcGetPTXSize");
    out.binary.resize(size);
    check_nvrtc(nvrtcGetPTX(prog.p, out.binary.data()), "nvrtcGetPTX");
  } else {
    check_nvrtc(nvrtcGetCUBINSize(prog.p, &size), "nvrtcGetCUBINSize");
    out.binary.resize(size);
    check_nvrtc(nvrtcGetCUBIN(prog.p, out.binary.data()), "nvrtcGetCUBIN");
  }
  out.ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace jitfuse::cuda
