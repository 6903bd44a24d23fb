/* jitfuse C ABI (version 1). Opaque handles, status codes, a thread-local last-error string; no C++
 * exception crosses this boundary. Tensors are DLPack DLTensors in device memory, contiguous row-major,
 * of the recipe's dtype. Work goes on the CUstream/cudaStream_t the caller passes. */
#ifndef JITFUSE_JITFUSE_H_
#define JITFUSE_JITFUSE_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(JF_BUILDING_LIBRARY)
#define JF_API __attribute__((visibility("default")))
#else
#define JF_API
#endif

#define JF_ABI_VERSION 1

typedef enum jf_status {
  JF_OK = 0,
  JF_ERR_INVALID_ARGUMENT = 1, /* bad tensor, shape, attribute, handle */
  JF_ERR_PARSE = 2,            /* malformed JSON (message has file:line:col) */
  JF_ERR_UNSUPPORTED = 3,      /* valid request this build cannot do (e.g. a linear under an FP8 recipe) */
  JF_ERR_COMPILE = 4,          /* NVRTC rejected a generated kernel (message holds the log) */
  JF_ERR_CUDA = 5,             /* a driver / cuBLASLt call failed */
  JF_ERR_IO = 6,               /* a file could not be read or written */
  JF_ERR_OUT_OF_MEMORY = 7,
  JF_ERR_NO_DEVICE = 8,        /* no GPU / driver */
  JF_ERR_INTERNAL = 9          /* a jitfuse bug: please report with the message */
} jf_status;

typedef struct jf_context_s* jf_context;
typedef struct jf_sequence_s* jf_sequence;
typedef struct jf_saved_s* jf_saved;
typedef struct CUstream_st* jf_stream; /* same type as CUstream and cudaStream_t */

/* Stream-ordered allocator: jitfuse asks for temporaries and saved tensors through it. `free` is called
 * as soon as the work using the memory is enqueued, so it must be stream-ordered (like cudaFreeAsync).
 * The cuBLASLt workspace (32 MiB per stream, kept by the context) is not taken from it. */
typedef struct jf_allocator {
  void* (*alloc)(size_t bytes, jf_stream stream, void* user);
  void (*free)(void* ptr, size_t bytes, jf_stream stream, void* user);
  void* user;
} jf_allocator;

JF_API int jf_abi_version(void);
JF_API const char* jf_version(void);
/* The message of the last failing call on this thread ("" if none). Valid until the next call. */
JF_API const char* jf_last_error(void);

/* A context works in the calling thread's current CUDA context (the device's primary context if none
 * is current); it loads built-in rules, then JITFUSE_RULE_PATH. Creating one needs no GPU. */
JF_API jf_status jf_context_create(jf_context* out);
JF_API jf_status jf_context_destroy(jf_context ctx);
/* Loads a rules file or directory. Nothing loaded is lost to a bad file: a broken rule (or an unreadable
 * path) is skipped, *n_errors (may be NULL) counts the problems and jf_last_error() lists them, each with
 * file:line:col; JF_OK is returned unless an argument is invalid. */
JF_API jf_status jf_context_load_rules(jf_context ctx, const char* path, int* n_errors);
/* alloc == NULL restores the default: cuMemAllocFromPoolAsync / cuMemFreeAsync on a jitfuse memory pool per
 * device that keeps up to 1 GiB of freed memory cached. */
JF_API jf_status jf_context_set_allocator(jf_context ctx, const jf_allocator* allocator);

/* Sequence from JSON text ("jitfuse.sequence/1") or a file, under a recipe: "fp32", "fp16", "bf16", or
 * "fp8_delayed" / "fp8_current" (bf16 activations; a sequence without linear ops whose last op, quantize,
 * writes E4M3 bytes). */
JF_API jf_status jf_sequence_create(jf_context ctx, const char* json, const char* recipe, jf_sequence* out);
JF_API jf_status jf_sequence_create_from_file(jf_context ctx, const char* path, const char* recipe, jf_sequence* out);
JF_API jf_status jf_sequence_destroy(jf_sequence seq);
JF_API int jf_sequence_num_ops(jf_sequence seq);

/* Builder: add ops one at a time (attributes as a JSON object text, may be NULL), then finish. */
typedef struct jf_builder_s* jf_builder;
JF_API jf_status jf_builder_create(const char* name, jf_builder* out);
JF_API jf_status jf_builder_add(jf_builder b, const char* op, const char* attrs_json);
JF_API jf_status jf_builder_finish(jf_builder b, jf_context ctx, const char* recipe, jf_sequence* out);
JF_API jf_status jf_builder_destroy(jf_builder b);

/* Parameters are device memory the host owns: (op index, "weight" | "bias"). */
JF_API jf_status jf_sequence_bind_param(jf_sequence seq, int op_index, const char* name, const DLTensor* t);
/* Where backward writes a parameter's gradient (linear with accumulate_grad: true adds to it). */
JF_API jf_status jf_sequence_bind_grad(jf_sequence seq, int op_index, const char* name, const DLTensor* t);

typedef struct jf_forward_options {
  uint64_t rng_offset; /* Philox offset for dropout this step (seed comes from the op) */
  int save_for_backward; /* 1: fill *saved (training); 0: inference, saved may be NULL */
} jf_forward_options;

/* Runs the forward. Inputs, outputs and the tensors a saved context refers to (the input, the output,
 * extra inputs) must stay alive and unmodified until jf_backward / jf_saved_release. */
JF_API jf_status jf_forward(jf_sequence seq, const DLTensor* input, const DLTensor* const* extra_inputs,
                            int n_extra_inputs, DLTensor* output, DLTensor* const* extra_outputs, int n_extra_outputs,
                            const jf_forward_options* options, jf_saved* saved, jf_stream stream);

JF_API jf_status jf_backward(jf_sequence seq, jf_saved saved, const DLTensor* grad_output,
                             const DLTensor* const* grad_extra_outputs, int n_grad_extra_outputs, DLTensor* grad_input,
                             DLTensor* const* grad_extra_inputs, int n_grad_extra_inputs, jf_stream stream);

/* FP8 recipes (fp8_delayed, fp8_current): the recipe state of a quantize op on the current device, owned
 * by the sequence and kept across calls (allocated on first use: scale = scale_inv = 1, history zeros).
 * All fp32 device pointers, read and written stream-ordered by jf_forward. After a forward, scale_inv
 * dequantizes its E4M3 output (x ~ e4m3 * scale_inv). fp8_current: history_len 1, the last call's amax.
 * fp8_delayed: history_len 1024, newest first; `scale` is the one the next call will use. */
typedef struct jf_fp8_state {
  float* scale;
  float* scale_inv;
  float* amax_history;
  int64_t history_len;
} jf_fp8_state;
JF_API jf_status jf_sequence_fp8_state(jf_sequence seq, int op_index, jf_fp8_state* out);

/* Frees a saved context's tensors (stream-ordered on `stream`). */
JF_API jf_status jf_saved_release(jf_saved saved, jf_stream stream);

/* The fusion decisions for an input shape, as JSON text (owned by the sequence, valid until the next
 * call on it). Needs no GPU. */
JF_API jf_status jf_sequence_explain(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                                     const char** json_out);

#ifdef __cplusplus
}
#endif
#endif /* JITFUSE_JITFUSE_H_ */
