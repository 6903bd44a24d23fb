/* jitfuse C ABI (version 2). Opaque handles, status codes, a thread-local last-error string; no C++
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

#define JF_ABI_VERSION 2
#define JF_MAX_DIMS 16 /* the most dims a tensor may have */

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
  JF_ERR_INTERNAL = 9,         /* a jitfuse bug: please report with the message */
  JF_ERR_NOT_PREPARED = 10     /* a forward/backward of an unprepared shape inside a CUDA-graph capture */
} jf_status;

typedef struct jf_context_s* jf_context;
typedef struct jf_sequence_s* jf_sequence;
typedef struct jf_saved_s* jf_saved;
typedef struct CUstream_st* jf_stream; /* same type as CUstream and cudaStream_t */

/* Stream-ordered allocator: jitfuse asks for temporaries and saved tensors through it. `free` is called
 * as soon as the work using the memory is enqueued, so it must be stream-ordered (like cudaFreeAsync).
 * It is asked only for what the host did not pass (jf_forward_args.saved / .workspace). */
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
 * writes E4M3 bytes), or "fp8_block" (bf16 activations; the linears' GEMM operands E4M3 with a scale per
 * 1x128 block of activations and gradients and per 128x128 block of weights: docs/rules.md, "FP8"). */
JF_API jf_status jf_sequence_create(jf_context ctx, const char* json, const char* recipe, jf_sequence* out);
JF_API jf_status jf_sequence_create_from_file(jf_context ctx, const char* path, const char* recipe, jf_sequence* out);
JF_API jf_status jf_sequence_destroy(jf_sequence seq);
JF_API int jf_sequence_num_ops(jf_sequence seq);
/* The sequence's wiring as the parser numbered it, as JSON text owned by the sequence (valid as long as it,
 * the same text at every call; any thread): {"extra_inputs": [slot...], "extra_outputs": [slot...],
 * "channels": [{"name", "source", "readers", "returned"}...], "input_channels": [name...]}, each slot
 * {"slot", "op", "index", "kind", "channel"} in slot order. Needs no GPU (docs/c_api.md, "Sequence"). */
JF_API jf_status jf_sequence_wiring(jf_sequence seq, const char** json_out);
/* The argument counts of a call whose tensors come by position (a host layer such as jitfuse.torch), checked
 * against the sequence: JF_OK, or JF_ERR_INVALID_ARGUMENT with the one message for a wrong count (jf_last_error:
 * "<caller>: sequence 'name' takes 1 extra input(s) (...) and 3 parameter(s); got 0 and 3"). caller: names the
 * call in the message (NULL: none). n_params < 0: parameters not checked (shape may be NULL); otherwise they
 * are counted on the ops inferred for the input `shape` (what the call passes). n_extra_outputs < 0: a forward
 * (outputs and their gradients not checked); otherwise a backward's n_extra_outputs and n_grad_extra_outputs
 * are checked too. Needs no GPU. */
JF_API jf_status jf_sequence_check_counts(jf_sequence seq, const char* caller, const int64_t* shape, int ndim,
                                          int n_extra_inputs, int n_params, int n_extra_outputs,
                                          int n_grad_extra_outputs);

/* Builder: add ops one at a time (attributes as a JSON object text, may be NULL), then finish. */
typedef struct jf_builder_s* jf_builder;
JF_API jf_status jf_builder_create(const char* name, jf_builder* out);
JF_API jf_status jf_builder_add(jf_builder b, const char* op, const char* attrs_json);
JF_API jf_status jf_builder_finish(jf_builder b, jf_context ctx, const char* recipe, jf_sequence* out);
JF_API jf_status jf_builder_destroy(jf_builder b);

/* ---- ABI 2: prepare a shape, then run it with per-call tensors ------------------------------------
 *
 * jf_sequence_prepare does everything that cannot go into a CUDA graph: plan, program, NVRTC/cache,
 * module loads, occupancy queries, cuBLASLt heuristics, FP8 recipe state. A jf_forward / jf_backward of a
 * prepared shape then only enqueues stream-ordered work on the caller's stream (no compile, no module
 * load, no synchronous allocation, no host synchronisation), so it may be captured in a CUDA graph; the
 * one exception is the first call with a tensor that is not 16-byte aligned, which compiles (or reads from
 * the cache) and loads the kernels' scalar variants, inside a capture too, unless JITFUSE_ALL_VARIANTS=1
 * loaded them at prepare (docs/c_api.md, "Alignment"). An
 * unprepared shape is prepared on first use outside a capture; inside a capture the call fails with
 * JF_ERR_NOT_PREPARED before touching the stream (the capture stays valid). */
