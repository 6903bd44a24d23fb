// The GPU-vs-reference check: random inputs, poisoned outputs, forward + backward, comparison.
#include "harness/check.hpp"

#include <cmath>
#include <cstring>
#include <memory>
#include <random>

#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "harness/device_tensor.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "reference/fp8.hpp"
#include "reference/sequence.hpp"

namespace jitfuse::harness {
namespace {

using reference::ParamKey;
using reference::SeqForward;
using reference::SeqGrads;
using reference::SeqInputs;
using reference::Vec;

void ok(jf_status s, const char* what) {
  if (s != JF_OK) throw Error(static_cast<Status>(s), fmt::format("{}: {}", what, jf_last_error()));
}

Vec random_vec(std::mt19937_64& rng, int64_t n, double lo, double hi, const std::string& recipe) {
  std::uniform_real_distribution<double> u(lo, hi);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  reference::round_all(recipe, v);
  return v;
}

// FP8 recipes. Elementwise against the quantising reference: 4x DESIGN's FP8 tolerance (rtol 0.125,
// atol 0.0675): that reference cannot mirror every bf16 rounding between two groups, and one flipped E5M2
// code is a 12.5-25 % change of that element. Normwise: 2^-4 (half an E4M3 step) against the quantising
// reference, 0.125 (DESIGN's FP8 rtol) against the exact one.
constexpr double kFp8Rtol = 0.5, kFp8Atol = 0.27, kFp8QuantizedBound = 0.0625, kFp8ExactBound = 0.125;

TensorCheck compare(const std::string& name, const Vec& got, const Vec& ref, double atol, double rtol) {
  TensorCheck c;
  c.name = name;
  c.n = static_cast<int64_t>(ref.size());
  c.atol = atol;
  c.rtol = rtol;
  double ss = 0;
  for (double r : ref) ss += r * r;
  const double rms = ref.empty() ? 0 : std::sqrt(ss / static_cast<double>(ref.size()));
  for (size_t i = 0; i < ref.size(); ++i) {
    c.max_ref = std::max(c.max_ref, std::fabs(ref[i]));
    if (std::isnan(got[i])) {
      ++c.unwritten;
      continue;
    }
    const double err = std::fabs(got[i] - ref[i]);
    const double tol = atol + rtol * (std::fabs(ref[i]) + rms);
    c.max_abs_err = std::max(c.max_abs_err, err);
    c.worst = std::max(c.worst, err / tol);
    if (!(err <= tol)) ++c.failures;
  }
  return c;
}

// FP8: the error of a whole tensor, ||got - ref|| / ||ref||, against `bound` (worst = that ratio / bound).
// An FP8 GEMM's output carries per-element rounding noise of its operands (E4M3: up to 2^-4 relative,
// E5M2: 2^-3) summed over k products, so single elements far from their own magnitude are expected; the
// tensor's relative error is what the format determines. (Elementwise checks run beside it, looser.)
TensorCheck compare_normwise(const std::string& name, const Vec& got, const Vec& ref, double bound) {
  TensorCheck c;
  c.name = name;
  c.n = static_cast<int64_t>(ref.size());
  c.rtol = bound;
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    c.max_ref = std::max(c.max_ref, std::fabs(ref[i]));
    if (std::isnan(got[i])) {
      ++c.unwritten;
      continue;
    }
    const double d = got[i] - ref[i];
    c.max_abs_err = std::max(c.max_abs_err, std::fabs(d));
    num += d * d;
    den += ref[i] * ref[i];
  }
  const double rel = den > 0 ? std::sqrt(num / den) : std::sqrt(num);
  c.worst = rel / bound;
  c.failures = c.worst <= 1.0 ? 0 : 1;
  return c;
}

}  // namespace

