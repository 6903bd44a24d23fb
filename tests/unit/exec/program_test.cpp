// Programs (runtime/exec/ir/program.*, builder.*, impl/): the golden step list of every built-in rule case,
// forward and backward; arena packing never overlaps two live buffers; saved sets; the new epilogues.
#include <catch2/catch.hpp>

#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <sstream>

#include "common/env.hpp"
#include "exec/lower/impl/implementation.hpp"
#include "exec/ir/program.hpp"
#include "rules/rule.hpp"
#include "support/builtin_cases.hpp"

using namespace jitfuse;

namespace {

const std::string kGolden = std::string(JF_SOURCE_DIR) + "/tests/golden/programs/builtin_bf16_16x64.txt";

std::string read(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

std::shared_ptr<const exec::Program> program_of(const char* ops_json, const char* recipe = "bf16", bool training = true,
                                          ops::Shape shape = {16, 64}) {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  test::BuiltinCase c{0, ops_json, recipe, training, shape};
  return test::case_program(c, rs);
}

std::string step_names(const std::vector<exec::Step>& steps) {
  std::string out;
  for (const auto& s : steps)
    out += (out.empty() ? "" : " | ") +
           (s.kind == exec::Step::Kind::gemm     ? "gemm " + cuda::epilogue_name(s.gemm.call.epilogue)
            : s.kind == exec::Step::Kind::kernel ? "kernel " + s.kernel->gen.kernel
            : s.kind == exec::Step::Kind::finalize ? "finalize " + s.finalize.kernel
                                                   : std::string(exec::step_kind_name(s.kind)));
  return out;
}

}  // namespace

TEST_CASE("the program of every built-in rule case matches its golden step list", "[exec][golden]") {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  std::string text;
  for (const auto& c : test::builtin_cases()) {
    if (c.recipe != "bf16" && c.recipe != "fp8_current") continue;
    if (ops::cols_of(c.shape) != 64) continue;
    auto p = test::case_program(c, rs);
    text += "===== " + c.id() + "\n" + exec::program_text(*p, 3350) + "\n";
  }
  if (env::flag("JITFUSE_UPDATE_GOLDEN")) {
    std::ofstream(kGolden, std::ios::binary) << text;
    WARN("golden programs rewritten: " << kGolden);
    return;
  }
  const std::string golden = read(kGolden);
  REQUIRE_FALSE(golden.empty());
  if (golden != text) {
    // Show the first differing line.
    std::istringstream g(golden), t(text);
    std::string gl, tl;
    int line = 0;
    while (std::getline(g, gl) && std::getline(t, tl)) {
      ++line;
      INFO("line " << line);
      REQUIRE(gl == tl);
    }
  }
  CHECK(golden == text);
}

TEST_CASE("arena packing never overlaps two buffers that are live at once", "[exec]") {
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  size_t checked = 0;
  for (const auto& c : test::builtin_cases()) {
    auto p = test::case_program(c, rs);
    for (auto arena : {exec::Storage::fwd_arena, exec::Storage::bwd_arena}) {
      const size_t total = arena == exec::Storage::fwd_arena ? p->fwd_arena : p->bwd_arena;
      for (const auto& a : p->buffers) {
        if (a.storage != arena || a.first < 0) continue;
        INFO(c.id() << " buffer " << a.name);
        CHECK(a.offset % 256 == 0);
        CHECK(a.offset + a.bytes <= total);
        for (const auto& b : p->buffers) {
          if (b.id <= a.id || b.storage != arena || b.first < 0) continue;
          const bool live_together = a.first <= b.last && b.first <= a.last;
          const bool overlap = a.offset < b.offset + b.bytes && b.offset < a.offset + a.bytes;
          INFO("and " << b.name);
          CHECK_FALSE((live_together && overlap));
          ++checked;
        }
      }
    }
  }
  CHECK(checked > 50);
}

TEST_CASE("saved buffers are what the backward reads, in the saved block or the caller's tensors", "[exec]") {
  auto p = program_of(R"([{"op": "layernorm"}, {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "bias"}, {"op": "gelu", "approximate": "tanh"}])");
  std::vector<std::string> names;
  for (int id : p->saved_set()) names.push_back(p->buffer(id).name);
  // layernorm: its input (the caller's) and row stats; linear: its input (act1, kept in the saved block);
  // gelu: its input, written by the GELU_AUX_BIAS epilogue.
  CHECK(names == std::vector<std::string>{"input", "act1", "op0.mean", "op0.rstd", "op3.input"});
  CHECK(p->buffer(p->find(exec::BufferRole::activation, 1, "act1")).storage == exec::Storage::saved_block);
  CHECK(p->saved_bytes == 256 + 256 + 16 * 64 * 2 + 16 * 64 * 2);
  auto inference = program_of(R"([{"op": "layernorm"}, {"op": "linear", "in_features": 64, "out_features": 64}])",
                              "bf16", false);
  CHECK(inference->saved_set().empty());
  CHECK(inference->saved_bytes == 0);
  CHECK(inference->backward.empty());
}

TEST_CASE("linear gelu and linear relu without bias run as one cuBLASLt GEMM", "[exec]") {
  auto gelu = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "gelu", "approximate": "tanh"}])");
  CHECK(gelu->plan.forward.size() == 1);
  CHECK(gelu->plan.forward[0].rule == "linear_gelu");
  CHECK(step_names(gelu->forward) == "gemm GELU_AUX");
  REQUIRE(gelu->forward[0].gemm.aux >= 0);
  CHECK(gelu->buffer(gelu->forward[0].gemm.aux).name == "op1.input");
  // The backward reads gelu's input from the aux output (dgelu kernel), then the linear's dgrad and wgrad.
  CHECK(step_names(gelu->backward) == "kernel jf_gelu_bwd | gemm DEFAULT | gemm DEFAULT");
  auto gelu_inf = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "gelu", "approximate": "tanh"}])",
                             "bf16", false);
  CHECK(step_names(gelu_inf->forward) == "gemm GELU");
  auto erf = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "gelu", "approximate": "none"}])");
  CHECK(erf->plan.forward.size() == 2);  // cuBLASLt's GELU is the tanh one: erf gelu stays a kernel

  auto relu = program_of(R"([{"op": "linear", "in_features": 64, "out_features": 64}, {"op": "relu"}])");
  CHECK(relu->plan.forward[0].rule == "linear_relu");
  CHECK(step_names(relu->forward) == "gemm RELU");
  // relu saves its output: the GEMM's D, which is the caller's output tensor.
  std::vector<std::string> saved;
  for (int id : relu->saved_set()) saved.push_back(relu->buffer(id).name);
  CHECK(saved == std::vector<std::string>{"input", "output"});
}

