// The jitfuse::forward / jitfuse::backward ops in C++: their CUDA kernels (the C ABI's jf_program calls on the
// current stream, outputs and workspaces from the caching allocator), their Meta kernels (fake tensors), the
// forward's autograd (a C++ torch::autograd::Function saving real tensors) and Sequential's eager entry.
#include "jitfuse_torch.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <cuda_runtime_api.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cstdint>


namespace jitfuse_torch {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The names Python prints (the extension's own messages: devices, counts, the Meta kernel's dtype check).
const char* py_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kDouble: return "torch.float64";
    case at::kByte: return "torch.uint8";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    default: return c10::toString(t);
  }
}

DLDataType dl_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return {2, 32, 1};
    case at::kHalf: return {2, 16, 1};
    case at::kBFloat16: return {4, 16, 1};
    case at::kByte: return {1, 8, 1};
    case at::kLong: return {0, 64, 1};
    case at::kFloat8_e4m3fn: return {10, 8, 1};
    case at::kDouble: return {2, 64, 1};
    case at::kInt: return {0, 32, 1};
    default: TORCH_CHECK_TYPE(false, "jitfuse: tensors of ", py_dtype(t), " cannot be passed to jitfuse");
  }
}

// A tensor as the library sees it: its own sizes, strides and dtype, so the library's checks of every call
// (shape against the program, dtype against the recipe, row-major layout) judge the tensor itself and its
// error names it (jf_last_error, through fail_call): one set of checks and messages for every host.
DLTensor dl(const at::Tensor& t, int device) {
  DLTensor d{};
  d.data = t.data_ptr();
  d.device = DLDevice{kDLCUDA, device};
  d.ndim = static_cast<int>(t.dim());
  d.dtype = dl_of(t.scalar_type());
  d.shape = const_cast<int64_t*>(t.sizes().data());
  d.strides = const_cast<int64_t*>(t.strides().data());
  d.byte_offset = 0;
  return d;
}

// What the library cannot see in a DLTensor: that a tensor exists and lives on the call's device (a pointer
// of another device would be read as this one's).
void check(const Sequence& s, const std::string& label, const at::Tensor& t, int device) {
  TORCH_CHECK(t.defined(), "jitfuse: sequence '", s.name, "': ", label, " is an undefined tensor");
  TORCH_CHECK_TYPE(t.is_cuda() && t.get_device() == device, "jitfuse: sequence '", s.name, "': ", label, " is on ",
                   t.device().str(), ", the call runs on cuda:", device);
}

std::vector<int64_t> concrete_sizes(const at::Tensor& t) {
  std::vector<int64_t> out;
  out.reserve(t.dim());
  for (const c10::SymInt& d : t.sym_sizes()) out.push_back(d.guard_int(__FILE__, __LINE__));
  return out;
}

// The counts a call of the ops must have (CUDA and Meta kernels alike), before the parameters' ABI names are
// looked up by position in s.params. A call with the registered counts passes at once; any other gets the
// library's verdict and message (jf_sequence_check_counts: the one count check of both torch layers).
void check_arity(const Sequence& s, const char* fn, const at::Tensor& input, size_t n_extra_inputs, size_t n_params,
                 size_t n_extra_outputs = SIZE_MAX, size_t n_grad_extra_outputs = SIZE_MAX) {
  const bool backward = n_extra_outputs != SIZE_MAX;
  const bool ok = static_cast<int>(n_extra_inputs) == s.n_extra_inputs && n_params == s.params.size() &&
                  (!backward || (static_cast<int>(n_extra_outputs) == s.n_extra_outputs &&
                                 n_grad_extra_outputs == n_extra_outputs));
  if (ok) return;
  auto count = [](size_t n) { return static_cast<int>(std::min<size_t>(n, 1u << 30)); };
  const std::vector<int64_t> shape = concrete_sizes(input);
  if (jf_sequence_check_counts(s.seq, fn, shape.data(), static_cast<int>(shape.size()), count(n_extra_inputs),
                               count(n_params), backward ? count(n_extra_outputs) : -1,
                               backward ? count(n_grad_extra_outputs) : -1) != JF_OK) {
    const char* msg = jf_last_error();
    TORCH_CHECK_TYPE(false, msg ? msg : "jitfuse: wrong argument counts");
  }
  // The library counts the parameters of the ops, this extension those the module registered: they differ
  // only if the registration was wrong.
  TORCH_CHECK_TYPE(false, fn, ": sequence '", s.name, "' was registered with ", s.params.size(),
                   " parameter(s); got ", n_params);
}

