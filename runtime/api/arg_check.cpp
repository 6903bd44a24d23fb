// Argument checks for the C ABI (see arg_check.hpp). Every message names the argument and says what
// was expected; no check dereferences tensor data.
#include "api/arg_check.hpp"

#include <algorithm>

#include <cstring>
#include <string>
#include <vector>

#include <fmt/ranges.h>

#include "common/error.hpp"
#include "common/text.hpp"

namespace jitfuse::api {

void check_name(const char* s, const Name& what) {
  if (!s) fail(Status::invalid_argument, "{} is NULL", what.str());
  size_t n = ::strnlen(s, kMaxNameBytes + 1);
  std::string_view v(s, n);
  if (n > kMaxNameBytes)
    fail(Status::invalid_argument, "{} '{}' is longer than {} bytes", what.str(), text::shorten(v), kMaxNameBytes);
  if (!text::valid_utf8(v))
    fail(Status::invalid_argument, "{} '{}' is not valid UTF-8 (names must be UTF-8 text)", what.str(),
         text::shorten(v));
}

std::string SpanName::str() const {
  if (op && param) return fmt::format("{} {} '{}'", kind, op->label(), param);
  if (op) return fmt::format("{} {} (op {})", kind, slot, op->index);
  return kind;
}

std::string dl_dtype_name(DLDataType t) {
  const char* base = t.code == kDLFloat    ? "float"
                     : t.code == kDLBfloat ? "bfloat"
                     : t.code == kDLInt    ? "int"
                     : t.code == kDLUInt   ? "uint"
                     : t.code == 10        ? "float8_e4m3fn"
                     : t.code == 12        ? "float8_e5m2"
                                           : "other";
  std::string s = fmt::format("{}{}", base, t.bits);
  if (t.lanes != 1) s += fmt::format("x{}", t.lanes);
  return s;
}

bool dtype_matches(DLDataType t, ops::DType d) {
  if (t.lanes != 1) return false;
  switch (d) {
    case ops::DType::f32: return t.code == kDLFloat && t.bits == 32;
    case ops::DType::f16: return t.code == kDLFloat && t.bits == 16;
    case ops::DType::bf16: return t.code == kDLBfloat && t.bits == 16;
    case ops::DType::e4m3: return (t.code == 10 || t.code == kDLUInt) && t.bits == 8;
    case ops::DType::e5m2: return (t.code == 12 || t.code == kDLUInt) && t.bits == 8;  // DLPack 1.0's kDLFloat8_e5m2
    case ops::DType::i32: return t.code == kDLInt && t.bits == 32;
    case ops::DType::i64: return t.code == kDLInt && t.bits == 64;
  }
  return false;
}

Span span_of(const DLTensor* t, SpanName name, bool written) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
  const auto begin = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  return {name, begin, begin + static_cast<uintptr_t>(n) * ((t->dtype.bits * t->dtype.lanes + 7u) / 8u), written};
}

void check_no_overlap(std::vector<Span>& spans) {
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) { return a.begin < b.begin; });
  for (size_t i = 0; i < spans.size(); ++i)
    for (size_t j = i + 1; j < spans.size() && spans[j].begin < spans[i].end; ++j) {
      const Span &a = spans[i], &b = spans[j];
      if (a.begin == a.end || b.begin == b.end || (!a.written && !b.written)) continue;
      if ((a.over_saved && b.saved_buffer) || (b.over_saved && a.saved_buffer)) continue;  // jf_grad_alias
      fail(Status::invalid_argument, "tensor '{}' (bytes 0x{:x}..0x{:x}) overlaps tensor '{}' (bytes 0x{:x}..0x{:x}) "
           "and {} written by this call: pass separate memory", a.name.str(), a.begin, a.end, b.name.str(), b.begin,
           b.end, a.written && b.written ? "both are" : a.written ? "the first is" : "the second is");
    }
}

DLDataType dl_dtype(ops::DType d) {
  switch (d) {
    case ops::DType::f16: return {kDLFloat, 16, 1};
    case ops::DType::bf16: return {kDLBfloat, 16, 1};
    case ops::DType::e4m3: return {10, 8, 1};
    case ops::DType::e5m2: return {12, 8, 1};
    case ops::DType::i32: return {kDLInt, 32, 1};
    case ops::DType::i64: return {kDLInt, 64, 1};
    default: return {kDLFloat, 32, 1};
  }
}

