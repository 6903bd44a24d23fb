// The C ABI: every entry point catches everything, turns it into a status code and a thread-local
// message, and validates DLTensors (device, dtype, layout, shape) with errors naming the tensor.
#include "jitfuse/jitfuse.h"

#include <cstring>

#include "api/arg_check.hpp"
#include "api/handles.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "common/json_util.hpp"
#include "common/log.hpp"
#include "common/text.hpp"
#include "fuser/explain.hpp"

static_assert(JF_ERR_INTERNAL == static_cast<int>(jitfuse::Status::internal), "jf_status mirrors Status");

struct jf_builder_s {
  std::string name;
  nlohmann::json ops = nlohmann::json::array();
};

namespace {

using jitfuse::Error;
using jitfuse::Status;
using jitfuse::fail;

thread_local std::string g_last_error;

// Messages can quote paths and values from the host: jf_last_error always returns valid UTF-8 of
// bounded size. Setting it never throws (a failure to allocate leaves a fixed message).
void set_error(std::string_view msg) noexcept {
  try {
    g_last_error = jitfuse::text::sanitize_message(msg);
  } catch (...) {
    g_last_error.clear();
  }
}

// Every entry point's body runs in here: no exception crosses the C ABI, whatever the input.
template <typename F>
jf_status guarded(F&& f) noexcept {
  try {
    g_last_error.clear();
    f();
    return JF_OK;
  } catch (const Error& e) {
    set_error(e.what());
    return static_cast<jf_status>(e.status());
  } catch (const std::bad_alloc&) {
    set_error("out of host memory");
    return JF_ERR_OUT_OF_MEMORY;
  } catch (const std::exception& e) {
    set_error(std::string("internal error: ") + e.what());
    return JF_ERR_INTERNAL;
  } catch (...) {
    set_error("internal error: unknown exception");
    return JF_ERR_INTERNAL;
  }
}

void need(const void* p, const char* what) {
  if (!p) fail(Status::invalid_argument, "{} is NULL", what);
}

using jitfuse::api::dl_dtype_name;
using jitfuse::api::dtype_matches;

jitfuse::ops::Shape shape_of(const DLTensor* t) { return jitfuse::ops::Shape(t->shape, t->shape + t->ndim); }

using jitfuse::api::Name;
using jitfuse::api::SpanName;

// Checks device, dtype, contiguity and (if given) shape; returns the data pointer. Formats and allocates
// nothing unless a check fails (the name is made then).
void* check_tensor(const DLTensor* t, const Name& name, jitfuse::ops::DType dtype, const jitfuse::ops::Shape* want) {
  jitfuse::api::check_dltensor(t, name);  // the struct: dims, sizes, device, data
  if (!dtype_matches(t->dtype, dtype))
    fail(Status::invalid_argument, "tensor '{}': expected dtype {} for this recipe, got {}", name.str(),
         jitfuse::ops::dtype_name(dtype), dl_dtype_name(t->dtype));
  if (t->strides) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        std::string s;
        for (int j = 0; j < t->ndim; ++j) s += (j ? "," : "") + std::to_string(t->strides[j]);
        fail(Status::invalid_argument, "tensor '{}' is not contiguous row-major: strides ({}) for shape {}", name.str(),
             s, jitfuse::ops::shape_str(shape_of(t)));
      }
      expect *= t->shape[i];
    }
  }
  if (want) {
    int64_t n = 1;  // check_dltensor checked that this product does not overflow
    for (int i = 0; i < t->ndim; ++i) n *= t->shape[i];
    if (n != jitfuse::ops::numel(*want) || t->shape[t->ndim - 1] != jitfuse::ops::cols_of(*want))
      fail(Status::invalid_argument, "tensor '{}': expected shape {}, got {}", name.str(),
           jitfuse::ops::shape_str(*want), jitfuse::ops::shape_str(shape_of(t)));
  }
  return static_cast<char*>(t->data) + t->byte_offset;  // not NULL: check_dltensor checked
}