JF_API jf_status jf_sequence_prepare(jf_sequence seq, const int64_t* shape, int ndim, int training, jf_stream stream);

/* One tensor of a prepared program, as jf_sequence_info describes it. Strings are owned by the sequence
 * and live as long as it does. */
typedef struct jf_tensor_info {
  const char* name;  /* "output", "extra_output 0", "op 2 (gelu) input", "weight" ... */
  int op_index;      /* the op it belongs to, -1 for the sequence's own tensors */
  DLDataType dtype;
  int ndim;
  int64_t shape[JF_MAX_DIMS];
  size_t bytes;
  size_t offset;     /* saved tensors: byte offset inside the saved buffer; else 0 */
} jf_tensor_info;

/* What a prepared (shape, training) needs and makes, without running anything. */
typedef struct jf_program_info {
  int n_outputs;
  const jf_tensor_info* outputs;  /* [0]: the output; then the extra outputs by slot */
  int n_params;
  const jf_tensor_info* params;   /* every parameter (op_index, name, shape, dtype); its gradient has the same */
  int n_saved;
  const jf_tensor_info* saved;    /* training: the saved-for-backward tensors inside the saved buffer */
  size_t saved_bytes;             /* training: size of the saved buffer (0 in inference) */
  size_t forward_workspace_bytes; /* one forward call's scratch, the cuBLASLt workspace included */
  size_t backward_workspace_bytes;
  size_t alignment;               /* saved buffer and workspaces: byte alignment they need (256) */
  int uses_rng;                   /* 1 if a dropout draws from the Philox state */
  uint64_t rng_offset_advance;    /* what the host adds to the Philox offset after each forward (1 if uses_rng) */
} jf_program_info;

/* Prepares (shape, training) if needed (so it needs a GPU) and describes it. */
JF_API jf_status jf_sequence_info(jf_sequence seq, const int64_t* shape, int ndim, int training,
                                  jf_program_info* out);

/* A parameter or gradient for one call: the op's index and the parameter's name as the op declares it
 * (linear: "weight"; bias: "bias"; layernorm: "weight", "bias"; rmsnorm: "weight"; user ops: their own). */
typedef struct jf_param {
  int op_index;
  const char* name;
  const DLTensor* tensor;
} jf_param;

typedef struct jf_forward_args {
  const DLTensor* input;
  const DLTensor* const* extra_inputs;  /* by slot (add_extra_input ops in order) */
  int n_extra_inputs;
  DLTensor* output;
  DLTensor* const* extra_outputs;       /* by slot (make_extra_output ops in order) */
  int n_extra_outputs;
  const jf_param* params;               /* every parameter, once each, in any order */
  int n_params;
  int training;                         /* 1: write the saved buffer for jf_backward */
  /* Philox state of dropout. rng_state: device memory holding {seed, offset} (two uint64), read by the
   * forward when it runs, so a replayed graph draws from whatever the host wrote there; jitfuse never
   * writes it. NULL: rng_seed / rng_offset are used (baked into a captured graph). A dropout op's Philox
   * key is its `seed` attribute XOR the state's seed. */
  const uint64_t* rng_state;
  uint64_t rng_seed, rng_offset;
  /* Training: the saved buffer (jf_program_info.saved_bytes, aligned), which the backward reads. NULL:
   * jitfuse allocates it through the allocator and *saved_out owns it. */
  void* saved;
  size_t saved_bytes;
  /* Scratch for this call (forward_workspace_bytes, aligned), free again when the stream passes this
   * call. NULL: taken from the allocator and given back stream-ordered. */
  void* workspace;
  size_t workspace_bytes;
  /* FP8 recipes with linear ops: 1 if the weights are the same as in the last forward (no optimizer step
   * since, e.g. the next microbatch of a step): their FP8 casts are skipped and the copies the sequence
   * keeps are reused. jitfuse casts anyway when it never cast them or a weight pointer changed. 0 (the
   * zero-initialised default): cast them. */
  int fp8_weights_unchanged;
} jf_forward_args;

