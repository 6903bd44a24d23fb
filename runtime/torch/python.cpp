// _jitfuse_torch_C: the Python package's hooks into libjitfuse_torch.so (registering the sequences of its
// modules, the resolver, the FP8 promise) and Sequential's eager entry, one call from Python to the op.
#include "jitfuse_torch.h"

#include <ATen/autocast_mode.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <pybind11/stl.h>

#include <execinfo.h>
#include <csignal>
#include <cstdlib>
#include <unistd.h>

namespace py = pybind11;

namespace {

PyObject* g_error_class = nullptr;  // jitfuse.errors.JitfuseError (a strong reference, kept for the process)
PyObject* g_resolver = nullptr;     // callable(key, device) -> bool, kept for the process

at::ScalarType dtype_named(const std::string& n) {
  if (n == "float32") return at::kFloat;
  if (n == "float16") return at::kHalf;
  if (n == "bfloat16") return at::kBFloat16;
  TORCH_CHECK_VALUE(false, "jitfuse: no recipe dtype '", n, "'");
}

bool from_jitfuse(const c10::Error& e) { return e.msg().rfind("jitfuse", 0) == 0; }

// jitfuse_torch::module_forward (for tensors module_call_ok takes) with the GIL released as PyTorch's own ops
// do: 1 ran, -1 a jitfuse error, set as jitfuse.JitfuseError (TypeError / ValueError and PyTorch's errors
// propagate unchanged as C++ exceptions).
int run_module_forward(int64_t key, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
                       const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& rng_state,
                       bool training, int n_extra_outputs, std::vector<at::Tensor>& out) {
  try {
    py::gil_scoped_release no_gil;
    jitfuse_torch::module_forward(key, input, extra_inputs, params, rng_state, training, n_extra_outputs, out);
    return 1;
  } catch (const c10::Error& e) {
    if (typeid(e) == typeid(c10::Error) && from_jitfuse(e) && g_error_class) {
      PyErr_SetString(g_error_class, e.what_without_backtrace());
      return -1;
    }
    throw;
  }
}

// Sequential's eager call: the op through the dispatcher (autograd, modes and subclasses see it), with the
// GIL released as PyTorch's own ops do. None: the caller takes its checked path. One tensor, or a tuple
// (output, *extra_outputs[, scale_inv of an E4M3 output]) when there is more than the output.
py::object module_forward(int64_t key, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
                          const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& rng_state,
                          bool training, int n_extra_outputs) {
  HANDLE_TH_ERRORS
  if (!jitfuse_torch::module_call_ok(input, extra_inputs, params)) return py::none();
  std::vector<at::Tensor> out;
  if (run_module_forward(key, input, extra_inputs, params, rng_state, training, n_extra_outputs, out) < 0)
    throw py::error_already_set();
  if (out.size() == 1) return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[0])));
  py::tuple t(out.size());
  for (size_t i = 0; i < out.size(); ++i)
    t[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[i])));
  return std::move(t);
  END_HANDLE_TH_ERRORS_PYBIND
}

// ---- Sequential.__call__ in C++ ------------------------------------------------------------------------
// The module's whole eager call when nothing unusual is about: the checks of Sequential.__call__ (no hook of
// the module or global one, no Module.compile(), no TorchScript trace, forward not overridden) and of
// _eager_forward (no labels, no autocast, no FP8 output, a key for the input's dtype, the extra-input count,
// tensors module_forward takes), the parameters read live from the ops' _parameters, then module_forward.
// Returns None where Python must decide (its path raises the errors); the random state is drawn only once
// the call is sure to run here, so a None leaves PyTorch's generator as it was.
struct ModuleCallState {
  PyObject* forward = nullptr;       // Sequential.forward
  PyObject* global_hooks = nullptr;  // tuple of torch.nn.modules.module's four global hook dicts
  PyObject* draw_rng = nullptr;      // jitfuse.torch.modules._draw_rng
  PyObject *s_training, *s_keys, *s_refs, *s_labels, *s_fp8_output, *s_rng, *s_n_in, *s_n_out, *s_params,
      *s_last_shape, *s_compiled, *s_forward;
  PyObject* s_hooks[4];
};
ModuleCallState g_call;

