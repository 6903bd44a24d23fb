// Parsing user-declared pointwise ops (the "ops" array of a rules file): name, math, a template file beside
// the rules file that defines the device functor, number attributes (float constants) and what it saves.

#include <algorithm>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "common/error.hpp"
#include "common/file_read.hpp"
#include "rules/parse.hpp"

namespace jitfuse::rules::detail {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

bool ident_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_';
}

// The functor must be defined by the template, so look for it as a whole word, not as a substring.
bool contains_word(const std::string& text, const std::string& word) {
  for (size_t at = text.find(word); at != std::string::npos; at = text.find(word, at + 1)) {
    bool left = at == 0 || !ident_char(text[at - 1]);
    bool right = at + word.size() >= text.size() || !ident_char(text[at + word.size()]);
    if (left && right) return true;
  }
  return false;
}

// A relative path below the rules directory: no "..", not absolute, plain file-name characters.
std::string check_template_path(const std::string& tpl, const std::string& p) {
  if (tpl.empty() || tpl.size() > 256) invalid(p, "\"template\" must be a relative path of 1 to 256 characters");
  fs::path path(tpl);
  if (path.is_absolute() || tpl[0] == '/' || tpl[0] == '\\')
    invalid(p, fmt::format("template path {} is absolute; give it relative to the rules file's directory", show(tpl)));
  for (const auto& part : path) {
    if (part == "..")
      invalid(p, fmt::format("template path {} contains \"..\"; keep templates in the rules file's directory (or "
                             "below it)",
                             show(tpl)));
  }
  std::string base = path.filename().string();
  bool ok = !base.empty() && base[0] != '.' && std::all_of(base.begin(), base.end(), [](char c) {
    return ident_char(c) || c == '.' || c == '-';
  });
  if (!ok)
    invalid(p, fmt::format("template file name {} may only use letters, digits, '_', '-' and '.', and must not "
                           "start with '.'",
                           show(base)));
  return base;
}

// The template is code that will be compiled and run: it must be a regular file that really lies inside the
// rules file's directory (after resolving symlinks), and small. Opened without blocking (a FIFO or device
// must not hang the loader) and checked with fstat on the open descriptor, then read up to the cap.
std::string read_template(const std::string& dir, const std::string& tpl, const std::string& p, std::string& real_path) {
  if (dir.empty())
    invalid(p, "this rules text was loaded without a directory, so its template cannot be found; load the rules "
               "from a file or directory instead");
  std::error_code ec;
  fs::path root = fs::canonical(fs::path(dir), ec);
  if (ec) invalid(p, fmt::format("cannot resolve the rules directory {}: {}", show(dir), ec.message()));
  fs::path full = fs::path(dir) / tpl;
  fs::path real = fs::canonical(full, ec);
  if (ec)
    invalid(p, fmt::format("template {} not found (looked for {}); put it beside the rules file", show(tpl),
                           show(full.string())));
  auto rel = real.lexically_relative(root);
  if (rel.empty() || *rel.begin() == ".." || rel == ".")
    invalid(p, fmt::format("template {} resolves to {}, outside the rules directory {} (a symlink that leaves the "
                           "directory?); templates must lie inside the directory of the rules file that declares them",
                           show(tpl), show(real.string()), show(root.string())));
  // One bounded reader for every untrusted file (common/file_read.hpp): non-blocking open, fstat, cap.
  std::string text;
  try {
    std::string not_regular;
    auto f = files::RegularFile::open(real.string(), &not_regular);
    if (!f)
      invalid(p, fmt::format("template {} is not a regular file ({}); give a .cuh text file", show(real.string()),
                             not_regular.empty() ? "it vanished while loading" : not_regular));
    if (f->size() > kMaxTemplateBytes)
      invalid(p, fmt::format("template {} is {} bytes, more than the limit of {} bytes (256 KiB)",
                             show(real.string()), f->size(), kMaxTemplateBytes));
    text = f->read_all(kMaxTemplateBytes, "template");
  } catch (const jitfuse::Error& e) {
    invalid(p, e.what());
  }
  if (text.find('\0') != std::string::npos)
    invalid(p, fmt::format("template {} is not a text file (it contains NUL bytes)", show(real.string())));
  real_path = real.string();
  return text;
}

