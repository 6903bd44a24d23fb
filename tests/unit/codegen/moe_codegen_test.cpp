// The moe skeleton's specs (issue 43) without a GPU: arguments and launch of each kernel, the literals
// that make the source independent of the op's place in a sequence, and the specs codegen refuses.
#include <catch2/catch.hpp>

#include "jitfuse/codegen/kernel_spec.hpp"
#include "support/moe_cases.hpp"

using namespace jitfuse;
using codegen::Arg;
using K = codegen::MoeSpec::Kernel;

namespace {

codegen::KernelSpec spec_of(K kernel, int64_t hidden = 256) { return test::moe_spec(kernel, 8, 2, hidden, "bf16", 7, 5); }

bool has(const std::string& s, const std::string& t) { return s.find(t) != std::string::npos; }

std::vector<Arg::Role> roles(const codegen::Generated& g) {
  std::vector<Arg::Role> r;
  for (const auto& a : g.args) r.push_back(a.role);
  return r;
}

}  // namespace

TEST_CASE("moe kernels: arguments, fixed grids and the routing layout", "[moe][codegen]") {
  using R = Arg::Role;
  const auto count = codegen::generate(spec_of(K::count));
  CHECK(roles(count) == std::vector<R>{R::extra_in, R::saved, R::rows});
  CHECK(count.args[1].key == codegen::Key::route);
  CHECK(count.args[1].op == 5);  // back to the sequence's index: the permute op's routing
  CHECK(count.args[0].op == 7);
  CHECK(count.args[1].writes);
  CHECK(count.launch.grid_x > 0);  // fixed, whatever the routing
  CHECK(has(count.source, "jf_moe_count_chunk(idx, rt, 8, jf_hist, c)"));
  CHECK(has(count.source, "long long* __restrict__ idx"));
  const auto scan = codegen::generate(spec_of(K::scan));
  CHECK(scan.launch.grid_x == 1);
  CHECK(scan.launch.bx == 1024);
  auto capped = spec_of(K::scatter);
  capped.moe->capacity = 5;
  capped.moe->idx_i64 = false;
  const auto scatter = codegen::generate(capped);
  CHECK(has(scatter.source, "jf_moe_scatter_chunk(idx, rt, 2, 8, 5LL, jf_ids, c)"));
  CHECK(has(scatter.source, "const int* __restrict__ idx"));
  const auto perm = codegen::generate(spec_of(K::permute));
  CHECK(roles(perm) == std::vector<R>{R::in, R::out, R::saved, R::rows});
  CHECK_FALSE(perm.args[2].writes);
  CHECK(has(perm.source, "const bool kept = p < rt.starts[8];"));
  auto un = spec_of(K::unpermute);
  un.moe->residual = true;
  const auto unp = codegen::generate(un);
  CHECK(roles(unp) == std::vector<R>{R::in, R::out, R::saved, R::extra_in, R::extra_in, R::rows});
  CHECK(has(unp.source, "jf_load8<DT, JF_VEC>(residual + t * 256 + c0, s);"));
  const auto unb = codegen::generate(spec_of(K::unpermute_bwd));
  bool dprobs = false;
  for (const auto& a : unb.args) dprobs |= a.role == R::grad_extra_in && a.name == "dprobs" && a.writes;
  CHECK(dprobs);
  // The layout's size: dest and src (n = T k each), splits, starts (E + 1), counts and bases per chunk.
  CHECK(codegen::moe_route_ints(4096, 2, 8) == 2 * 8192 + 17 + 2 * 8 * 8);
  CHECK(codegen::moe_route_ints(1, 1, 1) == 2 + 3 + 2);
}

TEST_CASE("moe specs codegen refuses", "[moe][codegen]") {
  auto no_route = spec_of(K::permute);
  no_route.moe->route_op = -1;
  CHECK_THROWS_AS(codegen::generate(no_route), std::invalid_argument);
  auto topk = spec_of(K::count);
  topk.moe->topk = 9;  // more than the experts
  CHECK_THROWS_AS(codegen::generate(topk), std::invalid_argument);
  CHECK_THROWS_AS(codegen::generate(spec_of(K::permute, 100)), std::invalid_argument);  // hidden % 8
  auto wrong = spec_of(K::permute);
  wrong.skeleton = codegen::Skeleton::elementwise;
  CHECK_THROWS_AS(codegen::generate(wrong), std::invalid_argument);
  auto missing = spec_of(K::permute);
  missing.moe.reset();
  CHECK_THROWS_AS(codegen::generate(missing), std::invalid_argument);
}
