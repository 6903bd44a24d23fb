// `jitfuse bench`'s harness: options, the timer, random inputs, result rows, and a sequence run through the
// C ABI with random parameters. The cases (bench_cases.cpp) are built from these; see docs/benchmarks.md.
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "cuda/driver.hpp"
#include "jitfuse/jitfuse.h"
#include "ops/op.hpp"
#include "harness/device_tensor.hpp"

namespace jitfuse::cli::bench {

using harness::DeviceTensor;

struct BenchOpts {
  bool json = false;
  bool sync = false;
  int warmup = 10, iters = 50;
  std::string only;
};

// What every case runs with.
struct BenchEnv {
  jf_context ctx = nullptr;
  CUstream stream = nullptr;
  const BenchOpts& opts;
};

struct Row {
  std::string name, shape;
  double ms = 0, bytes = 0, flops = 0, baseline_ms = 0;
  double speedup = 0;  // mlp_fp8, gemm_fp8: the bf16 row's time over this row's
};

constexpr int64_t R = 8192;  // rows (tokens) of every case but the norm sweep and decode
constexpr double kBf16Bytes = 2;

void ok(jf_status s, const char* what);
// The median of o.iters timed calls of fn, after o.warmup untimed ones (see the definition).
double median_ms(CUstream s, const std::function<void()>& fn, const BenchOpts& o);
std::vector<double> random_values(size_t n, uint64_t seed, double lo, double hi);
// n random bytes for a GEMM operand: bf16 (2n bytes) or E4M3 codes, never zero, never overflowing.
std::vector<uint8_t> random_operand_bytes(size_t n, bool fp8, uint64_t seed);
// Device-to-device copy bandwidth in GB/s (read + write), the memory-bound cases' yardstick; with bytes > 0,
// of a copy moving that many bytes (read + write), timed the same way.
double copy_bandwidth(CUstream s, const BenchOpts& o, double bytes = 0);

// A parameter of a sequence: the op it belongs to, its name, its shape.
using ParamSpec = std::tuple<int, std::string, ops::Shape>;

// One sequence with random parameters and inputs, in bf16, run through the C ABI (its uploads on `stream`,
// the stream the calls run on).
struct SeqBench {
  jf_sequence seq = nullptr;
  CUstream stream = nullptr;
  std::vector<std::unique_ptr<DeviceTensor>> keep;  // per parameter: the tensor, then its gradient
  DeviceTensor *x = nullptr, *y = nullptr, *gy = nullptr, *gx = nullptr;
  std::vector<DeviceTensor*> ein, eout, gein, geout;
  std::vector<const DLTensor*> ein_t, geout_t, eout_ct;
  std::vector<DLTensor*> eout_t, gein_t;
  std::deque<std::string> names;
  std::vector<jf_param> params, grads;

  SeqBench(jf_context ctx, CUstream s, const std::string& ops_json, const ops::Shape& in, const ops::Shape& out,
           const std::vector<ParamSpec>& ps, int n_extra_in, int n_extra_out, const char* recipe = "bf16");
  ~SeqBench();
  SeqBench(const SeqBench&) = delete;
  SeqBench& operator=(const SeqBench&) = delete;

  DeviceTensor* make(const ops::Shape& s, uint64_t seed);
  void* param(size_t i) const { return reinterpret_cast<void*>(keep[2 * i]->ptr()); }  // i-th of `ps`
  void* grad(size_t i) const { return reinterpret_cast<void*>(keep[2 * i + 1]->ptr()); }
  jf_forward_args forward_args(bool training);
  // saved: a training forward (the saved block is allocated and handed out); NULL: inference.
  // weights_unchanged: FP8 recipes reuse the FP8 weight copies of the last forward (a later microbatch).
  void forward(CUstream s, jf_saved* saved, bool weights_unchanged = false);
  void backward(CUstream s, jf_saved saved);
  // A training step: forward (saving), backward, release of the saved block.
  void step(CUstream s, bool weights_unchanged = false);
};

inline void* ptr(const DeviceTensor& t) { return reinterpret_cast<void*>(t.ptr()); }

}  // namespace jitfuse::cli::bench