void tolerance(const std::string& recipe, bool has_gemm, size_t n_ops, double* atol, double* rtol) {
  if (recipe == "fp32" && !has_gemm) {
    *rtol = 1.3e-6;
    *atol = 1e-5;
  } else if (recipe == "fp32" || recipe == "fp16") {
    *rtol = 1e-3;
    *atol = 1e-5;
  } else {
    *rtol = 1.6e-2;
    *atol = 1e-5;
  }
  // Each op may round its output once to the storage dtype; errors add along the chain.
  const double k = static_cast<double>(std::max<size_t>(1, n_ops));
  *rtol *= k;
  *atol *= k;
}

bool CheckReport::pass() const {
  for (auto& t : tensors)
    if (!t.pass()) return false;
  return !tensors.empty();
}

std::string CheckReport::table() const {
  std::string out = fmt::format("  {:<28} {:>10} {:>11} {:>11} {:>9} {:>9}  {}\n", "tensor", "elements", "max |err|",
                                "max |ref|", "err/tol", "unwritten", "result");
  for (auto& t : tensors)
    out += fmt::format("  {:<28} {:>10} {:>11.3e} {:>11.3e} {:>9.3f} {:>9}  {}\n", t.name, t.n, t.max_abs_err,
                       t.max_ref, t.worst, t.unwritten, t.pass() ? "ok" : "FAIL");
  return out;
}

namespace {

// The device side of one check: every tensor its calls read or write (owned by `keep`, in the check's
// storage dtype, offset by one element when misaligned), and their C ABI views.
struct Tensors {
  std::string dtype;
  bool misalign = false;
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  std::map<ParamKey, DeviceTensor*> grads;
  std::vector<jf_param> params, grad_params;
  DeviceTensor* x = nullptr;
  DeviceTensor* y = nullptr;
  std::vector<DeviceTensor*> ein, eout, gein, geout;
  std::vector<Vec> gext_out;  // the extra outputs' gradients, as uploaded
  std::vector<const DLTensor*> ein_t;
  std::vector<DLTensor*> eout_t;

