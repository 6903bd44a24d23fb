// jf_sequence_check_counts: the one count check of the torch layers (jitfuse.torch's Sequential and the C++
// ops ask it for the verdict and the message of a call whose tensors come by position).
#include <catch2/catch.hpp>
#include <string>

#include "jitfuse/jitfuse.h"

namespace {

std::string last() { return jf_last_error() ? jf_last_error() : ""; }

struct Seq {
  jf_context ctx = nullptr;
  jf_sequence s = nullptr;
  explicit Seq(const char* json) {
    REQUIRE(jf_context_create(&ctx) == JF_OK);
    REQUIRE(jf_sequence_create(ctx, json, "bf16", &s) == JF_OK);
  }
  ~Seq() {
    jf_sequence_destroy(s);
    jf_context_destroy(ctx);
  }
};

const char* kMlp = R"({"name": "mlp", "ops": [{"op": "layernorm"}, {"op": "linear", "in_features": 64,
  "out_features": 128}, {"op": "bias"}, {"op": "gelu"}, {"op": "add_extra_input"},
  {"op": "make_extra_output"}]})";

}  // namespace

TEST_CASE("C ABI: jf_sequence_check_counts gives the verdict and the message of a call's counts", "[api][untrusted]") {
  Seq q(kMlp);
  const int64_t shape[2] = {8, 64};
  // layernorm weight+bias, linear weight, bias: 4 parameters on the ops inferred for [8, 64].
  CHECK(jf_sequence_check_counts(q.s, "m", shape, 2, 1, 4, -1, -1) == JF_OK);
  CHECK(jf_sequence_check_counts(q.s, "m", nullptr, 0, 1, -1, -1, -1) == JF_OK);  // parameters not checked
  CHECK(jf_sequence_check_counts(q.s, "m", shape, 2, 1, 4, 1, 1) == JF_OK);       // a backward's
  CHECK(jf_sequence_check_counts(q.s, "m", nullptr, 0, 0, -1, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "m: sequence 'mlp' takes 1 extra input(s) (add_extra_input ops without a channel); got 0");
  CHECK(jf_sequence_check_counts(q.s, "jitfuse::forward", shape, 2, 1, 5, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "jitfuse::forward: sequence 'mlp' takes 1 extra input(s) (add_extra_input ops without a channel) "
                  "and 4 parameter(s); got 1 and 5");
  CHECK(jf_sequence_check_counts(q.s, "jitfuse::backward", shape, 2, 1, 4, 1, 0) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "jitfuse::backward: sequence 'mlp' takes 1 extra input(s) (add_extra_input ops without a channel), "
                  "1 extra output(s) and their gradients and 4 parameter(s); got 1, 1 (0) and 4");
  CHECK(jf_sequence_check_counts(q.s, nullptr, nullptr, 0, 2, -1, 0, 0) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "sequence 'mlp' takes 1 extra input(s) (add_extra_input ops without a channel), 1 extra output(s) "
                  "and their gradients; got 2, 0 (0)");
}

TEST_CASE("C ABI: jf_sequence_check_counts refuses hostile arguments with a message", "[api][untrusted]") {
  Seq q(kMlp);
  const int64_t shape[2] = {8, 64}, wrong[2] = {8, 65}, zero[2] = {8, 0};
  CHECK(jf_sequence_check_counts(nullptr, "m", shape, 2, 1, 4, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "seq is NULL");
  CHECK(jf_sequence_check_counts(q.s, "m", nullptr, 2, 1, 4, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last().find("shape") != std::string::npos);
  CHECK(jf_sequence_check_counts(q.s, "m", zero, 2, 1, 4, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last().find("positive") != std::string::npos);
  // A shape the ops cannot take is the library's shape error (what the call would have got anyway).
  CHECK(jf_sequence_check_counts(q.s, "m", wrong, 2, 1, 4, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last().find("linear") != std::string::npos);
  CHECK(jf_sequence_check_counts(q.s, "\xff\xfe", nullptr, 0, 0, -1, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last().find("not valid UTF-8") != std::string::npos);
  const std::string long_name(5000, 'a');
  CHECK(jf_sequence_check_counts(q.s, long_name.c_str(), nullptr, 0, 0, -1, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last().find("longer than 4096 bytes") != std::string::npos);
}

TEST_CASE("C ABI: jf_sequence_check_counts names input channels and labels", "[api]") {
  Seq ch(R"({"name": "blk", "input_channels": ["r"], "ops": [{"op": "add_extra_input", "channel": "r"},
    {"op": "add_extra_input"}, {"op": "gelu"}]})");
  CHECK(jf_sequence_check_counts(ch.s, "blk", nullptr, 0, 1, -1, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "blk: sequence 'blk' takes 2 extra input(s) (add_extra_input ops without a channel and one per "
                  "input channel); got 1");
  Seq ce(R"({"name": "head", "ops": [{"op": "cross_entropy"}]})");
  CHECK(jf_sequence_check_counts(ce.s, "head", nullptr, 0, 0, -1, -1, -1) == JF_ERR_INVALID_ARGUMENT);
  CHECK(last() == "head: sequence 'head' takes 1 extra input(s) (the labels of cross_entropy); got 0");
}
