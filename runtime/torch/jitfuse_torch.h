// The C++ side of jitfuse.torch: the registry of sequences the jitfuse::forward / jitfuse::backward ops run
// (one per (key, device), with its jf_program handles per (input shape, training)) and the eager entry.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <jitfuse/jitfuse.h>

namespace jitfuse_torch {

// The torch version this build serves (C++ autograd needs full libtorch headers: no stable ABI), and the C ABI.
const char* built_for_torch();

// One prepared (input shape, training) of a sequence: its jf_program handle and what it makes and needs.
struct Program {
  std::vector<int64_t> shape;
  bool training = false;
  jf_program handle = nullptr;
  std::vector<int64_t> out_shape;
  at::ScalarType out_dtype = at::kFloat;
  std::vector<std::pair<std::vector<int64_t>, at::ScalarType>> extra_outputs;
  size_t saved_bytes = 0;
  size_t forward_workspace = 0;
  size_t backward_workspace = 0;
  ~Program();
};

// What a sequence key means on one device. The jf_sequence belongs to the host that registered it (the
// Python package's DeviceProgram, or a C++ program through define()); programs keep it alive.
struct Sequence {
  int64_t key = 0;
  int device = 0;
  jf_sequence seq = nullptr;
  bool owns_seq = false;
  jf_context owned_ctx = nullptr;
  std::string name;
  at::ScalarType dtype = at::kFloat;                    // the activations' dtype (FP8 recipes: bfloat16)
  std::vector<std::pair<int, std::string>> params;      // (op index, ABI name) in the order the op receives them
  std::vector<std::string> param_labels;                // "op 1 bias"
  std::vector<char> accumulate;                         // the library adds into the gradient (zero-filled)
  int n_extra_inputs = 0;
  int n_extra_outputs = 0;
  bool fp8 = false;         // an FP8 recipe: the weights' FP8 copies may be reused (fp8_weights_unchanged)
  bool fp8_output = false;  // ends in quantize: the op returns the scale_inv of its E4M3 output after the extras
  int last_op = 0;

  // The program of (shape, training), opened on first use (outside a CUDA-graph capture).
  std::shared_ptr<Program> program(c10::IntArrayRef shape, bool training, void* stream);
  ~Sequence();

  // Which calls the C ABI saw from this extension, for tests that must tell the paths apart (the Python
  // package's GPU tests: `_jitfuse_torch_C.watch_calls` / `watched_calls`). Off: one relaxed load per call.
  void watch(bool on);
  std::vector<std::string> watched();
  void record(const char* call) {
    if (watching_.load(std::memory_order_relaxed)) record_locked(call);
  }

 private:
  void record_locked(const char* call);
  std::mutex mu_;
  std::vector<std::shared_ptr<Program>> programs_;
  std::atomic<bool> watching_{false};
  std::vector<std::string> watched_;  // guarded by mu_
};

// The registry. A miss asks the resolver (the Python package: it creates the sequence and registers it).
std::shared_ptr<Sequence> sequence(int64_t key, int device);
void register_sequence(std::shared_ptr<Sequence> s);
void forget(int64_t key);
// The lowest device `key` is registered on, or -1 (the Meta kernels prepare their program there).
int registered_device(int64_t key);
void set_resolver(std::function<bool(int64_t key, int device)> resolver);
// The forward's Meta kernel for an input with symbolic row dims (torch.compile(dynamic=True)): the Python
// package's answer (jitfuse.torch._ops.symbolic_fake_outputs: outputs keeping the symbolic rows, the saved
// block's size data-dependent), or nullopt to specialise the dims as a host without Python does.
using SymbolicMeta = std::function<std::optional<std::vector<at::Tensor>>(int64_t key, int device,
                                                                          const at::Tensor& input, bool training)>;
void set_symbolic_meta(SymbolicMeta fn);

// C++ hosts (no Python): a sequence document ("jitfuse.sequence/1" JSON), its recipe and parameter order,
// created on every device it runs on.
void define(int64_t key, const std::string& document, const std::string& recipe,
            const std::vector<std::pair<int, std::string>>& params, const std::vector<bool>& accumulate,
            int n_extra_inputs, int n_extra_outputs, const std::string& name = "", bool fp8_output = false);
// The definitions file jitfuse.torch.export_definitions writes ("jitfuse.torch_sequences/1": one line per
// key). Returns how many it defined; throws naming the file and line on a malformed one. The registry also
// reads every file named in $JITFUSE_TORCH_SEQUENCES (':'-separated) on its first unknown key.
int load_definitions(const std::string& path);

// FP8: this thread's promise that no weight changed since the last forward (jitfuse.torch.fp8_weights_unchanged).
bool set_fp8_promise(bool on);
bool fp8_promise();

// The ops, called through the dispatcher.
std::vector<at::Tensor> call_forward(int64_t key, const at::Tensor& input, at::TensorList extra_inputs,
                                     at::TensorList params, const std::optional<at::Tensor>& rng_state, bool training);

// Whether module_forward takes these tensors: all defined, the input on CUDA, the rest of its dtype and device.
bool module_call_ok(const at::Tensor& input, at::TensorList extra_inputs, at::TensorList params);

// Sequential's eager call, for tensors module_call_ok takes (its callers check that first): checks nothing
// the op checks. `out`: [output, *extra_outputs], then, for an E4M3 output (an FP8 sequence ending in quantize),
// the float32 [1] scale_inv that decodes it (the caller wraps both in a Float8Tensor).
void module_forward(int64_t key, const at::Tensor& input, const std::vector<at::Tensor>& extra_inputs,
                    const std::vector<at::Tensor>& params, const std::optional<at::Tensor>& rng_state, bool training,
                    int n_extra_outputs, std::vector<at::Tensor>& out);

}  // namespace jitfuse_torch