TEST_CASE("implementations answer the loader: impossible rules are refused at load with a reason", "[exec][rules]") {
  auto load = [](const std::string& rule) {
    rules::RuleSet rs = rules::RuleSet::with_builtins();
    return rs.load_text(R"({"format": "jitfuse.rules/1", "rules": [)" + rule + "]}", "x.json", ".");
  };
  // [linear add_extra_input] is a RESIDUAL window (the bias-free residual GEMM); [linear relu add_extra_input]
  // is not: relu cannot run between the GEMM and its accumulation into C.
  CHECK(load(R"J({"name": "r2", "math": "y = x W^T + e", "pass": "forward", "pattern": ["linear", "add_extra_input"], "impl": {"kind": "cublaslt", "epilogue": "RESIDUAL", "epilogue_ops": 2}})J").empty());
  auto residual3 = load(R"J({"name": "r3", "math": "y = relu(x W^T) + e", "pass": "forward", "pattern": ["linear", "relu", "add_extra_input"], "impl": {"kind": "cublaslt", "epilogue": "RESIDUAL", "epilogue_ops": 3}})J");
  REQUIRE(residual3.size() == 1);
  CHECK(residual3[0].where.rfind("x.json:1:", 0) == 0);
  CHECK(residual3[0].message.find("RESIDUAL cannot run any window this pattern matches") != std::string::npos);
  CHECK(residual3[0].message.find("[linear add_extra_input] or [linear bias|scale add_extra_input]") != std::string::npos);
  auto bad_tail = load(R"J({"name": "t", "math": "y", "pass": "forward", "pattern": ["linear", "bias", "layernorm"], "impl": {"kind": "cublaslt", "epilogue": "BIAS", "epilogue_ops": 2, "tail": "elementwise"}})J");
  REQUIRE(bad_tail.size() == 1);
  CHECK(bad_tail[0].message.find("tail must be an elementwise chain") != std::string::npos);
  auto recompute = load(R"J({"name": "rc", "math": "y", "pass": "joint", "pattern": ["linear", "bias"], "impl": {"kind": "joint", "strategy": "recompute_linear_output", "saves": ["x"]}})J");
  REQUIRE(recompute.size() == 1);
  CHECK(recompute[0].message.find("recompute_linear_output implements [linear, pointwise op that saves its input]") !=
        std::string::npos);
  auto ok = load(R"J({"name": "ok", "math": "y = relu(x W^T)", "pass": "forward", "pattern": ["linear", {"op": ["relu", "gelu"]}], "impl": {"kind": "cublaslt", "epilogue": "RELU", "epilogue_ops": 2}})J");
  CHECK(ok.empty());  // some window (linear relu) can run: the relu alternative
  // Every built-in rule passes its own implementation's check.
  CHECK(rules::RuleSet::with_builtins().errors().empty());
  // One implementation per rule kind the built-ins use, each with a description.
  for (const auto* impl : exec::implementations()) CHECK_FALSE(impl->covers_text().empty());
  CHECK(exec::implementations().size() == 23);  // 10 epilogues, 3 skeletons + fp8_cast + moe + allreduce_rownorm,
                                                // 6 joint strategies, unfused
}

