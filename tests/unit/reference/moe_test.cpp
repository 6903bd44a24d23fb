// Tests of the float64 mixture-of-experts references (issue 43): the routing's order and capacity,
// finite-difference checks of every backward, and the whole expert block (permute -> grouped linear ->
// scaled swiglu -> grouped linear -> unpermute) against a direct loop over each token's experts.
#include <catch2/catch.hpp>
#include <cmath>
#include <cstdio>
#include <random>
#include <stdexcept>

#include "grad_check.hpp"
#include "ops/sequence.hpp"
#include "reference/reference.hpp"
#include "reference/sequence.hpp"
#include "rules/rule.hpp"

namespace ref = jitfuse::reference;
namespace ops = jitfuse::ops;
namespace rules = jitfuse::rules;
using ref::Vec;
using ref::testing::check_grad;
using ref::testing::dot;
using ref::testing::numeric_grad;
using ref::testing::random_vec;

TEST_CASE("moe_route orders rows by expert, then token and slot, and drops past the capacity", "[reference][moe]") {
  // 4 tokens, top-2 of 3 experts; expert 1 gets tokens 0, 2, 3, expert 0 tokens 0, 1, expert 2 tokens 1, 2, 3.
  const std::vector<int64_t> idx = {1, 0, 2, 0, 1, 2, 2, 1};
  const auto r = ref::moe_route(idx, 4, 2, 3);
  CHECK(r.splits == std::vector<int64_t>{2, 3, 3});
  CHECK(r.src == std::vector<int64_t>{0, 1, 0, 2, 3, 1, 2, 3});
  CHECK(r.dest == std::vector<int64_t>{2, 0, 5, 1, 3, 6, 7, 4});
  // Capacity 2: expert 1 keeps tokens 0 and 2 (first come), expert 2 tokens 1 and 2; token 3 loses both.
  const auto c = ref::moe_route(idx, 4, 2, 3, 2);
  CHECK(c.splits == std::vector<int64_t>{2, 2, 2});
  CHECK(c.dest == std::vector<int64_t>{2, 0, 4, 1, 3, 5, -1, -1});
  // An empty expert, top-1.
  const auto e = ref::moe_route(std::vector<int64_t>{2, 2, 0}, 3, 1, 4);
  CHECK(e.splits == std::vector<int64_t>{1, 0, 2, 0});
  CHECK(e.src == std::vector<int64_t>{2, 0, 1});
}

TEST_CASE("moe_route refuses an expert id out of range, naming the token and slot", "[reference][moe]") {
  try {
    ref::moe_route(std::vector<int64_t>{0, 1, 3, 0}, 2, 2, 3);
    FAIL("no throw");
  } catch (const std::invalid_argument& e) {
    CHECK(std::string(e.what()).find("token 1 slot 0 routes to expert 3") != std::string::npos);
  }
  CHECK_THROWS_AS(ref::moe_route(std::vector<int64_t>{0, 1, 2}, 2, 2, 3), std::invalid_argument);  // wrong count
  CHECK_THROWS_AS(ref::grouped_linear_fwd(Vec(6), Vec(4), std::vector<int64_t>{2, -1}, 1, 2), std::invalid_argument);
}