[[noreturn]] void fail_call(const char* fn, const Sequence& s) {
  const char* msg = jf_last_error();
  TORCH_CHECK(false, "jitfuse: ", fn, " (sequence '", s.name, "'): ", msg ? msg : "");
}

bool capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  return cudaStreamIsCapturing(stream, &st) == cudaSuccess && st != cudaStreamCaptureStatusNone;
}

at::Tensor bytes(size_t n, const at::Tensor& like) {
  return at::empty({static_cast<int64_t>(n)}, like.options().dtype(at::kByte));
}

// ---- the CUDA kernels ------------------------------------------------------------------------------

// `Tensor[]? extra_inputs, Tensor[]? params`: an empty list and None mean the same. The lists are optional in
// the schema because AOTInductor's proxy executor (torch/csrc/inductor/aoti_torch/oss_proxy_executor.cpp, torch
// 2.11) leaves the stack slot of an empty `Tensor[]` argument None, which a `Tensor[]` kernel cannot take: the
// call failed and the package's output stayed unfilled. None is what `Tensor[]?` expects.
using OptTensors = std::optional<at::TensorList>;

at::TensorList tensors_or_none(const OptTensors& l) { return l.has_value() ? *l : at::TensorList(); }

std::vector<at::Tensor> forward_cuda(int64_t key, const at::Tensor& input, const OptTensors& extra_inputs_opt,
                                     const OptTensors& params_opt, const std::optional<at::Tensor>& rng_state,
                                     bool training) {
  const at::TensorList extra_inputs = tensors_or_none(extra_inputs_opt), params = tensors_or_none(params_opt);
  TORCH_CHECK_VALUE(input.is_cuda(), "jitfuse::forward: jitfuse runs on CUDA tensors; the input is on ",
                    input.device().str());
  const int dev = input.get_device();
  c10::cuda::CUDAGuard guard(input.device());
  auto sp = sequence(key, dev);
  const Sequence& s = *sp;
  check_arity(s, "jitfuse::forward", input, extra_inputs.size(), params.size());
  check(s, "input", input, dev);
  for (size_t i = 0; i < extra_inputs.size(); ++i) check(s, "extra input " + std::to_string(i), extra_inputs[i], dev);
  for (size_t i = 0; i < params.size(); ++i) check(s, s.param_labels[i], params[i], dev);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
  auto pp = sp->program(input.sizes(), training, stream);
  const Program& p = *pp;
  if (rng_state.has_value() && rng_state->defined()) {
    const at::Tensor& r = *rng_state;
    TORCH_CHECK(r.is_cuda() && r.get_device() == dev && r.scalar_type() == at::kLong && r.numel() == 2 &&
                    r.is_contiguous(),
                "jitfuse: sequence '", s.name, "': rng_state must be a contiguous int64 tensor of 2 elements on cuda:",
                dev, " ({seed, offset})");
  }

  std::vector<at::Tensor> outs;
  outs.reserve(3 + p.extra_outputs.size());
  outs.push_back(at::empty(p.out_shape, input.options().dtype(p.out_dtype)));
  for (auto& [shape, dt] : p.extra_outputs) outs.push_back(at::empty(shape, input.options().dtype(dt)));
  at::Tensor saved_block = training ? bytes(p.saved_bytes, input) : at::Tensor();
  at::Tensor workspace = p.forward_workspace ? bytes(p.forward_workspace, input) : at::Tensor();

  const size_t ne = extra_inputs.size(), neo = p.extra_outputs.size(), np = params.size();
  c10::SmallVector<DLTensor, 16> t;
  t.reserve(2 + ne + neo + np);
  c10::SmallVector<const DLTensor*, 8> extra_in;
  c10::SmallVector<DLTensor*, 8> extra_out;
  c10::SmallVector<jf_param, 16> jp;
  t.push_back(dl(input, dev));
  for (auto& e : extra_inputs) t.push_back(dl(e, dev));
  for (size_t i = 0; i <= neo; ++i) t.push_back(dl(outs[i], dev));
  for (auto& q : params) t.push_back(dl(q, dev));
  for (size_t i = 0; i < ne; ++i) extra_in.push_back(&t[1 + i]);
  for (size_t i = 0; i < neo; ++i) extra_out.push_back(&t[2 + ne + i]);
  for (size_t i = 0; i < np; ++i) jp.push_back(jf_param{s.params[i].first, s.params[i].second.c_str(), &t[2 + ne + neo + i]});

  jf_forward_args a{};
  a.input = &t[0];
  a.extra_inputs = extra_in.data();
  a.n_extra_inputs = static_cast<int>(ne);
  a.output = &t[1 + ne];
  a.extra_outputs = extra_out.data();
  a.n_extra_outputs = static_cast<int>(neo);
  a.params = jp.data();
  a.n_params = static_cast<int>(np);
  a.training = training ? 1 : 0;
  a.rng_state = rng_state.has_value() && rng_state->defined()
                    ? static_cast<const uint64_t*>(rng_state->data_ptr()) : nullptr;
  a.saved = p.saved_bytes ? saved_block.data_ptr() : nullptr;
  a.saved_bytes = p.saved_bytes;
  a.workspace = p.forward_workspace ? workspace.data_ptr() : nullptr;
  a.workspace_bytes = p.forward_workspace;
  a.fp8_weights_unchanged = s.fp8 && fp8_promise() && !capturing(stream) ? 1 : 0;
  sp->record(a.fp8_weights_unchanged ? "forward:fp8_weights_unchanged" : "forward");
  jf_saved saved_handle = nullptr;
  if (jf_program_forward(p.handle, &a, &saved_handle, stream) != JF_OK) fail_call("jf_program_forward", s);
  if (saved_handle) jf_saved_release(saved_handle, stream);  // training with nothing to save
  if (s.fp8_output) {  // the scale_inv that decodes this call's codes, copied before the next call moves it
    jf_fp8_state st{};
    if (jf_sequence_fp8_state(s.seq, s.last_op, &st) != JF_OK) fail_call("jf_sequence_fp8_state", s);
    outs.push_back(at::from_blob(st.scale_inv, {1}, input.options().dtype(at::kFloat)).clone());
  }
  if (training) outs.push_back(std::move(saved_block));
  return outs;
}