PyObject* intern(const char* s) { return PyUnicode_InternFromString(s); }

void init_module_call(py::object forward, py::tuple global_hooks, py::object draw_rng) {
  TORCH_CHECK(global_hooks.size() == 4, "jitfuse: init_module_call takes the four global hook dicts");
  for (auto h : global_hooks) TORCH_CHECK(PyDict_Check(h.ptr()), "jitfuse: a global hook table is not a dict");
  g_call.forward = forward.release().ptr();
  g_call.global_hooks = global_hooks.release().ptr();
  g_call.draw_rng = draw_rng.release().ptr();
  g_call.s_training = intern("training");
  g_call.s_keys = intern("_jf_keys");
  g_call.s_refs = intern("_jf_param_refs");
  g_call.s_labels = intern("_jf_labels");
  g_call.s_fp8_output = intern("_jf_fp8_output");
  g_call.s_rng = intern("_jf_uses_rng");
  g_call.s_n_in = intern("_n_extra_inputs");
  g_call.s_n_out = intern("_n_extra_outputs");
  g_call.s_params = intern("_parameters");
  g_call.s_last_shape = intern("_jf_last_shape");
  g_call.s_compiled = intern("_compiled_call_impl");
  g_call.s_forward = intern("forward");
  const char* hooks[4] = {"_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks"};
  for (int i = 0; i < 4; ++i) g_call.s_hooks[i] = intern(hooks[i]);
}

// An owned reference released at scope end.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
};

bool is_empty_dict(PyObject* d) { return d != nullptr && PyDict_Check(d) && PyDict_GET_SIZE(d) == 0; }

// The module-level conditions of the fast call (Sequential.__call__'s own list).
bool plain_call(PyObject* self, PyObject* dict) {
  for (PyObject* s : g_call.s_hooks)
    if (!is_empty_dict(PyDict_GetItem(dict, s))) return false;
  for (Py_ssize_t i = 0; i < 4; ++i)
    if (PyDict_GET_SIZE(PyTuple_GET_ITEM(g_call.global_hooks, i)) != 0) return false;
  PyObject* compiled = PyDict_GetItem(dict, g_call.s_compiled);
  if (compiled != nullptr && compiled != Py_None) return false;
  if (torch::jit::tracer::isTracing()) return false;
  Ref fwd(PyObject_GetAttr(reinterpret_cast<PyObject*>(Py_TYPE(self)), g_call.s_forward));
  if (fwd.p != g_call.forward) {
    PyErr_Clear();
    return false;
  }
  return true;
}

// The parameters read live: refs is [(op, name)], each op's _parameters[name] a tensor.
bool live_params(PyObject* refs, std::vector<at::Tensor>& params) {
  if (refs == nullptr || !PyList_Check(refs)) return false;
  const Py_ssize_t n = PyList_GET_SIZE(refs);
  params.reserve(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* ref = PyList_GET_ITEM(refs, i);
    if (!PyTuple_Check(ref) || PyTuple_GET_SIZE(ref) != 2) return false;
    Ref op_dict(PyObject_GenericGetDict(PyTuple_GET_ITEM(ref, 0), nullptr));
    if (op_dict.p == nullptr) {
      PyErr_Clear();
      return false;
    }
    PyObject* ps = PyDict_GetItem(op_dict.p, g_call.s_params);
    PyObject* p = ps != nullptr && PyDict_Check(ps) ? PyDict_GetItem(ps, PyTuple_GET_ITEM(ref, 1)) : nullptr;
    if (p == nullptr || !THPVariable_Check(p)) return false;
    params.push_back(THPVariable_Unpack(p));
  }
  return true;
}