TEST_CASE("moe permute / unpermute backward agree with finite differences", "[reference][moe]") {
  std::mt19937_64 rng(0x5eed4301);
  const int64_t T = 5, k = 2, E = 4, H = 3;
  const std::vector<int64_t> idx = {3, 1, 0, 3, 1, 2, 3, 0, 1, 0};
  for (int64_t cap : {int64_t{-1}, int64_t{2}}) {
    INFO("capacity " << cap);
    const auto r = ref::moe_route(idx, T, k, E, cap);
    const Vec x = random_vec(rng, T * H), rp = random_vec(rng, r.rows() * H);
    auto lp = [&](const Vec& xs) { return dot(ref::moe_permute_fwd(xs, r, H), rp); };
    check_grad("permute dx", ref::moe_permute_bwd(rp, r, H), numeric_grad(lp, x));

    const Vec y = random_vec(rng, r.rows() * H), probs = random_vec(rng, T * k), ro = random_vec(rng, T * H);
    const auto b = ref::moe_unpermute_bwd(ro, y, probs, r, H);
    auto ly = [&](const Vec& ys) { return dot(ref::moe_unpermute_fwd(ys, probs, r, H), ro); };
    check_grad("unpermute dy", b.dy, numeric_grad(ly, y));
    auto lpr = [&](const Vec& ps) { return dot(ref::moe_unpermute_fwd(y, ps, r, H), ro); };
    const Vec np = numeric_grad(lpr, probs);
    if (cap < 0) {
      check_grad("unpermute dprobs", b.dprobs, np);
    } else {  // dropped slots: no gradient either way
      for (size_t i = 0; i < np.size(); ++i) CHECK(std::abs(b.dprobs[i] - np[i]) <= 1e-6 * std::max(1.0, std::abs(np[i])));
      CHECK(b.dprobs[12 / 2 + 0] == 0.0);  // token 3 slot 0 (expert 3, its third) is dropped at capacity 2
    }
  }
}

TEST_CASE("grouped linear, grouped bias and the scaled gated op agree with finite differences", "[reference][moe]") {
  std::mt19937_64 rng(0x5eed4302);
  const int64_t n = 3, k = 4;
  const std::vector<int64_t> splits = {2, 0, 1, 3};  // an empty group
  const int64_t m = 6, g = 4;
  const Vec x = random_vec(rng, m * k), w = random_vec(rng, g * n * k), b = random_vec(rng, g * n),
            r = random_vec(rng, m * n);
  auto lx = [&](const Vec& xs) { return dot(ref::grouped_linear_fwd(xs, w, splits, n, k), r); };
  check_grad("grouped dx", ref::grouped_linear_dgrad(r, w, splits, n, k), numeric_grad(lx, x));
  auto lw = [&](const Vec& ws) { return dot(ref::grouped_linear_fwd(x, ws, splits, n, k), r); };
  const Vec dw = ref::grouped_linear_wgrad(r, x, splits, n, k);
  const Vec nw = numeric_grad(lw, w);
  for (int64_t i = n * k; i < 2 * n * k; ++i) CHECK(dw[static_cast<size_t>(i)] == 0.0);  // the empty group
  check_grad("grouped dW", dw, nw);
  const Vec y = random_vec(rng, m * n);
  auto lb = [&](const Vec& bs) { return dot(ref::grouped_bias_fwd(y, bs, splits, n), r); };
  check_grad("grouped db", ref::grouped_col_sum(r, splits, n), numeric_grad(lb, b));

  const int64_t rows = 4, h = 3;
  const Vec xg = random_vec(rng, rows * 2 * h), sc = random_vec(rng, rows), rg = random_vec(rng, rows * h);
  for (const char* kind : {"swiglu", "geglu"}) {
    INFO(kind);
    const auto bw = ref::scaled_gated_bwd(kind, xg, sc, rg, rows, h);
    auto lgx = [&](const Vec& xs) { return dot(ref::scaled_gated_fwd(kind, xs, sc, rows, h), rg); };
    check_grad("scaled gated dx", bw.dx, numeric_grad(lgx, xg));
    auto lgs = [&](const Vec& ss) { return dot(ref::scaled_gated_fwd(kind, xg, ss, rows, h), rg); };
    check_grad("scaled gated dscale", bw.dscale, numeric_grad(lgs, sc));
  }
}

