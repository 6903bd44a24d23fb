// The GPU-vs-reference check: random inputs, poisoned outputs, forward + backward, comparison.
#include "reference/check.hpp"

#include <cmath>
#include <cstring>
#include <random>

#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "ops/recipe.hpp"
#include "ops/sequence.hpp"
#include "reference/device_tensor.hpp"
#include "reference/sequence.hpp"

namespace jitfuse::reference {
namespace {

void ok(jf_status s, const char* what) {
  if (s != JF_OK) throw Error(static_cast<Status>(s), fmt::format("{}: {}", what, jf_last_error()));
}

Vec random_vec(std::mt19937_64& rng, int64_t n, double lo, double hi, const std::string& recipe) {
  std::uniform_real_distribution<double> u(lo, hi);
  Vec v(static_cast<size_t>(n));
  for (auto& x : v) x = u(rng);
  round_all(recipe, v);
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

Fp8Reference::Fp8Reference(const ops::Recipe& r)
    : delayed_(r.kind == ops::RecipeKind::fp8_delayed), len_(std::max(1, r.amax_history)),
      margin_(std::ldexp(1.0f, r.margin)) {}

void Fp8Reference::operator()(int op, const std::string& tensor, Vec& v) {
  const bool e5m2 = tensor == "grad_output";
  const float fmax = e5m2 ? 57344.f : 448.f;
  auto& st = state_[{op, tensor}];
  if (st.hist.empty()) st.hist.assign(static_cast<size_t>(len_), 0.f);
  float amax = 0.f;
  for (double x : v) amax = std::max(amax, std::fabs(static_cast<float>(x)));
  const float scale = delayed_ ? st.scale : scale_of(amax, fmax);
  const float scale_inv = 1.f / scale;
  for (double& x : v) {
    const double c = static_cast<double>(static_cast<float>(x) * scale);
    x = (e5m2 ? e5m2_value(e5m2_bits(c)) : e4m3_value(e4m3_bits(c))) * static_cast<double>(scale_inv);
  }
  if (delayed_) {
    for (size_t i = st.hist.size() - 1; i > 0; --i) st.hist[i] = st.hist[i - 1];
    st.hist[0] = amax;
    st.scale = scale_of(*std::max_element(st.hist.begin(), st.hist.end()), fmax);
  }
}

float Fp8Reference::scale_of(float amax, float fmax) const {
  return amax > 0.f && amax < 3.0e38f ? fmax / amax / margin_ : 1.f;
}

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
  struct SeqGuard {
    jf_sequence s;
    ~SeqGuard() { jf_sequence_destroy(s); }
  } guard{seq};
  if (!def.group.empty()) {
    if (!opt.comm) throw Error(Status::invalid_argument, "sequence runs collectives: CheckOptions::comm is needed");
    ok(jf_sequence_set_comm(seq, def.group.c_str(), opt.comm), "jf_sequence_set_comm");
  }

  // The calls run on a non-blocking stream of their own (as a framework's would): every upload, poison and
  // download of the check goes on it too, so none can race the calls (issue 26).
  const auto& d = cuda::driver();
  CUstream stream = nullptr;
  cuda::check(d.cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  struct StreamGuard {
    CUstream s;
    ~StreamGuard() {
      if (auto* d = cuda::try_driver()) d->cuStreamDestroy(s);
    }
  } sguard{stream};

  SeqInputs in;
  in.rng_offset = opt.rng_offset;
  in.rng_seed = opt.rng_seed;
  in.input = random_vec(rng, ops::numel(opt.shape), -2, 2, rc);
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  auto dev = [&](const ops::Shape& s) {
    keep.push_back(std::make_unique<DeviceTensor>(s, rc, opt.misalign));
    return keep.back().get();
  };
  std::map<ParamKey, DeviceTensor*> grads;
  std::vector<jf_param> params, grad_params;
  for (auto& op : ops) {
    for (auto& p : op.params) {
      Vec v;
      if (op.family == ops::Family::linear) {
        double s = 1.0 / std::sqrt(static_cast<double>(p.shape[1]));
        v = random_vec(rng, ops::numel(p.shape), -s, s, rc);
      } else if (op.family == ops::Family::norm && p.name == "weight") {
        v = op.flag("zero_centered_gamma") ? random_vec(rng, ops::numel(p.shape), -0.5, 0.5, rc)
                                           : random_vec(rng, ops::numel(p.shape), 0.5, 1.5, rc);
      } else {
        v = random_vec(rng, ops::numel(p.shape), -1, 1, rc);
      }
      DeviceTensor* t = dev(p.shape);
      t->upload_values(v, stream);
      in.params[{op.index, p.name}] = v;
      params.push_back({op.index, p.name.c_str(), t->dl()});
      DeviceTensor* gt = dev(p.shape);
      grads[{op.index, p.name}] = gt;
      grad_params.push_back({op.index, p.name.c_str(), gt->dl()});
    }
  }
  DeviceTensor* x = dev(opt.shape);
  x->upload_values(in.input, stream);
  std::vector<DeviceTensor*> ein, eout, gein, geout;
  std::vector<Vec> gext_out;
  for (auto& op : ops) {
    if (op.extra_slot < 0) continue;  // a channel's op without a caller tensor of its own
    if (op.family == ops::Family::add_extra_input) {
      in.extra_in.push_back(random_vec(rng, ops::numel(op.in), -2, 2, rc));
      ein.push_back(dev(op.in));
      ein.back()->upload_values(in.extra_in.back(), stream);
      gein.push_back(dev(op.in));
    }
    if (op.extra_input) {  // cross_entropy's labels: random classes, about a fifth of the rows ignored (not row 0)
      const int64_t v = ops::cols_of(op.in), ignore = op.attrs.at("ignore_index").get<int64_t>();
      std::uniform_int_distribution<int64_t> cls(0, v - 1);
      std::bernoulli_distribution skip(0.2);
      Vec labels(static_cast<size_t>(ops::numel(op.extra_input->shape)));
      for (size_t r = 0; r < labels.size(); ++r) labels[r] = static_cast<double>(r > 0 && skip(rng) ? ignore : cls(rng));
      in.extra_in.push_back(labels);
      keep.push_back(std::make_unique<DeviceTensor>(op.extra_input->shape, ops::dtype_name(op.extra_input->dtype),
                                                    opt.misalign));
      ein.push_back(keep.back().get());
      ein.back()->upload_values(labels, stream);
      gein.push_back(nullptr);  // labels have no gradient: NULL in grad_extra_inputs
    }
    if (op.family == ops::Family::make_extra_output) {
      eout.push_back(dev(op.in));
      geout.push_back(dev(op.in));
      gext_out.push_back(random_vec(rng, ops::numel(op.in), -1, 1, rc));
      geout.back()->upload_values(gext_out.back(), stream);
    }
  }
  DeviceTensor* y = dev(ops.back().out);
  y->poison(stream);
  for (auto* t : eout) t->poison(stream);
  std::vector<const DLTensor*> ein_t;
  std::vector<DLTensor*> eout_t;
  for (auto* t : ein) ein_t.push_back(t->dl());
  for (auto* t : eout) eout_t.push_back(t->dl());

  std::vector<CUdeviceptr> keep_raw;
  struct RawGuard {
    std::vector<CUdeviceptr>& v;
    ~RawGuard() {
      if (auto* d = cuda::try_driver()) {
        d->cuCtxSynchronize();
        for (auto p : v) d->cuMemFree(p);
      }
    }
  } raw_guard{keep_raw};
  const auto js = reinterpret_cast<jf_stream>(stream);
  jf_program_info info{};
  ok(jf_sequence_info(seq, opt.shape.data(), static_cast<int>(opt.shape.size()), opt.backward ? 1 : 0, &info),
     "jf_sequence_info");
  // Host memory: one raw buffer each, freed with the check.
  auto raw = [&](size_t bytes) -> void* {
    if (!bytes) return nullptr;
    CUdeviceptr p = 0;
    cuda::check(d.cuMemAlloc(&p, bytes), "cuMemAlloc");
    keep_raw.push_back(p);
    cuda::check(d.cuMemsetD8Async(p, 0xFF, bytes, stream), "cuMemsetD8Async");  // NaN-poisoned, like outputs
    return reinterpret_cast<void*>(p);
  };
  jf_forward_args fa{};
  fa.input = x->dl();
  fa.extra_inputs = ein_t.data();
  fa.n_extra_inputs = static_cast<int>(ein_t.size());
  fa.output = y->dl();
  fa.extra_outputs = eout_t.data();
  fa.n_extra_outputs = static_cast<int>(eout_t.size());
  fa.params = params.data();
  fa.n_params = static_cast<int>(params.size());
  fa.training = opt.backward ? 1 : 0;
  if (opt.device_rng) {
    const uint64_t state[2] = {opt.rng_seed, opt.rng_offset};
    void* p = raw(16);
    host_to_device(reinterpret_cast<CUdeviceptr>(p), state, 16, stream);
    fa.rng_state = static_cast<const uint64_t*>(p);
  } else {
    fa.rng_seed = opt.rng_seed;
    fa.rng_offset = opt.rng_offset;
  }
  if (opt.host_memory) {
    fa.saved = raw(info.saved_bytes);
    fa.saved_bytes = info.saved_bytes;
    fa.workspace = raw(info.forward_workspace_bytes);
    fa.workspace_bytes = info.forward_workspace_bytes;
  }
  // FP8: the reference quantises every GEMM operand as the GPU's casts do, with its own copy of the recipe
  // state; calls before the compared one advance both states (the delayed amax history rolls).
  Fp8Reference q8(recipe);
  if (fp8) in.quantize = [&q8](int op, const std::string& t, Vec& v) { q8(op, t, v); };
  Vec gy;
  if (opt.backward) gy = random_vec(rng, ops::numel(ops.back().out), -1, 1, rc);
  // One backward of the forward that left `sv` (or the host's saved buffer), dy = gy, dx into `gxt`.
  auto backward_call = [&](jf_saved sv, DeviceTensor* gxt) {
    DeviceTensor* gyt = dev(ops.back().out);
    gyt->upload_values(gy, stream);
    std::vector<const DLTensor*> geout_t;
    std::vector<DLTensor*> gein_t;
    for (auto* t : geout) geout_t.push_back(t->dl());
    for (auto* t : gein) gein_t.push_back(t ? t->dl() : nullptr);
    jf_backward_args ba{};
    ba.input = x->dl();
    ba.extra_inputs = ein_t.data();
    ba.n_extra_inputs = fa.n_extra_inputs;
    ba.output = y->dl();
    ba.extra_outputs = const_cast<const DLTensor* const*>(eout_t.data());
    ba.n_extra_outputs = fa.n_extra_outputs;
    ba.params = params.data();
    ba.n_params = fa.n_params;
    ba.grads = grad_params.data();
    ba.n_grads = static_cast<int>(grad_params.size());
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
      ba.workspace = raw(info.backward_workspace_bytes);
      ba.workspace_bytes = info.backward_workspace_bytes;
    }
    ok(jf_backward(seq, &ba, js), "jf_backward");
  };
  for (int call = 1; call < opt.calls; ++call) {
    jf_saved early = nullptr;
    ok(jf_forward(seq, &fa, &early, js), "jf_forward");
    SeqForward rf = sequence_forward(ops, in);
    if (opt.backward) {
      backward_call(early, dev(opt.shape));
      sequence_backward(ops, in, rf, gy, gext_out);
    }
    cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(earlier call)");
    if (early) ok(jf_saved_release(early, js), "jf_saved_release");
    y->poison(stream);
    for (auto* t : eout) t->poison(stream);
  }
  jf_saved saved = nullptr;
  ok(jf_forward(seq, &fa, &saved, js), "jf_forward");
  struct SavedGuard {
    jf_saved s;
    jf_stream st;
    ~SavedGuard() { jf_saved_release(s, st); }
  } saved_guard{saved, js};
  cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(forward)");

  double atol, rtol;
  tolerance(rc, has_gemm, ops.size(), &atol, &rtol);
  if (fp8) {
    atol = kFp8Atol;
    rtol = kFp8Rtol;
  }
  CheckReport rep;
  // The backward on a random dy with every gradient buffer poisoned first.
  DeviceTensor* gx = nullptr;
  auto run_backward = [&] {
    gx = dev(opt.shape);
    gx->poison(stream);
    for (auto* t : gein)
      if (t) t->poison(stream);
    for (auto& [k, t] : grads) t->poison(stream);
    backward_call(saved, gx);
    cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(backward)");
  };
  // Every tensor against its reference; without one (user-declared ops), against itself, which counts
  // only unwritten (NaN) elements.
  const bool self = opt.no_reference;
  auto check = [&](const std::string& name, const Vec& got, const Vec* ref) {
    Vec mine;
    if (self) {
      mine = got;
      for (auto& v : mine)
        if (std::isnan(v)) v = 0;
    }
    rep.tensors.push_back(compare(name, got, self ? mine : *ref, atol, rtol));
    // FP8: the tensor's relative error against the quantising reference, too (see compare_normwise).
    if (fp8 && !self) rep.tensors.push_back(compare_normwise(name + " normwise", got, *ref, kFp8QuantizedBound));
  };
  // FP8: every tensor also against the exact (unquantised) float64 reference, at DESIGN's FP8 tolerance.
  SeqInputs exact_in = in;
  exact_in.quantize = nullptr;
  auto check_exact = [&](const std::string& name, const Vec& got, const Vec& ref) {
    if (fp8) rep.tensors.push_back(compare_normwise(name + " vs exact normwise", got, ref, kFp8ExactBound));
  };
  SeqForward ref, exact;
  if (!self) ref = sequence_forward(ops, in);
  if (fp8) exact = sequence_forward(ops, exact_in);
  const Vec y_got = y->download_values(stream);
  check("output", y_got, &ref.output);
  check_exact("output", y_got, exact.output);
  for (size_t i = 0; i < eout.size(); ++i) {
    const Vec got = eout[i]->download_values(stream);
    check(fmt::format("extra_output[{}]", i), got, self ? nullptr : &ref.extra_out[i]);
    if (fp8) check_exact(fmt::format("extra_output[{}]", i), got, exact.extra_out[i]);
  }
  if (!opt.backward) return rep;
  run_backward();
  SeqGrads rg, eg;
  if (!self) rg = sequence_backward(ops, in, ref, gy, gext_out);
  if (fp8) eg = sequence_backward(ops, exact_in, exact, gy, gext_out);
  const Vec gx_got = gx->download_values(stream);
  check("grad_input", gx_got, &rg.grad_input);
  if (fp8) check_exact("grad_input", gx_got, eg.grad_input);
  for (size_t i = 0; i < gein.size(); ++i) {
    if (!gein[i]) continue;  // labels
    const Vec got = gein[i]->download_values(stream);
    check(fmt::format("grad_extra_input[{}]", i), got, self ? nullptr : &rg.grad_extra_in[i]);
    if (fp8) check_exact(fmt::format("grad_extra_input[{}]", i), got, eg.grad_extra_in[i]);
  }
  for (auto& [k, t] : grads) {
    const Vec got = t->download_values(stream);
    check(fmt::format("grad op{}.{}", k.first, k.second), got, self ? nullptr : &rg.grad_params.at(k));
    if (fp8) check_exact(fmt::format("grad op{}.{}", k.first, k.second), got, eg.grad_params.at(k));
  }
  return rep;
}

}  // namespace jitfuse::reference