// The key of the module's program for (training, the input's dtype); -1: none.
int64_t module_key(PyObject* dict, bool training, at::ScalarType dt) {
  PyObject* keys = PyDict_GetItem(dict, g_call.s_keys);
  PyObject* by_dtype = keys != nullptr && PyDict_Check(keys) ? PyDict_GetItem(keys, training ? Py_True : Py_False)
                                                              : nullptr;
  if (by_dtype == nullptr || !PyDict_Check(by_dtype)) return -1;
  PyObject* k = PyDict_GetItem(by_dtype, reinterpret_cast<PyObject*>(torch::getTHPDtype(dt)));
  if (k == nullptr || !PyLong_Check(k)) return -1;
  const long long v = PyLong_AsLongLong(k);
  if (v == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return -1;
  }
  return v;
}

int dict_int(PyObject* dict, PyObject* name, int otherwise) {
  PyObject* v = PyDict_GetItem(dict, name);
  if (v == nullptr || !PyLong_Check(v)) return otherwise;
  const long r = PyLong_AsLong(v);
  if (r == -1 && PyErr_Occurred()) {
    PyErr_Clear();
    return otherwise;
  }
  return static_cast<int>(r);
}

// The input's shape as a tuple of ints (what explain() reads; torch.Size compares equal to it).
PyObject* shape_tuple(const at::Tensor& t) {
  const auto sizes = t.sizes();
  PyObject* r = PyTuple_New(static_cast<Py_ssize_t>(sizes.size()));
  if (r == nullptr) return nullptr;
  for (size_t i = 0; i < sizes.size(); ++i) {
    PyObject* v = PyLong_FromLongLong(sizes[i]);
    if (v == nullptr) {
      Py_DECREF(r);
      return nullptr;
    }
    PyTuple_SET_ITEM(r, static_cast<Py_ssize_t>(i), v);
  }
  return r;
}

PyObject* wrap_outputs(std::vector<at::Tensor>& out) {
  if (out.size() == 1) return THPVariable_Wrap(std::move(out[0]));
  PyObject* t = PyTuple_New(static_cast<Py_ssize_t>(out.size()));
  if (t == nullptr) return nullptr;
  for (size_t i = 0; i < out.size(); ++i) {
    PyObject* v = THPVariable_Wrap(std::move(out[i]));
    if (v == nullptr) {
      Py_DECREF(t);
      return nullptr;
    }
    PyTuple_SET_ITEM(t, static_cast<Py_ssize_t>(i), v);
  }
  return t;
}

