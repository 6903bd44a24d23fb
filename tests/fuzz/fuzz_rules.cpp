// libFuzzer target for the parsers that read user files: RuleSet::load_text and ops::parse_sequence, fed the same
// bytes; an input "RULES\n---\nSEQUENCE" also loads the rules part and plans the sequence part with them.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/error.hpp"
#include "fuser/plan.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

#ifndef JF_FUZZ_TEMPLATE_DIR
#define JF_FUZZ_TEMPLATE_DIR ""
#endif

namespace {

using jitfuse::rules::RuleSet;

// Load errors are expected (that is the point). A validator bug escapes as an exception: the fuzz build defines
// JF_FUZZ_STRICT, so load_text's catch-all rethrows instead of recording it.
void check_errors(const std::vector<jitfuse::rules::LoadError>& errs) {
  for (const auto& e : errs)
    if (e.to_string().empty()) std::abort();
}

void parse_and_plan(const std::string& text, const RuleSet& rs) {
  try {
    jitfuse::ops::SequenceDef def = jitfuse::ops::parse_sequence(text, "fuzz.json", rs.registry());
    if (def.ops.size() > 64) return;  // planning cost grows with length; 64 ops say all there is to say
    std::vector<jitfuse::ops::Op> ops = jitfuse::ops::infer(def, {4, 64});
    for (bool training : {true, false}) {
      jitfuse::fuser::PlanInputs in;
      in.recipe = in.dtype = "bf16";
      in.arch = 90;
      in.training = training;
      jitfuse::fuser::Plan p = jitfuse::fuser::plan(ops, in, rs, {});
      if (p.forward.empty() != ops.empty()) std::abort();
    }
  } catch (const jitfuse::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("JITFUSE_LOG_LEVEL", "off", 1);  // logging every rejected input would only slow the fuzzer down
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const RuleSet base = RuleSet::with_builtins();
  std::string text(reinterpret_cast<const char*>(data), size);
  {
    RuleSet rs = base;
    check_errors(rs.load_text(text, "fuzz.json", JF_FUZZ_TEMPLATE_DIR));
    parse_and_plan(text, rs);
  }
  size_t sep = text.find("\n---\n");
  if (sep != std::string::npos) {
    RuleSet rs = base;
    check_errors(rs.load_text(text.substr(0, sep), "fuzz_rules.json", JF_FUZZ_TEMPLATE_DIR));
    parse_and_plan(text.substr(sep + 5), rs);
  }
  return 0;
}
