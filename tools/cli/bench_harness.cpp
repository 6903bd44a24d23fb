// `jitfuse bench`'s harness (bench_harness.hpp): CUDA-event medians after warm-up, random inputs (never
// zeros), and a sequence with its parameters, inputs and gradients driven through the C ABI.
#include "bench_harness.hpp"

#include <algorithm>
#include <cstring>
#include <random>

#include <fmt/format.h>

#include "common/error.hpp"

namespace jitfuse::cli::bench {

void ok(jf_status s, const char* what) {
  if (s != JF_OK) throw Error(static_cast<Status>(s), fmt::format("{}: {}", what, jf_last_error()));
}

// Each timed call sits between its own pair of events. By default the calls are enqueued back to back
// with no host synchronisation in between, as a training loop runs them: the host prepares call i+1
// while the GPU runs call i, so an interval is the call's GPU time (plus any gap the host could not
// fill). --sync waits for every call before enqueuing the next, so the host's per-call work (argument
// checks, plan lookup, launches) shows in the interval too.
double median_ms(CUstream s, const std::function<void()>& fn, const BenchOpts& o) {
  const auto& d = cuda::driver();
  for (int i = 0; i < o.warmup; ++i) fn();
  std::vector<CUevent> ev(2 * static_cast<size_t>(o.iters));
  for (auto& e : ev) cuda::check(d.cuEventCreate(&e, CU_EVENT_DEFAULT), "cuEventCreate");
  std::vector<float> t;
  for (int i = 0; i < o.iters; ++i) {
    cuda::check(d.cuEventRecord(ev[2 * i], s), "cuEventRecord");
    fn();
    cuda::check(d.cuEventRecord(ev[2 * i + 1], s), "cuEventRecord");
    if (o.sync) cuda::check(d.cuEventSynchronize(ev[2 * i + 1]), "cuEventSynchronize");
  }
  cuda::check(d.cuEventSynchronize(ev.back()), "cuEventSynchronize");
  for (int i = 0; i < o.iters; ++i) {
    float ms = 0;
    cuda::check(d.cuEventElapsedTime(&ms, ev[2 * i], ev[2 * i + 1]), "cuEventElapsedTime");
    t.push_back(ms);
  }
  for (auto& e : ev) d.cuEventDestroy(e);
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

std::vector<double> random_values(size_t n, uint64_t seed, double lo, double hi) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(n);
  for (auto& x : v) x = u(rng);
  return v;
}

// Without touching doubles (the FP8 cases fill 134 M-element buffers): bf16 values of magnitude in
// [2^-7, 2) with random signs and mantissas; E4M3 codes the same way (exponent field 0..7, never NaN), so
// neither format's products overflow and no operand is zero.
std::vector<uint8_t> random_operand_bytes(size_t n, bool fp8, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> b(fp8 ? n : 2 * n);
  for (size_t i = 0; i < n; ++i) {
    const uint64_t r = rng();
    if (fp8) {
      b[i] = static_cast<uint8_t>((r & 0x80) | ((r >> 8) & 0x38) | ((r >> 16) & 0x7));  // sign, exp 0..7, mantissa
    } else {
      const uint16_t v = static_cast<uint16_t>((r & 0x8000) | ((120 + (r >> 20) % 8) << 7) | ((r >> 32) & 0x7F));
      std::memcpy(&b[2 * i], &v, 2);
    }
  }
  return b;
}

double copy_bandwidth(CUstream s, const BenchOpts& o, double bytes) {
  // bytes = 0: the yardstick, 1 GiB (its per-call cost, an event pair and the launch gap, is ~0.5 % of it).
  // Otherwise a copy that moves `bytes` (bytes / 2 read, bytes / 2 written), timed as the cases are: what
  // copy reaches at a case's size, with the same per-call cost.
  const size_t n = bytes > 0 ? (static_cast<size_t>(bytes / 2) + 255) / 256 * 256 : size_t(1) << 30;
  DeviceTensor a({static_cast<int64_t>(n / 2)}, "bf16"), b({static_cast<int64_t>(n / 2)}, "bf16");
  const auto& d = cuda::driver();
  if (bytes > 0)
    cuda::check(d.cuMemsetD32Async(a.ptr(), 0x3f9d3c2bu, n / 4, s), "cuMemsetD32Async");  // nonzero bf16 pairs
  else
    a.upload_values(random_values(n / 2, 99, -1, 1), s);
  double ms = median_ms(s, [&] { cuda::check(d.cuMemcpyDtoDAsync(b.ptr(), a.ptr(), n, s), "cuMemcpyDtoDAsync"); }, o);
  return 2.0 * static_cast<double>(n) / (ms * 1e-3) / 1e9;  // read + write
}

DeviceTensor* SeqBench::make(const ops::Shape& s, uint64_t seed) {
  keep.push_back(std::make_unique<DeviceTensor>(s, "bf16"));
  keep.back()->upload_values(random_values(static_cast<size_t>(ops::numel(s)), seed, -1, 1), stream);
  return keep.back().get();
}

SeqBench::SeqBench(jf_context ctx, CUstream s, const std::string& ops_json, const ops::Shape& in,
                   const ops::Shape& out, const std::vector<ParamSpec>& ps, int n_extra_in, int n_extra_out,
                   const char* recipe)
    : stream(s) {
  std::string j = R"({"format": "jitfuse.sequence/1", "name": "bench", "ops": )" + ops_json + "}";
  ok(jf_sequence_create(ctx, j.c_str(), recipe, &seq), "jf_sequence_create");
  // The output's dtype as the library says (E4M3 where an FP8 recipe ends the sequence in quantize): asked,
  // not re-derived here (prepares the inference program, which the first timed call would do anyway).
  jf_program_info info{};
  ok(jf_sequence_info(seq, in.data(), static_cast<int>(in.size()), 0, &info), "jf_sequence_info");
  const bool fp8_out = info.outputs[0].dtype.bits == 8;
  uint64_t seed = 1;
  for (auto& [op, name, shape] : ps) {
    names.push_back(name);
    params.push_back({op, names.back().c_str(), make(shape, seed++)->dl()});
    grads.push_back({op, names.back().c_str(), make(shape, seed++)->dl()});
  }
  x = make(in, seed++);
  if (fp8_out) {  // E4M3 bytes: nothing to upload, the forward writes them
    keep.push_back(std::make_unique<DeviceTensor>(out, "e4m3"));
    y = keep.back().get();
    seed++;
  } else {
    y = make(out, seed++);
  }
  gy = make(out, seed++);
  gx = make(in, seed++);
  for (int i = 0; i < n_extra_in; ++i) {
    ein.push_back(make(out, seed++));
    gein.push_back(make(out, seed++));
  }
  for (int i = 0; i < n_extra_out; ++i) {
    eout.push_back(make(in, seed++));
    geout.push_back(make(in, seed++));
  }
  for (auto* t : ein) ein_t.push_back(t->dl());
  for (auto* t : eout) eout_t.push_back(t->dl());
  for (auto* t : eout) eout_ct.push_back(t->dl());
  for (auto* t : gein) gein_t.push_back(t->dl());
  for (auto* t : geout) geout_t.push_back(t->dl());
}

SeqBench::~SeqBench() { jf_sequence_destroy(seq); }

jf_forward_args SeqBench::forward_args(bool training) {
  jf_forward_args a{};
  a.input = x->dl();
  a.extra_inputs = ein_t.data();
  a.n_extra_inputs = static_cast<int>(ein_t.size());
  a.output = y->dl();
  a.extra_outputs = eout_t.data();
  a.n_extra_outputs = static_cast<int>(eout_t.size());
  a.params = params.data();
  a.n_params = static_cast<int>(params.size());
  a.training = training ? 1 : 0;
  a.rng_offset = 1;
  return a;
}

void SeqBench::forward(CUstream s, jf_saved* saved, bool weights_unchanged) {
  auto a = forward_args(saved != nullptr);
  a.fp8_weights_unchanged = weights_unchanged ? 1 : 0;
  ok(jf_forward(seq, &a, saved, reinterpret_cast<jf_stream>(s)), "jf_forward");
}

void SeqBench::backward(CUstream s, jf_saved saved) {
  jf_backward_args a{};
  a.input = x->dl();
  a.extra_inputs = ein_t.data();
  a.n_extra_inputs = static_cast<int>(ein_t.size());
  a.output = y->dl();
  a.extra_outputs = eout_ct.data();
  a.n_extra_outputs = static_cast<int>(eout_ct.size());
  a.params = params.data();
  a.n_params = static_cast<int>(params.size());
  void* block = nullptr;
  ok(jf_saved_buffer(saved, &block, &a.saved_bytes), "jf_saved_buffer");
  a.saved = block;
  a.grad_output = gy->dl();
  a.grad_extra_outputs = geout_t.data();
  a.n_grad_extra_outputs = static_cast<int>(geout_t.size());
  a.grad_input = gx->dl();
  a.grad_extra_inputs = gein_t.data();
  a.n_grad_extra_inputs = static_cast<int>(gein_t.size());
  a.grads = grads.data();
  a.n_grads = static_cast<int>(grads.size());
  ok(jf_backward(seq, &a, reinterpret_cast<jf_stream>(s)), "jf_backward");
}

void SeqBench::step(CUstream s, bool weights_unchanged) {
  jf_saved saved = nullptr;
  forward(s, &saved, weights_unchanged);
  backward(s, saved);
  jf_saved_release(saved, reinterpret_cast<jf_stream>(s));
}

}  // namespace jitfuse::cli::bench
