// Host time per call from C++, no Python: one kernel launch (the floor under any call that launches a
// kernel: jitfuse's C ABI, a PyTorch op) and jf_forward of a prepared one-kernel sequence (bias + gelu,
// 16 x 1024 bf16, inference), so that what jitfuse adds over the launch it makes shows apart from ctypes
// and PyTorch. An empty kernel with four arguments, loaded from PTX, launched on the legacy default
// stream, the per-thread stream, a created stream and a non-blocking one; µs per call, batches of 8 calls
// timed from the first call's start to the last one's return, synchronised outside the timing, median
// over batches.
// From the repository root (the program, then the in-process loop host_overhead.py loads through
// HOST_FLOOR_LOOP=<path of the .so>), one command each, wrapped here (add -DHOST_FLOOR_NO_PROGRAM_HANDLE to
// build against a library without jf_program_open):
//   g++ -O2 -std=c++17 tools/microbench/host_floor.cpp -Iruntime/include -I/usr/local/cuda/include
//       -L/usr/local/cuda/lib64/stubs -lcuda -Lbuild/runtime -ljitfuse -o host_floor
//   g++ -O2 -std=c++17 -DHOST_FLOOR_LOOP -shared -fPIC tools/microbench/host_floor.cpp -Iruntime/include
//       -I/usr/local/cuda/include -Lbuild/runtime -ljitfuse -o host_floor_loop.so
#include <cuda.h>
#include <jitfuse/jitfuse.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CK(x)                                                    \
  do {                                                           \
    CUresult r_ = (x);                                           \
    if (r_ != CUDA_SUCCESS) {                                    \
      std::fprintf(stderr, "%s failed: %d\n", #x, (int)r_);      \
      std::exit(1);                                              \
    }                                                            \
  } while (0)

#ifndef HOST_FLOOR_LOOP
static const char* kPtx = R"(.version 8.0
.target sm_90
.address_size 64
.visible .entry noop(.param .u64 a, .param .u64 b, .param .u64 c, .param .u32 n) { ret; }
)";

template <class F>
static double us_per_call(F f, int batches = 200, int batch = 8) {
  for (int i = 0; i < 64; ++i) f();
  CK(cuCtxSynchronize());
  std::vector<double> v;
  for (int b = 0; b < batches; ++b) {
    auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < batch; ++i) f();
    auto t1 = std::chrono::steady_clock::now();
    v.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / batch);
    CK(cuCtxSynchronize());
  }
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