// The expert block as one chain equals, token by token, the sum over its experts of prob x FFN_e(x).
TEST_CASE("the expert block through the MoE references equals a loop over each token's experts", "[reference][moe]") {
  std::mt19937_64 rng(0x5eed4303);
  const int64_t T = 7, k = 2, E = 4, H = 4, F = 3;
  std::uniform_int_distribution<int64_t> pick(0, E - 2);  // expert 3 stays empty
  std::vector<int64_t> idx(static_cast<size_t>(T * k));
  for (int64_t t = 0; t < T; ++t) {
    idx[static_cast<size_t>(t * k)] = pick(rng);
    idx[static_cast<size_t>(t * k + 1)] = (idx[static_cast<size_t>(t * k)] + 1) % (E - 1);  // two distinct experts
  }
  const Vec x = random_vec(rng, T * H), probs = random_vec(rng, T * k);
  const Vec w1 = random_vec(rng, E * 2 * F * H), w2 = random_vec(rng, E * H * F);
  for (int64_t cap : {int64_t{-1}, int64_t{3}}) {
    INFO("capacity " << cap);
    const auto r = ref::moe_route(idx, T, k, E, cap);
    CHECK(r.splits[3] == 0);
    const Vec xp = ref::moe_permute_fwd(x, r, H);
    const Vec h1 = ref::grouped_linear_fwd(xp, w1, r.splits, 2 * F, H);
    Vec ones(static_cast<size_t>(r.rows()), 1.0);
    const Vec a = ref::scaled_gated_fwd("swiglu", h1, ones, r.rows(), F);
    const Vec h2 = ref::grouped_linear_fwd(a, w2, r.splits, H, F);
    const Vec out = ref::moe_unpermute_fwd(h2, probs, r, H);
    Vec want(static_cast<size_t>(T * H), 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < k; ++j) {
        if (r.dest[static_cast<size_t>(t * k + j)] < 0) continue;
        const int64_t e = idx[static_cast<size_t>(t * k + j)];
        const Vec u = ref::linear_fwd(Vec(x.begin() + t * H, x.begin() + (t + 1) * H),
                                      Vec(w1.begin() + e * 2 * F * H, w1.begin() + (e + 1) * 2 * F * H), 1, 2 * F, H);
        const Vec v = ref::gated_fwd("swiglu", u, 1, F);
        const Vec o = ref::linear_fwd(v, Vec(w2.begin() + e * H * F, w2.begin() + (e + 1) * H * F), 1, H, F);
        for (int64_t c = 0; c < H; ++c) want[static_cast<size_t>(t * H + c)] += probs[static_cast<size_t>(t * k + j)] * o[static_cast<size_t>(c)];
      }
    for (size_t i = 0; i < want.size(); ++i) CHECK(out[i] == Approx(want[i]).epsilon(1e-12).margin(1e-12));
  }
}

