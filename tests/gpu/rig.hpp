// A training call's every tensor in device memory the test owns (tests/gpu: graph_test, parallel_test):
// inputs drawn from a seed, the saved buffer and workspaces sized from jf_sequence_info, a device Philox
// state, and the calls enqueued with nothing but host memory (what a CUDA graph captures).
#pragma once
#include <deque>
#include <memory>
#include <random>
#include <vector>

#include "api/handles.hpp"
#include "gpu/gpu_check.hpp"
#include "ops/sequence.hpp"
#include "harness/device_tensor.hpp"

namespace jitfuse::test {

using harness::DeviceTensor;

// Everything one training call of a sequence needs, in device memory the test owns: tensors drawn from
// `seed`, the saved buffer and both workspaces sized from jf_sequence_info, and a device Philox state.
// Its uploads and downloads go on `stream`, the stream its calls run on.
struct Rig {
  jf_sequence seq = nullptr;
  CUstream stream = nullptr;
  std::vector<ops::Op> ops;
  std::vector<std::unique_ptr<DeviceTensor>> keep;
  DeviceTensor *x = nullptr, *y = nullptr, *dy = nullptr, *dx = nullptr;
  std::vector<DeviceTensor*> outs;  // everything the calls write, in a fixed order
  size_t y_at = 0;                  // the output's index in outs
  std::deque<std::string> names;
  std::vector<jf_param> params, grads;
  std::vector<const DLTensor*> ein, eout_c, geout;
  std::vector<DLTensor*> eout, gein;
  jf_program_info info{};
  CUdeviceptr saved = 0, fws = 0, bws = 0, rng = 0;

  bool misalign = false;  // every tensor one element past a 16-byte boundary
  jf_program prog = nullptr;  // set: the calls go through this prepared-program handle (jf_program_*)

  DeviceTensor* make(const ops::Shape& s, std::mt19937_64& g) {
    keep.push_back(std::make_unique<DeviceTensor>(s, "bf16", misalign));
    std::uniform_real_distribution<double> u(-1, 1);
    std::vector<double> v(static_cast<size_t>(ops::numel(s)));
    for (auto& e : v) e = u(g);
    keep.back()->upload_values(v, stream);
    return keep.back().get();
  }

  Rig(jf_context ctx, jf_sequence s, CUstream st, const ops::Shape& shape, uint64_t seed, bool misaligned = false)
      : seq(s), stream(st), misalign(misaligned) {
    const auto& reg = api::context_of(ctx).registry();
    ops = ops::infer(s->impl->def, shape, s->impl->parallel());
    (void)reg;
    std::mt19937_64 g(seed);
    for (const auto& op : ops)
      for (const auto& p : op.params) {
        names.push_back(p.name);
        params.push_back({op.index, names.back().c_str(), make(p.shape, g)->dl()});
        DeviceTensor* gt = make(p.shape, g);
        grads.push_back({op.index, names.back().c_str(), gt->dl()});
        outs.push_back(gt);
      }
    x = make(shape, g);
    y = make(ops.back().out, g);
    dy = make(ops.back().out, g);
    dx = make(shape, g);
    y_at = outs.size();
    outs.push_back(y);
    outs.push_back(dx);
    for (const auto& op : ops) {
      if (op.extra_slot < 0) continue;  // a channel's reader or a hidden channel: not the caller's tensor
      if (op.family == ops::Family::add_extra_input) {
        ein.push_back(make(op.in, g)->dl());
        DeviceTensor* t = make(op.in, g);
        gein.push_back(t->dl());
        outs.push_back(t);
      }
      if (op.family == ops::Family::make_extra_output) {
        DeviceTensor* t = make(op.in, g);
        eout.push_back(t->dl());
        eout_c.push_back(t->dl());
        geout.push_back(make(op.in, g)->dl());
        outs.push_back(t);
      }
    }
    REQUIRE(jf_sequence_info(seq, shape.data(), static_cast<int>(shape.size()), 1, &info) == JF_OK);
    for (auto [p, n] : {std::pair{&saved, info.saved_bytes}, {&fws, info.forward_workspace_bytes},
                        {&bws, info.backward_workspace_bytes}, {&rng, size_t{16}}})
      cuda::check(cuda::driver().cuMemAlloc(p, std::max<size_t>(n, 256)), "cuMemAlloc");
  }
  ~Rig() {
    for (auto p : {saved, fws, bws, rng}) cuda::driver().cuMemFree(p);
  }

  void set_rng(uint64_t seed, uint64_t offset) {
    const uint64_t st[2] = {seed, offset};
    harness::host_to_device(rng, st, 16, stream);
  }
  void poison() {
    for (auto* t : outs) t->poison(stream);
  }
  // One training forward and its backward, enqueued on the rig's stream with nothing but host memory.
  jf_status enqueue() {
    jf_forward_args f{};
    f.input = x->dl();
    f.extra_inputs = ein.data();
    f.n_extra_inputs = static_cast<int>(ein.size());
    f.output = y->dl();
    f.extra_outputs = eout.data();
    f.n_extra_outputs = static_cast<int>(eout.size());
    f.params = params.data();
    f.n_params = static_cast<int>(params.size());
    f.training = 1;
    f.rng_state = reinterpret_cast<const uint64_t*>(rng);
    f.saved = reinterpret_cast<void*>(saved);
    f.saved_bytes = info.saved_bytes;
    f.workspace = reinterpret_cast<void*>(fws);
    f.workspace_bytes = info.forward_workspace_bytes;
    const auto js = reinterpret_cast<jf_stream>(stream);
    if (jf_status st = prog ? jf_program_forward(prog, &f, nullptr, js) : jf_forward(seq, &f, nullptr, js); st != JF_OK)
      return st;
    jf_backward_args b{};
    b.input = x->dl();
    b.extra_inputs = ein.data();
    b.n_extra_inputs = f.n_extra_inputs;
    b.output = y->dl();
    b.extra_outputs = eout_c.data();
    b.n_extra_outputs = f.n_extra_outputs;
    b.params = params.data();
    b.n_params = f.n_params;
    b.saved = f.saved;
    b.saved_bytes = f.saved_bytes;
    b.grad_output = dy->dl();
    b.grad_extra_outputs = geout.data();
    b.n_grad_extra_outputs = static_cast<int>(geout.size());
    b.grad_input = dx->dl();
    b.grad_extra_inputs = gein.data();
    b.n_grad_extra_inputs = static_cast<int>(gein.size());
    b.grads = grads.data();
    b.n_grads = static_cast<int>(grads.size());
    b.workspace = reinterpret_cast<void*>(bws);
    b.workspace_bytes = info.backward_workspace_bytes;
    return prog ? jf_program_backward(prog, &b, js) : jf_backward(seq, &b, js);
  }
  std::vector<std::vector<uint8_t>> results() const {
    std::vector<std::vector<uint8_t>> r;
    for (auto* t : outs) r.push_back(t->download(stream));
    return r;
  }
};


}  // namespace jitfuse::test