int main() {
  CK(cuInit(0));
  CUdevice dev;
  CK(cuDeviceGet(&dev, 0));
  CUcontext ctx;
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  CUmodule mod;
  CK(cuModuleLoadData(&mod, kPtx));
  CUfunction fn;
  CK(cuModuleGetFunction(&fn, mod, "noop"));
  CUdeviceptr buf;
  CK(cuMemAlloc(&buf, 1 << 20));
  unsigned long long a = buf, b = 0, c = 0;
  unsigned n = 16;
  void* args[] = {&a, &b, &c, &n};
  CUstream blocking, nonblocking;
  CK(cuStreamCreate(&blocking, CU_STREAM_DEFAULT));
  CK(cuStreamCreate(&nonblocking, CU_STREAM_NON_BLOCKING));
  struct S {
    const char* name;
    CUstream s;
  } streams[] = {{"legacy default stream (0)", nullptr},
                 {"per-thread default stream", CU_STREAM_PER_THREAD},
                 {"created stream", blocking},
                 {"created non-blocking stream", nonblocking}};
  for (int round = 0; round < 2; ++round)
    for (auto& s : streams)
      std::printf("cuLaunchKernel(empty kernel), %-28s %6.2f us\n", s.name,
                  us_per_call([&] { CK(cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, s.s, args, nullptr)); }));
  CUstreamCaptureStatus st;
  std::printf("cuStreamIsCapturing                                        %6.2f us\n",
              us_per_call([&] { CK(cuStreamIsCapturing(nonblocking, &st)); }));
  CUcontext cur;
  std::printf("cuCtxGetCurrent                                            %6.2f us\n",
              us_per_call([&] { CK(cuCtxGetCurrent(&cur)); }));
  CUevent ev;
  CK(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING));
  std::printf("cuEventRecord (created stream)                             %6.2f us\n",
              us_per_call([&] { CK(cuEventRecord(ev, blocking)); }));
  // jf_forward of bias + gelu, prepared, on the created stream and on the legacy one.
  jf_context jc;
  jf_sequence seq;
  const char* json = R"({"format": "jitfuse.sequence/1", "name": "bias_gelu",
    "ops": [{"op": "bias"}, {"op": "gelu", "approximate": "tanh"}]})";
  auto jk = [](jf_status s, const char* what) {
    if (s != JF_OK) {
      std::fprintf(stderr, "%s: %s\n", what, jf_last_error());
      std::exit(1);
    }
  };
  jk(jf_context_create(&jc), "jf_context_create");
  jk(jf_sequence_create(jc, json, "bf16", &seq), "jf_sequence_create");
  int64_t shape[2] = {16, 1024}, bshape[1] = {1024};
  for (CUstream s : {blocking, (CUstream) nullptr}) jk(jf_sequence_prepare(seq, shape, 2, 0, s), "jf_sequence_prepare");
  CUdeviceptr x, y, bias;
  CK(cuMemAlloc(&x, 16 * 1024 * 2));
  CK(cuMemAlloc(&y, 16 * 1024 * 2));
  CK(cuMemAlloc(&bias, 1024 * 2));
  CK(cuMemsetD16Async(x, 0x3f80, 16 * 1024, blocking));  // on the stream the calls run on
  CK(cuMemsetD16Async(bias, 0x3f80, 1024, blocking));
  CK(cuStreamSynchronize(blocking));
  auto dl = [](CUdeviceptr p, int64_t* shp, int nd) {
    DLTensor t{};
    t.data = reinterpret_cast<void*>(p);
    t.device = {kDLCUDA, 0};
    t.ndim = nd;
    t.dtype = {kDLBfloat, 16, 1};
    t.shape = shp;
    return t;
  };
  DLTensor tx = dl(x, shape, 2), ty = dl(y, shape, 2), tb = dl(bias, bshape, 1);
  jf_param pb{0, "bias", &tb};
  jf_forward_args fa{};
  fa.input = &tx;
  fa.output = &ty;
  fa.params = &pb;
  fa.n_params = 1;
  for (int round = 0; round < 2; ++round)
    for (auto& s : {streams[0], streams[2]})
      std::printf("jf_forward(bias+gelu, 16x1024 bf16, inference), %-20s %6.2f us\n", s.name,
                  us_per_call([&] { jk(jf_forward(seq, &fa, nullptr, s.s), "jf_forward"); }));
#ifndef HOST_FLOOR_NO_PROGRAM_HANDLE  // -D it to build against a library older than jf_program (ABI 2.1)
  // The same through a prepared-program handle: no lookup, lock, getenv or driver query per call.
  jf_program prog;
  jk(jf_program_open(seq, shape, 2, 0, blocking, &prog), "jf_program_open");
  for (int round = 0; round < 2; ++round)
    for (auto& s : {streams[0], streams[2]})
      std::printf("jf_program_forward(same),                       %-20s %6.2f us\n", s.name,
                  us_per_call([&] { jk(jf_program_forward(prog, &fa, nullptr, s.s), "jf_program_forward"); }));
  jf_program_close(prog);
#endif
  jf_sequence_destroy(seq);
  jf_context_destroy(jc);
  return 0;
}
#endif  // HOST_FLOOR_LOOP

#ifdef HOST_FLOOR_LOOP
// Built as a shared library (-DHOST_FLOOR_LOOP -shared -fPIC), loaded by
// tools/torch_baselines/host_overhead.py: `n` jf_forward calls in a C loop inside the PyTorch process,
// mean µs per call (the caller synchronises around it), so the C side is timed there without ctypes.
extern "C" double host_floor_loop(jf_sequence seq, const jf_forward_args* fa, jf_stream stream, int n) {
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i)
    if (jf_forward(seq, fa, nullptr, stream) != JF_OK) return -1.0;
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::micro>(t1 - t0).count() / n;
}
#endif