TEST_CASE("the sequence reference runs moe_permute and moe_unpermute with a capacity that drops", "[reference][moe]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  auto def = ops::parse_sequence(R"({"ops": [{"op": "moe_permute", "num_experts": 3, "top_k": 2, "capacity": 2},
      {"op": "scale", "value": 2.0}, {"op": "moe_unpermute"}]})", "<moe>", rs.registry());
  const auto ops = ops::infer(def, {4, 8}, {});
  ref::SeqInputs in;
  std::mt19937_64 g(5);
  std::uniform_real_distribution<double> u(-1, 1);
  in.input.resize(32);
  for (auto& x : in.input) x = u(g);
  in.extra_in = {{0, 1, 0, 2, 0, 1, 2, 1}, {0.5, 0.25, 1, 0.75, 0.125, 0.5, 0.25, 1}};  // experts 0 and 1 drop tokens 2 and 3
  const auto f = ref::sequence_forward(ops, in);
  REQUIRE(f.values[1].size() == 8 * 8);  // the permuted rows: the static bound T k, zero past the kept ones
  const auto r = ref::moe_route(std::vector<int64_t>{0, 1, 0, 2, 0, 1, 2, 1}, 4, 2, 3, 2);
  CHECK(r.rows() == 6);  // experts 0 and 1 each drop a third slot
  for (size_t i = 6 * 8; i < 64; ++i) CHECK(f.values[1][i] == 0.0);
  // y[t] = sum over kept slots of p[t, j] 2 x[t].
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t c = 0; c < 8; ++c) {
      double want = 0;
      for (int64_t j = 0; j < 2; ++j)
        if (r.dest[static_cast<size_t>(t * 2 + j)] >= 0) want += in.extra_in[1][static_cast<size_t>(t * 2 + j)] * 2;
      CHECK(f.output[static_cast<size_t>(t * 8 + c)] == Approx(want * in.input[static_cast<size_t>(t * 8 + c)]));
    }
  ref::Vec dy(32);
  for (auto& x : dy) x = u(g);
  const auto gr = ref::sequence_backward(ops, in, f, dy, {});
  REQUIRE(gr.grad_extra_in.size() == 2);
  CHECK(gr.grad_extra_in[0].empty());       // the indices: no gradient
  REQUIRE(gr.grad_extra_in[1].size() == 8);  // dprobs
  CHECK(gr.grad_extra_in[1][4] == 0.0);      // token 2's dropped slot
  double dot = 0;
  for (int64_t c = 0; c < 8; ++c) dot += dy[static_cast<size_t>(c)] * 2 * in.input[static_cast<size_t>(c)];
  CHECK(gr.grad_extra_in[1][0] == Approx(dot));
  CHECK(gr.grad_input.size() == 32);
}

TEST_CASE("the padded layout puts expert e's rows at e x capacity and the block computes the same", "[reference][moe]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  const char* block = R"({"ops": [{"op": "moe_permute", "num_experts": 3, "top_k": 2, "capacity": 3, "layout": "%s"},
      {"op": "grouped_linear", "num_groups": 3, "in_features": 8, "out_features": 16}, {"op": "silu"},
      {"op": "grouped_linear", "num_groups": 3, "in_features": 16, "out_features": 8}, {"op": "moe_unpermute"}]})";
  char text[1024];
  std::snprintf(text, sizeof text, block, "padded");
  auto def = ops::parse_sequence(text, "<moe>", rs.registry());
  const auto ops = ops::infer(def, {4, 8}, {});
  REQUIRE(ops[0].out == ops::Shape{9, 8});
  ref::SeqInputs in;
  std::mt19937_64 g(9);
  std::uniform_real_distribution<double> u(-1, 1);
  in.input.resize(32);
  for (auto& x : in.input) x = u(g);
  in.extra_in = {{0, 1, 0, 2, 0, 1, 2, 1}, {0.5, 0.25, 1, 0.75, 0.125, 0.5, 0.25, 1}};
  ref::Vec w1(3 * 16 * 8), w2(3 * 8 * 16);
  for (auto& x : w1) x = u(g);
  for (auto& x : w2) x = u(g);
  in.params[{1, "weight"}] = w1;
  in.params[{3, "weight"}] = w2;
  const auto f = ref::sequence_forward(ops, in);
  // Expert 1's rows start at 3: tokens 0 and 2 (its first two rows), then a zero row.
  for (int64_t c = 0; c < 8; ++c) {
    CHECK(f.values[1][static_cast<size_t>(3 * 8 + c)] == in.input[static_cast<size_t>(c)]);
    CHECK(f.values[1][static_cast<size_t>(4 * 8 + c)] == in.input[static_cast<size_t>(2 * 8 + c)]);
  }
  // Against the loop over each token's kept experts.
  const auto r = ref::moe_route(std::vector<int64_t>{0, 1, 0, 2, 0, 1, 2, 1}, 4, 2, 3, 3);
  for (int64_t t = 0; t < 4; ++t)
    for (int64_t o = 0; o < 8; ++o) {
      double want = 0;
      for (int64_t j = 0; j < 2; ++j) {
        if (r.dest[static_cast<size_t>(t * 2 + j)] < 0) continue;
        const int64_t e = static_cast<int64_t>(in.extra_in[0][static_cast<size_t>(t * 2 + j)]);
        double y = 0;
        for (int64_t h = 0; h < 16; ++h) {
          double a = 0;
          for (int64_t k = 0; k < 8; ++k) a += in.input[static_cast<size_t>(t * 8 + k)] * w1[static_cast<size_t>((e * 16 + h) * 8 + k)];
          y += a / (1 + std::exp(-a)) * w2[static_cast<size_t>((e * 8 + o) * 16 + h)];
        }
        want += in.extra_in[1][static_cast<size_t>(t * 2 + j)] * y;
      }
      CHECK(f.output[static_cast<size_t>(t * 8 + o)] == Approx(want).margin(1e-12));
    }
  ref::Vec dy(32);
  for (auto& x : dy) x = u(g);
  const auto gr = ref::sequence_backward(ops, in, f, dy, {});
  CHECK(gr.grad_params.count({1, "weight"}) == 1);
  CHECK(gr.grad_params.at({3, "weight"}).size() == w2.size());
}

