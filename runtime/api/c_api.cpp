// The C ABI: every entry point catches everything, turns it into a status code and a thread-local
// message, and validates DLTensors (device, dtype, layout, shape) with errors naming the tensor.
#include "jitfuse/jitfuse.h"

#include <cstring>

#include "api/arg_check.hpp"
#include "api/handles.hpp"
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

// Checks device, dtype, contiguity and (if given) shape; returns the data pointer.
void* check_tensor(const DLTensor* t, const char* name, jitfuse::ops::DType dtype, const jitfuse::ops::Shape* want) {
  jitfuse::api::check_dltensor(t, name);  // the struct: dims, sizes, device, data
  if (!dtype_matches(t->dtype, dtype))
    fail(Status::invalid_argument, "tensor '{}': expected dtype {} for this recipe, got {}", name,
         jitfuse::ops::dtype_name(dtype), dl_dtype_name(t->dtype));
  if (t->strides) {
    int64_t expect = 1;
    for (int i = t->ndim - 1; i >= 0; --i) {
      if (t->shape[i] != 1 && t->strides[i] != expect) {
        std::string s;
        for (int j = 0; j < t->ndim; ++j) s += (j ? "," : "") + std::to_string(t->strides[j]);
        fail(Status::invalid_argument, "tensor '{}' is not contiguous row-major: strides ({}) for shape {}", name, s,
             jitfuse::ops::shape_str(shape_of(t)));
      }
      expect *= t->shape[i];
    }
  }
  if (want && jitfuse::ops::numel(shape_of(t)) != jitfuse::ops::numel(*want)) {
    fail(Status::invalid_argument, "tensor '{}': expected shape {}, got {}", name, jitfuse::ops::shape_str(*want),
         jitfuse::ops::shape_str(shape_of(t)));
  }
  if (want && jitfuse::ops::cols_of(shape_of(t)) != jitfuse::ops::cols_of(*want))
    fail(Status::invalid_argument, "tensor '{}': expected shape {}, got {}", name, jitfuse::ops::shape_str(*want),
         jitfuse::ops::shape_str(shape_of(t)));
  need(t->data, name);
  return static_cast<char*>(t->data) + t->byte_offset;
}

// Before any work is enqueued: every parameter (and, for a backward, every grad) is bound, and bound
// tensors have the shapes the ops infer for this input.
void check_bindings(const jitfuse::api::Sequence& s, const std::vector<jitfuse::ops::Op>& ops, bool grads) {
  for (const auto& op : ops)
    for (const auto& p : op.params) {
      if (!s.params.count({op.index, p.name}))
        fail(Status::invalid_argument, "{}: parameter '{}' ({}) is not bound: call jf_sequence_bind_param", op.label(),
             p.name, jitfuse::ops::shape_str(p.shape));
      if (grads && !s.grads.count({op.index, p.name}))
        fail(Status::invalid_argument, "{}: no buffer for the gradient of '{}' ({}): call jf_sequence_bind_grad",
             op.label(), p.name, jitfuse::ops::shape_str(p.shape));
      for (const auto* m : {&s.param_shapes, &s.grad_shapes}) {
        auto it = m->find({op.index, p.name});
        if (it != m->end() && it->second != p.shape)
          fail(Status::invalid_argument, "{} {}{}: expected shape {}, got {}", op.label(),
               m == &s.grad_shapes ? "grad of " : "", p.name, jitfuse::ops::shape_str(p.shape),
               jitfuse::ops::shape_str(it->second));
      }
    }
}

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
    jitfuse::ops::check_recipe_support(def, r);
    auto* s = new jf_sequence_s();
    s->impl = std::make_unique<jitfuse::api::Sequence>(ctx->impl, std::move(def), r);
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

