// _jitfuse_torch_C: the Python package's hooks into libjitfuse_torch.so (registering the sequences of its
// modules, the resolver, the FP8 promise) and Sequential's eager entry, one call from Python to the op.
#include "jitfuse_torch.h"

#include <torch/csrc/Exceptions.h>
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

// Sequential's eager call: the op through the dispatcher (autograd, modes and subclasses see it), with the
// GIL released as PyTorch's own ops do. None: the caller takes its checked path. One tensor, or a tuple
// (output, *extra_outputs[, scale_inv of an E4M3 output]) when there is more than the output.
py::object module_forward(int64_t key, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
                          const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& rng_state,
                          bool training, int n_extra_outputs) {
  HANDLE_TH_ERRORS
  std::vector<at::Tensor> out;
  bool ok = false;
  try {
    py::gil_scoped_release no_gil;
    ok = jitfuse_torch::module_forward(key, input, extra_inputs, params, rng_state, training, n_extra_outputs, out);
  } catch (const c10::Error& e) {
    // jitfuse's own errors as jitfuse.JitfuseError (TypeError / ValueError and PyTorch's errors unchanged).
    if (typeid(e) == typeid(c10::Error) && from_jitfuse(e) && g_error_class) {
      PyErr_SetString(g_error_class, e.what_without_backtrace());
      throw py::error_already_set();
    }
    throw;
  }
  if (!ok) return py::none();
  if (out.size() == 1) return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[0])));
  py::tuple t(out.size());
  for (size_t i = 0; i < out.size(); ++i)
    t[i] = py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(out[i])));
  return std::move(t);
  END_HANDLE_TH_ERRORS_PYBIND
}

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
  m.def("forget", [](const std::vector<int64_t>& keys) {
    for (auto k : keys) jitfuse_torch::forget(k);
  });
  m.def("define", &jitfuse_torch::define);
  m.def("load_definitions", &jitfuse_torch::load_definitions);
  m.def("set_error_class", [](py::object cls) {
    Py_XDECREF(g_error_class);
    g_error_class = cls.release().ptr();
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