// A call's (op index, name, tensor) array against the parameters the program's ops declare (the op
// registry's names): every one passed exactly once, with the op's shape and the recipe's dtype. Returns
// the pointers by slot (exec::param_slot: the ops' parameters in declaration order).
template <class T>
std::vector<T> collect_params(const jitfuse::api::Sequence& s, const std::vector<jitfuse::ops::Op>& ops,
                              const jf_param* arr, int n, const char* what, std::vector<jitfuse::api::Span>* spans,
                              bool written) {
  using jitfuse::text::shorten;
  if (n < 0 || n > 1000000) fail(Status::invalid_argument, "n_{} is {}", what, n);
  if (n > 0) need(arr, what);
  std::vector<T> out(jitfuse::exec::param_slot_count(ops), nullptr);
  for (int i = 0; i < n; ++i) {
    const jf_param& e = arr[i];
    jitfuse::api::check_name(e.name, [&] { return fmt::format("{}[{}].name", what, i); });
    if (e.op_index < 0 || e.op_index >= static_cast<int>(ops.size()))
      fail(Status::invalid_argument, "{}[{}]: op index {} out of range: sequence '{}' has {} ops", what, i, e.op_index,
           s.def.name, ops.size());
    const auto& op = ops[static_cast<size_t>(e.op_index)];
    const int slot = jitfuse::exec::param_slot(ops, e.op_index, e.name);
    const jitfuse::ops::Param* decl = nullptr;
    for (const auto& prm : op.params)
      if (prm.name == e.name) decl = &prm;
    if (slot < 0 || !decl) {
      std::string names;
      for (const auto& prm : op.params) names += (names.empty() ? "" : ", ") + prm.name;
      fail(Status::invalid_argument, "{}[{}]: {} has no parameter '{}' ({})", what, i, op.label(), shorten(e.name),
           names.empty() ? "it has no parameters" : "its parameters: " + names);
    }
    const SpanName label{what, -1, &op, decl->name.c_str()};
    void* p = check_tensor(e.tensor, [&] { return label.str(); }, s.recipe.dtype, &decl->shape);
    if (out[static_cast<size_t>(slot)])
      fail(Status::invalid_argument, "{}[{}]: {} '{}' is passed twice", what, i, op.label(), decl->name);
    out[static_cast<size_t>(slot)] = p;  // not null: check_tensor checked
    if (spans) spans->push_back(jitfuse::api::span_of(e.tensor, label, written));
  }
  // Every entry is a declared parameter passed once (checked above): all are there iff none is null.
  size_t slot = 0;
  for (const auto& op : ops)
    for (const auto& prm : op.params)
      if (!out[slot++])
        fail(Status::invalid_argument, "{}: {} '{}' ({}) is missing: pass every parameter with each call", what,
             op.label(), prm.name, jitfuse::ops::shape_str(prm.shape));
  return out;
}

// A host buffer (saved block, workspace) of at least `want` bytes at the arena alignment, or NULL.
void check_buffer(const void* p, size_t bytes, size_t want, const char* what, std::vector<jitfuse::api::Span>& spans,
                  bool written) {
  if (!p) return;
  if (bytes < want)
    fail(Status::invalid_argument, "{} is {} bytes; this program needs {} (jf_sequence_info)", what, bytes, want);
  if (reinterpret_cast<uintptr_t>(p) % jitfuse::exec::kArenaAlignment)
    fail(Status::invalid_argument, "{} at {} is not {}-byte aligned", what, p, jitfuse::exec::kArenaAlignment);
  const auto b = reinterpret_cast<uintptr_t>(p);
  spans.push_back({SpanName{what}, b, b + want, written});
}

CUstream as_stream(jf_stream s) { return reinterpret_cast<CUstream>(s); }

}  // namespace