void check_dltensor(const DLTensor* t, const Name& name) {
  // Every message formats the name itself (name.str()): nothing is formatted while the checks pass.
  if (!t) fail(Status::invalid_argument, "tensor '{}' is NULL", name.str());
  if (t->ndim < 1 || t->ndim > static_cast<int>(ops::kMaxDims))
    fail(Status::invalid_argument, "tensor '{}' has ndim {}; jitfuse takes 1 to {} dims", name.str(), t->ndim,
         ops::kMaxDims);
  if (!t->shape)
    fail(Status::invalid_argument, "tensor '{}' has ndim {} but its shape pointer is NULL", name.str(), t->ndim);
  const int64_t* shape = t->shape;
  const int64_t* shape_end = t->shape + t->ndim;
  for (int i = 0; i < t->ndim; ++i)
    if (shape[i] <= 0)
      fail(Status::invalid_argument, "tensor '{}': dim {} of shape ({}) is {}; every dim must be positive",
           name.str(), i, fmt::join(shape, shape_end, ","), shape[i]);
  int64_t n = 1;
  for (int i = 0; i < t->ndim; ++i)
    if (__builtin_mul_overflow(n, shape[i], &n))
      fail(Status::invalid_argument, "tensor '{}': shape ({}) has more elements than int64 can count", name.str(),
           fmt::join(shape, shape_end, ","));
  if (t->dtype.lanes != 1 || (t->dtype.bits != 8 && t->dtype.bits != 16 && t->dtype.bits != 32 && t->dtype.bits != 64))
    fail(Status::invalid_argument, "tensor '{}': dtype {} (code {}, {} bits, {} lanes) is not a scalar type jitfuse "
         "reads", name.str(), dl_dtype_name(t->dtype), t->dtype.code, t->dtype.bits, t->dtype.lanes);
  int64_t bytes = 0;
  if (__builtin_mul_overflow(n, int64_t(t->dtype.bits / 8), &bytes))
    fail(Status::invalid_argument, "tensor '{}': shape ({}) of {} is more bytes than int64 can count", name.str(),
         fmt::join(shape, shape_end, ","), dl_dtype_name(t->dtype));
  if (t->strides)
    for (int i = 0; i < t->ndim; ++i)
      if (t->strides[i] < 0)
        fail(Status::invalid_argument, "tensor '{}': stride {} is {}; negative strides are not supported", name.str(),
             i, t->strides[i]);
  // Read as the int a C host stored: a value outside the enum's range is the host's to pass, and loading
  // it as a DLDeviceType would be undefined behaviour (found by fuzz_args).
  int device_type = 0;
  static_assert(sizeof device_type == sizeof t->device.device_type);
  std::memcpy(&device_type, &t->device.device_type, sizeof device_type);
  if (device_type != kDLCUDA && device_type != kDLCUDAManaged)
    fail(Status::invalid_argument, "tensor '{}' must be in CUDA device memory (DLPack device type {}), got type {}",
         name.str(), static_cast<int>(kDLCUDA), device_type);
  if (t->device.device_id < 0)
    fail(Status::invalid_argument, "tensor '{}': device id {} is negative", name.str(), t->device.device_id);
  if (!t->data) fail(Status::invalid_argument, "tensor '{}': data is NULL", name.str());
  if (t->byte_offset > uint64_t(INT64_MAX) - uint64_t(bytes))
    fail(Status::invalid_argument, "tensor '{}': byte_offset {} is out of range", name.str(), t->byte_offset);
}

void check_dltensor_array(const DLTensor* const* arr, int n, int expected, const char* what) {
  if (n != expected) fail(Status::invalid_argument, "expected {} {}(s), got {}", expected, what, n);
  if (n > 0 && !arr) fail(Status::invalid_argument, "the {} array is NULL but {} {}(s) were announced", what, n, what);
  for (int i = 0; i < n; ++i) check_dltensor(arr[i], [&] { return fmt::format("{} {}", what, i); });
}