TEST_CASE("schema.json lists exactly the implementations jitfuse has", "[exec][rules]") {
  // The schema's enums help editors; the implementations are the truth. One list, checked here.
  std::ifstream f(std::string(JF_SOURCE_DIR) + "/fusion_rules/schema.json");
  const auto schema = nlohmann::json::parse(f);
  std::map<std::string, std::set<std::string>> in_schema;
  std::function<void(const nlohmann::json&)> walk = [&](const nlohmann::json& j) {
    if (j.is_object()) {
      for (const char* key : {"skeleton", "epilogue", "strategy"})
        if (j.contains(key) && j[key].is_object() && j[key].contains("enum"))
          for (const auto& v : j[key]["enum"]) in_schema[key].insert(v.get<std::string>());
      for (const auto& [k, v] : j.items()) walk(v);
    } else if (j.is_array()) {
      for (const auto& v : j) walk(v);
    }
  };
  walk(schema);
  std::map<std::string, std::set<std::string>> have;
  for (const auto* impl : exec::implementations()) {
    const char* key = impl->kind() == rules::Impl::Kind::generated  ? "skeleton"
                      : impl->kind() == rules::Impl::Kind::cublaslt ? "epilogue"
                      : impl->kind() == rules::Impl::Kind::joint    ? "strategy"
                                                                    : nullptr;
    if (key) have[key].insert(impl->name());
  }
  CHECK(in_schema == have);
}

TEST_CASE("follow-up steps: each finalize and FP8 update names an earlier step that writes its partials",
          "[exec][steps]") {
  // What the executor relies on (issue 41 item 4): a finalize step follows the kernel step whose module holds
  // it and whose partials it sums; an update's entries name the steps that wrote their amax partials (a kernel,
  // or an FP8 GEMM's one float); the pass's batched update is its last step (group -1) and no other is.
  rules::RuleSet rs = rules::RuleSet::with_builtins();
  int finalizes = 0, per_cast = 0, batched = 0;
  for (const auto& c : test::builtin_cases()) {
    auto p = test::case_program(c, rs);
    for (const auto* steps : {&p->forward, &p->backward})
      for (size_t i = 0; i < steps->size(); ++i) {
        const auto& s = (*steps)[i];
        INFO(c.id() << " step " << i << " " << s.what);
        CHECK((s.group < 0) == (s.kind == exec::Step::Kind::fp8_update && s.fp8_update.batched));
        if (s.kind == exec::Step::Kind::finalize) {
          ++finalizes;
          const int k = s.finalize.kernel_step;
          REQUIRE((k >= 0 && static_cast<size_t>(k) < i));
          const auto& ks = (*steps)[static_cast<size_t>(k)];
          REQUIRE(ks.kind == exec::Step::Kind::kernel);
          CHECK(ks.group == s.group);
          CHECK(ks.weight_cast == s.weight_cast);
          CHECK(s.finalize.index < static_cast<int>(ks.kernel->gen.finalize.size()));
          CHECK(s.finalize.pairs.size() == 2 * static_cast<size_t>(s.finalize.count));
          for (size_t j = 0; j < s.finalize.pairs.size(); j += 2) {  // its partials: what that kernel writes
            bool written = false;
            for (const auto& a : ks.kernel->args) written = written || a.buffer == s.finalize.pairs[j];
            CHECK(written);
          }
        }
        if (s.kind != exec::Step::Kind::fp8_update) continue;
        (s.fp8_update.batched ? batched : per_cast)++;
        if (s.fp8_update.batched) CHECK(i + 1 == steps->size());
        if (!s.fp8_update.batched) CHECK(s.fp8_update.entries.size() == 1);
        for (const auto& e : s.fp8_update.entries) {
          REQUIRE((e.step >= 0 && static_cast<size_t>(e.step) < i));
          const auto& by = (*steps)[static_cast<size_t>(e.step)];
          if (by.kind == exec::Step::Kind::gemm) {
            CHECK(by.gemm.d_amax == e.partials);
          } else {
            REQUIRE(by.kind == exec::Step::Kind::kernel);
            CHECK(by.kernel->amax_partials == e.partials);
            CHECK(!by.kernel->gen.fp8_update.empty());
          }
          CHECK((e.history >= 0 && e.scale >= 0));
        }
      }
  }
  CHECK(finalizes > 20);
  CHECK(per_cast > 5);
  CHECK(batched > 5);
}