  DeviceTensor* make(const ops::Shape& s) {
    keep.push_back(std::make_unique<DeviceTensor>(s, dtype, misalign));
    return keep.back().get();
  }
};

// Parameters drawn where training starts them: a linear's weight within +-1/sqrt(in_features), a norm's
// gamma around 1 (around 0 when zero-centred), the rest within +-1. Each goes to the device and to the
// reference; its gradient gets a tensor of its own.
void upload_params(Tensors& t, SeqInputs& in, const std::vector<ops::Op>& ops, std::mt19937_64& rng,
                   CUstream stream) {
  const std::string& rc = t.dtype;
  for (auto& op : ops) {
    for (auto& p : op.params) {
      Vec v;
      if (op.family == ops::Family::linear || op.family == ops::Family::grouped_linear) {
        double s = 1.0 / std::sqrt(static_cast<double>(p.shape.back()));  // in_features
        v = random_vec(rng, ops::numel(p.shape), -s, s, rc);
      } else if (op.family == ops::Family::norm && p.name == "weight") {
        v = op.flag("zero_centered_gamma") ? random_vec(rng, ops::numel(p.shape), -0.5, 0.5, rc)
                                           : random_vec(rng, ops::numel(p.shape), 0.5, 1.5, rc);
      } else {
        v = random_vec(rng, ops::numel(p.shape), -1, 1, rc);
      }
      DeviceTensor* dt = t.make(p.shape);
      dt->upload_values(v, stream);
      in.params[{op.index, p.name}] = v;
      t.params.push_back({op.index, p.name.c_str(), dt->dl()});
      DeviceTensor* gt = t.make(p.shape);
      t.grads[{op.index, p.name}] = gt;
      t.grad_params.push_back({op.index, p.name.c_str(), gt->dl()});
    }
  }
}

// A moe op's extra input. moe_permute's indices: distinct experts per token, skewed — expert 0 about four times
// as often as the others and the last quarter of the experts never picked (empty groups). moe_unpermute's
// probabilities: fp32 in [0.05, 1], with an fp32 gradient of the same shape.
void upload_routing(Tensors& t, SeqInputs& in, const ops::Op& op, std::mt19937_64& rng, CUstream stream) {
  const ops::Shape& shape = op.extra_input->shape;
  Vec v(static_cast<size_t>(ops::numel(shape)));
  if (op.kind == "moe_permute") {
    const int64_t e = op.attrs.at("num_experts").get<int64_t>(), k = op.attrs.at("top_k").get<int64_t>();
    const int64_t live = std::min(e, std::max<int64_t>(k + 1, e * 3 / 4));
    std::uniform_int_distribution<int64_t> pick(0, live - 1);
    std::bernoulli_distribution hot(std::min(1.0, 4.0 / static_cast<double>(live)));
    for (int64_t r = 0; r < shape[0]; ++r)
      for (int64_t j = 0; j < k; ++j) {
        int64_t x = 0;
        bool dup = true;
        while (dup) {
          x = (j == 0 && hot(rng)) ? 0 : pick(rng);
          dup = false;
          for (int64_t i = 0; i < j; ++i) dup = dup || v[static_cast<size_t>(r * k + i)] == static_cast<double>(x);
        }
        v[static_cast<size_t>(r * k + j)] = static_cast<double>(x);
      }
  } else {
    std::uniform_real_distribution<double> p(0.05, 1.0);
    for (auto& x : v) x = static_cast<double>(static_cast<float>(p(rng)));
  }
  in.extra_in.push_back(v);
  const std::string dt = ops::dtype_name(op.extra_input->dtype);
  t.keep.push_back(std::make_unique<DeviceTensor>(shape, dt, t.misalign));
  t.ein.push_back(t.keep.back().get());
  t.ein.back()->upload_values(v, stream);
  if (op.info->extra_input_grad) {
    t.keep.push_back(std::make_unique<DeviceTensor>(shape, dt, t.misalign));
    t.gein.push_back(t.keep.back().get());
  } else {
    t.gein.push_back(nullptr);  // integers: no gradient
  }
}

// The input, every extra input (random) and extra output's gradient (random), and the outputs, poisoned
// (NaN) so that an element no kernel writes is seen.
void upload_inputs(Tensors& t, SeqInputs& in, const std::vector<ops::Op>& ops, const ops::Shape& shape,
                   std::mt19937_64& rng, CUstream stream) {
  const std::string& rc = t.dtype;
  t.x = t.make(shape);
  t.x->upload_values(in.input, stream);
  for (auto& op : ops) {
    if (op.extra_slot < 0) continue;  // a channel's op without a caller tensor of its own
    if (op.family == ops::Family::add_extra_input) {
      in.extra_in.push_back(random_vec(rng, ops::numel(op.in), -2, 2, rc));
      t.ein.push_back(t.make(op.in));
      t.ein.back()->upload_values(in.extra_in.back(), stream);
      t.gein.push_back(t.make(op.in));
    }
    if (op.extra_input && op.family == ops::Family::moe) {
      upload_routing(t, in, op, rng, stream);
      continue;
    }
    if (op.extra_input) {  // cross_entropy's labels: random classes, about a fifth of the rows ignored (not row 0)
      const int64_t v = ops::cols_of(op.in), ignore = op.attrs.at("ignore_index").get<int64_t>();
      std::uniform_int_distribution<int64_t> cls(0, v - 1);
      std::bernoulli_distribution skip(0.2);
      Vec labels(static_cast<size_t>(ops::numel(op.extra_input->shape)));
      for (size_t r = 0; r < labels.size(); ++r) labels[r] = static_cast<double>(r > 0 && skip(rng) ? ignore : cls(rng));
      in.extra_in.push_back(labels);
      t.keep.push_back(std::make_unique<DeviceTensor>(op.extra_input->shape, ops::dtype_name(op.extra_input->dtype),
                                                      t.misalign));
      t.ein.push_back(t.keep.back().get());
      t.ein.back()->upload_values(labels, stream);
      t.gein.push_back(nullptr);  // labels have no gradient: NULL in grad_extra_inputs
    }
    if (op.family == ops::Family::make_extra_output) {
      t.eout.push_back(t.make(op.in));
      t.geout.push_back(t.make(op.in));
      t.gext_out.push_back(random_vec(rng, ops::numel(op.in), -1, 1, rc));
      t.geout.back()->upload_values(t.gext_out.back(), stream);
    }
  }
  t.y = t.make(ops.back().out);
  t.y->poison(stream);
  for (auto* e : t.eout) e->poison(stream);
  for (auto* e : t.ein) t.ein_t.push_back(e->dl());
  for (auto* e : t.eout) t.eout_t.push_back(e->dl());
}

// Host memory: one raw buffer each, NaN-poisoned like outputs, freed with the check once the device is
// done with it.
struct RawBuffers {
  CUstream stream;
  std::vector<CUdeviceptr> v;

