// The compile check behind `rules validate`: a user op's functor in a one-kernel harness that calls fwd
// and bwd as the generated kernels do, compiled by NVRTC on the CPU, errors mapped back to the template.
#include "rules/template_check.hpp"

#include <map>
#include <sstream>

#include <fmt/format.h>

#include "common/embedded.hpp"
#include "common/error.hpp"
#include "cuda/nvrtc.hpp"

namespace jitfuse::rules {
namespace {

// The calls mirror codegen's unary stages: F::fwd(x, c...) and F::bwd(saved, dy, c...), all floats.
std::string harness_source(const ops::OpKind& k) {
  std::string params, consts;
  for (size_t i = 0; i < k.const_attrs.size(); ++i) {
    params += fmt::format(", float c{}", i);
    consts += fmt::format(", c{}", i);
  }
  return fmt::format(
      "#include \"skeletons/common.cuh\"\n"
      "#include \"{0}\"\n"
      "extern \"C\" __global__ void jf_validate_{1}(float* __restrict__ y, const float* __restrict__ x{2}) {{\n"
      "  const float v = x[threadIdx.x];\n"
      "  const float f = {3}::fwd(v{4});\n"
      "  const float g = {3}::bwd(v, 1.0f{4});\n"
      "  y[threadIdx.x] = f + g;\n"
      "}}\n",
      k.template_file, k.name, params, k.functor, consts);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

std::string printable(const std::string& s, size_t max = 160) {
  std::string out;
  for (size_t i = 0; i < s.size() && i < max; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    out += c == '\t' ? ' ' : (c >= 0x20 && c < 0x7f) ? static_cast<char>(c) : '?';
  }
  return out;
}

}  // namespace

std::string map_template_log(const std::string& log, const std::string& key, const std::string& path,
                             const std::string& template_text) {
  std::vector<std::string> tpl = lines_of(template_text);
  std::string out;
  std::string prefix = key + "(";
  for (const std::string& line : lines_of(log)) {
    size_t at = line.find(prefix);
    size_t close = at == std::string::npos ? std::string::npos : line.find(')', at + prefix.size());
    if (at != std::string::npos && close != std::string::npos) {
      std::string num = line.substr(at + prefix.size(), close - at - prefix.size());
      bool digits = !num.empty() && num.size() < 9 && num.find_first_not_of("0123456789") == std::string::npos;
      if (digits) {
        size_t n = std::stoul(num);
        out += printable(line.substr(0, at) + path + ":" + num + line.substr(close + 1), 400) + "\n";
        if (n >= 1 && n <= tpl.size()) out += fmt::format("    {} | {}\n", n, printable(tpl[n - 1]));
        continue;
      }
    }
    out += printable(line, 400) + "\n";
  }
  return out;
}

std::vector<LoadError> compile_user_ops(const RuleSet& rs, const std::string& arch,
                                        const std::function<bool(const std::string& file)>& selected) {
  std::map<std::string, std::string> headers;
  for (const auto& f : embedded::templates) headers[std::string(f.path)] = std::string(f.content);
  for (const auto& [key, text] : rs.user_templates()) headers[key] = text;
  std::vector<std::string> options = cuda::target_for(arch).options();
  std::vector<LoadError> errs;
  for (const auto& name : rs.registry().names()) {
    const ops::OpKind* k = rs.registry().find(name);
    if (!k || !k->user_declared) continue;
    std::string file = k->declared_in.substr(0, k->declared_in.rfind(':', k->declared_in.rfind(':') - 1));
    if (selected && !selected(file)) continue;
    try {
      cuda::compile(harness_source(*k), "jf_validate_" + k->name + ".cu", headers, options);
    } catch (const Error& e) {
      if (e.status() != Status::compile_error) throw;
      // The log follows "Compiler log:\n" in the message (cuda/nvrtc.cpp keeps it apart from the summary).
      std::string what = e.what();
      size_t log_at = what.find("Compiler log:\n");
      std::string log = log_at == std::string::npos ? what : what.substr(log_at + 14);
      auto tpl = rs.user_templates().find(k->template_file);
      std::string mapped = map_template_log(log, k->template_file, k->template_path.empty() ? k->template_file
                                                                                          : k->template_path,
                                            tpl == rs.user_templates().end() ? "" : tpl->second);
      while (!mapped.empty() && mapped.back() == '\n') mapped.pop_back();
      errs.push_back({k->declared_in, "",
                      fmt::format("op '{}': functor {} does not compile with NVRTC (it must define static __device__ "
                                  "float fwd(float x{}) and bwd(float x, float dy{})):\n{}",
                                  k->name, k->functor, k->const_attrs.empty() ? "" : ", float constants...",
                                  k->const_attrs.empty() ? "" : ", float constants...", mapped)});
    }
  }
  return errs;
}

}  // namespace jitfuse::rules