extern "C" {

int jf_abi_version(void) { return JF_ABI_VERSION; }
const char* jf_version(void) { return JITFUSE_VERSION_STRING; }
const char* jf_last_error(void) { return g_last_error.c_str(); }

jf_status jf_context_create(jf_context* out) {
  return guarded([&] {
    need(out, "out");
    *out = new jf_context_s();
  });
}

jf_status jf_context_destroy(jf_context ctx) {
  return guarded([&] { delete ctx; });
}

jf_status jf_context_load_rules(jf_context ctx, const char* path, int* n_errors) {
  std::string all;
  jf_status st = guarded([&] {
    need(ctx, "ctx");
    need(path, "path");
    auto errors = ctx->impl.load_rules(path);
    if (n_errors) *n_errors = static_cast<int>(errors.size());
    for (auto& e : errors) all += e.to_string() + "\n";
  });
  // Broken rules are reported through jf_last_error although the call succeeds: the good ones loaded.
  if (st == JF_OK) set_error(all);
  return st;
}

jf_status jf_context_set_allocator(jf_context ctx, const jf_allocator* a) {
  return guarded([&] {
    need(ctx, "ctx");
    jitfuse::exec::Allocator alloc;
    if (a && a->alloc) {
      if (!a->free) fail(Status::invalid_argument, "allocator: alloc is set but free is NULL");
      alloc.alloc = reinterpret_cast<void* (*)(size_t, CUstream, void*)>(a->alloc);
      alloc.free = reinterpret_cast<void (*)(void*, size_t, CUstream, void*)>(a->free);
      alloc.user = a->user;
    }
    ctx->impl.set_allocator(alloc);
  });
}

static jf_status make_sequence(jf_context ctx, const std::string& text, const std::string& where, const char* recipe,
                               jf_sequence* out) {
  return guarded([&] {
    need(ctx, "ctx");
    jitfuse::api::check_name(recipe, "recipe");
    need(out, "out");
    auto r = jitfuse::ops::parse_recipe(recipe);
    auto def = [&] {
      // jf_context_load_rules on another thread may be adding op kinds: read the registry under its lock.
      std::lock_guard<std::mutex> lock(ctx->impl.mutex());
      return jitfuse::ops::parse_sequence(text, where, ctx->impl.registry());
    }();
    jitfuse::ops::apply_recipe(def, r);
    auto* s = new jf_sequence_s();
    s->impl = std::make_shared<jitfuse::api::Sequence>(ctx->impl, std::move(def), r);
    *out = s;
  });
}

jf_status jf_sequence_create(jf_context ctx, const char* json, const char* recipe, jf_sequence* out) {
  std::string text;
  jf_status st = guarded([&] {
    need(json, "json");
    size_t n = ::strnlen(json, jitfuse::json_util::kMaxTextBytes + 1);
    if (n > jitfuse::json_util::kMaxTextBytes)
      fail(Status::parse_error, "<sequence>: the JSON text is more than the limit of {} bytes",
           jitfuse::json_util::kMaxTextBytes);
    text.assign(json, n);
  });
  if (st != JF_OK) return st;
  return make_sequence(ctx, text, "<sequence>", recipe, out);
}

jf_status jf_sequence_create_from_file(jf_context ctx, const char* path, const char* recipe, jf_sequence* out) {
  std::string text;
  jf_status st = guarded([&] {
    need(path, "path");
    text = jitfuse::json_util::read_file(path);
  });
  if (st != JF_OK) return st;
  return make_sequence(ctx, text, path, recipe, out);
}

jf_status jf_sequence_destroy(jf_sequence seq) {
  return guarded([&] { delete seq; });
}

int jf_sequence_num_ops(jf_sequence seq) { return seq ? static_cast<int>(seq->impl->def.ops.size()) : -1; }

jf_status jf_sequence_wiring(jf_sequence seq, const char** json_out) {
  return guarded([&] {
    need(json_out, "json_out");
    *json_out = nullptr;
    need(seq, "seq");
    *json_out = seq->impl->wiring.c_str();
  });
}

jf_status jf_sequence_check_counts(jf_sequence seq, const char* caller, const int64_t* shape, int ndim,
                                   int n_extra_inputs, int n_params, int n_extra_outputs, int n_grad_extra_outputs) {
  return guarded([&] {
    need(seq, "seq");
    auto& s = *seq->impl;
    int declared = -1;
    if (n_params >= 0) {
      const auto ops = s.ops_for(jitfuse::api::checked_shape(shape, ndim, "shape"));
      declared = static_cast<int>(jitfuse::exec::param_slot_count(*ops));
    }
    jitfuse::api::check_counts(s.def, caller, declared,
                               {n_extra_inputs, n_params, n_extra_outputs, n_grad_extra_outputs});
  });
}

jf_status jf_builder_create(const char* name, jf_builder* out) {
  return guarded([&] {
    need(out, "out");
    if (name) jitfuse::api::check_name(name, "builder name");
    auto* b = new jf_builder_s();
    b->name = name ? name : "sequence";
    *out = b;
  });
}

jf_status jf_builder_add(jf_builder b, const char* op, const char* attrs_json) {
  return guarded([&] {
    need(b, "builder");
    jitfuse::api::check_name(op, "op");
    if (b->ops.size() >= jitfuse::ops::kMaxOps)
      fail(Status::invalid_argument, "builder '{}' already has {} ops, the most a sequence may have",
           jitfuse::text::shorten(b->name), jitfuse::ops::kMaxOps);
    nlohmann::json o = nlohmann::json::object();
    if (attrs_json && *attrs_json) {
      o = jitfuse::json_util::parse(attrs_json, fmt::format("attributes of op {} ({})", b->ops.size(),
                                                            jitfuse::text::shorten(op)));
      if (!o.is_object())
        fail(Status::parse_error, "attributes of op {} ({}) must be a JSON object", b->ops.size(),
             jitfuse::text::shorten(op));
    }
    o["op"] = op;
    b->ops.push_back(o);
  });
}

jf_status jf_builder_finish(jf_builder b, jf_context ctx, const char* recipe, jf_sequence* out) {
  std::string text, where;
  jf_status st = guarded([&] {
    need(b, "builder");
    nlohmann::json j = {{"format", "jitfuse.sequence/1"}, {"name", b->name}, {"ops", b->ops}};
    // Names were checked when added; `replace` keeps a dump from ever throwing (type_error 316) regardless.
    text = j.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
    where = "<builder " + jitfuse::text::shorten(b->name) + ">";
  });
  if (st != JF_OK) return st;
  return make_sequence(ctx, text, where, recipe, out);
}

jf_status jf_builder_destroy(jf_builder b) {
  return guarded([&] { delete b; });
}

jf_status jf_sequence_fp8_state(jf_sequence seq, int op_index, jf_fp8_state* out) {
  return guarded([&] {
    need(seq, "seq");
    need(out, "out");
    auto& s = *seq->impl;
    if (!s.recipe.is_fp8())
      fail(Status::invalid_argument, "sequence '{}' runs recipe {}: FP8 recipe state exists under fp8_delayed and "
           "fp8_current only", s.def.name, jitfuse::ops::recipe_name(s.recipe.kind));
    if (op_index < 0 || op_index >= static_cast<int>(s.def.ops.size()) || s.def.ops[op_index].kind != "quantize")
      fail(Status::invalid_argument, "op {} of sequence '{}' is not a quantize op: only quantize has FP8 recipe state",
           op_index, s.def.name);
    const auto& st = s.fp8_state().state(op_index, jitfuse::exec::fp8::Operand::none);
    *out = jf_fp8_state{st.scale, st.scale_inv, st.history, st.len};
  });
}

jf_status jf_sequence_fp8_operand_state(jf_sequence seq, int op_index, const char* tensor, jf_fp8_state* out) {
  return guarded([&] {
    need(seq, "seq");
    need(tensor, "tensor");
    need(out, "out");
    auto& s = *seq->impl;
    if (!s.recipe.is_fp8())
      fail(Status::invalid_argument, "sequence '{}' runs recipe {}: FP8 recipe state exists under fp8_delayed and "
           "fp8_current only", s.def.name, jitfuse::ops::recipe_name(s.recipe.kind));
    if (s.recipe.is_block())
      fail(Status::invalid_argument, "sequence '{}' runs recipe fp8_block: its GEMM operands have no recipe state "
           "(each 1x128 or 128x128 block is scaled by its own amax as it is cast); operand state exists under "
           "fp8_delayed and fp8_current", s.def.name);
    if (op_index < 0 || op_index >= static_cast<int>(s.def.ops.size()) || s.def.ops[op_index].kind != "linear")
      fail(Status::invalid_argument, "op {} of sequence '{}' is not a linear op: only linear has FP8 operand state",
           op_index, s.def.name);
    const std::string t(tensor, strnlen(tensor, 32));
    const auto operand = jitfuse::exec::fp8::parse_operand(t);
    if (!operand || *operand == jitfuse::exec::fp8::Operand::none)
      fail(Status::invalid_argument, "tensor must be \"input\", \"weight\" or \"grad_output\" (the FP8 operands of a "
           "linear), not '{}'", jitfuse::text::shorten(t));
    const auto& st = s.fp8_state().state(op_index, *operand);
    *out = jf_fp8_state{st.scale, st.scale_inv, st.history, st.len};
  });
}

jf_status jf_sequence_prepare(jf_sequence seq, const int64_t* shape, int ndim, int training, jf_stream stream) {
  return guarded([&] {
    need(seq, "seq");
    auto in_shape = jitfuse::api::checked_shape(shape, ndim, "shape");
    seq->impl->prepared_for(in_shape, training != 0, as_stream(stream));
  });
}

jf_status jf_sequence_info(jf_sequence seq, const int64_t* shape, int ndim, int training, jf_program_info* out) {
  return guarded([&] {
    need(seq, "seq");
    auto in_shape = jitfuse::api::checked_shape(shape, ndim, "shape");
    need(out, "out");
    auto pp = seq->impl->prepared_for(in_shape, training != 0, nullptr);
    *out = seq->impl->info(pp);
  });
}

}  // extern "C"

