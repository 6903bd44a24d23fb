// Text from rule and sequence files (math notes, op kinds, rule names, labels) reaches generated source only
// inside `//` comments, escaped: a trailing backslash, newlines, "*/", '#', NUL or "??/" cannot change a kernel.
#include <sstream>

#include <catch2/catch.hpp>

#include "jitfuse/codegen/kernel_spec.hpp"

using namespace jitfuse::codegen;

namespace {

KernelSpec spec_with(const std::string& text, Direction dir) {
  KernelSpec s;
  s.skeleton = Skeleton::elementwise;
  s.dir = dir;
  s.dtype = "bf16";
  s.cols = 64;
  Stage bias;
  bias.kind = Stage::Kind::bias;
  bias.op = 0;
  bias.op_kind = "bias" + text;
  bias.math = "y = x + b" + text;
  Stage act;
  act.kind = Stage::Kind::unary;
  act.op = 1;
  act.op_kind = "gelu" + text;
  act.math = "y = gelu(x)" + text;
  act.functor = "jf_op_gelu_tanh";
  act.save_input = dir == Direction::forward;
  s.pre = {bias, act};
  s.headers["ops/activations.cuh"] = "";
  s.label = "bias_gelu";
  s.rule = "bias_act" + text;
  return s;
}

std::vector<std::string> lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

// The source without its comment-only lines: what the compiler sees.
std::string code_only(const std::string& source) {
  std::string out;
  for (const auto& l : lines(source)) {
    auto first = l.find_first_not_of(' ');
    if (first != std::string::npos && l.compare(first, 2, "//") == 0) continue;
    out += l + "\n";
  }
  return out;
}

}  // namespace

TEST_CASE("hostile text in every text field of a KernelSpec stays inside its comment", "[codegen][trust]") {
  const std::vector<std::string> hostile = {
      " \\",            // a trailing backslash splices the next line into the comment
      " \\  \t",        // ... also with blanks after it
      "\nv[e] = 0.f;",  // a newline would start a line of code
      "\r\n#define DT float",
      " */ #include \"/etc/passwd\" /*",
      std::string(" nul\0after", 10),
      " ??/",           // trigraph for a backslash
      " caf\xc3\xa9 \x1b[31m",
  };
  for (Direction dir : {Direction::forward, Direction::backward}) {
    Generated plain = generate(spec_with("", dir));
    for (const auto& h : hostile) {
      INFO("text: " << h);
      Generated g = generate(spec_with(h, dir));
      // The code is identical to the plain kernel's; only comments differ.
      CHECK(code_only(g.source) == code_only(plain.source));
      CHECK(g.kernel == plain.kernel);
      CHECK(lines(g.source).size() == lines(plain.source).size());
      for (const auto& l : lines(g.source)) {
        // Every line is printable ASCII and no line ends in a backslash (which would splice the next one).
        for (char c : l) CHECK((static_cast<unsigned char>(c) >= 0x20 && static_cast<unsigned char>(c) < 0x7f));
        auto end = l.find_last_not_of(" \t");
        if (end != std::string::npos) CHECK(l[end] != '\\');
        CHECK(l.find("??/") == std::string::npos);
      }
    }
  }
}

TEST_CASE("plain math text is kept as is in the comments", "[codegen][trust]") {
  Generated g = generate(spec_with("", Direction::forward));
  CHECK(g.source.find("// op 1 gelu (forward): y = gelu(x)\n") != std::string::npos);
  Generated h = generate(spec_with(" \\", Direction::forward));
  CHECK(h.source.find("// op 1 gelu \\x5c (forward): y = gelu(x) \\x5c\n") != std::string::npos);
  Generated n = generate(spec_with("\n#x", Direction::forward));
  CHECK(n.source.find("y = gelu(x)\\x0a#x\n") != std::string::npos);
}
