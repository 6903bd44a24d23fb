// `jitfuse explain` run as users run it: on a built-in example (text, --json, --dot, --inference) and with a
// broken rules directory, whose errors are reported while the good rules still take part.
#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;
using jf_test::src;

TEST_CASE("explain on the mlp example: candidates, reasons and final groups", "[fuser][cli]") {
  auto r = run_cli("explain '" + src("tools/examples/mlp.json") + "' --recipe bf16 --shape 8192x4096");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("arch sm_90 (default; pass --arch to plan for another GPU)"));
  CHECK_THAT(r.out, Catch::Contains("joint pass:"));
  CHECK_THAT(r.out, Catch::Contains("forward pass:"));
  CHECK_THAT(r.out, Catch::Contains("backward pass:"));
  CHECK_THAT(r.out, Catch::Contains("linear_bias_gelu         priority 30   taken"));
  CHECK_THAT(r.out, Catch::Contains(
                        "linear_bias              priority 25   not taken: overlaps higher-priority rule linear_bias_gelu at ops [1, 4)"));
  CHECK_THAT(r.out, Catch::Contains("forward groups:\n  [0, 1)     layernorm"));
  CHECK_THAT(r.out, Catch::Contains("[1, 4)     linear bias gelu                   linear_bias_gelu: cublaslt GELU_AUX_BIAS (3 ops)"));
  CHECK_THAT(r.out, Catch::Contains("backward groups:"));
  CHECK_THAT(r.out, Catch::Contains("[1, 3)     linear bias                        linear_bias_bwd: cublaslt BGRADB (2 ops)"));
  CHECK_THAT(r.out, Catch::Contains("[3, 4)     gelu                               unfused"));
  CHECK_THAT(r.out, Catch::Contains("act_dbias                priority 20   not taken: overlaps higher-priority rule "
                                    "linear_bias_bwd at ops [1, 3)"));
}

TEST_CASE("explain --json and --arch, and shape reasons", "[fuser][cli]") {
  jf_test::TempDir dir;
  // Any in_features fuses (issue 27); an out_features that is not a multiple of 8 is refused by GELU_AUX_BIAS
  // (cuBLASLt's aux leading dimension), with its reason, and [linear bias] takes the BIAS epilogue instead.
  std::string seq = dir.write("odd.json", R"J({"format": "jitfuse.sequence/1", "name": "odd", "ops": [
    {"op": "linear", "in_features": 4098, "out_features": 1020}, {"op": "bias"}, {"op": "gelu"}]})J");
  auto r = run_cli("explain '" + seq + "' --recipe fp16 --shape 32x4098 --arch sm_80 --json", "", true);
  INFO(r.out);
  REQUIRE(r.status == 0);
  auto j = nlohmann::json::parse(r.out);
  CHECK(j.at("arch") == 80);
  CHECK(j.at("recipe") == "fp16");
  CHECK(j.at("training") == true);
  bool found = false;
  for (const auto& d : j.at("decisions"))
    if (d.at("rule") == "linear_bias_gelu") {
      found = true;
      CHECK(d.at("taken") == false);
      CHECK(d.at("reason") == "GELU_AUX_BIAS saves gelu's input as cuBLASLt's aux matrix, whose leading dimension is "
                              "out_features = 1020; cuBLASLt needs it to be a multiple of 8 "
                              "(CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)");
    }
  CHECK(found);
  REQUIRE(j.at("forward").size() == 2);
  CHECK(j.at("forward")[0].at("rule") == "linear_bias");
  CHECK(j.at("forward")[0].at("begin") == 0);
  CHECK(j.at("forward")[0].at("end") == 2);
  CHECK(j.at("forward")[1].at("ops") == nlohmann::json{"gelu"});
}

TEST_CASE("explain --dot draws forward and backward with fused groups as clusters", "[fuser][cli]") {
  auto r = run_cli("explain '" + src("tools/examples/transformer_layer.json") + "' --recipe bf16 --shape 4x512x1024 --dot");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::StartsWith("digraph \"transformer_layer\" {"));
  CHECK_THAT(r.out, Catch::Contains("subgraph cluster_forward {"));
  CHECK_THAT(r.out, Catch::Contains("subgraph cluster_backward {"));
  CHECK_THAT(r.out, Catch::Contains("label=\"joint: bias_dropout_add_joint"));
  CHECK_THAT(r.out, Catch::Contains("label=\"linear_bias\\ncublaslt BIAS (2 ops)\""));
  CHECK_THAT(r.out, Catch::Contains("forward_0 -> forward_1;"));
  CHECK_THAT(r.out, Catch::Contains("backward_1 -> backward_0;"));
  CHECK(r.out.back() == '\n');
  CHECK(r.out.rfind("}\n") == r.out.size() - 2);
}