// module_call(module, args): the module's output, or None (the caller runs its Python path).
PyObject* module_call(PyObject* /*m*/, PyObject* const* argv, Py_ssize_t argc) {
  HANDLE_TH_ERRORS
  if (argc != 2 || g_call.forward == nullptr || !PyTuple_Check(argv[1])) Py_RETURN_NONE;
  PyObject* self = argv[0];
  PyObject* args = argv[1];
  Ref dict(PyObject_GenericGetDict(self, nullptr));
  if (dict.p == nullptr) {
    PyErr_Clear();
    Py_RETURN_NONE;
  }
  if (!plain_call(self, dict.p)) Py_RETURN_NONE;
  PyObject* labels = PyDict_GetItem(dict.p, g_call.s_labels);
  PyObject* fp8_out = PyDict_GetItem(dict.p, g_call.s_fp8_output);
  if (labels == nullptr || !is_empty_dict(labels) || fp8_out != Py_False) Py_RETURN_NONE;
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  if (n < 1 || n - 1 != dict_int(dict.p, g_call.s_n_in, -1)) Py_RETURN_NONE;
  for (Py_ssize_t i = 0; i < n; ++i)
    if (!THPVariable_Check(PyTuple_GET_ITEM(args, i))) Py_RETURN_NONE;
  if (at::autocast::is_autocast_enabled(at::kCUDA)) Py_RETURN_NONE;
  PyObject* training_obj = PyDict_GetItem(dict.p, g_call.s_training);
  if (training_obj != Py_True && training_obj != Py_False) Py_RETURN_NONE;
  const bool training = training_obj == Py_True;
  const at::Tensor& input = THPVariable_Unpack(PyTuple_GET_ITEM(args, 0));
  std::vector<at::Tensor> extras, params;
  extras.reserve(n - 1);
  for (Py_ssize_t i = 1; i < n; ++i) extras.push_back(THPVariable_Unpack(PyTuple_GET_ITEM(args, i)));
  if (!live_params(PyDict_GetItem(dict.p, g_call.s_refs), params)) Py_RETURN_NONE;
  const int64_t key = module_key(dict.p, training, input.scalar_type());
  const int n_extra_outputs = dict_int(dict.p, g_call.s_n_out, -1);
  if (key < 0 || n_extra_outputs < 0 || !jitfuse_torch::module_call_ok(input, extras, params)) Py_RETURN_NONE;
  std::optional<at::Tensor> rng;
  PyObject* uses_rng = PyDict_GetItem(dict.p, g_call.s_rng);
  PyObject* rng_on = uses_rng != nullptr && PyDict_Check(uses_rng)
                         ? PyDict_GetItem(uses_rng, training ? Py_True : Py_False) : nullptr;
  if (rng_on != Py_True && rng_on != Py_False) Py_RETURN_NONE;
  if (rng_on == Py_True) {
    Ref r(PyObject_CallOneArg(g_call.draw_rng, PyTuple_GET_ITEM(args, 0)));
    if (r.p == nullptr) return nullptr;
    if (!THPVariable_Check(r.p)) Py_RETURN_NONE;
    rng = THPVariable_Unpack(r.p);
  }
  std::vector<at::Tensor> out;
  if (run_module_forward(key, input, extras, params, rng, training, n_extra_outputs, out) < 0) return nullptr;
  Ref shape(shape_tuple(input));  // what explain() shows
  if (shape.p == nullptr || PyDict_SetItem(dict.p, g_call.s_last_shape, shape.p) != 0) return nullptr;
  return wrap_outputs(out);
  END_HANDLE_TH_ERRORS
}

PyMethodDef g_methods[] = {
    {"module_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&module_call)), METH_FASTCALL,
     "module_call(module, args): Sequential's eager call in C++, or None where Python must decide"},
    {nullptr, nullptr, 0, nullptr}};

void register_sequence(int64_t key, int device, uintptr_t seq, const std::string& name, const std::string& dtype,
                       const std::vector<std::pair<int, std::string>>& params, const std::vector<bool>& accumulate,
                       int n_extra_inputs, int n_extra_outputs, bool fp8, bool fp8_output, int last_op) {
  auto s = std::make_shared<jitfuse_torch::Sequence>();
  s->key = key;
  s->device = device;
  s->seq = reinterpret_cast<jf_sequence>(seq);
  s->name = name;
  s->dtype = dtype_named(dtype);
  s->params = params;
  for (auto& [op, n] : params) s->param_labels.push_back("op " + std::to_string(op) + " " + n);
  for (bool a : accumulate) s->accumulate.push_back(a ? 1 : 0);
  s->accumulate.resize(params.size(), 0);
  s->n_extra_inputs = n_extra_inputs;
  s->n_extra_outputs = n_extra_outputs;
  s->fp8 = fp8;
  s->fp8_output = fp8_output;
  s->last_op = last_op;
  jitfuse_torch::register_sequence(std::move(s));
}

// Called by the ops (any thread, GIL held or not: the dispatcher releases it) for a key they have not seen on
// a device. Plain CPython calls: no pybind11 state is shared with the caller's GIL release.
bool resolve(int64_t key, int device) {
  PyGILState_STATE gil = PyGILState_Ensure();
  PyObject* r = PyObject_CallFunction(g_resolver, "Li", static_cast<long long>(key), device);
  std::string err;
  bool ok = false;
  if (r == nullptr) {
    PyObject *type = nullptr, *value = nullptr, *tb = nullptr;
    PyErr_Fetch(&type, &value, &tb);
    PyObject* text = value ? PyObject_Str(value) : nullptr;
    const char* c = text ? PyUnicode_AsUTF8(text) : nullptr;
    err = c ? c : "the resolver raised";
    Py_XDECREF(text);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
  } else {
    ok = PyObject_IsTrue(r) == 1;
    Py_DECREF(r);
  }
  PyGILState_Release(gil);
  TORCH_CHECK(err.empty(), "jitfuse: defining sequence key ", key, " on cuda:", device, " failed: ", err);
  return ok;
}