ops::Shape checked_shape(const int64_t* shape, int ndim, const char* what) {
  if (ndim < 1 || ndim > static_cast<int>(ops::kMaxDims))
    fail(Status::invalid_argument, "{}: ndim is {}; give 1 to {} dims", what, ndim, ops::kMaxDims);
  if (!shape) fail(Status::invalid_argument, "{} is NULL", what);
  ops::Shape s(shape, shape + ndim);
  for (int i = 0; i < ndim; ++i)
    if (s[i] <= 0)
      fail(Status::invalid_argument, "{}: dim {} of ({}) is {}; every dim must be positive", what, i,
           fmt::join(s, ","), s[i]);
  ops::numel(s);  // throws when the count overflows
  return s;
}

namespace {

// What a sequence's extra inputs are, for the messages that count them: the kinds of its slots (the wiring).
std::string extra_inputs_note(const ops::SequenceDef& s) {
  bool add = false, channel = false, labels = false, routing = false;
  for (const auto& slot : s.extra_input_slots) {
    add = add || slot.kind == "add";
    channel = channel || slot.kind == "channel";
    labels = labels || slot.kind == "labels";
    routing = routing || slot.kind == "indices" || slot.kind == "probs";
  }
  std::vector<std::string> parts;
  if (add || (!channel && !labels && !routing)) parts.emplace_back("add_extra_input ops without a channel");
  if (channel) parts.emplace_back("one per input channel");
  if (labels) parts.emplace_back("the labels of cross_entropy");
  if (routing) parts.emplace_back("the routing indices and probabilities of moe_permute / moe_unpermute");
  std::string note = parts[0];
  for (size_t i = 1; i < parts.size(); ++i) note += (i + 1 == parts.size() ? " and " : ", ") + parts[i];
  return note;
}

void check_dtype(const DLTensor* t, const Name& name, ops::DType want) {
  if (!dtype_matches(t->dtype, want))
    fail(Status::invalid_argument, "tensor '{}': expected dtype {} for this recipe, got {}", name.str(),
         ops::dtype_name(want), dl_dtype_name(t->dtype));
}

}  // namespace

void check_forward_args(const ops::SequenceDef& s, ops::DType dtype, ops::DType out_dtype, const DLTensor* input, const DLTensor* const* extra_inputs,
                        int n_extra_inputs, const DLTensor* output, const DLTensor* const* extra_outputs,
                        int n_extra_outputs) {
  check_dltensor(input, "input");
  check_dtype(input, "input", dtype);
  check_dltensor(output, "output");
  check_dtype(output, "output", out_dtype);
  if (n_extra_inputs != s.extra_inputs)
    fail(Status::invalid_argument, "sequence '{}' takes {} extra input(s) ({}), got {}", s.name, s.extra_inputs,
         extra_inputs_note(s), n_extra_inputs);
  if (n_extra_outputs != s.extra_outputs)
    fail(Status::invalid_argument, "sequence '{}' makes {} extra output(s) (make_extra_output ops), got {}",
         s.name, s.extra_outputs, n_extra_outputs);
  check_dltensor_array(extra_inputs, n_extra_inputs, s.extra_inputs, "extra input");
  check_dltensor_array(extra_outputs, n_extra_outputs, s.extra_outputs, "extra output");
}

void check_backward_args(const ops::SequenceDef& s, ops::DType dtype, const DLTensor* grad_output, const DLTensor* const* grad_extra_outputs,
                         int n_grad_extra_outputs, const DLTensor* grad_input, const DLTensor* const* grad_extra_inputs,
                         int n_grad_extra_inputs) {
  check_dltensor(grad_output, "grad_output");
  check_dtype(grad_output, "grad_output", dtype);
  check_dltensor(grad_input, "grad_input");
  check_dtype(grad_input, "grad_input", dtype);
  if (n_grad_extra_outputs != s.extra_outputs || n_grad_extra_inputs != s.extra_inputs)
    fail(Status::invalid_argument, "sequence '{}' needs {} grad extra output(s) and {} grad extra input(s), got {} and {}",
         s.name, s.extra_outputs, s.extra_inputs, n_grad_extra_outputs, n_grad_extra_inputs);
  check_dltensor_array(grad_extra_outputs, n_grad_extra_outputs, s.extra_outputs, "grad extra output");
  if (n_grad_extra_inputs > 0 && !grad_extra_inputs)
    fail(Status::invalid_argument, "the grad extra input array is NULL but {} grad extra input(s) were announced",
         n_grad_extra_inputs);
  for (int i = 0; i < n_grad_extra_inputs; ++i) {
    const bool nograd = std::find(s.nograd_extra_inputs.begin(), s.nograd_extra_inputs.end(), i) !=
                        s.nograd_extra_inputs.end();
    if (!nograd) {
      check_dltensor(grad_extra_inputs[i], [&] { return fmt::format("grad extra input {}", i); });
    } else if (grad_extra_inputs[i]) {
      fail(Status::invalid_argument, "grad extra input {} must be NULL: extra input {} holds integers (cross_entropy's "
           "labels, moe_permute's indices), which have no gradient", i, i);
    }
  }
}