// The backward call once backward_cuda has checked every argument: the gradients allocated (zeros where the
// parameter accumulates), every tensor viewed as a DLTensor of one array, jf_program_backward on `stream`.
std::vector<at::Tensor> call_backward(const Sequence& s, const Program& p, int dev, cudaStream_t stream,
                                      const at::Tensor& input, at::TensorList extra_inputs, const at::Tensor& output,
                                      at::TensorList extra_outputs, at::TensorList params, const at::Tensor& saved,
                                      const at::Tensor& grad_output, at::TensorList grad_extra_outputs) {
  const size_t ne = extra_inputs.size(), neo = extra_outputs.size(), np = params.size();
  std::vector<at::Tensor> res;
  res.reserve(1 + ne + np);
  res.push_back(at::empty_like(input));
  for (auto& e : extra_inputs) res.push_back(at::empty_like(e));
  for (size_t i = 0; i < np; ++i) res.push_back(s.accumulate[i] ? at::zeros_like(params[i]) : at::empty_like(params[i]));
  at::Tensor workspace = p.backward_workspace ? bytes(p.backward_workspace, input) : at::Tensor();

  // input, extras, output, extra outputs, params, grad_output, grad extra outputs, grad_input, grad extras, grads
  c10::SmallVector<DLTensor, 32> t;
  t.reserve(4 + 3 * ne + 2 * neo + 2 * np);
  t.push_back(dl(input, dev));
  for (auto& e : extra_inputs) t.push_back(dl(e, dev));
  t.push_back(dl(output, dev));
  for (auto& e : extra_outputs) t.push_back(dl(e, dev));
  for (auto& q : params) t.push_back(dl(q, dev));
  t.push_back(dl(grad_output, dev));
  for (auto& g : grad_extra_outputs) t.push_back(dl(g, dev));
  for (auto& r : res) t.push_back(dl(r, dev));
  const size_t at_out = 1 + ne, at_par = at_out + 1 + neo, at_go = at_par + np, at_gi = at_go + 1 + neo,
               at_grads = at_gi + 1 + ne;
  c10::SmallVector<const DLTensor*, 8> extra_in, extra_out_v, grad_extra_out;
  c10::SmallVector<DLTensor*, 8> grad_extra_in;
  c10::SmallVector<jf_param, 16> jp, jg;
  for (size_t i = 0; i < ne; ++i) extra_in.push_back(&t[1 + i]);
  for (size_t i = 0; i < neo; ++i) extra_out_v.push_back(&t[at_out + 1 + i]);
  for (size_t i = 0; i < neo; ++i) grad_extra_out.push_back(&t[at_go + 1 + i]);
  for (size_t i = 0; i < ne; ++i) grad_extra_in.push_back(&t[at_gi + 1 + i]);
  for (size_t i = 0; i < np; ++i) {
    jp.push_back(jf_param{s.params[i].first, s.params[i].second.c_str(), &t[at_par + i]});
    jg.push_back(jf_param{s.params[i].first, s.params[i].second.c_str(), &t[at_grads + i]});
  }
  jf_backward_args a{};
  a.input = &t[0];
  a.extra_inputs = extra_in.data();
  a.n_extra_inputs = static_cast<int>(ne);
  a.output = &t[at_out];
  a.extra_outputs = extra_out_v.data();
  a.n_extra_outputs = static_cast<int>(neo);
  a.params = jp.data();
  a.n_params = static_cast<int>(np);
  a.saved = p.saved_bytes ? saved.data_ptr() : nullptr;
  a.saved_bytes = saved.nbytes();  // the library checks it against the program's (its message names both)
  a.grad_output = &t[at_go];
  a.grad_extra_outputs = grad_extra_out.data();
  a.n_grad_extra_outputs = static_cast<int>(neo);
  a.grad_input = &t[at_gi];
  a.grad_extra_inputs = grad_extra_in.data();
  a.n_grad_extra_inputs = static_cast<int>(ne);
  a.grads = jg.data();
  a.n_grads = static_cast<int>(np);
  a.workspace = p.backward_workspace ? workspace.data_ptr() : nullptr;
  a.workspace_bytes = p.backward_workspace;
  if (jf_program_backward(p.handle, &a, stream) != JF_OK) fail_call("jf_program_backward", s);
  return res;
}

