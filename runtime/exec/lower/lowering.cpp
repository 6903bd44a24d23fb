// Chains of ops into KernelSpecs and kernel steps, linear ops into GEMM steps: the lowering vocabulary
// the implementations share.
#include "exec/lower/lowering.hpp"

#include "exec/lower/impl/implementation.hpp"

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

}  // namespace

bool chain_vectorizable(const std::vector<Op>& ops, int b, int e) {
  for (int i = b; i < e; ++i)
    if (ops::cols_of(ops[i].in) % 8 != 0 || ops::cols_of(ops[i].out) % 8 != 0) return false;
  return true;
}

namespace {
// The pointwise stage of op i of a chain [b, e) (not its norm, gated op or quantize).
Stage stage_of(const std::vector<Op>& ops, int i, int b, int e, const ChainOptions& opt, KernelSpec& spec) {
  const Op& op = ops[static_cast<size_t>(i)];
  const bool fwd = opt.dir == codegen::Direction::forward;
  const bool train = opt.training;
  Stage s;
  s.op = i;
  s.op_kind = op.kind;
  s.math = op.info->math;
  switch (op.family) {
    case Family::bias: s.kind = Stage::Kind::bias; break;
    case Family::add_extra_input:
      s.kind = Stage::Kind::extra_add;
      s.grad_accumulate = !fwd && op.grad_accumulate;
      break;
    case Family::make_extra_output:
      s.kind = Stage::Kind::extra_tap;
      s.grad_two_parts = !fwd && op.grad_two_parts;
      break;
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
  return s;
}
}  // namespace

KernelSpec chain_spec(const std::vector<Op>& ops, int b, int e, const ChainOptions& opt) {
  Skeleton sk = Skeleton::elementwise;
  const bool identity_half = opt.comm_identity && e == b + 1 && ops[static_cast<size_t>(b)].family == Family::comm;
  if (!identity_half)
    if (auto p = chain_problem(window_of(ops, b, e), 0, &sk)) fail(Status::internal, "lowering an illegal chain: {}", *p);
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
    (after_anchor ? spec.post : spec.pre).push_back(stage_of(ops, i, b, e, opt, spec));
  }
  if (sk == Skeleton::elementwise) spec.cols = ops::cols_of(ops[b].in);
  spec.label = label;
  return spec;
}

ChainOptions chain_options(const Builder& b) {
  ChainOptions opt;
  opt.dir = b.forward() ? codegen::Direction::forward : codegen::Direction::backward;
  opt.training = b.training();
  opt.dtype = ops::dtype_name(b.recipe().dtype);
  opt.rule = b.group().rule;
  if (b.recipe().is_fp8() && b.forward()) {
    codegen::Fp8Spec q;
    q.delayed = b.recipe().kind == ops::RecipeKind::fp8_delayed;
    q.margin = b.recipe().margin;
    opt.fp8 = q;
  }
  return opt;
}

void lower_chain(Builder& b, int kb, int e, const ChainOptions& opt0, int64_t rows, int in, int out) {
  ChainOptions opt = opt0;
  opt.vec = chain_vectorizable(b.ops(), kb, e);
  const bool fwd = b.forward();
  if (in < 0) in = fwd ? b.act(kb) : b.grad_of(e);
  if (out < 0) out = fwd ? b.act(e) : b.grad_of(kb);
  KernelSpec spec = chain_spec(b.ops(), kb, e, opt);
  nlohmann::json meta = b.kernel_meta(kb, fwd ? "forward" : "backward");
  const std::string what = b.rule_or_unfused() + ": generated " +
                           codegen::skeleton_name(spec.skeleton);
  lower_spec(b, spec, meta, in, out, rows, what);
}

void lower_spec(Builder& b, const KernelSpec& spec, const nlohmann::json& meta, int in, int out, int64_t rows,
                const std::string& what) {
  if (spec.fp8 && !spec.fp8->delayed) {
    // Current scaling needs amax(output) before the first byte is cast: a first pass reduces it and
    // saves nothing (the cast pass saves the group's context).
    KernelSpec amax = spec;
    amax.fp8->amax_only = true;
    if (amax.norm) amax.norm->save_stats = amax.norm->save_input = false;
    if (amax.gated) amax.gated->save_input = false;
    for (auto* stages : {&amax.pre, &amax.post}) {
      for (auto& st : *stages) st.save_input = st.save_output = st.dropout_save_mask = false;
      // A residual add's backward only writes the gradient (de = g, g unchanged): the cast pass writes it.
      // Run here too, a channel reader that adds its gradient into the channel's would add it twice.
      if (amax.dir == codegen::Direction::backward)
        std::erase_if(*stages, [](const codegen::Stage& st) { return st.kind == codegen::Stage::Kind::extra_add; });
    }
    amax.label += "_amax";
    nlohmann::json m = meta;
    m["pass"] = meta.value("pass", std::string()) + " (amax)";
    b.kernel(amax, m, in, out, rows, what + " (amax pass)");
  }
  b.kernel(spec, meta, in, out, rows, what);
}

