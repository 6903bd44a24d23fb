// cross_entropy on the GPU against the float64 reference (reference/check.cpp: fresh random logits, random labels with
// about a fifth of the rows ignored, every output and gradient poisoned first; DESIGN's tolerances): the op alone for
// each attribute and reduction, odd shapes (7 x 50257, V = 8, 13, 128256) and misaligned tensors (the scalar variants);
// then the joint head [linear, bias?, cross_entropy] (dx, dW, db from the forward), one chunk and several, against the
// same reference and with fusion disabled.
#include "gpu/gpu_check.hpp"

using namespace jitfuse;
using jitfuse::test::run_check;

namespace {

std::string ce(const std::string& attrs = "") {
  return test::seq_json(R"([{"op": "cross_entropy")" + (attrs.empty() ? "" : ", " + attrs) + "}]", "ce");
}

std::string head(int64_t h, int64_t v, const std::string& attrs = "", bool bias = false) {
  return test::seq_json(
      fmt::format(R"([{{"op": "linear", "in_features": {}, "out_features": {}}}, {}{{"op": "cross_entropy"{}}}])", h, v,
                  bias ? R"({"op": "bias"}, )" : "", attrs.empty() ? "" : ", " + attrs),
      "head");
}

const char* const kRecipes[] = {"fp32", "fp16", "bf16"};

}  // namespace

TEST_CASE("cross_entropy alone, each reduction and attribute, matches the reference", "[cross_entropy]") {
  const std::vector<std::string> attrs = {
      "",  // mean, ignore_index -100
      R"("reduction": "sum")",
      R"("reduction": "none")",
      R"("ignore_index": 3)",  // a class index that random labels hit
      R"("label_smoothing": 0.1)",
      R"("z_loss": 0.01)",
      R"("softcap": 30)",  // Gemma-2's cap
      R"("softcap": 2)",   // a cap that bites at logits in [-2, 2]
      R"("label_dtype": "int32", "reduction": "none")",
      R"("reduction": "sum", "label_smoothing": 0.2, "z_loss": 1e-4, "softcap": 5, "label_dtype": "int32")",
  };
  for (const auto& a : attrs)
    for (const char* recipe : kRecipes)
      for (ops::Shape shape : {ops::Shape{7, 50257}, ops::Shape{3, 8}, ops::Shape{5, 1, 13}, ops::Shape{64, 1000}})
        run_check(ce(a), recipe, shape);
}

TEST_CASE(
    "cross_entropy at Llama-3's and Gemma's vocabularies, and misaligned "
    "(scalar variants)",
    "[cross_entropy]") {
  for (const char* recipe : kRecipes) {
    run_check(ce(), recipe, {4, 128256});
    run_check(ce(R"("reduction": "none", "softcap": 30)"), recipe, {3, 256000});
    run_check(ce(R"("label_smoothing": 0.1)"), recipe, {7, 50257}, true,
              /*misalign=*/true);
    run_check(ce(R"("reduction": "none")"), recipe, {5, 13}, true,
              /*misalign=*/true);
  }
  run_check(ce(), "bf16", {7, 50257},
            /*backward=*/false);  // inference: nothing saved
}

TEST_CASE(
    "linear -> cross_entropy through the joint rule (one chunk) matches "
    "the reference",
    "[cross_entropy]") {
  for (const char* recipe : kRecipes) {
    run_check(head(64, 50257), recipe, {7, 64});
    run_check(head(64, 1000, R"("reduction": "sum", "ignore_index": 5)"), recipe, {33, 64});
    run_check(head(24, 1000, R"("label_smoothing": 0.1, "z_loss": 1e-3, "softcap": 30)", true), recipe, {17, 24});
    run_check(head(40, 257, R"("label_dtype": "int32")", true), recipe, {5, 2, 40});
  }
}

TEST_CASE("the joint head over several chunks, and the same ops unfused", "[cross_entropy]") {
  // 1030 rows of 128256 bf16 logits: chunks of 1024 and 6 rows (a 256 MiB budget); dW accumulates. An odd
  // vocabulary (the weight padded to 8 rows) over three chunks of 128 rows and one of 2 (chunk_mib 16).
  run_check(head(16, 128256, R"("chunk_mib": 256)"), "bf16", {1030, 16});
  run_check(head(16, 128256, R"("reduction": "sum", "chunk_mib": 256)", true), "bf16", {1030, 16});
  run_check(head(24, 50257, R"("chunk_mib": 16, "label_smoothing": 0.1)", true), "bf16", {386, 24});
  {
    test::ScopedEnv off("JITFUSE_DISABLE_FUSION", "1");
    run_check(head(64, 50257, R"("label_smoothing": 0.1)", true), "bf16", {7, 64});
  }
  // reduction none: the joint rule is refused, the unfused ops run.
  for (const char* recipe : kRecipes) run_check(head(64, 1000, R"("reduction": "none")"), recipe, {9, 64});
}