std::vector<at::Tensor> backward_cuda(int64_t key, const at::Tensor& input, at::TensorList extra_inputs,
                                      const at::Tensor& output, at::TensorList extra_outputs, at::TensorList params,
                                      const at::Tensor& saved, const at::Tensor& grad_output,
                                      at::TensorList grad_extra_outputs) {
  TORCH_CHECK_VALUE(input.is_cuda(), "jitfuse::backward: the input is on ", input.device().str());
  const int dev = input.get_device();
  c10::cuda::CUDAGuard guard(input.device());
  auto sp = sequence(key, dev);
  const Sequence& s = *sp;
  check_arity(s, "jitfuse::backward", input, extra_inputs.size(), params.size(), extra_outputs.size(),
              grad_extra_outputs.size());
  check(s, "input", input, dev);
  for (size_t i = 0; i < extra_inputs.size(); ++i) check(s, "extra input " + std::to_string(i), extra_inputs[i], dev);
  for (size_t i = 0; i < params.size(); ++i) check(s, s.param_labels[i], params[i], dev);
  check(s, "output", output, dev);
  for (size_t i = 0; i < extra_outputs.size(); ++i) check(s, "extra output " + std::to_string(i), extra_outputs[i], dev);
  check(s, "grad_output", grad_output, dev);
  for (size_t i = 0; i < grad_extra_outputs.size(); ++i)
    check(s, "grad of extra output " + std::to_string(i), grad_extra_outputs[i], dev);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
  auto pp = sp->program(input.sizes(), true, stream);
  const Program& p = *pp;
  check(s, "the saved buffer", saved, dev);  // its size: the library's check (call_backward passes its bytes)
  TORCH_CHECK(saved.is_contiguous(), "jitfuse: sequence '", s.name, "': the saved buffer is not contiguous");

  sp->record("backward");
  return call_backward(s, p, dev, stream, input, extra_inputs, output, extra_outputs, params, saved, grad_output,
                       grad_extra_outputs);
}