namespace {

using jitfuse::api::Sequence;
using jitfuse::exec::Prepared;

// JITFUSE_VERIFY: the shadow (unfused) run of a fused forward, or null where there is none to compare with
// (no fused group, or an FP8 recipe: a shadow run would advance the recipe state twice).
std::shared_ptr<jitfuse::exec::Shadow> shadow_for(const std::shared_ptr<const Prepared>& pp,
                                                  jitfuse::exec::Runtime& rt) {
  if (!pp->reference) return nullptr;
  if (pp->program->recipe.is_fp8()) {
    rt.verify->note_skip("FP8 recipes are not verified (a shadow run would advance the recipe state twice)");
    return nullptr;
  }
  return std::make_shared<jitfuse::exec::Shadow>(pp, pp->reference, *rt.verify, rt);
}

// A call's arguments, checked against the sequence and the ops of its input shape before anything is
// prepared (a bad call never compiles anything), then against the prepared program's sizes, and run.
// `open` gives the program: looked up (and prepared on first use) by jf_forward, held by a jf_program.
template <class Open>
void forward_call(Sequence& s, const std::vector<jitfuse::ops::Op>& ops, const jf_forward_args& a,
                  jf_saved* saved_out, jf_stream stream, Open&& open) {
  const bool train = a.training != 0;
  if (train && !a.saved) need(saved_out, "saved_out (a training forward without a host saved buffer)");
  if (saved_out) *saved_out = nullptr;
  std::vector<jitfuse::api::Span> spans;
  jitfuse::exec::ForwardArgs fa;
  fa.stream = as_stream(stream);
  fa.training = train;
  spans.reserve(static_cast<size_t>(4 + a.n_extra_inputs + a.n_extra_outputs + std::max(a.n_params, 0)));
  fa.input = check_tensor(a.input, "input", s.recipe.dtype, &ops.front().in);
  fa.output = check_tensor(a.output, "output", s.output_dtype(), &ops.back().out);
  spans.push_back(jitfuse::api::span_of(a.input, SpanName{"input"}, false));
  spans.push_back(jitfuse::api::span_of(a.output, SpanName{"output"}, true));
  for (const auto& op : ops) {
    if (op.extra_slot < 0) continue;  // a channel's op without a caller tensor of its own
    if (op.family == jitfuse::ops::Family::add_extra_input) {
      const SpanName name{"extra input", op.extra_slot, &op};
      fa.extra_in.push_back(check_tensor(a.extra_inputs[op.extra_slot], [&] { return name.str(); }, s.recipe.dtype,
                                         &op.in));
      spans.push_back(jitfuse::api::span_of(a.extra_inputs[op.extra_slot], name, false));
    }
    if (op.extra_input) {  // an op's own extra input (cross_entropy's labels): its own dtype and shape
      const SpanName name{op.extra_input->name == "labels" ? "labels: extra input" : "extra input", op.extra_slot, &op};
      fa.extra_in.push_back(
          jitfuse::api::check_own_extra_input(a.extra_inputs[op.extra_slot], name, *op.extra_input, a.input));
      spans.push_back(jitfuse::api::span_of(a.extra_inputs[op.extra_slot], name, false));
    }
    if (op.family == jitfuse::ops::Family::make_extra_output) {
      const SpanName name{"extra output", op.extra_slot, &op};
      fa.extra_out.push_back(check_tensor(a.extra_outputs[op.extra_slot], [&] { return name.str(); },
                                          s.recipe.dtype, &op.in));
      spans.push_back(jitfuse::api::span_of(a.extra_outputs[op.extra_slot], name, true));
    }
  }
  fa.params = collect_params<const void*>(s, ops, a.params, a.n_params, "params", &spans, false);
  jitfuse::api::check_no_overlap(spans);  // before prepare: a bad call never compiles anything
  const jf_program_s& prog = open();
  const std::shared_ptr<const Prepared>& pp = prog.prepared;
  const auto& L = pp->layout;
  if (train) check_buffer(a.saved, a.saved_bytes, L.saved_bytes, "saved buffer", spans, true);
  check_buffer(a.workspace, a.workspace_bytes, L.fwd_arena, "workspace", spans, true);
  jitfuse::api::check_no_overlap(spans);
  fa.saved = train ? a.saved : nullptr;
  fa.workspace = a.workspace;
  fa.rng.state = a.rng_state;
  fa.rng.seed = a.rng_seed;
  fa.rng.offset = a.rng_offset;
  if (s.recipe.is_fp8()) fa.weights_unchanged = pp->weight_copies.unchanged(fa.params, a.fp8_weights_unchanged != 0);
  auto owned = train && !a.saved ? std::make_unique<jf_saved_s>() : nullptr;
  auto& rt = *prog.rt;
  auto shadow = rt.verify ? shadow_for(pp, rt) : nullptr;  // JITFUSE_VERIFY only
  auto res = jitfuse::exec::run_forward(pp, rt, fa, shadow ? shadow->forward_observer(fa).get() : nullptr);
  const void* block = train ? (a.saved ? a.saved : res.saved) : nullptr;
  if (shadow && block) s.keep_shadow(block, std::move(shadow));
  if (owned) {
    owned->block = res.saved;
    owned->bytes = res.saved_bytes;
    owned->allocator = rt.allocator;
    *saved_out = owned.release();
  }
}

// The backward's tensors: the forward's as it had them, and the gradients.
void backward_tensors(const Sequence& s, const std::vector<jitfuse::ops::Op>& ops, const jf_backward_args& a,
                      jitfuse::exec::BackwardArgs& ba, std::vector<jitfuse::api::Span>& spans) {
  auto tensor = [&](const DLTensor* t, const SpanName& name, jitfuse::ops::DType dt, const jitfuse::ops::Shape& want,
                    bool written) {
    void* p = check_tensor(t, [&] { return name.str(); }, dt, &want);
    spans.push_back(jitfuse::api::span_of(t, name, written));
    return p;
  };
  ba.input = tensor(a.input, SpanName{"input"}, s.recipe.dtype, ops.front().in, false);
  ba.output = tensor(a.output, SpanName{"output"}, s.output_dtype(), ops.back().out, false);
  ba.grad_output = tensor(a.grad_output, SpanName{"grad_output"}, s.recipe.dtype, ops.back().out, false);
  ba.grad_input = tensor(a.grad_input, SpanName{"grad_input"}, s.recipe.dtype, ops.front().in, true);
  for (const auto& op : ops) {
    if (op.extra_slot < 0) continue;  // a channel's op without a caller tensor of its own
    const auto slot = static_cast<size_t>(op.extra_slot);
    if (op.family == jitfuse::ops::Family::add_extra_input) {
      ba.extra_in.push_back(tensor(a.extra_inputs[slot], SpanName{"extra input", op.extra_slot, &op},
                                   s.recipe.dtype, op.in, false));
      ba.grad_extra_in.push_back(tensor(a.grad_extra_inputs[slot], SpanName{"grad extra input", op.extra_slot, &op},
                                        s.recipe.dtype, op.in, true));
    }
    if (op.extra_input) {  // read again by the backward: labels and indices have no gradient (NULL), probs have one
      const SpanName name{op.extra_input->name == "labels" ? "labels: extra input" : "extra input", op.extra_slot, &op};
      ba.extra_in.push_back(
          jitfuse::api::check_own_extra_input(a.extra_inputs[slot], name, *op.extra_input, a.input));
      spans.push_back(jitfuse::api::span_of(a.extra_inputs[slot], name, false));
      ba.grad_extra_in.push_back(op.info->extra_input_grad
                                     ? tensor(a.grad_extra_inputs[slot], SpanName{"grad extra input", op.extra_slot, &op},
                                              op.extra_input->dtype, op.extra_input->shape, true)
                                     : nullptr);
    }
    if (op.family == jitfuse::ops::Family::make_extra_output) {
      ba.extra_out.push_back(tensor(a.extra_outputs[slot], SpanName{"extra output", op.extra_slot, &op},
                                    s.recipe.dtype, op.in, false));
      ba.grad_extra_out.push_back(tensor(a.grad_extra_outputs[slot],
                                         SpanName{"grad extra output", op.extra_slot, &op}, s.recipe.dtype, op.in,
                                         false));
    }
  }
  ba.params = collect_params<const void*>(s, ops, a.params, a.n_params, "params", &spans, false);
  ba.grads = collect_params<void*>(s, ops, a.grads, a.n_grads, "grads", &spans, true);
}

// The gradients the caller placed exactly where the program lets them sit in the saved buffer
// (Program::grad_aliases, jf_program_grad_aliases): their overlap with it is allowed. Any other is not.
void mark_grad_aliases(const Prepared& pp, const void* saved, std::vector<jitfuse::api::Span>& spans) {
  const auto& p = *pp.program;
  if (!saved || p.grad_aliases.empty()) return;
  const auto base = reinterpret_cast<uintptr_t>(saved);
  for (const auto& ga : p.grad_aliases) {
    const auto& g = p.buffer(ga.grad);
    const auto& sv = pp.layout.buffers.at(static_cast<size_t>(ga.saved));
    const bool input = g.role == jitfuse::exec::BufferRole::grad_input;
    for (auto& sp : spans) {
      const bool same = input ? std::string_view(sp.name.kind) == "grad_input"
                              : std::string_view(sp.name.kind) == "grads" && sp.name.op && sp.name.op->index == g.op &&
                                    sp.name.param && g.key == sp.name.param;
      if (same && sp.written && sp.begin == base + sv.offset && sp.end - sp.begin == sv.bytes) sp.over_saved = true;
    }
  }
}

template <class Open>
void backward_call(Sequence& s, const std::vector<jitfuse::ops::Op>& ops, const jf_backward_args& a, jf_stream stream,
                   Open&& open) {
  std::vector<jitfuse::api::Span> spans;
  jitfuse::exec::BackwardArgs ba;
  ba.stream = as_stream(stream);
  spans.reserve(static_cast<size_t>(6 + 2 * (a.n_extra_inputs + a.n_extra_outputs) + std::max(a.n_params, 0) +
                                    std::max(a.n_grads, 0)));
  backward_tensors(s, ops, a, ba, spans);
  jitfuse::api::check_no_overlap(spans);
  const jf_program_s& prog = open();
  const std::shared_ptr<const Prepared>& pp = prog.prepared;
  const auto& L = pp->layout;
  if (L.saved_bytes) need(a.saved, "saved (the forward's saved buffer)");
  check_buffer(a.saved, a.saved_bytes, L.saved_bytes, "saved buffer", spans, false);
  if (a.saved && !spans.empty()) spans.back().saved_buffer = true;
  mark_grad_aliases(*pp, a.saved, spans);
  check_buffer(a.workspace, a.workspace_bytes, L.bwd_arena, "workspace", spans, true);
  jitfuse::api::check_no_overlap(spans);
  ba.saved = a.saved;
  ba.workspace = a.workspace;
  auto shadow = prog.rt->verify ? s.take_shadow(a.saved) : nullptr;  // JITFUSE_VERIFY only
  jitfuse::exec::run_backward(*pp, *prog.rt, ba, shadow ? shadow->backward_observer(ba).get() : nullptr);
}

void check_forward_struct(const Sequence& s, const jf_forward_args* args) {
  need(args, "args");
  const auto& a = *args;
  jitfuse::api::check_forward_args(s.def, s.recipe.dtype, s.output_dtype(), a.input, a.extra_inputs,
                                   a.n_extra_inputs, a.output, a.extra_outputs, a.n_extra_outputs);
}

void check_backward_struct(const Sequence& s, const jf_backward_args* args) {
  need(args, "args");
  const auto& a = *args;
  jitfuse::api::check_forward_args(s.def, s.recipe.dtype, s.output_dtype(), a.input, a.extra_inputs,
                                   a.n_extra_inputs, a.output, a.extra_outputs, a.n_extra_outputs);
  jitfuse::api::check_backward_args(s.def, s.recipe.dtype, a.grad_output, a.grad_extra_outputs,
                                    a.n_grad_extra_outputs, a.grad_input, a.grad_extra_inputs, a.n_grad_extra_inputs);
}

// The program of (input shape, training) on the current device, prepared on first use, with everything a
// call on it needs resolved: what jf_program_open hands out and jf_forward / jf_backward call through.
jf_program_s lookup_program(jf_sequence seq, const jitfuse::ops::Shape& input, bool training, jf_stream stream) {
  jf_program_s p;
  p.seq = seq->impl;
  p.training = training;
  p.prepared = p.seq->prepared_for(input, training, as_stream(stream));
  p.rt = &p.seq->ctx.runtime();
  return p;
}

// A jf_program call's input must have the shape the program was prepared for.
void check_program_shape(const jf_program_s& p, const DLTensor* input) {
  const auto& want = p.prepared->program->ops.front().in;
  if (shape_of(input) != want)
    fail(Status::invalid_argument, "tensor 'input': this jf_program was prepared for input shape {}, got {} (open "
         "one per shape with jf_program_open)", jitfuse::ops::shape_str(want),
         jitfuse::ops::shape_str(shape_of(input)));
}

}  // namespace