TEST_CASE("the dropless block (packed: each expert's own rows) equals the padded one with room for every row",
          "[reference][moe]") {
  static const rules::RuleSet rs = rules::RuleSet::with_builtins();
  auto run = [&](const char* permute) {
    char text[1024];
    std::snprintf(text, sizeof text, R"({"ops": [{"op": "moe_permute", "num_experts": 3, "top_k": 2%s},
        {"op": "grouped_linear", "num_groups": 3, "in_features": 8, "out_features": 16}, {"op": "silu"},
        {"op": "grouped_linear", "num_groups": 3, "in_features": 16, "out_features": 8}, {"op": "moe_unpermute"}]})",
                  permute);
    auto def = ops::parse_sequence(text, "<moe>", rs.registry());
    const auto ops = ops::infer(def, {5, 8}, {});
    ref::SeqInputs in;
    std::mt19937_64 g(11);
    std::uniform_real_distribution<double> u(-1, 1);
    in.input.resize(40);
    for (auto& x : in.input) x = u(g);
    in.extra_in = {{0, 1, 0, 2, 0, 1, 1, 0, 1, 0}, {0.5, 0.25, 1, 0.75, 0.125, 0.5, 0.25, 1, 0.3, 0.6}};  // expert 2 once
    ref::Vec w1(3 * 16 * 8), w2(3 * 8 * 16);
    for (auto& x : w1) x = u(g);
    for (auto& x : w2) x = u(g);
    in.params[{1, "weight"}] = w1;
    in.params[{3, "weight"}] = w2;
    const auto f = ref::sequence_forward(ops, in);
    ref::Vec dy(40);
    for (auto& x : dy) x = u(g);
    return std::make_pair(f, ref::sequence_backward(ops, in, f, dy, {}));
  };
  const auto [fd, gd] = run("");
  const auto [fp, gp] = run(R"(, "capacity": 5, "layout": "padded")");
  REQUIRE(fd.values[1].size() == 10 * 8);  // T k rows
  REQUIRE(fd.output.size() == fp.output.size());
  for (size_t i = 0; i < fd.output.size(); ++i) CHECK(fd.output[i] == Approx(fp.output[i]).margin(1e-12));
  for (size_t i = 0; i < gd.grad_input.size(); ++i) CHECK(gd.grad_input[i] == Approx(gp.grad_input[i]).margin(1e-12));
  for (size_t i = 0; i < 10; ++i) CHECK(gd.grad_extra_in[1][i] == Approx(gp.grad_extra_in[1][i]).margin(1e-12));
  for (int op : {1, 3}) {
    const auto& a = gd.grad_params.at({op, "weight"});
    const auto& b = gp.grad_params.at({op, "weight"});
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) CHECK(a[i] == Approx(b[i]).margin(1e-12));
  }
}