/* Runs the forward. saved_out: set (training without a host saved buffer) to a handle owning the saved
 * buffer (jf_saved_buffer, jf_saved_release); may be NULL otherwise. */
JF_API jf_status jf_forward(jf_sequence seq, const jf_forward_args* args, jf_saved* saved_out, jf_stream stream);

typedef struct jf_backward_args {
  /* The forward's tensors, as that forward had them (the backward reads what the program saved of them). */
  const DLTensor* input;
  const DLTensor* const* extra_inputs;
  int n_extra_inputs;
  const DLTensor* output;
  const DLTensor* const* extra_outputs;
  int n_extra_outputs;
  const jf_param* params;
  int n_params;
  const void* saved;   /* the forward's saved buffer (the host's, or jf_saved_buffer) */
  size_t saved_bytes;
  /* Gradients. */
  const DLTensor* grad_output;
  const DLTensor* const* grad_extra_outputs;
  int n_grad_extra_outputs;
  DLTensor* grad_input;
  DLTensor* const* grad_extra_inputs;
  int n_grad_extra_inputs;
  const jf_param* grads;  /* where each parameter's gradient goes (linear accumulate_grad: added to) */
  int n_grads;
  void* workspace;        /* backward_workspace_bytes, or NULL (allocator) */
  size_t workspace_bytes;
} jf_backward_args;

JF_API jf_status jf_backward(jf_sequence seq, const jf_backward_args* args, jf_stream stream);

/* ---- Prepared-program handles: calls with no lookup ---------------------------------------------
 *
 * jf_program_open prepares (shape, training) as jf_sequence_prepare does (so: outside a CUDA-graph capture)
 * and returns a handle to that prepared program. jf_program_forward / jf_program_backward take the same
 * arguments as jf_forward / jf_backward, checked the same way (plus: the input has the shape the handle was
 * opened for), and run the program with no plan lookup, lock, environment read or driver query per call
 * (under an FP8 recipe, the weight-change check takes one lock). The handle is fixed when it is opened:
 * rules loaded and JITFUSE_DISABLE_FUSION changed afterwards do not change it (open another). Call it with
 * the device that was current at open and a stream of that device. It keeps its sequence alive
 * (jf_sequence_destroy with open handles is allowed), not its context: close every handle before
 * jf_context_destroy. Thread-safe: one handle may run on several threads at once. */
typedef struct jf_program_s* jf_program;
JF_API jf_status jf_program_open(jf_sequence seq, const int64_t* shape, int ndim, int training, jf_stream stream,
                                 jf_program* out);
/* What jf_sequence_info says of the same (shape, training). */
JF_API jf_status jf_program_get_info(jf_program prog, jf_program_info* out);
/* Gradients a backward may write in place over the saved buffer: passing grad_input (op_index -1, name
 * "grad_input") or a parameter's gradient (op_index, name) as the `bytes` at `saved_offset` inside the saved
 * buffer lets the backward allocate nothing for it (the chunked LM head + loss saves dx and dW and its
 * backward only scales them). Any other overlap with the saved buffer is refused. After such a backward the
 * saved buffer holds those gradients: it serves no second backward. Empty (*n = 0) for most programs and
 * in inference; the array lives as long as the handle. */
typedef struct jf_grad_alias {
  int op_index;
  const char* name;
  size_t saved_offset;
  size_t bytes;
} jf_grad_alias;
JF_API jf_status jf_program_grad_aliases(jf_program prog, const jf_grad_alias** aliases, int* n);
JF_API jf_status jf_program_forward(jf_program prog, const jf_forward_args* args, jf_saved* saved_out,
                                    jf_stream stream);
JF_API jf_status jf_program_backward(jf_program prog, const jf_backward_args* args, jf_stream stream);
/* NULL is a no-op. */
JF_API jf_status jf_program_close(jf_program prog);

/* The saved buffer a jf_forward allocated (NULL for a released handle), and its size. */
JF_API jf_status jf_saved_buffer(jf_saved saved, void** buffer, size_t* bytes);