// ---- the Meta kernels ------------------------------------------------------------------------------

// What fake tensors see (torch.compile, torch.export, opcheck, FakeTensorMode): the outputs' shapes and dtypes
// from the program of (shape, training), prepared on first use as a real call prepares it. A Meta kernel sees
// no CUDA device, so the program is the one on the device the key is registered on (the Python package
// registers a module's sequence on its device when it first runs or is traced), else the current device.
// Symbolic row dims: the package's answer (set_symbolic_meta) where a Python package set one; otherwise, and for other
// symbolic sizes, they are specialised (a guard per dimension): programs are prepared per concrete shape.
int meta_device(int64_t key) {
  const int d = registered_device(key);
  return d >= 0 ? d : static_cast<int>(c10::cuda::current_device());
}

// Fake tensor mode runs a Meta kernel with Meta in this thread's included dispatch keys, which would turn the
// tensors a first-time sequence definition makes (the resolver: a tensor-parallel group's communicator, set up
// through torch.distributed) into meta tensors. The definition and the preparation run without it.
struct NoMetaInclude {
  const bool was = c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta);
  NoMetaInclude() { c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Meta, false); }
  ~NoMetaInclude() { c10::impl::tls_set_dispatch_key_included(c10::DispatchKey::Meta, was); }
  NoMetaInclude(const NoMetaInclude&) = delete;
  NoMetaInclude& operator=(const NoMetaInclude&) = delete;
};

std::mutex g_symbolic_mu;
SymbolicMeta g_symbolic_meta;  // set by the Python package (python.cpp); empty in a host without Python

bool has_symbolic_dim(const at::Tensor& t) {
  for (const c10::SymInt& d : t.sym_sizes())
    if (!d.maybe_as_int()) return true;
  return false;
}

