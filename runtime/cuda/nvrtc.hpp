// NVRTC: compile generated CUDA source to CUBIN for an exact arch (PTX only when this NVRTC does not
// know the device's arch). Templates are passed as in-memory headers; no include path is used.
#pragma once
#include <map>
#include <string>
#include <vector>

namespace jitfuse::cuda {

struct NvrtcTarget {
  std::string arch;   // "sm_90a"
  bool ptx = false;   // true: emit PTX for compute_XY (this NVRTC is older than the device)
  std::vector<std::string> options() const;
};

// Picks CUBIN for `arch` if this NVRTC supports it, else PTX of the newest arch it supports.
NvrtcTarget target_for(const std::string& arch);
std::string nvrtc_version();                 // "13.0"
std::vector<std::string> supported_archs();  // "sm_75", ...

struct CompileOutput {
  std::string binary;  // CUBIN or PTX
  std::string log;
  double ms = 0;
};

// Throws Error(compile_error) with the compiler log kept apart from the message.
CompileOutput compile(const std::string& source, const std::string& name,
                      const std::map<std::string, std::string>& headers, const std::vector<std::string>& options);

}  // namespace jitfuse::cuda
