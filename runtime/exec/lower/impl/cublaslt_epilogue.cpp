// The shared predicate and lowering of cuBLASLt epilogues: the GEMM part, then the generated tail.
#include "exec/lower/impl/cublaslt_epilogue.hpp"

#include <fmt/format.h>

namespace jitfuse::exec {

std::string CublasEpilogue::covers_text() const {
  std::string out;
  for (const auto& s : shapes()) {
    std::string one;
    for (const auto& alt : s) {
      std::string a;
      for (const auto& k : alt) a += (a.empty() ? "" : "|") + k;
      one += (one.empty() ? "" : " ") + a;
    }
    out += (out.empty() ? "" : " or ") + ("[" + one + "]");
  }
  return out + " in the " + rules::pass_name(pass()) + " pass" +
         (pass() == rules::Pass::forward ? ", then an optional generated elementwise tail" : "");
}

std::optional<std::string> CublasEpilogue::check(const std::vector<OpUse>& w, const rules::Impl& impl,
                                                 rules::Pass p) const {
  if (p != pass())
    return "epilogue " + name() + " belongs to the " + rules::pass_name(pass()) + " pass, not " + rules::pass_name(p);
  const size_t n = static_cast<size_t>(impl.epilogue_ops);
  if (w.size() < n) return "window shorter than epilogue_ops";
  std::optional<std::string> why;
  bool sized = false;
  for (const auto& s : shapes()) {
    if (s.size() != n) continue;
    sized = true;
    why = expect_kinds(w, 0, s, "epilogue " + name());
    if (!why) break;
  }
  if (!sized) return "epilogue " + name() + " covers " + covers_text() + ", not " + std::to_string(n) + " ops";
  if (why) return why;
  if (auto e = extra(std::vector<OpUse>(w.begin(), w.begin() + static_cast<long>(n)))) return e;
  if (w.size() > n) {
    if (p != rules::Pass::forward) return "backward GEMM groups take no generated tail";
    codegen::Skeleton sk;
    if (auto t = chain_problem(w, n, &sk)) return "tail: " + *t;
    if (sk != codegen::Skeleton::elementwise) return "tail must be an elementwise chain";
  }
  return std::nullopt;
}

void CublasEpilogue::lower(Builder& b, const rules::Impl& impl) const {
  const auto& g = b.group();
  if (!b.forward()) return backward(b);
  const int gemm_end = g.begin + impl.epilogue_ops;
  forward(b, g.begin, b.act(gemm_end));
  b.boundary_saves(g.begin, gemm_end);
  if (gemm_end < g.end) {
    lower_chain(b, gemm_end, g.end, chain_options(b), ops::rows_of(b.ops()[gemm_end].in));
    b.boundary_saves(gemm_end, g.end);
  }
}

int epilogue_saved_input(Builder& b, int op) {
  const auto& o = b.ops()[op];
  return b.saved_new(op, Key::input, b.recipe().dtype, ops::rows_of(o.in), ops::cols_of(o.in),
                     static_cast<size_t>(ops::numel(o.in)) * ops::dtype_bytes(b.recipe().dtype));
}

std::optional<std::string> gelu_aux_ld_problem(const std::string& epilogue, const char* role, int64_t ld,
                                               const char* what) {
  if (ld <= 0 || ld % 8 == 0) return std::nullopt;
  return fmt::format("{} {} gelu's input as cuBLASLt's aux matrix, whose leading dimension is {} = {}; cuBLASLt "
                     "needs it to be a multiple of 8 (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD)",
                     epilogue, role, what, ld);
}

}  // namespace jitfuse::exec