std::vector<ops::AttrSpec> parse_attrs(const json& op, const std::string& p) {
  std::vector<ops::AttrSpec> out;
  if (!op.contains("attrs")) return out;
  const json& a = op.at("attrs");
  std::string ap = p + "/attrs";
  if (!a.is_array() || a.size() > 8)
    invalid(ap, "\"attrs\" must be an array of at most 8 {\"name\", \"type\": \"number\", \"default\"} objects");
  for (size_t i = 0; i < a.size(); ++i) {
    std::string ip = ap + "/" + std::to_string(i);
    if (!a[i].is_object()) invalid(ip, "an attribute is {\"name\": \"beta\", \"type\": \"number\", \"default\": 1.0}");
    check_keys(a[i], ip, {"name", "type", "default", "comment"}, "attribute");
    ops::AttrSpec spec;
    spec.name = need_string(a[i], "name", ip, "an identifier such as \"beta\"");
    if (!is_identifier(spec.name) || spec.name == "op" || spec.name == "name" || spec.name == "comment")
      invalid(ip + "/name", fmt::format("attribute name {} must be an identifier other than op, name and comment",
                                        show(spec.name)));
    for (const auto& prev : out)
      if (prev.name == spec.name) invalid(ip + "/name", fmt::format("attribute {} is declared twice", show(spec.name)));
    std::string type = need_string(a[i], "type", ip, "\"number\"");
    if (type != "number")
      invalid(ip + "/type", fmt::format("attribute type {} is not supported: attributes of user-declared ops are "
                                        "numbers (passed to fwd/bwd as float constants)",
                                        show(type)));
    spec.type = ops::AttrSpec::Type::number;
    if (a[i].contains("default")) {
      const json& d = a[i].at("default");
      if (!d.is_number()) invalid(ip + "/default", fmt::format("\"default\" must be a number, got {}", show(d)));
      // The default becomes a float constant in the kernel: it must be one.
      if (std::string why = ops::float_range_problem(d.get<double>()); !why.empty())
        invalid(ip + "/default", fmt::format("\"default\" of attribute {} must be {}, got {}", show(spec.name), why,
                                             show(d)));
      spec.default_value = d.get<double>();
    }
    out.push_back(std::move(spec));
  }
  return out;
}

}  // namespace

DeclaredOp parse_op(const json& j, const std::string& p, const std::string& dir, const ops::Registry& reg) {
  if (!j.is_object())
    invalid(p, "an op declaration is an object with \"name\", \"math\", \"template\" and \"functor\"");
  check_keys(j, p, {"name", "math", "template", "functor", "attrs", "saves", "arity", "comment"}, "op declaration");
  DeclaredOp d;
  ops::OpKind& k = d.kind;
  k.name = need_string(j, "name", p, "an identifier such as \"softplus\"");
  if (!is_identifier(k.name, 48))
    invalid(p + "/name", fmt::format("op name {} must be an identifier ([A-Za-z_][A-Za-z0-9_]*, at most 48 "
                                     "characters)",
                                     show(k.name)));
  if (const ops::OpKind* prev = reg.find(k.name); prev && !prev->user_declared)
    invalid(p + "/name", fmt::format("op {} is built in and cannot be redeclared; pick another name", show(k.name)));
  k.math = need_math(j, p, "op");
  if (j.contains("arity")) {
    const json& a = j.at("arity");
    if (!a.is_number_integer() || a.get<int64_t>() != 1)
      invalid(p + "/arity", fmt::format("arity {} is not supported: user-declared ops are pointwise with one input "
                                        "(\"arity\": 1); express binary ops with add_extra_input",
                                        show(a)));
  }
  k.saves = ops::SavedKind::input;
  if (j.contains("saves")) {
    std::string s = need_string(j, "saves", p, "\"input\" or \"output\"");
    if (s == "output") {
      k.saves = ops::SavedKind::output;
    } else if (s != "input") {
      invalid(p + "/saves", fmt::format("\"saves\" must be \"input\" or \"output\" (what bwd receives as x), got {}",
                                        show(s)));
    }
  }
  k.functor = need_string(j, "functor", p, "the device struct's name, e.g. \"jf_op_softplus\"");
  if (!is_identifier(k.functor))
    invalid(p + "/functor", fmt::format("functor {} must be a C identifier", show(k.functor)));
  std::string tpl = need_string(j, "template", p, "the .cuh file beside the rules file that defines the functor");
  std::string base = check_template_path(tpl, p + "/template");
  d.template_text = read_template(dir, tpl, p + "/template", k.template_path);
  if (!contains_word(d.template_text, k.functor))
    invalid(p + "/functor", fmt::format("functor {} does not appear in template {}; define struct {} {{ fwd, bwd }} "
                                        "there",
                                        show(k.functor), show(tpl), k.functor));
  d.template_key = "user/" + base;
  k.attrs = parse_attrs(j, p);
  for (const auto& a : k.attrs) k.const_attrs.push_back(a.name);
  k.family = ops::Family::pointwise;
  k.template_file = d.template_key;
  k.user_declared = true;
  return d;
}

}  // namespace jitfuse::rules::detail
