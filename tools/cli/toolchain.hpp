// The C++ compiler check of `jitfuse doctor`: does the compiler Inductor builds AOTInductor packages with link
// part of libstdc++ statically? (The same check as jitfuse/_toolchain.py; docs/deploy.md says why it matters.)
#pragma once
#include <string>
#include <vector>

namespace jitfuse::cli {

struct CxxCheck {
  std::string compiler;                   // $CXX, else g++ (what torch._inductor.config.cpp.cxx reads)
  bool from_env = false;                  // compiler came from $CXX
  std::string libstdcxx;                  // its -print-file-name=libstdc++.so, else what its linker opens;
                                          // empty: no such compiler or file
  bool linker_script = false;             // libstdcxx is a GNU ld script, not the shared object
  std::vector<std::string> static_parts;  // what that script links statically (archives, *nonshared*)
};

// The files and -l names of a GNU ld script's INPUT(...) / GROUP(...) commands (AS_NEEDED entries included).
std::vector<std::string> linker_script_inputs(const std::string& text);
// The entries of a linker script that link code statically: *.a, -l:*.a, and *nonshared* libraries.
std::vector<std::string> static_libstdcxx_parts(const std::vector<std::string>& inputs);
// Runs `$CXX -print-file-name=libstdc++.so` (through the shell, as make runs $(CXX)) and reads what it names;
// when that is the bare name, links an empty shared object with `-Wl,--verbose` and reads the libstdc++.so
// the linker opened. Never throws: what cannot be learnt stays empty.
CxxCheck check_inductor_cxx();

}  // namespace jitfuse::cli