static jf_status bind(jf_sequence seq, int op_index, const char* name, const DLTensor* t, bool grad) {
  return guarded([&] {
    need(seq, "seq");
    jitfuse::api::check_name(name, "name");
    auto& s = *seq->impl;
    if (op_index < 0 || op_index >= static_cast<int>(s.def.ops.size()))
      fail(Status::invalid_argument, "op index {} out of range: the sequence has {} ops", op_index, s.def.ops.size());
    // The name is checked now; the shape when a forward knows the input shape (check_bound_shapes).
    const auto& d = s.def.ops[op_index];
    std::string label = fmt::format("op {} ({}) {}{}", op_index, d.kind, grad ? "grad of " : "", name);
    void* p = check_tensor(t, label.c_str(), s.recipe.dtype, nullptr);
    bool known = (d.kind == "linear" && std::strcmp(name, "weight") == 0) || (d.kind == "bias" && std::strcmp(name, "bias") == 0) ||
                 ((d.kind == "layernorm" || d.kind == "rmsnorm") && std::strcmp(name, "weight") == 0) ||
                 (d.kind == "layernorm" && std::strcmp(name, "bias") == 0);
    if (!known)
      fail(Status::invalid_argument, "op {} ({}) has no parameter '{}' (linear: weight; bias: bias; layernorm: weight, "
           "bias; rmsnorm: weight)", op_index, d.kind, jitfuse::text::shorten(name));
    if (grad) {
      s.grads[{op_index, name}] = p;
      s.grad_shapes[{op_index, name}] = shape_of(t);
    } else {
      s.params[{op_index, name}] = p;
      s.param_shapes[{op_index, name}] = shape_of(t);
    }
  });
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
    const auto& st = s.fp8_state().at(op_index);
    *out = jf_fp8_state{st.scale, st.scale_inv, st.history, st.len};
  });
}

jf_status jf_sequence_bind_param(jf_sequence seq, int op_index, const char* name, const DLTensor* t) {
  return bind(seq, op_index, name, t, false);
}
jf_status jf_sequence_bind_grad(jf_sequence seq, int op_index, const char* name, const DLTensor* t) {
  return bind(seq, op_index, name, t, true);
}

jf_status jf_forward(jf_sequence seq, const DLTensor* input, const DLTensor* const* extra_inputs, int n_extra_inputs,
                     DLTensor* output, DLTensor* const* extra_outputs, int n_extra_outputs,
                     const jf_forward_options* options, jf_saved* saved, jf_stream stream) {
  return guarded([&] {
    need(seq, "seq");
    jitfuse::api::check_forward_args(seq->impl->def, seq->impl->recipe.dtype, seq->impl->output_dtype(), input,
                                     extra_inputs, n_extra_inputs, output, extra_outputs, n_extra_outputs);
    auto& s = *seq->impl;
    const bool train = options ? options->save_for_backward != 0 : saved != nullptr;
    if (train) need(saved, "saved (save_for_backward is set)");
    if (n_extra_inputs != s.def.extra_inputs)
      fail(Status::invalid_argument, "sequence '{}' takes {} extra input(s) (add_extra_input ops), got {}", s.def.name,
           s.def.extra_inputs, n_extra_inputs);
    if (n_extra_outputs != s.def.extra_outputs)
      fail(Status::invalid_argument, "sequence '{}' makes {} extra output(s) (make_extra_output ops), got {}",
           s.def.name, s.def.extra_outputs, n_extra_outputs);
    jitfuse::ops::Shape in_shape = shape_of(input);
    auto pp = s.prepared_for(in_shape, train);
    const auto& prog = *pp->program;
    check_bindings(s, prog.ops, false);
    jitfuse::exec::ForwardArgs fa;
    fa.stream = reinterpret_cast<CUstream>(stream);
    fa.rng_offset = options ? options->rng_offset : 0;
    fa.input = check_tensor(input, "input", s.recipe.dtype, &in_shape);
    fa.output = check_tensor(output, "output", s.output_dtype(), &prog.ops.back().out);
    if (s.recipe.is_fp8()) fa.fp8 = s.fp8_state();
    for (const auto& op : prog.ops) {
      if (op.family == jitfuse::ops::Family::add_extra_input)
        fa.extra_in.push_back(check_tensor(extra_inputs[op.extra_slot],
                                           fmt::format("extra input {} (op {})", op.extra_slot, op.index).c_str(),
                                           s.recipe.dtype, &op.in));
      if (op.family == jitfuse::ops::Family::make_extra_output)
        fa.extra_out.push_back(check_tensor(extra_outputs[op.extra_slot],
                                            fmt::format("extra output {} (op {})", op.extra_slot, op.index).c_str(),
                                            s.recipe.dtype, &op.in));
    }
    std::unique_ptr<jf_saved_s> sv;
    if (train) {
      sv = std::make_unique<jf_saved_s>();
      sv->seq = seq;
    }
    jitfuse::exec::run_forward(pp, s.ctx.runtime(), s.params, fa, sv ? &sv->impl : nullptr);
    if (train) *saved = sv.release();
  });
}