TEST_CASE("explain --inference: no joint groups, no backward pass", "[fuser][cli]") {
  auto r = run_cli("explain '" + src("tools/examples/transformer_layer.json") + "' --recipe bf16 --shape 64x1024 --inference");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("inference (forward only)"));
  CHECK_THAT(r.out, Catch::Contains("bias_dropout_add_joint   priority 40   not taken: condition training failed"));
  CHECK_THAT(r.out, Catch::Contains("skipped: planning for inference (training = false)"));
}

TEST_CASE("explain with a broken rules directory reports the errors and uses the good rules", "[fuser][cli]") {
  jf_test::TempDir dir;
  std::string text =
      "{\n  \"format\": \"jitfuse.rules/1\",\n  \"rules\": [\n"
      "    {\"name\": \"gelu_scale\", \"math\": \"y = s gelu(x)\", \"pass\": \"forward\", \"priority\": 90, "
      "\"pattern\": [\"gelu\", \"scale\"], \"impl\": {\"kind\": \"generated\", \"skeleton\": \"elementwise\"}},\n"
      "    {\"name\": \"broken\", \"math\": \"y = x\", \"pass\": \"forward\", \"pattern\": [\"gelux\"], "
      "\"impl\": {\"kind\": \"generated\", \"skeleton\": \"elementwise\"}}\n  ]\n}\n";
  std::string file = dir.write("rules/user.json", text);
  std::string seq = dir.write("seq.json", R"J({"format": "jitfuse.sequence/1", "ops": [
    {"op": "bias"}, {"op": "gelu"}, {"op": "scale", "value": 0.5}]})J");
  auto r = run_cli("explain '" + seq + "' --recipe bf16 --shape 8x64 --rules '" + dir.path() + "/rules'");
  INFO(r.out);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("49 rules loaded (1 skipped with errors, listed on stderr)"));
  CHECK_THAT(r.out, Catch::Contains("rule skipped: " + jf_test::loc(file, text, "\"gelux\"") + ": "));
  CHECK_THAT(r.out, Catch::Contains("rule 'broken': unknown op 'gelux'"));
  CHECK_THAT(r.out, Catch::Contains("gelu_scale               priority 90   taken"));
  CHECK_THAT(r.out, Catch::Contains("bias_act                 priority 20   not taken: overlaps higher-priority rule gelu_scale at ops [1, 3)"));

  // A broken sequence or bad options: a clear error and exit 2 (docs/cli.md), no crash.
  auto bad = run_cli("explain '" + seq + "' --recipe bf17 --shape 8x64");
  CHECK(bad.status == 2);
  CHECK_THAT(bad.out, Catch::Contains("unknown recipe 'bf17'"));
  bad = run_cli("explain '" + seq + "' --recipe bf16 --shape 8x64 --arch hopper");
  CHECK(bad.status == 2);
  CHECK_THAT(bad.out, Catch::Contains("bad --arch 'hopper'"));
  bad = run_cli("explain '" + seq + "' --recipe bf16 --shape 8xfoo");
  CHECK(bad.status == 2);
  CHECK_THAT(bad.out, Catch::Contains("bad shape '8xfoo'"));
  bad = run_cli("explain '" + dir.path() + "/nope.json' --recipe bf16 --shape 8x64");
  CHECK(bad.status == 2);
  CHECK_THAT(bad.out, Catch::Contains("cannot read"));
}

TEST_CASE("planning commands refuse what an FP8 recipe cannot run, and bench refuses --iters 0", "[fuser][cli]") {
  jf_test::TempDir dir;
  std::string seq = dir.write("fp8.json", R"J({"format": "jitfuse.sequence/1", "name": "fp8", "ops": [
    {"op": "linear", "in_features": 64, "out_features": 64}, {"op": "quantize"}]})J");
  auto r = run_cli("explain '" + seq + "' --recipe fp8_current --shape 8x64");
  CHECK(r.status != 0);
  // 8 rows: the FP8 wgrad contracts over them, and FP8 GEMMs need multiples of 16.
  CHECK_THAT(r.out, Catch::Contains("op 0 (linear) under recipe fp8_current: FP8 GEMMs need the number of rows"));
  CHECK_THAT(r.out, Catch::Contains("multiple of 16 (got 8"));
  r = run_cli("explain '" + seq + "' --recipe fp8_current --shape 16x64");  // 16 rows: planned
  CHECK(r.status == 0);
  r = run_cli("explain '" + seq + "' --recipe fp8_current --shape 16x64 --program");
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("(e4m3 x e4m3, fast accumulation)"));  // the forward GEMM on FP8 operands
  CHECK_THAT(r.out, Catch::Contains("op0.weight.col"));                     // the transposed weight for dgrad
  std::string ok = dir.write("ok.json", R"J({"format": "jitfuse.sequence/1", "name": "ok", "ops": [
    {"op": "layernorm"}, {"op": "quantize"}]})J");
  r = run_cli("explain '" + ok + "' --recipe fp8_delayed --shape 8x64");
  CHECK(r.status == 0);
  CHECK_THAT(r.out, Catch::Contains("norm_quantize: generated rownorm"));
  r = run_cli("bench --iters 0");
  CHECK(r.status != 0);
  CHECK_THAT(r.out, Catch::Contains("--iters"));
}

