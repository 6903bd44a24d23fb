// `jitfuse explain SEQ.json --recipe R --shape S`: every candidate window each pass tried (rule, priority, taken
// or why not), then the final forward and backward groups; --json for scripts, --dot for a Graphviz drawing.
#include <cstdio>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli_common.hpp"
#include "commands.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "fuser/explain.hpp"
#include "exec/ir/program.hpp"
#include "fuser/plan.hpp"

namespace jitfuse::cli {
namespace {

using nlohmann::json;

struct ExplainOpts {
  std::string seq, recipe, shape, arch = "sm_90";
  std::vector<std::string> rules;
  bool json = false, dot = false, inference = false, arch_given = false, program = false;
  double bandwidth = 3350;  // GB/s: H100 SXM's HBM3 (pass the copy bandwidth measured by `jitfuse bench`)
  int world_size = 1, rank = 0;  // the tensor-parallel group planned for (docs/parallel.md)
};

std::string dot_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    out += (static_cast<unsigned char>(c) < 0x20) ? ' ' : c;
  }
  return out;
}

// One subgraph per direction; each fused group is a nested cluster, unfused ops stand alone.
void print_dot(const ops::SequenceDef& def, const std::vector<ops::Op>& ops, const fuser::Plan& p) {
  std::printf("digraph \"%s\" {\n  rankdir=LR;\n  node [shape=box, fontname=\"Helvetica\"];\n",
              dot_escape(def.name).c_str());
  auto direction = [&](const char* id, const char* label, const std::vector<fuser::Group>& groups, bool reverse) {
    std::printf("  subgraph cluster_%s {\n    label=\"%s\";\n", id, label);
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const auto& g = groups[gi];
      bool fused = !g.rule.empty();
      if (fused)
        std::printf("    subgraph cluster_%s_%zu {\n      label=\"%s%s\\n%s\";\n      style=%s;\n", id, gi,
                    g.joint ? "joint: " : "", g.rule.c_str(), dot_escape(fuser::impl_text(g)).c_str(),
                    g.joint ? "dashed" : "\"rounded,filled\"; fillcolor=\"#e8f0fe\"");
      for (int i = g.begin; i < g.end; ++i)
        std::printf("    %s%s_%d [label=\"%d %s\"];\n", fused ? "  " : "", id, i, i, ops[i].kind.c_str());
      if (fused) std::printf("    }\n");
    }
    for (size_t i = 0; i + 1 < ops.size(); ++i) {
      size_t a = reverse ? ops.size() - 1 - i : i, b = reverse ? a - 1 : a + 1;
      std::printf("    %s_%zu -> %s_%zu;\n", id, a, id, b);
    }
    for (const auto& op : ops)  // channels: source -> reader (its gradient flows back the other way)
      if (op.family == ops::Family::add_extra_input && op.channel_src >= 0 &&
          ops[static_cast<size_t>(op.channel_src)].family == ops::Family::make_extra_output) {
        const int a = reverse ? op.index : op.channel_src, b = reverse ? op.channel_src : op.index;
        std::printf("    %s_%d -> %s_%d [style=dashed, color=\"#1a73e8\", label=\"%s\"];\n", id, a, id, b,
                    dot_escape(op.channel).c_str());
      }
    std::printf("  }\n");
  };
  direction("forward", "forward", p.forward, false);
  direction("backward", "backward", p.backward, true);
  std::printf("}\n");
}

void print_text(const ExplainOpts& o, const ops::SequenceDef& def, const std::vector<ops::Op>& ops,
                const fuser::PlanInputs& in, const rules::RuleSet& rs, const fuser::Plan& p) {
  std::printf("sequence '%s' (%s): %zu ops, input %s\n", def.name.c_str(), o.seq.c_str(), ops.size(), o.shape.c_str());
  std::printf("recipe %s (dtype %s), arch sm_%d%s, %s\n", in.recipe.c_str(), in.dtype.c_str(), in.arch,
              o.arch_given ? "" : " (default; pass --arch to plan for another GPU)",
              in.training ? "training (forward + backward)" : "inference (forward only)");
  std::printf("%zu rules loaded%s\n", rs.rules().size(),
              rs.errors().empty() ? "" : fmt::format(" ({} skipped with errors, listed on stderr)", rs.errors().size()).c_str());
  std::printf("\nops:\n");
  for (const auto& op : ops) {
    const std::string wiring = fuser::op_wiring(op, ops);
    std::printf("  %3d  %-18s %s -> %s%s\n", op.index, op.kind.c_str(), ops::shape_str(op.in).c_str(),
                ops::shape_str(op.out).c_str(), wiring.empty() ? "" : ("   " + wiring).c_str());
  }
  for (auto pass : {rules::Pass::joint, rules::Pass::forward, rules::Pass::backward}) {
    std::printf("\n%s pass:\n", rules::pass_name(pass).c_str());
    size_t shown = 0;
    for (const auto& d : p.decisions) {
      if (d.pass != pass) continue;
      ++shown;
      if (d.rule.empty()) {
        std::printf("  %s\n", d.reason.c_str());
        continue;
      }
      std::string span = fmt::format("ops [{}, {})", d.begin, d.end);
      std::printf("  %-14s %-24s priority %-4d %s\n", span.c_str(), d.rule.c_str(), d.priority,
                  d.taken ? "taken" : ("not taken: " + d.reason).c_str());
      if (d.taken)  // which class / repeated element took which ops
        for (const auto& m : d.match)
          std::printf("      %-20s %s\n", m.element.c_str(),
                      m.begin == m.end ? "(no op)"
                                       : fmt::format("ops [{}, {}): {}", m.begin, m.end,
                                                     fuser::group_ops({m.begin, m.end}, ops)).c_str());
    }
    if (!shown) std::printf("  no rule of this pass matches any window\n");
  }
  auto groups = [&](const char* title, const std::vector<fuser::Group>& gs) {
    std::printf("\n%s groups:\n", title);
    for (const auto& g : gs) {
      std::string span = fmt::format("[{}, {})", g.begin, g.end);
      std::string what = g.rule.empty() ? "unfused" : g.rule + ": " + fuser::impl_text(g);
      std::printf("  %-10s %-34s %s\n", span.c_str(), fuser::group_ops(g, ops).c_str(), what.c_str());
    }
  };
  groups("forward", p.forward);
  groups("backward", p.backward);
  for (auto pass : {rules::Pass::forward, rules::Pass::backward}) {
    if (pass == rules::Pass::backward && !in.training) break;
    const auto apart = fuser::kept_apart(p, ops, pass);
    if (apart.empty()) continue;
    std::printf("\nadjacent ops kept apart (%s):\n", rules::pass_name(pass).c_str());
    for (const auto& a : apart)
      std::printf("  ops %d, %d (%s, %s): %s\n", a.left, a.left + 1, ops[a.left].kind.c_str(),
                  ops[a.left + 1].kind.c_str(), a.why.c_str());
  }
}