  void* alloc(size_t bytes) {
    if (!bytes) return nullptr;
    const auto& d = cuda::driver();
    CUdeviceptr p = 0;
    cuda::check(d.cuMemAlloc(&p, bytes), "cuMemAlloc");
    v.push_back(p);
    cuda::check(d.cuMemsetD8Async(p, 0xFF, bytes, stream), "cuMemsetD8Async");  // NaN-poisoned, like outputs
    return reinterpret_cast<void*>(p);
  }
  ~RawBuffers() {
    if (auto* d = cuda::try_driver()) {
      d->cuCtxSynchronize();
      for (auto p : v) d->cuMemFree(p);
    }
  }
};

// The forward's arguments: the tensors, the training flag, the randomness (a device {seed, offset} state,
// or host values) and, with host memory, the saved buffer and workspace sized by jf_sequence_info.
jf_forward_args forward_args(Tensors& t, RawBuffers& raw, const jf_program_info& info, const CheckOptions& opt,
                             CUstream stream) {
  jf_forward_args fa{};
  fa.input = t.x->dl();
  fa.extra_inputs = t.ein_t.data();
  fa.n_extra_inputs = static_cast<int>(t.ein_t.size());
  fa.output = t.y->dl();
  fa.extra_outputs = t.eout_t.data();
  fa.n_extra_outputs = static_cast<int>(t.eout_t.size());
  fa.params = t.params.data();
  fa.n_params = static_cast<int>(t.params.size());
  fa.training = opt.backward ? 1 : 0;
  if (opt.device_rng) {
    const uint64_t state[2] = {opt.rng_seed, opt.rng_offset};
    void* p = raw.alloc(16);
    host_to_device(reinterpret_cast<CUdeviceptr>(p), state, 16, stream);
    fa.rng_state = static_cast<const uint64_t*>(p);
  } else {
    fa.rng_seed = opt.rng_seed;
    fa.rng_offset = opt.rng_offset;
  }
  if (opt.host_memory) {
    fa.saved = raw.alloc(info.saved_bytes);
    fa.saved_bytes = info.saved_bytes;
    fa.workspace = raw.alloc(info.forward_workspace_bytes);
    fa.workspace_bytes = info.forward_workspace_bytes;
  }
  return fa;
}

// What the backward calls of a check share: one backward of the forward that left `sv` (or the host's
// saved buffer), dy = gy, dx into `gxt`.
struct Backward {
  jf_sequence seq;
  jf_stream js;
  CUstream stream;
  const CheckOptions& opt;
  const jf_program_info& info;
  const jf_forward_args& fa;
  Tensors& t;
  RawBuffers& raw;
  const std::vector<ops::Op>& ops;
  const Vec& gy;

