// Checks of what a host hands the C ABI (DLTensor structs, shape arrays, C strings), run before any
// planning or device work so that a bad argument is reported as such, naming it, even without a GPU.
#pragma once
#include <dlpack/dlpack.h>

#include <string>
#include <type_traits>
#include <vector>

#include "ops/op.hpp"
#include "ops/sequence.hpp"

namespace jitfuse::api {

// Longest C string argument (names, recipes, op kinds) we accept; a JSON text has its own limit.
inline constexpr size_t kMaxNameBytes = 4096;

// What an argument is called in an error message, made only when a message needs it: a call whose
// arguments pass every check formats no string and allocates nothing for names (issue 12: jf_forward
// and jf_backward run per training step). Refers to a C string, a std::string or a callable returning
// one, which must outlive the Name (pass lambdas as temporaries to a call).
class Name {
 public:
  Name(const char* s) : obj_(s), fn_(&from_cstr) {}         // NOLINT(google-explicit-constructor)
  Name(const std::string& s) : obj_(&s), fn_(&from_str) {}  // NOLINT(google-explicit-constructor)
  template <class F, class = std::enable_if_t<std::is_invocable_r_v<std::string, const F&>>>
  Name(const F& f) : obj_(&f), fn_([](const void* o) { return std::string((*static_cast<const F*>(o))()); }) {}  // NOLINT
  std::string str() const { return fn_(obj_); }

 private:
  static std::string from_cstr(const void* o) { return static_cast<const char*>(o); }
  static std::string from_str(const void* o) { return *static_cast<const std::string*>(o); }
  const void* obj_;
  std::string (*fn_)(const void*);
};

// Non-NULL, at most kMaxNameBytes, valid UTF-8. Throws Error(invalid_argument) naming `what`.
void check_name(const char* s, const Name& what);

// The DLTensor struct itself: not NULL, 1..kMaxDims dims, shape not NULL, dims positive, element and
// byte counts within int64, strides (if given) not negative, one lane of 8/16/32/64 bits, CUDA device
// memory, data not NULL. Throws Error(invalid_argument) naming `name`. Reads nothing through `data`.
void check_dltensor(const DLTensor* t, const Name& name);

// `n` tensors in `arr` (`what` 0 .. n-1); arr may be NULL only when n == 0.
void check_dltensor_array(const DLTensor* const* arr, int n, int expected, const char* what);

// A host's shape array (jf_sequence_explain): ndim in 1..kMaxDims, dims positive, count within int64.
ops::Shape checked_shape(const int64_t* shape, int ndim, const char* what);

// Everything of a jf_forward / jf_backward call that can be checked without planning: the tensor
// structs, their counts against the sequence's extra inputs/outputs, and their dtypes against the recipe
// (`dtype`: the recipe's; `out_dtype`: the output's, E4M3 after a final quantize under FP8).
void check_forward_args(const ops::SequenceDef& s, ops::DType dtype, ops::DType out_dtype, const DLTensor* input, const DLTensor* const* extra_inputs,
                        int n_extra_inputs, const DLTensor* output, const DLTensor* const* extra_outputs,
                        int n_extra_outputs);
void check_backward_args(const ops::SequenceDef& s, ops::DType dtype, const DLTensor* grad_output, const DLTensor* const* grad_extra_outputs,
                         int n_grad_extra_outputs, const DLTensor* grad_input, const DLTensor* const* grad_extra_inputs,
                         int n_grad_extra_inputs);

// The counts of a call whose tensors come by position (jf_sequence_check_counts; jitfuse.torch's one count
// check): `n_params_declared` < 0 leaves the parameters out, `n_extra_outputs` < 0 the outputs (a forward).
// Throws Error(invalid_argument) with the message the host layers show, prefixed "<caller>: " if given.
struct CallCounts {
  int extra_inputs = 0, params = -1, extra_outputs = -1, grad_extra_outputs = -1;
};
void check_counts(const ops::SequenceDef& s, const char* caller, int n_params_declared, const CallCounts& got);

// The name of a Span, kept as parts (no string per call): `kind` alone ("input", "saved buffer"),
// "<kind> <slot> (op <index>)" (extra inputs and outputs) or "<kind> <op label> '<param>'" (parameters
// and gradients). `op` and `param` point into the sequence's ops, alive for the call.
struct SpanName {
  const char* kind = "";
  int slot = -1;
  const ops::Op* op = nullptr;
  const char* param = nullptr;
  std::string str() const;
};

// An op's own extra input (ops::ExtraInputSpec: cross_entropy's labels) of a call: the struct, then exactly
// the spec's dtype and shape, contiguous, aligned to its elements, on the input's device (`input`, already
// checked; may be null). Returns its data pointer. Errors name the tensor, what was expected and what came.
void* check_own_extra_input(const DLTensor* t, const SpanName& name, const ops::ExtraInputSpec& spec,
                            const DLTensor* input);

// Device memory a call reads or writes, for the overlap check.
struct Span {
  SpanName name;
  uintptr_t begin = 0, end = 0;  // [begin, end)
  bool written = false;
  bool saved_buffer = false;  // the call's saved buffer
  bool over_saved = false;    // a gradient exactly where the program lets it sit in the saved buffer
};
Span span_of(const DLTensor* t, SpanName name, bool written);  // t already passed check_dltensor
// Two spans that overlap, one of them written, are refused naming both: a captured graph (or the
// kernels' __restrict__ pointers) would silently compute garbage. Sorts `spans` by address.
void check_no_overlap(std::vector<Span>& spans);

// Whether a DLPack dtype is the bytes of `d` (E4M3: DLPack 1.0's code 10, or uint8 storage).
bool dtype_matches(DLDataType t, ops::DType d);
std::string dl_dtype_name(DLDataType t);
// The DLPack dtype jitfuse reports for `d` (E4M3: DLPack 1.0's kDLFloat8_e4m3fn, code 10).
DLDataType dl_dtype(ops::DType d);

}  // namespace jitfuse::api