extern "C" {

jf_status jf_forward(jf_sequence seq, const jf_forward_args* args, jf_saved* saved_out, jf_stream stream) {
  return guarded([&] {
    need(seq, "seq");
    auto& s = *seq->impl;
    check_forward_struct(s, args);
    const jitfuse::ops::Shape in_shape = shape_of(args->input);
    const auto ops = s.ops_for(in_shape);  // every argument is checked before anything touches the GPU
    jf_program_s found;
    forward_call(s, *ops, *args, saved_out, stream, [&]() -> const jf_program_s& {
      return found = lookup_program(seq, in_shape, args->training != 0, stream);
    });
  });
}

jf_status jf_backward(jf_sequence seq, const jf_backward_args* args, jf_stream stream) {
  return guarded([&] {
    need(seq, "seq");
    auto& s = *seq->impl;
    check_backward_struct(s, args);
    const jitfuse::ops::Shape in_shape = shape_of(args->input);
    const auto ops = s.ops_for(in_shape);
    jf_program_s found;
    backward_call(s, *ops, *args, stream, [&]() -> const jf_program_s& {
      return found = lookup_program(seq, in_shape, true, stream);
    });
  });
}

jf_status jf_program_open(jf_sequence seq, const int64_t* shape, int ndim, int training, jf_stream stream,
                          jf_program* out) {
  return guarded([&] {
    need(seq, "seq");
    need(out, "out");
    *out = nullptr;
    auto in_shape = jitfuse::api::checked_shape(shape, ndim, "shape");
    *out = std::make_unique<jf_program_s>(lookup_program(seq, in_shape, training != 0, stream)).release();
  });
}

jf_status jf_program_get_info(jf_program prog, jf_program_info* out) {
  return guarded([&] {
    need(prog, "prog");
    need(out, "out");
    *out = prog->seq->info(prog->prepared);
  });
}

jf_status jf_program_grad_aliases(jf_program prog, const jf_grad_alias** aliases, int* n) {
  return guarded([&] {
    need(prog, "prog");
    need(aliases, "aliases");
    need(n, "n");
    const auto& pi = prog->seq->program_info(prog->prepared);
    *aliases = pi.grad_aliases.empty() ? nullptr : pi.grad_aliases.data();
    *n = static_cast<int>(pi.grad_aliases.size());
  });
}

jf_status jf_program_forward(jf_program prog, const jf_forward_args* args, jf_saved* saved_out, jf_stream stream) {
  return guarded([&] {
    need(prog, "prog");
    auto& s = *prog->seq;
    check_forward_struct(s, args);
    check_program_shape(*prog, args->input);
    if (args->training && !prog->training)
      fail(Status::invalid_argument, "a training forward needs a jf_program opened with training = 1");
    forward_call(s, prog->prepared->program->ops, *args, saved_out, stream,
                 [&]() -> const jf_program_s& { return *prog; });
  });
}

jf_status jf_program_backward(jf_program prog, const jf_backward_args* args, jf_stream stream) {
  return guarded([&] {
    need(prog, "prog");
    auto& s = *prog->seq;
    check_backward_struct(s, args);
    check_program_shape(*prog, args->input);
    if (!prog->training) fail(Status::invalid_argument, "a backward needs a jf_program opened with training = 1");
    backward_call(s, prog->prepared->program->ops, *args, stream,
                  [&]() -> const jf_program_s& { return *prog; });
  });
}

jf_status jf_program_close(jf_program prog) {
  return guarded([&] { delete prog; });
}

jf_status jf_saved_buffer(jf_saved saved, void** buffer, size_t* bytes) {
  return guarded([&] {
    need(saved, "saved");
    if (buffer) *buffer = saved->released ? nullptr : saved->block;
    if (bytes) *bytes = saved->released ? 0 : saved->bytes;
  });
}

jf_status jf_saved_release(jf_saved saved, jf_stream stream) {
  return guarded([&] {
    if (!saved) return;
    if (!saved->released) jitfuse::exec::free_block(saved->allocator, as_stream(stream), saved->block, saved->bytes);
    delete saved;
  });
}

namespace {
jf_status explain_for(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                      const jitfuse::ops::Parallel* par, const char** json_out) {
  return guarded([&] {
    need(seq, "seq");
    auto in_shape = jitfuse::api::checked_shape(shape, ndim, "shape");
    need(json_out, "json_out");
    auto& s = *seq->impl;
    auto program = s.compile(jitfuse::ops::infer(s.def, in_shape, par ? *par : s.parallel()), training != 0, arch,
                             jitfuse::env::flag("JITFUSE_DISABLE_FUSION"));
    nlohmann::json j = jitfuse::fuser::plan_json(program->plan, program->ops);
    j["program"] = jitfuse::exec::program_json(*program, 0);
    s.explain_buffer = j.dump(2);
    *json_out = s.explain_buffer.c_str();
  });
}
}  // namespace

jf_status jf_sequence_explain(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                              const char** json_out) {
  return explain_for(seq, shape, ndim, training, arch, nullptr, json_out);
}

jf_status jf_sequence_explain_parallel(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                                       int world_size, int rank, const char** json_out) {
  jitfuse::ops::Parallel par;
  par.world_size = world_size;
  par.rank = rank;
  return explain_for(seq, shape, ndim, training, arch, &par, json_out);
}

jf_status jf_nccl_version(int* version) {
  return guarded([&] {
    need(version, "version");
    *version = jitfuse::cuda::nccl().version;
  });
}

jf_status jf_comm_unique_id(uint8_t* id, size_t bytes) {
  return guarded([&] {
    need(id, "id");
    if (bytes < JF_COMM_ID_BYTES)
      fail(Status::invalid_argument, "id: {} bytes given, a unique id needs {}", bytes, JF_COMM_ID_BYTES);
    ncclUniqueId u = jitfuse::cuda::Communicator::unique_id();
    std::memcpy(id, u.internal, JF_COMM_ID_BYTES);
  });
}

jf_status jf_comm_create(const uint8_t* id, size_t id_bytes, int world_size, int rank, jf_comm* out) {
  return guarded([&] {
    need(id, "id");
    need(out, "out");
    *out = nullptr;
    if (id_bytes != JF_COMM_ID_BYTES)
      fail(Status::invalid_argument, "id: {} bytes given, a unique id has {} (jf_comm_unique_id)", id_bytes,
           JF_COMM_ID_BYTES);
    if (world_size < 1 || world_size > jitfuse::ops::kMaxWorldSize || rank < 0 || rank >= world_size)
      fail(Status::invalid_argument, "rank {} of world size {}: the world size is 1 to {}, the rank 0 to world size - 1",
           rank, world_size, jitfuse::ops::kMaxWorldSize);
    ncclUniqueId u;
    std::memcpy(u.internal, id, JF_COMM_ID_BYTES);
    auto c = std::make_unique<jf_comm_s>();
    c->impl = jitfuse::cuda::Communicator::create(u, world_size, rank);
    *out = c.release();
  });
}

jf_status jf_comm_wrap(void* nccl_comm, jf_comm* out) {
  return guarded([&] {
    need(nccl_comm, "nccl_comm");
    need(out, "out");
    *out = nullptr;
    auto c = std::make_unique<jf_comm_s>();
    c->impl = jitfuse::cuda::Communicator::wrap(static_cast<ncclComm_t>(nccl_comm));
    *out = c.release();
  });
}

jf_status jf_comm_info(jf_comm comm, int* world_size, int* rank, int* device) {
  return guarded([&] {
    need(comm, "comm");
    if (world_size) *world_size = comm->impl->world_size();
    if (rank) *rank = comm->impl->rank();
    if (device) *device = comm->impl->device();
  });
}

jf_status jf_comm_destroy(jf_comm comm) {
  return guarded([&] { delete comm; });
}

jf_status jf_sequence_set_comm(jf_sequence seq, const char* group, jf_comm comm) {
  return guarded([&] {
    need(seq, "seq");
    need(group, "group");
    need(comm, "comm");
    seq->impl->set_comm(std::string(group, ::strnlen(group, 256)), comm->impl);
  });
}

}  // extern "C"