  void operator()(jf_saved sv, DeviceTensor* gxt) const {
    DeviceTensor* gyt = t.make(ops.back().out);
    gyt->upload_values(gy, stream);
    std::vector<const DLTensor*> geout_t;
    std::vector<DLTensor*> gein_t;
    for (auto* e : t.geout) geout_t.push_back(e->dl());
    for (auto* e : t.gein) gein_t.push_back(e ? e->dl() : nullptr);
    jf_backward_args ba{};
    ba.input = t.x->dl();
    ba.extra_inputs = t.ein_t.data();
    ba.n_extra_inputs = fa.n_extra_inputs;
    ba.output = t.y->dl();
    ba.extra_outputs = const_cast<const DLTensor* const*>(t.eout_t.data());
    ba.n_extra_outputs = fa.n_extra_outputs;
    ba.params = t.params.data();
    ba.n_params = fa.n_params;
    ba.grads = t.grad_params.data();
    ba.n_grads = static_cast<int>(t.grad_params.size());
    if (fa.saved) {
      ba.saved = fa.saved;
      ba.saved_bytes = fa.saved_bytes;
    } else {
      void* b = nullptr;
      ok(jf_saved_buffer(sv, &b, &ba.saved_bytes), "jf_saved_buffer");
      ba.saved = b;
    }
    ba.grad_output = gyt->dl();
    ba.grad_extra_outputs = geout_t.data();
    ba.n_grad_extra_outputs = static_cast<int>(geout_t.size());
    ba.grad_input = gxt->dl();
    ba.grad_extra_inputs = gein_t.data();
    ba.n_grad_extra_inputs = static_cast<int>(gein_t.size());
    if (opt.host_memory) {
      ba.workspace = raw.alloc(info.backward_workspace_bytes);
      ba.workspace_bytes = info.backward_workspace_bytes;
    }
    ok(jf_backward(seq, &ba, js), "jf_backward");
  }
};

// The calls before the compared one (CheckOptions::calls), on the same inputs, each also run by the
// reference: under FP8 both recipe states advance alike (the delayed amax history rolls).
void earlier_calls(const Backward& backward, jf_forward_args& fa, SeqInputs& in) {
  const auto& d = cuda::driver();
  Tensors& t = backward.t;
  for (int call = 1; call < backward.opt.calls; ++call) {
    jf_saved early = nullptr;
    ok(jf_forward(backward.seq, &fa, &early, backward.js), "jf_forward");
    SeqForward rf = reference::sequence_forward(backward.ops, in);
    if (backward.opt.backward) {
      backward(early, t.make(backward.opt.shape));
      reference::sequence_backward(backward.ops, in, rf, backward.gy, t.gext_out);
    }
    cuda::check(d.cuStreamSynchronize(backward.stream), "cuStreamSynchronize(earlier call)");
    if (early) ok(jf_saved_release(early, backward.js), "jf_saved_release");
    t.y->poison(backward.stream);
    for (auto* e : t.eout) e->poison(backward.stream);
  }
}

// The report being built: every tensor against its reference; without one (user-declared ops), against
// itself, which counts only unwritten (NaN) elements.
struct Comparison {
  CheckReport rep;
  bool fp8 = false, self = false;
  double atol = 0, rtol = 0;