void check_counts(const ops::SequenceDef& s, const char* caller, int n_params_declared, const CallCounts& got) {
  const bool backward = got.extra_outputs >= 0, params = n_params_declared >= 0;
  if (got.extra_inputs == s.extra_inputs && (!params || got.params == n_params_declared) &&
      (!backward || (got.extra_outputs == s.extra_outputs && got.grad_extra_outputs == got.extra_outputs)))
    return;
  if (caller) check_name(caller, "caller");
  const std::string prefix = caller ? fmt::format("{}: ", caller) : std::string();
  const std::string outs = backward ? fmt::format(", {} extra output(s) and their gradients", s.extra_outputs) : "";
  const std::string outs_got =
      backward ? fmt::format(", {} ({})", got.extra_outputs, got.grad_extra_outputs) : std::string();
  if (params)
    fail(Status::invalid_argument, "{}sequence '{}' takes {} extra input(s) ({}){} and {} parameter(s); got {}{} and {}",
         prefix, s.name, s.extra_inputs, extra_inputs_note(s), outs, n_params_declared, got.extra_inputs, outs_got,
         got.params);
  fail(Status::invalid_argument, "{}sequence '{}' takes {} extra input(s) ({}){}; got {}{}", prefix, s.name,
       s.extra_inputs, extra_inputs_note(s), outs, got.extra_inputs, outs_got);
}

void* check_own_extra_input(const DLTensor* t, const SpanName& name, const ops::ExtraInputSpec& spec,
                            const DLTensor* input) {
  check_dltensor(t, [&] { return name.str(); });
  if (!dtype_matches(t->dtype, spec.dtype))
    fail(Status::invalid_argument, "tensor '{}': expected dtype {} for the {}{}, got {}{}", name.str(),
         ops::dtype_name(spec.dtype), spec.name,
         spec.dtype_attr.empty() ? std::string() : fmt::format(" (the op's \"{}\")", spec.dtype_attr),
         dl_dtype_name(t->dtype),
         !spec.dtype_attr.empty() && t->dtype.code == kDLInt && (t->dtype.bits == 32 || t->dtype.bits == 64)
             ? fmt::format("; set \"{}\": \"int{}\" on the op to pass these", spec.dtype_attr, t->dtype.bits)
             : std::string());
  const ops::Shape got(t->shape, t->shape + t->ndim);
  if (got != spec.shape)
    fail(Status::invalid_argument, "tensor '{}': expected shape {} (one per row of the op's input), got {}", name.str(),
         ops::shape_str(spec.shape), ops::shape_str(got));
  if (t->strides) {
    int64_t expect = 1;  // the shape is the spec's: the product fits (check_dltensor)
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect)
        fail(Status::invalid_argument, "tensor '{}' is not contiguous (stride {} of dim {}); pass a contiguous tensor",
             name.str(), t->strides[i], i);
      expect *= t->shape[i];
    }
  }
  const auto addr = reinterpret_cast<uintptr_t>(t->data) + t->byte_offset;
  if (addr % static_cast<uintptr_t>(ops::dtype_bytes(spec.dtype)) != 0)
    fail(Status::invalid_argument, "tensor '{}': data at 0x{:x} is not aligned to its {}-byte elements", name.str(),
         addr, ops::dtype_bytes(spec.dtype));
  if (input &&
      (t->device.device_type != input->device.device_type || t->device.device_id != input->device.device_id))
    fail(Status::invalid_argument, "tensor '{}' is on device {}:{}, the input on {}:{}: pass them on one GPU",
         name.str(), static_cast<int>(t->device.device_type), t->device.device_id,
         static_cast<int>(input->device.device_type), input->device.device_id);
  return reinterpret_cast<void*>(addr);
}

}  // namespace jitfuse::api
