// The legality predicate and the translation of op chains into KernelSpecs.
#include "exec/lowering.hpp"

#include "common/error.hpp"

namespace jitfuse::exec {

using codegen::KernelSpec;
using codegen::Skeleton;
using codegen::Stage;
using ops::Family;
using ops::Op;

namespace {

bool dropout_active(const Op& op) { return op.family == Family::dropout && op.flag("training") && op.num("p") > 0; }
bool saves(const Op& op, ops::SavedKind k) {
  for (auto s : op.saved)
    if (s == k) return true;
  return false;
}

std::optional<std::string> epilogue_problem(const std::string& epi, const std::vector<Op>& ops, int b, int e, int n) {
  auto kind = [&](int i) { return i < e ? ops[i].kind : std::string("<end>"); };
  auto want = [&](std::initializer_list<const char*> ks) -> std::optional<std::string> {
    int i = b;
    std::string got, expect;
    for (auto k : ks) {
      expect += (expect.empty() ? "" : " ") + std::string(k);
      got += (got.empty() ? "" : " ") + kind(i);
      ++i;
    }
    if (got != expect)
      return "epilogue " + epi + " implements [" + expect + "], the window starts with [" + got + "]";
    return std::nullopt;
  };
  std::optional<std::string> p;
  if (epi == "BIAS") p = want({"linear", "bias"});
  else if (epi == "GELU_AUX_BIAS") {
    p = want({"linear", "bias", "gelu"});
    if (!p && ops[b + 2].str("approximate") != "tanh") p = "GELU_AUX_BIAS computes the tanh approximation only";
  } else if (epi == "RELU_BIAS") p = want({"linear", "bias", "relu"});
  else if (epi == "RESIDUAL") {
    auto a = want({"linear", "bias", "add_extra_input"});
    auto s = want({"linear", "scale", "add_extra_input"});
    if (a && s) p = "epilogue RESIDUAL implements [linear bias|scale add_extra_input]";
  } else if (epi == "DGRAD_ACCUMULATE") p = want({"make_extra_output", "linear"});
  else if (epi == "SCALED") p = want({"linear", "scale"});
  else if (epi == "BGRADB") p = want({"linear", "bias"});
  else if (epi == "DGELU_BGRAD") {
    p = n == 4 ? want({"bias", "gelu", "linear", "bias"}) : want({"bias", "gelu", "linear"});
    if (!p && ops[b + 1].str("approximate") != "tanh") p = "DGELU_BGRAD differentiates the tanh approximation only";
  } else p = "unknown epilogue " + epi;
  const bool two = epi == "BIAS" || epi == "DGRAD_ACCUMULATE" || epi == "SCALED" || epi == "BGRADB";
  if (!p && !(n == (two ? 2 : 3) || (epi == "DGELU_BGRAD" && n == 4)))
    p = "epilogue_ops does not match the ops epilogue " + epi + " covers";
  return p;
}

}  // namespace

std::optional<std::string> chain_problem(const std::vector<Op>& ops, int b, int e, Skeleton* skeleton) {
  Skeleton sk = Skeleton::elementwise;
  int anchor = -1;
  for (int i = b; i < e; ++i) {
    const Op& op = ops[i];
    if (op.family == Family::linear) return "a generated kernel cannot run linear (" + op.label() + ")";
    if (op.kind == "reshape" && e - b > 1) return "reshape changes the column layout and runs alone";
    if (op.family == Family::norm || op.family == Family::gated) {
      if (anchor >= 0) return "two anchors (" + ops[anchor].label() + ", " + op.label() + ") in one kernel";
      anchor = i;
      sk = op.family == Family::norm ? Skeleton::rownorm : Skeleton::gated;
    }
  }
  for (int i = b; i < e; ++i) {
    const Op& op = ops[i];
    if (sk == Skeleton::rownorm && op.family == Family::bias) return "a rownorm kernel holds no bias stage";
    if (sk == Skeleton::gated && i < anchor && op.family == Family::dropout)
      return "dropout before a gated op would split mask bytes";
  }
  if (skeleton) *skeleton = sk;
  return std::nullopt;
}

std::optional<std::string> check_legal(const rules::Rule& rule, const std::vector<Op>& ops, int b, int e,
                                       rules::Pass pass) {
  using K = rules::Impl::Kind;
  const auto& impl = rule.impl;
  switch (impl.kind) {
    case K::unfused: return std::nullopt;
    case K::generated: {
      Skeleton sk;
      if (auto p = chain_problem(ops, b, e, &sk)) return p;
      if (codegen::skeleton_name(sk) != impl.skeleton)
        return "the ops need the " + codegen::skeleton_name(sk) + " skeleton, the rule names " + impl.skeleton;
      return std::nullopt;
    }
    case K::cublaslt: {
      bool bwd_epi = impl.epilogue == "DGRAD_ACCUMULATE" || impl.epilogue == "SCALED" ||
                     impl.epilogue == "DGELU_BGRAD" || impl.epilogue == "BGRADB";
      if (bwd_epi != (pass == rules::Pass::backward))
        return "epilogue " + impl.epilogue + " belongs to the " + (bwd_epi ? "backward" : "forward") + " pass";
      if (e - b < impl.epilogue_ops) return "window shorter than epilogue_ops";
      if (auto p = epilogue_problem(impl.epilogue, ops, b, e, impl.epilogue_ops)) return p;
      if (b + impl.epilogue_ops < e) {
        if (pass != rules::Pass::forward) return "backward GEMM groups take no generated tail";
        Skeleton sk;
        if (auto p = chain_problem(ops, b + impl.epilogue_ops, e, &sk)) return "tail: " + *p;
        if (sk != Skeleton::elementwise) return "tail must be an elementwise chain";
      }
      return std::nullopt;
    }
    case K::joint: {
      if (impl.strategy == "regenerate_dropout_mask") {
        Skeleton sk;
        if (auto p = chain_problem(ops, b, e, &sk)) return p;
        if (sk != Skeleton::elementwise) return "regenerate_dropout_mask needs an elementwise chain";
        bool any = false;
        for (int i = b; i < e; ++i) any |= dropout_active(ops[i]);
        if (!any) return "no active dropout in the window (eval mode or p = 0): nothing to regenerate";
        return std::nullopt;
      }
      if (impl.strategy == "recompute_linear_output") {
        if (e - b != 2 || ops[b].family != Family::linear || ops[b + 1].family != Family::pointwise ||
            !saves(ops[b + 1], ops::SavedKind::input))
          return "recompute_linear_output implements [linear, pointwise op that saves its input]";
        return std::nullopt;
      }
      if (impl.strategy == "relu_bitmask") {
        if (e - b < 4 || e - b > 5 || ops[b].family != Family::linear || ops[b + 1].family != Family::bias ||
            ops[b + 2].kind != "relu" || ops[b + 3].family != Family::linear ||
            (e - b == 5 && ops[b + 4].family != Family::bias))
          return "relu_bitmask implements [linear, bias, relu, linear] and [linear, bias, relu, linear, bias]";
        if (ops::cols_of(ops[b].out) % 8 != 0)
          return "relu_bitmask: the hidden width " + std::to_string(ops::cols_of(ops[b].out)) +
                 " must be a multiple of 8 (cuBLASLt rows are 16-byte aligned)";
        return std::nullopt;
      }
      return "unknown joint strategy " + impl.strategy;
    }
  }
  return "unknown implementation";
}

fuser::LegalityFn legality() {
  return [](const rules::Rule& rule, const std::vector<Op>& ops, int b, int e, rules::Pass pass) {
    return check_legal(rule, ops, b, e, pass);
  };
}

bool chain_vectorizable(const std::vector<Op>& ops, int b, int e) {
  for (int i = b; i < e; ++i)
    if (ops::cols_of(ops[i].in) % 8 != 0 || ops::cols_of(ops[i].out) % 8 != 0) return false;
  return true;
}

KernelSpec chain_spec(const std::vector<Op>& ops, int b, int e, const ChainOptions& opt) {
  Skeleton sk;
  if (auto p = chain_problem(ops, b, e, &sk)) fail(Status::internal, "lowering an illegal chain: {}", *p);
  KernelSpec spec;
  spec.skeleton = sk;
  spec.dir = opt.dir;
  spec.dtype = opt.dtype;
  spec.vec = opt.vec;
  spec.rule = opt.rule;
  const bool fwd = opt.dir == codegen::Direction::forward;
  const bool train = opt.training;
  bool after_anchor = false;
  std::string label;
  for (int i = b; i < e; ++i) {
    const Op& op = ops[i];
    label += (label.empty() ? "" : "_") + op.kind;
    if (!op.template_file.empty()) spec.headers[op.template_file] = "";
    if (op.family == Family::norm) {
      codegen::NormSpec ns;
      ns.op = i;
      ns.rms = op.kind == "rmsnorm";
      ns.eps = op.num("eps");
      ns.zero_centered = op.flag("zero_centered_gamma");
      ns.save_stats = fwd && train;
      ns.save_input = fwd && train && i != b;
      spec.norm = ns;
      spec.cols = ops::cols_of(op.in);
      after_anchor = true;
      continue;
    }
    if (op.family == Family::gated) {
      codegen::GatedSpec gs;
      gs.op = i;
      gs.functor = op.functor;
      gs.save_input = fwd && train && i != b;
      spec.gated = gs;
      spec.cols = ops::cols_of(op.out);
      after_anchor = true;
      continue;
    }
    if (op.kind == "quantize" && opt.fp8 && fwd) {
      // Under an FP8 recipe quantize is the sequence's last op: the cast of the kernel's output.
      if (i + 1 != e) fail(Status::internal, "lowering: {} under an FP8 recipe must end its group", op.label());
      spec.fp8 = *opt.fp8;
      spec.fp8->op = i;
      continue;
    }
    Stage s;
    s.op = i;
    s.op_kind = op.kind;
    s.math = op.info->math;
    switch (op.family) {
      case Family::bias: s.kind = Stage::Kind::bias; break;
      case Family::add_extra_input: s.kind = Stage::Kind::extra_add; break;
      case Family::make_extra_output: s.kind = Stage::Kind::extra_tap; break;
      case Family::dropout:
        if (dropout_active(op)) {
          s.kind = Stage::Kind::dropout;
          s.dropout_p = op.num("p");
          s.dropout_regenerate = opt.regenerate_dropout;
          s.dropout_save_mask = fwd && train && !opt.regenerate_dropout;
        } else {
          s.kind = Stage::Kind::unary;
          s.functor = "jf_op_identity";
          spec.headers["ops/activations.cuh"] = "";
        }
        break;
      default:
        s.kind = Stage::Kind::unary;
        s.functor = op.functor;
        s.consts = op.consts;
        s.saved_is_output = saves(op, ops::SavedKind::output);
        s.save_input = fwd && train && saves(op, ops::SavedKind::input) && i != b;
        s.save_output = fwd && train && saves(op, ops::SavedKind::output) && i + 1 != e;
        break;
    }
    (after_anchor ? spec.post : spec.pre).push_back(s);
  }
  if (sk == Skeleton::elementwise) spec.cols = ops::cols_of(ops[b].in);
  spec.label = label;
  return spec;
}

}  // namespace jitfuse::exec