std::vector<at::Tensor> forward_meta(int64_t key, const at::Tensor& input, const OptTensors& extra_inputs_opt,
                                     const OptTensors& params_opt, const std::optional<at::Tensor>& rng_state,
                                     bool training) {
  (void)rng_state;
  const at::TensorList extra_inputs = tensors_or_none(extra_inputs_opt), params = tensors_or_none(params_opt);
  const int dev = meta_device(key);
  std::shared_ptr<Sequence> sp;
  {
    NoMetaInclude real;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
    sp = sequence(key, dev);
  }
  // The counts and the dtype first: they read no size, so they hold for symbolic rows too.
  check_arity(*sp, "jitfuse::forward", input, extra_inputs.size(), params.size());
  TORCH_CHECK_TYPE(input.scalar_type() == sp->dtype, "jitfuse: sequence '", sp->name, "': input is ",
                   py_dtype(input.scalar_type()), ", the program runs ", py_dtype(sp->dtype));
  if (has_symbolic_dim(input)) {
    SymbolicMeta fn;
    {
      std::lock_guard<std::mutex> g(g_symbolic_mu);
      fn = g_symbolic_meta;
    }
    if (fn)
      if (auto outs = fn(key, dev, input, training)) return *outs;
  }
  std::shared_ptr<Program> pp;
  {
    NoMetaInclude real;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(dev));
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(dev)).stream();
    pp = sp->program(concrete_sizes(input), training, stream);
  }
  const Sequence& s = *sp;
  const Program& p = *pp;
  std::vector<at::Tensor> outs;
  outs.reserve(3 + p.extra_outputs.size());
  outs.push_back(at::empty(p.out_shape, input.options().dtype(p.out_dtype)));
  for (auto& [eshape, dt] : p.extra_outputs) outs.push_back(at::empty(eshape, input.options().dtype(dt)));
  if (s.fp8_output) outs.push_back(at::empty({1}, input.options().dtype(at::kFloat)));
  if (training) outs.push_back(bytes(p.saved_bytes, input));
  return outs;
}

std::vector<at::Tensor> backward_meta(int64_t key, const at::Tensor& input, at::TensorList extra_inputs,
                                      const at::Tensor& output, at::TensorList extra_outputs, at::TensorList params,
                                      const at::Tensor& saved, const at::Tensor& grad_output,
                                      at::TensorList grad_extra_outputs) {
  (void)key, (void)output, (void)extra_outputs, (void)saved, (void)grad_output, (void)grad_extra_outputs;
  std::vector<at::Tensor> res;
  res.reserve(1 + extra_inputs.size() + params.size());
  res.push_back(at::empty_like(input));
  for (auto& e : extra_inputs) res.push_back(at::empty_like(e));
  for (auto& q : params) res.push_back(at::empty_like(q));
  return res;
}

// ---- the ops through the dispatcher ----------------------------------------------------------------

using ForwardSig = std::vector<at::Tensor>(int64_t, const at::Tensor&, const OptTensors&, const OptTensors&,
                                           const std::optional<at::Tensor>&, bool);
using BackwardSig = std::vector<at::Tensor>(int64_t, const at::Tensor&, at::TensorList, const at::Tensor&,
                                            at::TensorList, at::TensorList, const at::Tensor&, const at::Tensor&,
                                            at::TensorList);

const c10::TypedOperatorHandle<ForwardSig>& forward_handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("jitfuse::forward", "").typed<ForwardSig>();
  return op;
}

const c10::TypedOperatorHandle<BackwardSig>& backward_handle() {
  static const auto op =
      c10::Dispatcher::singleton().findSchemaOrThrow("jitfuse::backward", "").typed<BackwardSig>();
  return op;
}

bool needs_grad(const at::Tensor& input, at::TensorList extra_inputs, at::TensorList params) {
  if (!at::GradMode::is_enabled()) return false;
  if (input.requires_grad()) return true;
  for (auto& t : params)
    if (t.requires_grad()) return true;
  for (auto& t : extra_inputs)
    if (t.requires_grad()) return true;
  return false;
}

// ---- autograd -------------------------------------------------------------------------------------