/* FP8 recipes (fp8_delayed, fp8_current): the recipe state of a quantize op on the current device, owned
 * by the sequence and kept across calls (allocated by jf_sequence_prepare: scale = scale_inv = 1, history
 * zeros). All fp32 device pointers, read and written stream-ordered by jf_forward. After a forward,
 * scale_inv dequantizes its E4M3 output (x ~ e4m3 * scale_inv). fp8_current: history_len 1, the last
 * call's amax. fp8_delayed: history_len 1024, newest first; `scale` is the one the next call will use. */
typedef struct jf_fp8_state {
  float* scale;
  float* scale_inv;
  float* amax_history;
  int64_t history_len;
} jf_fp8_state;
JF_API jf_status jf_sequence_fp8_state(jf_sequence seq, int op_index, jf_fp8_state* out);
/* The recipe state of one FP8 GEMM operand of a linear op: tensor "input" and "weight" (E4M3) or
 * "grad_output" (E5M2, written by jf_backward); fp8_delayed and fp8_current (fp8_block keeps none). scale_inv here is the last cast's; the GEMMs read the copy
 * each cast writes beside its FP8 tensor. */
JF_API jf_status jf_sequence_fp8_operand_state(jf_sequence seq, int op_index, const char* tensor, jf_fp8_state* out);

/* Frees the saved buffer a jf_forward allocated (stream-ordered on `stream`). */
JF_API jf_status jf_saved_release(jf_saved saved, jf_stream stream);

/* The fusion decisions for an input shape, as JSON text (owned by the sequence, valid until the next
 * call on it). Needs no GPU. */
JF_API jf_status jf_sequence_explain(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                                     const char** json_out);

/* ---- Tensor parallelism (docs/parallel.md) ----------------------------------------------------------
 *
 * A sequence with comm ops (all_gather, reduce_scatter, all_reduce) or parallel linears ("tensor_parallel":
 * "column" | "row") runs its collectives through NCCL, loaded at run time (libnccl.so.2, or
 * $JITFUSE_NCCL_LIBRARY): a build without NCCL runs everything else and fails these calls with
 * JF_ERR_UNSUPPORTED saying so. The host hands each such sequence a communicator before its first prepare
 * or call; every rank of the group prepares the same sequence and calls it in the same order. */
typedef struct jf_comm_s* jf_comm;
#define JF_COMM_ID_BYTES 128 /* NCCL's unique id: rank 0 makes it, the host sends it to every rank */

/* The loaded NCCL's version code (22809 for 2.28.9); JF_ERR_UNSUPPORTED with the reason if none loads. */
JF_API jf_status jf_nccl_version(int* version);
/* A new unique id (rank 0), `bytes` >= JF_COMM_ID_BYTES. */
JF_API jf_status jf_comm_unique_id(uint8_t* id, size_t bytes);
/* Joins rank `rank` of `world_size` ranks sharing `id` on the calling thread's current device (blocks until
 * every rank joined). jitfuse owns the NCCL communicator: it lives until the last jf_comm_destroy and the
 * last sequence using it are gone. */
JF_API jf_status jf_comm_create(const uint8_t* id, size_t id_bytes, int world_size, int rank, jf_comm* out);
/* The host's ncclComm_t (as void*), borrowed: the host keeps it alive while sequences use it. */
JF_API jf_status jf_comm_wrap(void* nccl_comm, jf_comm* out);
JF_API jf_status jf_comm_info(jf_comm comm, int* world_size, int* rank, int* device);
JF_API jf_status jf_comm_destroy(jf_comm comm);
/* Binds `comm` to the sequence's group (the "group" its comm ops and parallel linears name, default "tp").
 * Only before the sequence's first prepare, info or call: shapes depend on the world size. */
JF_API jf_status jf_sequence_set_comm(jf_sequence seq, const char* group, jf_comm comm);
/* jf_sequence_explain for rank `rank` of a group of `world_size` GPUs, with no communicator and no GPU:
 * what `jitfuse explain --world-size N --rank R` prints. */
JF_API jf_status jf_sequence_explain_parallel(jf_sequence seq, const int64_t* shape, int ndim, int training, int arch,
                                              int world_size, int rank, const char** json_out);

#ifdef __cplusplus
}
#endif
#endif /* JITFUSE_JITFUSE_H_ */