  void check(const std::string& name, const Vec& got, const Vec* ref) {
    Vec mine;
    if (self) {
      mine = got;
      for (auto& v : mine)
        if (std::isnan(v)) v = 0;
    }
    rep.tensors.push_back(compare(name, got, self ? mine : *ref, atol, rtol));
    // FP8: the tensor's relative error against the quantising reference, too (see compare_normwise).
    if (fp8 && !self) rep.tensors.push_back(compare_normwise(name + " normwise", got, *ref, kFp8QuantizedBound));
  }
  // FP8: every tensor also against the exact (unquantised) float64 reference, at DESIGN's FP8 tolerance.
  void check_exact(const std::string& name, const Vec& got, const Vec& ref) {
    if (fp8) rep.tensors.push_back(compare_normwise(name + " vs exact normwise", got, ref, kFp8ExactBound));
  }
};

// Tolerances: DESIGN's per dtype, scaled by the number of ops (tolerance()); FP8 recipes: kFp8Atol/Rtol.
Comparison comparison(const std::string& rc, bool has_gemm, size_t n_ops, bool fp8, bool self) {
  Comparison c;
  c.fp8 = fp8;
  c.self = self;
  tolerance(rc, has_gemm, n_ops, &c.atol, &c.rtol);
  if (fp8) {
    c.atol = kFp8Atol;
    c.rtol = kFp8Rtol;
  }
  return c;
}

// The backward of the compared forward (its saved context `saved`) on a random dy, with every gradient
// buffer poisoned first; returns the input gradient, once on the host's side of the stream.
const DeviceTensor* run_backward(const Backward& backward, jf_saved saved) {
  const CUstream stream = backward.stream;
  DeviceTensor* gx = backward.t.make(backward.opt.shape);
  gx->poison(stream);
  for (auto* e : backward.t.gein)
    if (e) e->poison(stream);
  for (auto& [k, gt] : backward.t.grads) gt->poison(stream);
  backward(saved, gx);
  cuda::check(cuda::driver().cuStreamSynchronize(stream), "cuStreamSynchronize(backward)");
  return gx;
}

// The output and extra outputs against the reference forward (`ref`; FP8: and the exact one, `exact`).
void compare_forward(Comparison& c, const Tensors& t, const std::vector<ops::Op>& ops, const SeqInputs& in,
                     const SeqInputs& exact_in, SeqForward& ref, SeqForward& exact, CUstream stream) {
  if (!c.self) ref = reference::sequence_forward(ops, in);
  if (c.fp8) exact = reference::sequence_forward(ops, exact_in);
  const Vec y_got = t.y->download_values(stream);
  c.check("output", y_got, &ref.output);
  c.check_exact("output", y_got, exact.output);
  for (size_t i = 0; i < t.eout.size(); ++i) {
    const Vec got = t.eout[i]->download_values(stream);
    c.check(fmt::format("extra_output[{}]", i), got, c.self ? nullptr : &ref.extra_out[i]);
    if (c.fp8) c.check_exact(fmt::format("extra_output[{}]", i), got, exact.extra_out[i]);
  }
}

// The input gradient, extra inputs' and parameters' gradients against the reference backward.
void compare_backward(Comparison& c, const Tensors& t, const DeviceTensor& gx, const std::vector<ops::Op>& ops,
                      const SeqInputs& in, const SeqInputs& exact_in, const SeqForward& ref, const SeqForward& exact,
                      const Vec& gy, CUstream stream) {
  SeqGrads rg, eg;
  if (!c.self) rg = reference::sequence_backward(ops, in, ref, gy, t.gext_out);
  if (c.fp8) eg = reference::sequence_backward(ops, exact_in, exact, gy, t.gext_out);
  const Vec gx_got = gx.download_values(stream);
  c.check("grad_input", gx_got, &rg.grad_input);
  if (c.fp8) c.check_exact("grad_input", gx_got, eg.grad_input);
  for (size_t i = 0; i < t.gein.size(); ++i) {
    if (!t.gein[i]) continue;  // labels
    const Vec got = t.gein[i]->download_values(stream);
    c.check(fmt::format("grad_extra_input[{}]", i), got, c.self ? nullptr : &rg.grad_extra_in[i]);
    if (c.fp8) c.check_exact(fmt::format("grad_extra_input[{}]", i), got, eg.grad_extra_in[i]);
  }
  for (auto& [k, gt] : t.grads) {
    const Vec got = gt->download_values(stream);
    c.check(fmt::format("grad op{}.{}", k.first, k.second), got, c.self ? nullptr : &rg.grad_params.at(k));
    if (c.fp8) c.check_exact(fmt::format("grad op{}.{}", k.first, k.second), got, eg.grad_params.at(k));
  }
}

// What check_sequence makes and must give back on every way out (an exception included), released in the
// reverse order of their making: the forward's saved context, then the stream, then the sequence.
struct SeqGuard {
  jf_sequence s;
  ~SeqGuard() { jf_sequence_destroy(s); }
};
struct StreamGuard {
  CUstream s;
  ~StreamGuard() {
    if (auto* d = cuda::try_driver()) d->cuStreamDestroy(s);
  }
};
struct SavedGuard {
  jf_saved s;
  jf_stream st;
  ~SavedGuard() { jf_saved_release(s, st); }
};

}  // namespace