// The autograd node of a forward: saves the input, extra inputs, parameters and every output of the op (the
// saved block too, so saved-tensor hooks see all the backward reads), and runs jitfuse::backward.
struct ForwardFunction : public torch::autograd::Function<ForwardFunction> {
  static variable_list forward(AutogradContext* ctx, int64_t key, const at::Tensor& input,
                               at::TensorList extra_inputs, at::TensorList params,
                               const std::optional<at::Tensor>& rng_state, bool training) {
    std::vector<at::Tensor> outs;
    {
      at::AutoDispatchBelowADInplaceOrView below;
      outs = forward_handle().call(key, input, extra_inputs, params, rng_state, training);
    }
    // [output, *extra_outputs, (scale_inv of an E4M3 output), (saved block)]: the tail is not differentiable.
    const bool fp8_out = outs[0].scalar_type() == at::kFloat8_e4m3fn;
    const size_t n_diff = outs.size() - (training ? 1 : 0) - (fp8_out ? 1 : 0);
    variable_list non_diff(outs.begin() + n_diff, outs.end());
    ctx->saved_data["key"] = key;
    ctx->saved_data["ne"] = static_cast<int64_t>(extra_inputs.size());
    ctx->saved_data["np"] = static_cast<int64_t>(params.size());
    ctx->saved_data["training"] = training;
    ctx->saved_data["n_diff"] = static_cast<int64_t>(n_diff);
    if (training) {
      variable_list keep;
      keep.reserve(1 + extra_inputs.size() + params.size() + outs.size());
      keep.push_back(input);
      keep.insert(keep.end(), extra_inputs.begin(), extra_inputs.end());
      keep.insert(keep.end(), params.begin(), params.end());
      keep.insert(keep.end(), outs.begin(), outs.end());
      ctx->save_for_backward(std::move(keep));
    }
    if (!non_diff.empty()) ctx->mark_non_differentiable(non_diff);
    ctx->set_materialize_grads(false);  // no zero-filled gradient for the saved block or unused extra outputs
    return outs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(ctx->saved_data["training"].toBool(),
                "jitfuse: backward through a forward that ran with training=False (no saved context)");
    const int64_t key = ctx->saved_data["key"].toInt();
    const int64_t ne = ctx->saved_data["ne"].toInt(), np = ctx->saved_data["np"].toInt();
    variable_list saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    std::vector<at::Tensor> extras(saved.begin() + 1, saved.begin() + 1 + ne);
    std::vector<at::Tensor> params(saved.begin() + 1 + ne, saved.begin() + 1 + ne + np);
    std::vector<at::Tensor> outs(saved.begin() + 1 + ne + np, saved.end());
    const size_t n_diff = static_cast<size_t>(ctx->saved_data["n_diff"].toInt());
    std::vector<at::Tensor> g;
    g.reserve(n_diff);
    for (size_t i = 0; i < n_diff; ++i) {
      at::Tensor gi = i < grads.size() ? grads[i] : at::Tensor();
      if (!gi.defined()) {
        gi = at::zeros(outs[i].sizes(), x.options());
      } else {
        if (gi.scalar_type() != x.scalar_type()) gi = gi.to(x.scalar_type());
        if (!gi.is_contiguous()) gi = gi.contiguous();
      }
      g.push_back(std::move(gi));
    }
    std::vector<at::Tensor> extra_outputs(outs.begin() + 1, outs.begin() + n_diff);
    std::vector<at::Tensor> res = backward_handle().call(key, x, extras, outs[0], extra_outputs, params, outs.back(),
                                                         g[0], at::TensorList(g).slice(1));
    // One gradient per forward argument, tensor lists flattened: key, input, extras, params, rng_state, training.
    variable_list out;
    out.reserve(res.size() + 3);
    out.emplace_back();
    for (auto& r : res) out.push_back(std::move(r));
    out.emplace_back();
    out.emplace_back();
    return out;
  }
};

std::vector<at::Tensor> forward_autograd(int64_t key, const at::Tensor& input, const OptTensors& extra_inputs_opt,
                                         const OptTensors& params_opt, const std::optional<at::Tensor>& rng_state,
                                         bool training) {
  // Plain lists for the node: autograd's apply takes its input edges from Tensor and TensorList arguments only.
  const at::TensorList extra_inputs = tensors_or_none(extra_inputs_opt), params = tensors_or_none(params_opt);
  if (needs_grad(input, extra_inputs, params))
    return ForwardFunction::apply(key, input, extra_inputs, params, rng_state, training);
  at::AutoDispatchBelowADInplaceOrView below;
  return forward_handle().call(key, input, extra_inputs, params, rng_state, training);
}

}  // namespace