namespace {

// An FP8 GEMM step's operand formats and accumulation (TransformerEngine: fast accumulation in the
// forward, full fp32 accumulation in dgrad and wgrad).
cuda::Fp8Gemm fp8_gemm(ops::DType a, ops::DType bt, bool fast) {
  cuda::Fp8Gemm f;
  f.a = a;
  f.b = bt;
  f.fast_accum = fast;
  return f;
}

// fp8_block (cuda::Fp8Scaling): E4M3 x E4M3 with A's and B's block scales, fp32 accumulation.
cuda::Fp8Gemm block_gemm(cuda::Fp8Scaling a, cuda::Fp8Scaling bt) {
  cuda::Fp8Gemm f = fp8_gemm(ops::DType::e4m3, ops::DType::e4m3, false);
  f.a_scaling = a;
  f.b_scaling = bt;
  return f;
}

}  // namespace

GemmStep linear_forward(Builder& b, int lin, int x, int y, cuda::Epilogue epi) {
  GemmStep g = b.linear_gemm(lin, cuda::GemmKind::fwd);
  g.d = y;
  g.call.epilogue = epi;
  if (b.recipe().is_fp8()) {
    check_fp8_linear(b, lin);
    if (epi != cuda::Epilogue::none && epi != cuda::Epilogue::bias)
      fail(Status::internal, "{}: FP8 GEMMs take the BIAS epilogue only, not {}", b.ops()[lin].label(),
           cuda::epilogue_name(epi));
    if (!b.fp8_operand(lin, fp8::Operand::input).ready) fp8_cast_operand(b, lin, fp8::Operand::input, x, lin, lin);
    if (!b.fp8_operand(lin, fp8::Operand::weight).ready)
      fp8_cast_operand(b, lin, fp8::Operand::weight, b.param(lin, Key::weight), lin, lin);
    const auto& xin = b.fp8_operand(lin, fp8::Operand::input);
    const auto& w = b.fp8_operand(lin, fp8::Operand::weight);
    g.call.fp8 = b.recipe().is_block() ? block_gemm(cuda::Fp8Scaling::row128, cuda::Fp8Scaling::block128)
                                       : fp8_gemm(ops::DType::e4m3, ops::DType::e4m3, true);
    if (b.recipe().is_block() && epi != cuda::Epilogue::none)
      fail(Status::internal, "{}: fp8_block GEMMs take no epilogue ({})", b.ops()[lin].label(), cuda::epilogue_name(epi));
    g.a = xin.row;
    g.b = w.row;
    g.a_scale_inv = xin.scale_inv;
    g.b_scale_inv = w.scale_inv;
    return g;
  }
  g.a = x;
  g.b = b.param(lin, Key::weight);
  if (b.ops()[lin].split_weight()) g.b2 = b.param(lin, Key::weight2);
  return g;
}

