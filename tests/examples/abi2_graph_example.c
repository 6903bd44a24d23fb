/* A training step of y = dropout(gelu(x W1^T + b1) W2^T + b2) + residual in bf16, captured once in a
 * CUDA graph and replayed, with the saved buffer and workspaces provided by the host and the dropout's
 * Philox state in device memory, its offset advanced between replays. The last replay is compared with
 * an eager step of the same state: they must agree bit for bit.
 *
 * Build: cc abi2_graph_example.c -I/usr/local/cuda/include -ljitfuse -L/usr/local/cuda/lib64 -lcudart
 * Exit status: 0 on success, 1 on a failure, 77 when there is no GPU (CTest's "skipped"). */
#include <cuda_runtime_api.h>
#include <jitfuse/jitfuse.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define JF_CHECK(call)                                                                    \
  do {                                                                                    \
    jf_status s_ = (call);                                                                \
    if (s_ != JF_OK) {                                                                    \
      fprintf(stderr, "%s failed with status %d: %s\n", #call, (int)s_, jf_last_error()); \
      exit(1);                                                                            \
    }                                                                                     \
  } while (0)
#define CUDA_CHECK(call)                                                 \
  do {                                                                   \
    cudaError_t e_ = (call);                                             \
    if (e_ != cudaSuccess) {                                             \
      fprintf(stderr, "%s failed: %s\n", #call, cudaGetErrorString(e_)); \
      exit(1);                                                           \
    }                                                                    \
  } while (0)

enum { M = 4096, H = 1024, F = 4096, MAX_PARAMS = 8, REPLAYS = 8 };

static const char* kSequence =
    "{\"format\": \"jitfuse.sequence/1\", \"name\": \"mlp\", \"ops\": ["
    " {\"op\": \"linear\", \"in_features\": 1024, \"out_features\": 4096},"
    " {\"op\": \"bias\"},"
    " {\"op\": \"gelu\", \"approximate\": \"tanh\"},"
    " {\"op\": \"linear\", \"in_features\": 4096, \"out_features\": 1024},"
    " {\"op\": \"bias\"},"
    " {\"op\": \"dropout\", \"p\": 0.1, \"seed\": 7},"
    " {\"op\": \"add_extra_input\"}]}";

/* A bf16 device tensor and its DLPack view (contiguous row-major: strides = NULL). */
typedef struct {
  int64_t shape[JF_MAX_DIMS];
  size_t bytes;
  DLTensor dl;
} Tensor;

static uint16_t to_bf16(float f) { /* round to nearest even */
  uint32_t u;
  memcpy(&u, &f, 4);
  return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float from_bf16(uint16_t h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Uniform values in [-scale/2, scale/2] (zeros for scale 0), copied on the stream the calls run on: a plain
 * cudaMemcpy from pageable memory is not ordered with a non-blocking stream, whose kernels could read the
 * tensor before the copy lands. Synchronised, as the host buffer is freed next. */
static void tensor_init(Tensor* t, int ndim, const int64_t* shape, float scale, cudaStream_t stream) {
  memset(t, 0, sizeof *t);
  int64_t n = 1;
  for (int i = 0; i < ndim; ++i) {
    t->shape[i] = shape[i];
    n *= shape[i];
  }
  t->bytes = (size_t)n * 2;
  uint16_t* host = malloc(t->bytes);
  for (int64_t i = 0; i < n; ++i) host[i] = to_bf16(scale * ((float)rand() / (float)RAND_MAX - 0.5f));
  void* dev = NULL;
  CUDA_CHECK(cudaMalloc(&dev, t->bytes));
  CUDA_CHECK(cudaMemcpyAsync(dev, host, t->bytes, cudaMemcpyHostToDevice, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  free(host);
  t->dl.data = dev;
  t->dl.device.device_type = kDLCUDA;
  t->dl.device.device_id = 0;
  t->dl.ndim = ndim;
  t->dl.dtype.code = kDLBfloat; /* the recipe's dtype */
  t->dl.dtype.bits = 16;
  t->dl.dtype.lanes = 1;
  t->dl.shape = t->shape;
  t->dl.strides = NULL;
}

/* Queued after the work on `stream` that wrote the tensor; synchronised, as the host reads it next. */
static uint16_t* download(const Tensor* t, cudaStream_t stream) {
  uint16_t* host = malloc(t->bytes);
  CUDA_CHECK(cudaMemcpyAsync(host, t->dl.data, t->bytes, cudaMemcpyDeviceToHost, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  return host;
}

/* Device memory of at least `bytes` at `alignment` (cudaMalloc gives 256 bytes). */
static void* device_buffer(size_t bytes, size_t alignment) {
  void* p = NULL;
  CUDA_CHECK(cudaMalloc(&p, bytes > alignment ? bytes : alignment));
  if ((uintptr_t)p % alignment != 0) {
    fprintf(stderr, "cudaMalloc returned memory that is not %zu-byte aligned\n", alignment);
    exit(1);
  }
  return p;
}

int main(void) {
  if (jf_abi_version() != JF_ABI_VERSION) {
    fprintf(stderr, "ABI mismatch: header %d, library %d\n", JF_ABI_VERSION, jf_abi_version());
    return 1;
  }
  int n_devices = 0;
  if (cudaGetDeviceCount(&n_devices) != cudaSuccess || n_devices == 0) {
    printf("SKIP: no GPU\n");
    return 77;
  }
  CUDA_CHECK(cudaSetDevice(0)); /* device 0's primary context becomes current: jitfuse works in it */
  cudaStream_t stream;          /* a cudaStream_t is a jf_stream; capture needs a stream of one's own */
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));

  jf_context ctx;
  JF_CHECK(jf_context_create(&ctx)); /* built-in rules, then JITFUSE_RULE_PATH */
  jf_sequence seq;
  JF_CHECK(jf_sequence_create(ctx, kSequence, "bf16", &seq));

  /* 1. Prepare (input shape, training) before any capture: plan, compile or load from the kernel cache,
   *    cuBLASLt algorithms. Then ask what the program needs. */
  const int64_t in_shape[2] = {M, H};
  JF_CHECK(jf_sequence_prepare(seq, in_shape, 2, /*training=*/1, stream));
  jf_program_info info;
  JF_CHECK(jf_sequence_info(seq, in_shape, 2, /*training=*/1, &info));
  printf("saved buffer %zu bytes, workspaces %zu (forward) and %zu (backward), rng offset advance %llu\n",
         info.saved_bytes, info.forward_workspace_bytes, info.backward_workspace_bytes,
         (unsigned long long)info.rng_offset_advance);
  for (int i = 0; i < info.n_saved; ++i)
    printf("  saved: %-24s %10zu bytes at offset %zu\n", info.saved[i].name, info.saved[i].bytes,
           info.saved[i].offset);
  if (info.n_params > MAX_PARAMS || !info.uses_rng) {
    fprintf(stderr, "unexpected program: %d parameters, uses_rng %d\n", info.n_params, info.uses_rng);
    return 1;
  }

  /* 2. Parameters and their gradient buffers, one pair per entry of info.params (op index, name, shape). */
  Tensor params[MAX_PARAMS], grads[MAX_PARAMS];
  jf_param p[MAX_PARAMS], g[MAX_PARAMS];
  for (int i = 0; i < info.n_params; ++i) {
    const jf_tensor_info* ti = &info.params[i];
    tensor_init(&params[i], ti->ndim, ti->shape, ti->ndim == 2 ? 0.05f : 0.1f, stream);
    tensor_init(&grads[i], ti->ndim, ti->shape, 0.f, stream);
    p[i] = (jf_param){.op_index = ti->op_index, .name = ti->name, .tensor = &params[i].dl};
    g[i] = (jf_param){.op_index = ti->op_index, .name = ti->name, .tensor = &grads[i].dl};
  }

  /* Input, the residual (extra input 0), output, and their gradients. */
  Tensor x, res, y, dy, dx, dres;
  tensor_init(&x, 2, in_shape, 2.f, stream);
  tensor_init(&res, 2, in_shape, 2.f, stream);
  tensor_init(&y, 2, in_shape, 0.f, stream);
  tensor_init(&dy, 2, in_shape, 1.f, stream);
  tensor_init(&dx, 2, in_shape, 0.f, stream);
  tensor_init(&dres, 2, in_shape, 0.f, stream);

  /* 3. The saved buffer, the workspaces and the Philox state {seed, offset}: the host's device memory. */
  void* saved = device_buffer(info.saved_bytes, info.alignment);
  void* fwd_ws = device_buffer(info.forward_workspace_bytes, info.alignment);
  void* bwd_ws = device_buffer(info.backward_workspace_bytes, info.alignment);
  uint64_t* rng_state = device_buffer(2 * sizeof(uint64_t), info.alignment);

  const DLTensor* extra_in[1] = {&res.dl};
  DLTensor* grad_extra_in[1] = {&dres.dl};
  const jf_forward_args fwd = {
      .input = &x.dl, .extra_inputs = extra_in, .n_extra_inputs = 1, .output = &y.dl,
      .params = p, .n_params = info.n_params, .training = 1,
      .rng_state = rng_state, /* read when the forward runs: each replay draws from what is there then */
      .saved = saved, .saved_bytes = info.saved_bytes,
      .workspace = fwd_ws, .workspace_bytes = info.forward_workspace_bytes};
  const jf_backward_args bwd = {
      .input = &x.dl, .extra_inputs = extra_in, .n_extra_inputs = 1, .output = &y.dl, /* the forward's */
      .params = p, .n_params = info.n_params, .saved = saved, .saved_bytes = info.saved_bytes,
      .grad_output = &dy.dl, .grad_input = &dx.dl,
      .grad_extra_inputs = grad_extra_in, .n_grad_extra_inputs = 1,
      .grads = g, .n_grads = info.n_params,
      .workspace = bwd_ws, .workspace_bytes = info.backward_workspace_bytes};

  /* The Philox state of each replay: one seed, the offset advanced by rng_offset_advance per forward.
   * Pinned and never rewritten, so each asynchronous copy below reads what it was given. */
  uint64_t(*states)[2] = NULL;
  CUDA_CHECK(cudaMallocHost((void**)&states, sizeof(uint64_t[2]) * REPLAYS));
  for (int r = 0; r < REPLAYS; ++r) {
    states[r][0] = 0x5eedULL;
    states[r][1] = 1000 + (uint64_t)r * info.rng_offset_advance;
  }

  /* 4. One eager step with the last replay's state, to compare the graph with. */
  CUDA_CHECK(cudaMemcpyAsync(rng_state, states[REPLAYS - 1], 16, cudaMemcpyHostToDevice, stream));
  JF_CHECK(jf_forward(seq, &fwd, NULL, stream));
  JF_CHECK(jf_backward(seq, &bwd, stream));
  CUDA_CHECK(cudaStreamSynchronize(stream));
  uint16_t* y_eager = download(&y, stream);
  uint16_t* dx_eager = download(&dx, stream);
  uint16_t* dw1_eager = download(&grads[0], stream);

  /* 5. Capture the step once. A prepared shape with host buffers only enqueues kernels, cuBLASLt
   *    matmuls and the 16-byte copy of the Philox state: nothing compiles, loads or allocates. */
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  jf_status st = jf_forward(seq, &fwd, NULL, stream);
  if (st == JF_OK) st = jf_backward(seq, &bwd, stream);
  if (st != JF_OK) fprintf(stderr, "captured step failed with status %d: %s\n", (int)st, jf_last_error());
  CUDA_CHECK(cudaStreamEndCapture(stream, &graph)); /* end the capture whatever happened */
  if (st != JF_OK) return 1;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));

  /* 6. Replay: write the next state, then launch; stream order puts the copy between the replays. */
  uint16_t y_row_first[H];
  for (int r = 0; r < REPLAYS; ++r) {
    CUDA_CHECK(cudaMemcpyAsync(rng_state, states[r], 16, cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaGraphLaunch(exec, stream));
    if (r == 0) /* the first row of y after the first replay */
      CUDA_CHECK(cudaMemcpyAsync(y_row_first, y.dl.data, sizeof y_row_first, cudaMemcpyDeviceToHost, stream));
  }
  CUDA_CHECK(cudaStreamSynchronize(stream));
  uint16_t* y_last = download(&y, stream);
  uint16_t* dx_last = download(&dx, stream);
  uint16_t* dw1_last = download(&grads[0], stream);
  const int same = memcmp(y_last, y_eager, y.bytes) == 0 && memcmp(dx_last, dx_eager, dx.bytes) == 0 &&
                   memcmp(dw1_last, dw1_eager, grads[0].bytes) == 0;
  const int masks_changed = memcmp(y_row_first, y_last, sizeof y_row_first) != 0;
  printf("replay %d %s the eager step bit for bit (y, dx, dW1); the dropout masks %s between replays\n",
         REPLAYS - 1, same ? "matches" : "DIFFERS FROM", masks_changed ? "changed" : "DID NOT CHANGE");
  printf("y[0] = %g\n", from_bf16(y_last[0]));

  /* The graph uses the sequence's kernels: destroy it before the sequence and the context. */
  CUDA_CHECK(cudaGraphExecDestroy(exec));
  CUDA_CHECK(cudaGraphDestroy(graph));
  JF_CHECK(jf_sequence_destroy(seq));
  JF_CHECK(jf_context_destroy(ctx));
  free(y_eager);
  free(dx_eager);
  free(dw1_eager);
  free(y_last);
  free(dx_last);
  free(dw1_last);
  for (int i = 0; i < info.n_params; ++i) {
    cudaFree(params[i].dl.data);
    cudaFree(grads[i].dl.data);
  }
  Tensor* acts[] = {&x, &res, &y, &dy, &dx, &dres};
  for (size_t i = 0; i < sizeof acts / sizeof acts[0]; ++i) cudaFree(acts[i]->dl.data);
  cudaFree(saved);
  cudaFree(fwd_ws);
  cudaFree(bwd_ws);
  cudaFree(rng_state);
  cudaFreeHost(states);
  cudaStreamDestroy(stream);
  return same && masks_changed ? 0 : 1;
}
