// `jitfuse doctor`'s compiler line: a devtoolset-style GCC (libstdc++.so a linker script adding
// libstdc++_nonshared.a) builds AOTInductor packages that crash when loaded; doctor names it before that happens.
#include "toolchain.hpp"

#include <unistd.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <regex>

#include "common/env.hpp"

namespace jitfuse::cli {
namespace {

// A compiler answers -print-file-name at once; `timeout` keeps a hanging wrapper script from hanging doctor.
constexpr const char* kTimeout = "/usr/bin/timeout";
constexpr size_t kMaxScriptBytes = 64 << 10;

std::string run_first_line(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
  if (::pclose(p) != 0) return {};
  auto end = out.find('\n');
  return out.substr(0, end);
}

std::string strip_comments(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 2, "/*") == 0) {
      auto e = text.find("*/", i + 2);
      i = e == std::string::npos ? text.size() : e + 2;
      out += ' ';
    } else {
      out += text[i++];
    }
  }
  return out;
}

}  // namespace

std::vector<std::string> linker_script_inputs(const std::string& text) {
  const std::string body = strip_comments(text);
  std::vector<std::string> names;
  static const std::regex command(R"(\b(INPUT|GROUP)\s*\()");
  for (auto it = std::sregex_iterator(body.begin(), body.end(), command); it != std::sregex_iterator(); ++it) {
    size_t i = static_cast<size_t>(it->position() + it->length());
    std::string tok;
    for (int depth = 1; i < body.size() && depth > 0; ++i) {  // AS_NEEDED ( ... ) nests
      const char c = body[i];
      depth += c == '(' ? 1 : c == ')' ? -1 : 0;
      if (c == '(' || c == ')' || c == ',' || std::isspace(static_cast<unsigned char>(c))) {
        if (!tok.empty() && tok != "AS_NEEDED") names.push_back(tok);
        tok.clear();
      } else {
        tok += c;
      }
    }
  }
  return names;
}

std::vector<std::string> static_libstdcxx_parts(const std::vector<std::string>& inputs) {
  std::vector<std::string> out;
  for (const auto& n : inputs) {
    const auto base = n.substr(n.find_last_of('/') == std::string::npos ? 0 : n.find_last_of('/') + 1);
    if ((n.size() > 2 && n.compare(n.size() - 2, 2, ".a") == 0) || base.find("nonshared") != std::string::npos)
      out.push_back(n);
  }
  return out;
}

std::string run_all(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (!p) return out;
  char buf[4096];
  size_t n = 0;
  while ((n = std::fread(buf, 1, sizeof buf, p)) > 0 && out.size() < (1u << 20)) out.append(buf, n);
  return ::pclose(p) == 0 ? out : std::string();
}

// The libstdc++.so (or, with none, the libstdc++.a) the compiler's linker opens linking an empty shared object
// (ld --verbose: "attempt to open /x/libstdc++.so succeeded" / "opened script file /x/libstdc++.so"): for a
// compiler that answers -print-file-name with the bare name although its specs or default -L paths find one,
// or that has no libstdc++.so at all (the GPU machine's /opt/gcc takes its libstdc++.a). As
// jitfuse/_toolchain.py's libstdcxx_linked.
std::string libstdcxx_linked(const std::string& prefix, const std::string& compiler) {
  char dir[] = "/tmp/jitfuse-cxx-XXXXXX";
  if (!::mkdtemp(dir)) return {};
  const std::string so = std::string(dir) + "/probe.so";
  const std::string out = run_all(prefix + compiler + " -shared -fPIC -x c++ /dev/null -o " + so +
                                  " -Wl,--verbose 2>&1");
  ::unlink(so.c_str());
  ::rmdir(dir);
  static const std::regex opened(
      R"((?:attempt to open (\S*/libstdc\+\+\.(?:so|a)) succeeded|opened script file (\S*/libstdc\+\+\.so)))");
  for (std::sregex_iterator it(out.begin(), out.end(), opened), end; it != end; ++it) {
    const std::string path = (*it)[1].matched ? (*it)[1].str() : (*it)[2].str();
    if (!path.empty() && path.front() == '/' && ::access(path.c_str(), R_OK) == 0) return path;
  }
  return {};
}

CxxCheck check_inductor_cxx() {
  CxxCheck c;
  auto env = env::get("CXX");
  c.from_env = env && env->find_first_not_of(" \t") != std::string::npos;
  c.compiler = c.from_env ? *env : "g++";
  try {
    const std::string prefix = ::access(kTimeout, X_OK) == 0 ? std::string(kTimeout) + " 10 " : "";
    std::string lib = run_first_line(prefix + c.compiler + " -print-file-name=libstdc++.so 2>/dev/null");
    // The bare name: none of its own on the printed search path; ask what its linker really opens.
    if (lib.empty() || lib.front() != '/' || ::access(lib.c_str(), R_OK) != 0)
      lib = libstdcxx_linked(prefix, c.compiler);
    if (lib.empty()) return c;  // no such compiler, or it links no libstdc++.so we can read
    std::ifstream f(lib, std::ios::binary);
    if (!f) return c;
    c.libstdcxx = lib;
    if (lib.size() > 2 && lib.compare(lib.size() - 2, 2, ".a") == 0) {  // no libstdc++.so: all of it static
      c.static_parts = {lib};
      return c;
    }
    std::string head(kMaxScriptBytes, '\0');
    f.read(head.data(), static_cast<std::streamsize>(head.size()));
    head.resize(static_cast<size_t>(f.gcount()));
    if (head.rfind("\x7f" "ELF", 0) == 0 || head.find('\0') != std::string::npos) return c;  // the shared object
    const auto inputs = linker_script_inputs(head);
    c.linker_script = !inputs.empty();
    c.static_parts = static_libstdcxx_parts(inputs);
  } catch (...) {  // doctor reports; it never fails because of this line
  }
  return c;
}

}  // namespace jitfuse::cli