CheckReport check_sequence(jf_context ctx, const ops::Registry& registry, const std::string& json,
                           const CheckOptions& opt) {
  // FP8 recipes keep bf16 tensors (the FP8 copies are the program's own).
  ops::Recipe recipe = ops::parse_recipe(opt.recipe);
  const bool fp8 = recipe.is_fp8();
  const std::string rc = fp8 ? std::string("bf16") : opt.recipe;
  cuda::current_device();  // a current context before any allocation (the primary one if none)
  auto def = ops::parse_sequence(json, "<check>", registry);
  ops::apply_recipe(def, recipe);  // the sequence's FP8 settings (amax history length, margin)
  auto ops = ops::infer(def, opt.shape);
  std::mt19937_64 rng(opt.seed);
  bool has_gemm = false;
  for (auto& op : ops) has_gemm |= op.family == ops::Family::linear;

  jf_sequence seq = nullptr;
  ok(jf_sequence_create(ctx, json.c_str(), opt.recipe.c_str(), &seq), "jf_sequence_create");
  SeqGuard guard{seq};
  if (!def.group.empty()) {
    if (!opt.comm) throw Error(Status::invalid_argument, "sequence runs collectives: CheckOptions::comm is needed");
    ok(jf_sequence_set_comm(seq, def.group.c_str(), opt.comm), "jf_sequence_set_comm");
  }

  // The calls run on a non-blocking stream of their own (as a framework's would): every upload, poison and
  // download of the check goes on it too, so none can race the calls (issue 26).
  const auto& d = cuda::driver();
  CUstream stream = nullptr;
  cuda::check(d.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  StreamGuard sguard{stream};

  SeqInputs in;
  in.rng_offset = opt.rng_offset;
  in.rng_seed = opt.rng_seed;
  in.input = random_vec(rng, ops::numel(opt.shape), -2, 2, rc);
  Tensors t;
  t.dtype = rc;
  t.misalign = opt.misalign;
  upload_params(t, in, ops, rng, stream);
  upload_inputs(t, in, ops, opt.shape, rng, stream);

  RawBuffers raw{stream, {}};
  const auto js = reinterpret_cast<jf_stream>(stream);
  jf_program_info info{};
  ok(jf_sequence_info(seq, opt.shape.data(), static_cast<int>(opt.shape.size()), opt.backward ? 1 : 0, &info),
     "jf_sequence_info");
  jf_forward_args fa = forward_args(t, raw, info, opt, stream);
  // FP8: the reference quantises every GEMM operand as the GPU's casts do, with its own copy of the recipe
  // state; calls before the compared one advance both states (the delayed amax history rolls).
  reference::Fp8Reference q8(recipe);
  if (fp8) {
    in.quantize = [&q8](int op, const std::string& tn, Vec& v, int64_t r, int64_t c) { q8(op, tn, v, r, c); };
    in.transposed_copies = q8.block();
  }
  Vec gy;
  if (opt.backward) gy = random_vec(rng, ops::numel(ops.back().out), -1, 1, rc);
  const Backward backward{seq, js, stream, opt, info, fa, t, raw, ops, gy};
  earlier_calls(backward, fa, in);
  jf_saved saved = nullptr;
  ok(jf_forward(seq, &fa, &saved, js), "jf_forward");
  SavedGuard saved_guard{saved, js};
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(forward)");

  Comparison c = comparison(rc, has_gemm, ops.size(), fp8, opt.no_reference);
  SeqInputs exact_in = in;
  exact_in.quantize = nullptr;
  SeqForward ref, exact;
  compare_forward(c, t, ops, in, exact_in, ref, exact, stream);
  if (!opt.backward) return c.rep;
  const DeviceTensor* gx = run_backward(backward, saved);
  compare_backward(c, t, *gx, ops, in, exact_in, ref, exact, gy, stream);
  return c.rep;
}

}  // namespace jitfuse::harness