TEST_CASE("under an FP8 recipe a user rule whose GEMM epilogue FP8 GEMMs cannot take is not taken, with why",
          "[fuser][cli]") {
  jf_test::TempDir dir;
  // A user's rule enabling cuBLASLt's GELU_AUX_BIAS under the FP8 recipes (the built-in one is bf16-only).
  std::string rules = dir.write("fp8_gelu.json", R"J({"format": "jitfuse.rules/1", "rules": [
    {"name": "my_linear_bias_gelu", "math": "y = gelu(x W^T + b)", "pass": "forward", "priority": 90, "pattern": ["linear", "bias", {"op": "gelu", "attrs": {"approximate": "tanh"}}],
     "conditions": {"recipes": ["fp8_delayed", "fp8_current"]},
     "impl": {"kind": "cublaslt", "epilogue": "GELU_AUX_BIAS", "epilogue_ops": 3}},
    {"name": "my_linear_bias_bwd", "math": "dx = dy W; dW = dy^T x; db = sum_rows dy", "pass": "backward", "priority": 90, "pattern": ["linear", "bias"],
     "conditions": {"recipes": ["fp8_delayed", "fp8_current"]},
     "impl": {"kind": "cublaslt", "epilogue": "BGRADB", "epilogue_ops": 2}}]})J");
  for (const char* recipe : {"fp8_delayed", "fp8_current"}) {
    INFO(recipe);
    auto r = run_cli("explain '" + src("tools/examples/mlp.json") + "' --recipe " + recipe +
                     " --shape 256x4096 --program --rules '" + rules + "'");
    INFO(r.out);
    REQUIRE(r.status == 0);  // planned and lowered: the windows go to the fp8 rules instead
    CHECK_THAT(r.out, Catch::Contains("50 rules loaded\n"));
    CHECK_THAT(r.out, Catch::Contains("my_linear_bias_gelu      priority 90   not taken: under an FP8 recipe a linear "
                                      "runs on FP8 GEMMs (E4M3/E5M2 operands, a BIAS epilogue at most), which cuBLASLt "
                                      "epilogue GELU_AUX_BIAS does not lower to"));
    CHECK_THAT(r.out, Catch::Contains("my_linear_bias_bwd       priority 90   not taken: under an FP8 recipe"));
    CHECK_THAT(r.out, Catch::Contains("[1, 4)     linear bias gelu                   fp8_linear_act_bwd: generated fp8_cast"));
    CHECK_THAT(r.out, Catch::Contains("(e4m3 x e4m3, fast accumulation)"));
    // The same rules under bf16 are taken (the refusal is the recipe's, not the rule's).
    auto b = run_cli("explain '" + src("tools/examples/mlp.json") + "' --recipe bf16 --shape 256x4096 --rules '" + rules + "'");
    CHECK(b.status == 0);
    CHECK_THAT(b.out, Catch::Contains("my_linear_bias_gelu      priority 90   not taken: condition recipe"));
  }
}

TEST_CASE("FP8 training: a norm before a linear writes the E4M3 codes, a transpose of the codes follows",
          "[fuser][cli]") {
  for (const char* recipe : {"fp8_delayed", "fp8_current"}) {
    INFO(recipe);
    auto r = run_cli("explain '" + src("tools/examples/mlp.json") + "' --recipe " + recipe + " --shape 256x4096 --program");
    INFO(r.out);
    REQUIRE(r.status == 0);
    CHECK_THAT(r.out, Catch::Contains("kernel jf_layernorm_e4m3_fwd"));
    CHECK_THAT(r.out, Catch::Contains("args: op1.input.row op1.input.col\n"));
    CHECK_THAT(r.out, Catch::Contains("fp8_norm_linear: generated transpose of the E4M3 input codes of op 1 (linear)"));
    CHECK_THAT(r.out, Catch::Contains("op0.mean op0.rstd"));  // the norm still saves its statistics
  }
}

