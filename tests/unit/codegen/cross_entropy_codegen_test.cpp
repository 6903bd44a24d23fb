// The cross_entropy skeleton's emitter (codegen/src/cross_entropy.cpp): kernel names, launch shapes and argument
// bindings per kernel, the attributes as literals (INT64_MIN's too), and position independence (the same source
// whatever the op's index in its sequence).
#include <catch2/catch.hpp>

#include <cstdint>

#include "jitfuse/codegen/kernel_spec.hpp"

using namespace jitfuse::codegen;

namespace {

KernelSpec spec(CrossEntropySpec::Kernel k, int op = 0, int64_t v = 50257) {
  KernelSpec s;
  s.skeleton = Skeleton::cross_entropy;
  s.dir = k == CrossEntropySpec::Kernel::rows_bwd || k == CrossEntropySpec::Kernel::scale ? Direction::backward
                                                                                         : Direction::forward;
  s.dtype = "bf16";
  s.cols = v;
  s.label = k == CrossEntropySpec::Kernel::reduce  ? "cross_entropy_reduce"
            : k == CrossEntropySpec::Kernel::fused ? "cross_entropy_fused"
                                                   : "cross_entropy";
  CrossEntropySpec ce;
  ce.kernel = k;
  ce.op = op;
  s.ce = ce;
  return s;
}

const Arg* find(const Generated& g, Arg::Role role, const std::string& name) {
  for (const auto& a : g.args)
    if (a.role == role && a.name == name) return &a;
  return nullptr;
}

}  // namespace

TEST_CASE("cross_entropy kernels: names, launches, arguments", "[codegen][cross_entropy]") {
  using K = CrossEntropySpec::Kernel;
  KernelSpec fwd = spec(K::rows_fwd, 3);
  fwd.ce->save = true;
  const Generated f = generate(fwd);
  CHECK(f.kernel == "jf_cross_entropy_fwd");
  CHECK(f.scalar_kernel == "jf_cross_entropy_fwd_scalar");
  CHECK(f.launch.grid_x == 0);  // one block per row of the call
  CHECK(f.launch.bx == 512);
  REQUIRE(find(f, Arg::Role::extra_in, "labels"));
  CHECK(find(f, Arg::Role::extra_in, "labels")->op == 3);  // bound to the sequence's op again
  REQUIRE(find(f, Arg::Role::saved, "lse"));
  CHECK(find(f, Arg::Role::saved, "lse")->writes);
  CHECK_THAT(f.source, Catch::Contains("y == (jf_i64)-100LL") && Catch::Contains("typedef jf_i64 LT;"));

  // Position independence: op 0 or op 3, one source.
  KernelSpec at0 = spec(K::rows_fwd, 0);
  at0.ce->save = true;
  CHECK(generate(at0).source == f.source);

  const Generated r = generate(spec(K::reduce));
  CHECK(r.kernel == "jf_cross_entropy_reduce_fwd");
  CHECK(r.launch.grid_x == 1);
  CHECK(r.launch.bx == 1024);
  CHECK(find(r, Arg::Role::saved, "scale") == nullptr);  // inference: nothing saved

  KernelSpec fu = spec(K::fused, 1, 128256);
  fu.ce->grid_rows = 1024;
  fu.ce->ignore_index = INT64_MIN;
  fu.ce->labels_i32 = true;
  const Generated fz = generate(fu);
  CHECK(fz.kernel == "jf_cross_entropy_fused_fwd");
  CHECK(fz.launch.grid_x == 1024);
  CHECK(fz.args.at(0).role == Arg::Role::in);
  CHECK(fz.args.at(0).writes);  // dlogits in place of the chunk's logits
  CHECK_THAT(fz.source, Catch::Contains("(-9223372036854775807LL - 1)") && Catch::Contains("typedef int LT;"));

  KernelSpec sc = spec(K::scale, 2, 4096);
  sc.ce->src_op = 0;
  sc.ce->src = Key::dW;
  sc.ce->accumulate = true;
  const Generated s = generate(sc);
  CHECK(s.kernel == "jf_cross_entropy_bwd");  // label "cross_entropy" here: the name follows the spec's label
  REQUIRE(find(s, Arg::Role::saved, "dW"));
  CHECK(find(s, Arg::Role::saved, "dW")->op == 0);
  CHECK(find(s, Arg::Role::saved, "scale")->op == 2);
  CHECK_THAT(s.source, Catch::Contains("v[e] = o[e] + g * v[e]"));
  sc.ce->src = Key::dx;  // another saved tensor of the same width: the same source
  CHECK(generate(sc).source == s.source);

  KernelSpec bad = spec(K::rows_fwd);
  bad.skeleton = Skeleton::elementwise;
  CHECK_THROWS_WITH(generate(bad), Catch::Contains("belongs to the cross_entropy skeleton"));
}