// The forward's Meta kernel on symbolic rows: jitfuse.torch._ops.symbolic_fake_outputs(key, device, input,
// training) -> a list of tensors, or None (specialise). Its exceptions propagate as the Meta kernel's.
PyObject* g_symbolic_meta = nullptr;  // the callable, kept for the process

std::optional<std::vector<at::Tensor>> symbolic_meta(int64_t key, int device, const at::Tensor& input, bool training) {
  py::gil_scoped_acquire gil;
  py::object r = py::reinterpret_borrow<py::object>(g_symbolic_meta)(key, device, input, training);
  if (r.is_none()) return std::nullopt;
  return r.cast<std::vector<at::Tensor>>();
}

// JITFUSE_TORCH_SEGV_TRACE=1: a crash prints its C++ frames to stderr (diagnosis on machines without gdb).
void segv_trace(int sig) {
  void* frames[64];
  int n = backtrace(frames, 64);
  const char msg[] = "jitfuse_torch: fatal signal, C++ frames:\n";
  (void)!write(2, msg, sizeof(msg) - 1);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

}  // namespace

PYBIND11_MODULE(_jitfuse_torch_C, m) {
  m.doc() = "jitfuse.torch's C++ extension: hooks of the Python package and Sequential's eager entry";
  if (const char* e = std::getenv("JITFUSE_TORCH_SEGV_TRACE"); e && *e == '1') {
    signal(SIGSEGV, segv_trace);
    signal(SIGABRT, segv_trace);
  }
  m.def("built_for_torch", [] { return std::string(jitfuse_torch::built_for_torch()); });
  m.def("abi_version", [] { return JF_ABI_VERSION; });
  m.def("module_forward", &module_forward, py::arg("key"), py::arg("input"), py::arg("extra_inputs"),
        py::arg("params"), py::arg("rng_state"), py::arg("training"), py::arg("n_extra_outputs"));
  m.def("register_sequence", &register_sequence);
  m.def("init_module_call", &init_module_call);
  if (PyModule_AddFunctions(m.ptr(), g_methods) != 0) throw py::error_already_set();
  m.def("forget", [](const std::vector<int64_t>& keys) {
    for (auto k : keys) jitfuse_torch::forget(k);
  });
  m.def("define", &jitfuse_torch::define);
  m.def("load_definitions", &jitfuse_torch::load_definitions);
  m.def("set_error_class", [](py::object cls) {
    Py_XDECREF(g_error_class);
    g_error_class = cls.release().ptr();
  });
  m.def("set_symbolic_meta", [](py::object fn) {
    PyObject* old = g_symbolic_meta;
    g_symbolic_meta = fn.release().ptr();
    Py_XDECREF(old);
    jitfuse_torch::set_symbolic_meta(&symbolic_meta);
  });
  m.def("set_resolver", [](py::object fn) {
    PyObject* old = g_resolver;
    g_resolver = fn.release().ptr();
    Py_XDECREF(old);
    jitfuse_torch::set_resolver(&resolve);
  });
  // Tests: record which calls of a sequence reached the C ABI from here ("forward", "forward:fp8_weights_unchanged",
  // "backward"), from watch_calls(key, device, True) on; watch_calls clears the record.
  m.def("watch_calls", [](int64_t key, int device, bool on) { jitfuse_torch::sequence(key, device)->watch(on); },
        py::arg("key"), py::arg("device"), py::arg("on") = true);
  m.def("watched_calls", [](int64_t key, int device) { return jitfuse_torch::sequence(key, device)->watched(); },
        py::arg("key"), py::arg("device"));
  m.def("set_fp8_promise", &jitfuse_torch::set_fp8_promise);
  m.def("fp8_promise", &jitfuse_torch::fp8_promise);
}