void run(const ExplainOpts& o) {
  // explain reports load errors itself (cli_common prints them); the library's warnings would repeat them.
  // JITFUSE_LOG_LEVEL=debug still shows every decision in the log.
  if (!env::get("JITFUSE_LOG_LEVEL")) log().set_level(spdlog::level::err);
  rules::RuleSet rs = load_rules(o.rules);
  ops::Parallel par;
  par.world_size = o.world_size;
  par.rank = o.rank;
  Planned p = plan_file(rs, o.seq, o.recipe, o.shape, parse_arch(o.arch), !o.inference, par);
  fuser::PlanInputs in;  // what plan_file planned with, for the header
  in.recipe = o.recipe;
  in.dtype = ops::dtype_name(p.recipe.dtype);
  in.arch = parse_arch(o.arch);
  in.training = !o.inference;
  in.disable_fusion = env::flag("JITFUSE_DISABLE_FUSION");
  if (o.dot) {
    print_dot(p.def, p.ops, p.plan);
  } else if (o.json) {
    json out = fuser::plan_json(p.plan, p.ops);
    json header = {{"sequence", p.def.name}, {"file", o.seq},   {"shape", o.shape},        {"recipe", in.recipe},
                   {"dtype", in.dtype},      {"arch", in.arch}, {"training", in.training}, {"disable_fusion", in.disable_fusion}};
    if (!p.def.group.empty()) header["parallel"] = {{"group", p.def.group}, {"world_size", o.world_size}, {"rank", o.rank}};
    out.update(header);
    out["rule_errors"] = json::array();
    for (const auto& e : rs.errors()) out["rule_errors"].push_back(e.to_string());
    if (o.program) out["program"] = exec::program_json(*p.program, o.bandwidth);
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    print_text(o, p.def, p.ops, in, rs, p.plan);
    if (o.program) std::printf("\n%s", exec::program_text(*p.program, o.bandwidth).c_str());
  }
}

}  // namespace

void add_explain_command(CLI::App& app) {
  auto o = std::make_shared<ExplainOpts>();
  CLI::App* cmd = app.add_subcommand(
      "explain", "Show every fusion decision for a sequence: candidate windows, why each was taken or not, final groups");
  cmd->add_option("SEQ", o->seq, "Sequence file (jitfuse.sequence/1)")->required();
  cmd->add_option("--recipe", o->recipe, "Recipe: fp32, fp16, bf16, fp8_delayed, fp8_current or fp8_block")->required();
  cmd->add_option("--shape", o->shape, "Input shape, e.g. 8192x4096")->required();
  CLI::Option* arch = cmd->add_option("--arch", o->arch, "GPU arch to plan for, e.g. sm_80 (default sm_90)");
  cmd->add_option("--rules", o->rules, "Extra rule file or directory, loaded after JITFUSE_RULE_PATH (repeatable)");
  CLI::Option* as_json = cmd->add_flag("--json", o->json, "Machine-readable output");
  CLI::Option* dot = cmd->add_flag("--dot", o->dot, "Graphviz drawing: fused groups as clusters, forward and backward");
  as_json->excludes(dot);
  cmd->add_flag("--program", o->program,
                "Also show the program: every GEMM and kernel step, buffers, saved set, arena and napkin time");
  cmd->add_option("--bandwidth", o->bandwidth, "GB/s for the napkin times of --program (default 3350)")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--world-size", o->world_size,
                  "Plan one rank of a tensor-parallel group of this many GPUs (default 1; no GPU needed)")
      ->check(CLI::Range(1, ops::kMaxWorldSize));
  cmd->add_option("--rank", o->rank, "The rank planned for, 0 to world size - 1 (default 0)")->check(CLI::NonNegativeNumber);
  cmd->add_flag("--inference", o->inference, "Plan for inference (no backward; joint rules that need training fail)");
  cmd->callback([o, arch] {
    o->arch_given = arch->count() > 0;
    run(*o);  // errors reach main(), which prints "jitfuse explain: error: ..." and exits 2
  });
}

}  // namespace jitfuse::cli