jf_status jf_backward(jf_sequence seq, jf_saved saved, const DLTensor* grad_output,
                      const DLTensor* const* grad_extra_outputs, int n_grad_extra_outputs, DLTensor* grad_input,
                      DLTensor* const* grad_extra_inputs, int n_grad_extra_inputs, jf_stream stream) {
  return guarded([&] {
    need(seq, "seq");
    need(saved, "saved");
    auto& s = *seq->impl;
    if (saved->seq != seq) fail(Status::invalid_argument, "this saved context belongs to another sequence");
    if (saved->impl.released) fail(Status::invalid_argument, "this saved context was already released");
    jitfuse::api::check_backward_args(s.def, s.recipe.dtype, grad_output, grad_extra_outputs, n_grad_extra_outputs, grad_input,
                                      grad_extra_inputs, n_grad_extra_inputs);
    const auto& cp = *saved->impl.prepared->program;
    if (n_grad_extra_outputs != s.def.extra_outputs || n_grad_extra_inputs != s.def.extra_inputs)
      fail(Status::invalid_argument, "sequence '{}' needs {} grad extra output(s) and {} grad extra input(s), got {} and {}",
           s.def.name, s.def.extra_outputs, s.def.extra_inputs, n_grad_extra_outputs, n_grad_extra_inputs);
    check_bindings(s, cp.ops, true);
    jitfuse::exec::BackwardArgs ba;
    ba.stream = reinterpret_cast<CUstream>(stream);
    ba.grad_output = check_tensor(grad_output, "grad_output", s.recipe.dtype, &cp.ops.back().out);
    ba.grad_input = check_tensor(grad_input, "grad_input", s.recipe.dtype, &cp.ops.front().in);
    for (const auto& op : cp.ops) {
      if (op.family == jitfuse::ops::Family::add_extra_input)
        ba.grad_extra_in.push_back(check_tensor(grad_extra_inputs[op.extra_slot],
                                                fmt::format("grad extra input {} (op {})", op.extra_slot, op.index).c_str(),
                                                s.recipe.dtype, &op.in));
      if (op.family == jitfuse::ops::Family::make_extra_output)
        ba.grad_extra_out.push_back(check_tensor(grad_extra_outputs[op.extra_slot],
                                                 fmt::format("grad extra output {} (op {})", op.extra_slot, op.index).c_str(),
                                                 s.recipe.dtype, &op.in));
    }
    jitfuse::exec::run_backward(*saved->impl.prepared, s.ctx.runtime(), s.params, s.grads, saved->impl, ba);
  });
}

jf_status jf_saved_release(jf_saved saved, jf_stream stream) {
  return guarded([&] {
    if (!saved) return;
    jitfuse::exec::release_saved(saved->impl, reinterpret_cast<CUstream>(stream));
    delete saved;
  });
}

jf_status jf_sequence_explain(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                              const char** json_out) {
  return guarded([&] {
    need(seq, "seq");
    auto in_shape = jitfuse::api::checked_shape(shape, ndim, "shape");
    need(json_out, "json_out");
    auto& s = *seq->impl;
    auto ops = jitfuse::ops::infer(s.def, in_shape);
    auto plan = s.plan_only(ops, training != 0, arch);
    nlohmann::json j = jitfuse::fuser::plan_json(plan, ops);
    jitfuse::exec::DeviceModel dev;
    if (arch > 0) dev.arch = arch == 90 ? "sm_90a" : "sm_" + std::to_string(arch);
    auto program = jitfuse::exec::make_program(ops, plan, s.recipe, training != 0, s.def.name, dev);
    j["program"] = jitfuse::exec::program_json(*program, 0);
    s.explain_buffer = j.dump(2);
    *json_out = s.explain_buffer.c_str();
  });
}

}  // extern "C"