TEST_CASE("fp8_delayed: a linear's GEMM writes a trailing quantize's E4M3 output (D scale, AMAX_D, batched update)",
          "[fuser][cli]") {
  jf_test::TempDir dir;
  std::string seq = dir.write("lbq.json", R"J({"format": "jitfuse.sequence/1", "name": "lbq", "ops": [
    {"op": "layernorm"}, {"op": "linear", "in_features": 128, "out_features": 256}, {"op": "bias"}, {"op": "gelu"},
    {"op": "linear", "in_features": 256, "out_features": 128}, {"op": "bias"}, {"op": "quantize"}]})J");
  for (const char* mode : {"", " --inference"}) {
    INFO(mode);
    auto r = run_cli("explain '" + seq + "' --recipe fp8_delayed --shape 64x128 --program" + mode);
    INFO(r.out);
    REQUIRE(r.status == 0);
    // The norm keeps its hand-off to the first linear; the activation's to the second, whose GEMM quantizes.
    CHECK_THAT(r.out, Catch::Contains("[0, 3)     layernorm linear bias              fp8_norm_linear: generated fp8_cast"));
    CHECK_THAT(r.out, Catch::Contains("[3, 7)     gelu linear bias quantize          fp8_act_linear_quantize: generated fp8_cast"));
    CHECK_THAT(r.out, Catch::Contains("gemm fwd   m=64 n=128 k=256 TN e4m3 BIAS (e4m3 x e4m3, fast accumulation)"));
    CHECK_THAT(r.out, Catch::Contains("d=output d_amax=amax op6 (FP8 GEMM output) d_scale=op6.scale"));
    CHECK_THAT(r.out, Catch::Contains("FP8 GEMM op 4 (linear) + BIAS -> E4M3 output of op 6 (quantize)"));
    // The pass ends with its batched recipe-state update, a step of its own: the GEMM output's state is in it.
    CHECK_THAT(r.out, Catch::Contains("fp8_update (batched)"));
    CHECK_THAT(r.out, Catch::Contains("FP8 recipe-state update of the pass"));
    CHECK_THAT(r.out, !Catch::Contains("jf_quantize"));  // no quantize kernel, no bf16 copy of the output
  }
  // Alone, and after a norm.
  std::string lq = dir.write("lq.json", R"J({"format": "jitfuse.sequence/1", "name": "lq", "ops": [
    {"op": "linear", "in_features": 128, "out_features": 96}, {"op": "quantize"}]})J");
  auto a = run_cli("explain '" + lq + "' --recipe fp8_delayed --shape 64x128 --program");
  INFO(a.out);
  CHECK_THAT(a.out, Catch::Contains("[0, 2)     linear quantize                    fp8_linear_quantize: generated fp8_cast"));
  CHECK_THAT(a.out, Catch::Contains("TN e4m3 DEFAULT (e4m3 x e4m3"));
  std::string nq = dir.write("nq.json", R"J({"format": "jitfuse.sequence/1", "name": "nq", "ops": [
    {"op": "rmsnorm"}, {"op": "linear", "in_features": 128, "out_features": 96}, {"op": "bias"}, {"op": "quantize"}]})J");
  auto n = run_cli("explain '" + nq + "' --recipe fp8_delayed --shape 64x128 --program");
  INFO(n.out);
  CHECK_THAT(n.out, Catch::Contains("rmsnorm linear bias quantize       fp8_norm_linear_quantize: generated fp8_cast"));
  CHECK_THAT(n.out, Catch::Contains("d_scale=op3.scale"));
  // Current scaling needs the output's amax before the cast: the rules are not taken, the quantize runs as
  // its own kernel after a bf16 GEMM output; a user rule naming both recipes lowers the same way.
  std::string rules = dir.write("lq_rules.json", R"J({"format": "jitfuse.rules/1", "rules": [
    {"name": "my_lq", "math": "y = e4m3(x W^T + b)", "pass": "forward", "priority": 90, "pattern": ["linear", "bias?", "quantize"],
     "conditions": {"recipes": ["fp8_delayed", "fp8_current"]}, "impl": {"kind": "generated", "skeleton": "fp8_cast"}}]})J");
  auto c = run_cli("explain '" + seq + "' --recipe fp8_current --shape 64x128 --program");
  INFO(c.out);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.out, Catch::Contains("fp8_act_linear_quantize  priority 44   not taken: condition recipe in [fp8_delayed] failed"));
  CHECK_THAT(c.out, Catch::Contains("kernel jf_quantize_amax_fwd"));
  CHECK_THAT(c.out, !Catch::Contains("d_scale="));
  auto u = run_cli("explain '" + lq + "' --recipe fp8_current --shape 64x128 --program --rules '" + rules + "'");
  INFO(u.out);
  REQUIRE(u.status == 0);
  CHECK_THAT(u.out, Catch::Contains("[0, 2)     linear quantize                    my_lq: generated fp8_cast"));
  CHECK_THAT(u.out, Catch::Contains("TN bf16 DEFAULT (e4m3 x e4m3"));
  CHECK_THAT(u.out, Catch::Contains("my_lq: generated elementwise"));
  CHECK_THAT(u.out, !Catch::Contains("d_scale="));
}