Fp8BackwardGemms fp8_backward_gemms(Builder& b, int lin, const LinearBackward& lb) {
  const auto& op = b.ops()[lin];
  check_fp8_linear(b, lin);
  if (lb.dgrad_epilogue != cuda::Epilogue::none || lb.bias_grad_op >= 0 || lb.input >= 0)
    fail(Status::internal, "{}: FP8 dgrad/wgrad take no epilogue", op.label());
  if (!b.fp8_operand(lin, fp8::Operand::grad_output).ready) fp8_cast_operand(b, lin, fp8::Operand::grad_output, lb.dy, lin + 1, lin + 1);
  const auto& dy = b.fp8_operand(lin, fp8::Operand::grad_output);
  const auto& w = b.fp8_operand(lin, fp8::Operand::weight);
  const auto& x = b.fp8_operand(lin, fp8::Operand::input);
  const int64_t m = ops::rows_of(op.in), k = ops::cols_of(op.in), n = ops::cols_of(op.out);
  const std::string who = b.rule_or_unfused();
  // Both as the TN primitive D[rows, cols] = (A[rows, inner] . B[cols, inner]^T) on E5M2 dy x E4M3 (fp8_block:
  // E4M3 x E4M3 with block scales: dgrad 1x128 dy x 128x128 W^T, wgrad 1x128 dy^T x 1x128 x^T, each transposed
  // copy with the scales of its own cast).
  const bool block = b.recipe().is_block();
  using cuda::Fp8Scaling;
  auto tn = [&](int64_t rows, int64_t cols, int64_t inner, int a, int a_si, int bt, int b_si, int d,
                Fp8Scaling b_scaling) {
    GemmStep g = b.linear_gemm(lin, cuda::GemmKind::fwd);
    g.call.m = rows;
    g.call.n = cols;
    g.call.k = inner;
    g.call.alpha = lb.alpha;
    g.call.fp8 = block ? block_gemm(Fp8Scaling::row128, b_scaling) : fp8_gemm(ops::DType::e5m2, ops::DType::e4m3, false);
    g.a = a;
    g.a_scale_inv = a_si;
    g.b = bt;
    g.b_scale_inv = b_si;
    g.d = d;
    return g;
  };
  // dx[m,k] = dy[m,n] . (W^T[k,n])^T
  GemmStep dg = tn(m, k, n, dy.row, dy.scale_inv, w.col, block ? w.col_scale_inv : w.scale_inv, lb.dx,
                   Fp8Scaling::block128);
  if (lb.accumulate >= 0) {
    dg.call.beta = 1.f;
    dg.c = lb.accumulate;
  }
  // dW[n,k] = dy^T[n,m] . (x^T[k,m])^T
  GemmStep wg = tn(n, k, m, dy.col, block ? dy.col_scale_inv : dy.scale_inv, x.col,
                   block ? x.col_scale_inv : x.scale_inv, b.grad(lin, Key::weight), Fp8Scaling::row128);
  wg.call.beta = op.flag("accumulate_grad") ? 1.f : 0.f;
  return {dg, wg,
          who + ": FP8 dgrad " + op.label() + (block ? " (E4M3 dy 1x128 x E4M3 W^T 128x128 block scales)" : " (E5M2 dy x E4M3 W^T)"),
          who + ": FP8 wgrad " + op.label() + (block ? " (E4M3 dy^T x E4M3 x^T, 1x128 block scales)" : " (E5M2 dy^T x E4M3 x^T)")};
}

namespace {

// The FP8 backward of linear `lin`: dy cast to E5M2 (row-major and transposed; unless a kernel of the
// group already wrote it, e.g. with dbias and an activation's backward), then dgrad and wgrad as the TN
// primitive over the FP8 copies.
void linear_backward_fp8(Builder& b, int lin, const LinearBackward& lb) {
  const Fp8BackwardGemms g = fp8_backward_gemms(b, lin, lb);
  b.gemm(g.dgrad, g.dgrad_what);
  b.gemm(g.wgrad, g.wgrad_what);
}

}  // namespace

void linear_backward(Builder& b, int lin, const LinearBackward& lb) {
  if (b.recipe().is_fp8()) return linear_backward_fp8(b, lin, lb);
  const auto& op = b.ops()[lin];
  const std::string who = b.rule_or_unfused();
  GemmStep dg = b.linear_gemm(lin, cuda::GemmKind::dgrad);
  dg.call.alpha = lb.alpha;
  dg.a = lb.dy;
  dg.b = b.param(lin, Key::weight);
  if (op.split_weight()) dg.b2 = b.param(lin, Key::weight2);
  dg.d = lb.dx;
  if (lb.accumulate >= 0) {
    dg.call.beta = 1.f;
    dg.c = lb.accumulate;
  }
  dg.call.epilogue = lb.dgrad_epilogue;
  dg.aux = lb.dgrad_aux;
  dg.bias = lb.dgrad_bias;
  b.gemm(dg, who + ": dgrad " + op.label() + (lb.dgrad_epilogue == cuda::Epilogue::none
                                                  ? std::string()
                                                  : " + " + cuda::epilogue_name(lb.dgrad_epilogue)));
  GemmStep wg = b.linear_gemm(lin, cuda::GemmKind::wgrad);
  wg.call.alpha = lb.alpha;
  wg.a = lb.dy;
  wg.b = lb.input >= 0 ? lb.input : b.saved_context(lin, Key::input);
  wg.d = b.grad(lin, Key::weight);
  if (op.split_weight()) wg.b2 = b.grad(lin, Key::weight2);
  wg.call.beta = op.flag("accumulate_grad") ? 1.f : 0.f;
  if (lb.bias_grad_op >= 0) {
    // db = column sums of dy, taken by the wgrad GEMM that reads dy anyway (ones: the fallback's column).
    wg.call.epilogue = cuda::Epilogue::bgradb;
    wg.bias = b.grad(lb.bias_grad_op, Key::bias);
    wg.bias_grad_fallback = true;
    wg.ones = b.temp("ones", b.recipe().dtype, wg.call.m, 1);
  }
  b.gemm(wg, who + ": wgrad " + op.label() + (lb.bias_grad_op >= 0 ? " + BGRADB" : ""));
}

}  // namespace jitfuse::exec