void set_symbolic_meta(SymbolicMeta fn) {
  std::lock_guard<std::mutex> g(g_symbolic_mu);
  g_symbolic_meta = std::move(fn);
}

std::vector<at::Tensor> call_forward(int64_t key, const at::Tensor& input, at::TensorList extra_inputs,
                                     at::TensorList params, const std::optional<at::Tensor>& rng_state, bool training) {
  return forward_handle().call(key, input, extra_inputs, params, rng_state, training);
}

bool module_call_ok(const at::Tensor& input, at::TensorList extra_inputs, at::TensorList params) {
  if (!input.defined() || !input.is_cuda()) return false;
  const auto dt = input.scalar_type();
  const auto dev = input.device();
  for (auto& t : params)
    if (!t.defined() || t.scalar_type() != dt || t.device() != dev) return false;
  for (auto& t : extra_inputs)
    if (!t.defined() || t.scalar_type() != dt || t.device() != dev) return false;
  return true;
}

void module_forward(int64_t key, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
                    const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& rng_state, bool training,
                    int n_extra_outputs, std::vector<at::Tensor>& out) {
  const bool grad = needs_grad(input, extra_inputs, params);
  bool all_contiguous = input.is_contiguous();
  for (auto& t : extra_inputs) all_contiguous = all_contiguous && t.is_contiguous();
  for (auto& t : params) all_contiguous = all_contiguous && t.is_contiguous();
  // Train mode runs the training program with or without grad (its plan may round differently from the
  // inference program's; a checkpoint's recompute must match its first forward).
  if (all_contiguous) {
    out = call_forward(key, input, extra_inputs, params, rng_state, training || grad);
  } else {
    // Row-major copies (autograd ops: a gradient flows back to a non-contiguous parameter, e.g. w.t()).
    std::vector<at::Tensor> extras, ps;
    extras.reserve(extra_inputs.size());
    ps.reserve(params.size());
    for (auto& t : extra_inputs) extras.push_back(t.contiguous());
    for (auto& t : params) ps.push_back(t.contiguous());
    out = call_forward(key, input.contiguous(), extras, ps, rng_state, training || grad);
  }
  // The saved block stays with the node; an E4M3 output (FP8, trailing quantize) keeps the scale_inv that
  // decodes it, last, for the caller's Float8Tensor.
  const bool fp8_out = !out.empty() && out[0].scalar_type() == at::kFloat8_e4m3fn;
  out.resize(1 + n_extra_outputs + (fp8_out ? 1 : 0));
}

}  // namespace jitfuse_torch

TORCH_LIBRARY(jitfuse, m) {
  // The same schemas as the pure-Python ops (runtime/python/jitfuse/torch/_ops.py). forward's lists are optional
  // for AOTInductor (see OptTensors); backward is never in an exported inference graph.
  m.def("forward(int key, Tensor input, Tensor[]? extra_inputs, Tensor[]? params, Tensor? rng_state, "
        "bool training) -> Tensor[]");
  m.def("backward(int key, Tensor input, Tensor[] extra_inputs, Tensor output, Tensor[] extra_outputs, "
        "Tensor[] params, Tensor saved, Tensor grad_output, Tensor[] grad_extra_outputs) -> Tensor[]");
}

TORCH_LIBRARY_IMPL(jitfuse, CUDA, m) {
  m.impl("forward", &jitfuse_torch::forward_cuda);
  m.impl("backward", &jitfuse_torch::backward_cuda);
}

TORCH_LIBRARY_IMPL(jitfuse, Meta, m) {
  m.impl("forward", &jitfuse_torch::forward_meta);
  m.impl("backward", &jitfuse_torch::backward_meta);
}

TORCH_LIBRARY_IMPL(jitfuse, Autograd, m) { m.impl("forward", &jitfuse_torch::forward_autograd); }
