// `jitfuse bench`: CUDA-event medians after warm-up for the memory-bound cases (GB/s against the
// device-to-device copy bandwidth measured in the same run) and the GEMM cases (TFLOP/s against bare
// cuBLASLt with the same epilogues). Inputs are random (never zeros). "%c@size": against a copy of the row's
// own byte count timed the same way (per-call events, so the fixed per-call cost is in both). See
// docs/benchmarks.md.
#include <cstdio>
#include <map>
#include <memory>

#include <nlohmann/json.hpp>

#include "bench_cases.hpp"
#include "commands.hpp"
#include "common/error.hpp"

namespace jitfuse::cli {
namespace {

using bench::BenchEnv;
using bench::BenchOpts;
using bench::Row;

// The cases --case names, or every case on by default, in table order.
std::vector<Row> run_cases(const BenchEnv& env) {
  std::vector<Row> rows;
  for (const auto& c : bench::bench_cases()) {
    if (!(env.opts.only == c.name || (env.opts.only.empty() && c.by_default))) continue;
    auto more = c.run(env);
    rows.insert(rows.end(), more.begin(), more.end());
  }
  return rows;
}

// What a copy of each row's byte count reaches, timed as the rows are (one measurement per distinct size).
class SizedCopy {
 public:
  SizedCopy(CUstream s, const BenchOpts& o) : s_(s), o_(o) {}
  double gbps(double bytes) {
    auto it = done_.find(bytes);
    if (it == done_.end()) it = done_.emplace(bytes, bench::copy_bandwidth(s_, o_, bytes)).first;
    return it->second;
  }

 private:
  CUstream s_;
  const BenchOpts& o_;
  std::map<double, double> done_;
};

nlohmann::json row_json(const Row& r, double copy, double sized_copy) {
  nlohmann::json j = {{"case", r.name}, {"shape", r.shape}, {"ms", r.ms}};
  if (r.bytes > 0) {
    const double gbps = r.bytes / (r.ms * 1e-3) / 1e9;
    j["bytes"] = r.bytes;
    j["gbps"] = gbps;
    j["pct_copy"] = 100 * gbps / copy;
    j["same_size_copy_gbps"] = sized_copy;
    j["pct_same_size_copy"] = 100 * gbps / sized_copy;
  }
  if (r.flops > 0) j["tflops"] = r.flops / (r.ms * 1e-3) / 1e12;
  if (r.flops > 0 && r.baseline_ms > 0) {  // gemm_fp8's rows are bare cuBLASLt themselves
    j["cublaslt_ms"] = r.baseline_ms;
    j["slowdown_pct"] = 100 * (r.ms / r.baseline_ms - 1);
  }
  if (r.speedup > 0) j["speedup_vs_bf16"] = r.speedup;
  return j;
}

void print_row(const Row& r, double copy, double sized_copy) {
  const double gbps = r.bytes > 0 ? r.bytes / (r.ms * 1e-3) / 1e9 : 0;
  const double tflops = r.flops > 0 ? r.flops / (r.ms * 1e-3) / 1e12 : 0;
  const bool vs_bare = r.flops > 0 && r.baseline_ms > 0;
  std::printf("%-22s %-24s %9.3f %9s %9s %7s %7s %9s %11s %9s%s\n", r.name.c_str(), r.shape.c_str(), r.ms,
              r.bytes > 0 ? fmt::format("{:.0f}", r.bytes / 1e6).c_str() : "-",
              r.bytes > 0 ? fmt::format("{:.0f}", gbps).c_str() : "-",
              r.bytes > 0 ? fmt::format("{:.1f}", 100 * gbps / copy).c_str() : "-",
              r.bytes > 0 ? fmt::format("{:.1f}", 100 * gbps / sized_copy).c_str() : "-",
              r.flops > 0 ? fmt::format("{:.0f}", tflops).c_str() : "-",
              vs_bare ? fmt::format("{:.3f}", r.baseline_ms).c_str() : "-",
              vs_bare ? fmt::format("{:+.1f}%", 100 * (r.ms / r.baseline_ms - 1)).c_str() : "-",
              r.speedup > 0 ? fmt::format("  FP8/bf16 {:.2f}x", r.speedup).c_str() : "");
}

void run_bench(const BenchOpts& o) {
  std::string why;
  if (!cuda::try_driver(&why)) fail(Status::no_device, "jitfuse bench needs a GPU: {}", why);
  auto dev = cuda::current_device();
  jf_context ctx = nullptr;
  bench::ok(jf_context_create(&ctx), "jf_context_create");
  CUstream s = nullptr;
  cuda::check(cuda::driver().cuStreamCreate(&s, CU_STREAM_NON_BLOCKING), "cuStreamCreate");
  const double copy = bench::copy_bandwidth(s, o);
  auto rows = run_cases(BenchEnv{ctx, s, o});
  nlohmann::json out = {{"gpu", dev.name}, {"arch", dev.arch()}, {"copy_gbps", copy}, {"warmup", o.warmup},
                        {"iters", o.iters}, {"sync", o.sync}, {"cases", nlohmann::json::array()}};
  if (!o.json) {
    std::printf("GPU %s (%s); device-to-device copy %.0f GB/s (read + write); median of %d runs after %d warm-up, %s\n",
                dev.name.c_str(), dev.arch().c_str(), copy, o.iters, o.warmup,
                o.sync ? "each call synchronised (host overhead included)" : "calls enqueued back to back");
    std::printf("%-22s %-24s %9s %9s %9s %7s %7s %9s %11s %9s\n", "case", "shape", "ms", "MB", "GB/s", "%copy",
                "%c@size", "TFLOP/s", "cuBLASLt ms", "vs bare");
  }
  SizedCopy sized(s, o);
  for (const auto& r : rows) {
    const double sc = r.bytes > 0 ? sized.gbps(r.bytes) : 0;
    out["cases"].push_back(row_json(r, copy, sc));
    if (!o.json) print_row(r, copy, sc);
  }
  if (o.json) std::printf("%s\n", out.dump(2).c_str());
  cuda::driver().cuStreamDestroy(s);
  jf_context_destroy(ctx);
}

}  // namespace

void add_bench_commands(CLI::App& app) {
  auto o = std::make_shared<BenchOpts>();
  auto* cmd = app.add_subcommand("bench", "Time the fused kernels: GB/s vs copy bandwidth, TFLOP/s vs bare cuBLASLt");
  cmd->add_flag("--json", o->json, "Machine-readable output");
  cmd->add_option("--warmup", o->warmup, "Untimed runs before timing (default 10)")->check(CLI::NonNegativeNumber);
  cmd->add_option("--iters", o->iters, "Timed runs; the median is reported (default 50)")->check(CLI::PositiveNumber);
  cmd->add_flag("--sync", o->sync, "Wait for each timed call before enqueuing the next (host overhead included)");
  cmd->add_option("--case", o->only,
                  "Run one case: bias_gelu, dgelu_dbias, layernorm, rmsnorm, layernorm_fp8_current, "
                  "layernorm_fp8_delayed, swiglu, bias_dropout_add, linear_bias_gelu, mlp, mlp_relu, decode (MLP inference "
                  "at M = 1, 16, 128: eager and as a replayed CUDA graph; not in the default set), mlp_fp8 (the MLP fwd+bwd under bf16, fp8_delayed and fp8_current, against the bare FP8 GEMMs; not in the default set), gemm_fp8 (the MLP's six GEMMs "
                  "as TN problems in bf16 and FP8 E4M3, TFLOP/s and the FP8 speed-up; not in the default set), blocks (the "
                  "Llama- and GPT-2-style MLP half-blocks, one sequence each with a residual channel, fwd+bwd in bf16, "
                  "fp8_delayed and fp8_block, against their six GEMMs on bare cuBLASLt; not in the default set), cast_transpose (a linear input's "
                  "FP8 cast + transpose (+ amax) at 8192x4096 and 8192x16384: the linear's forward minus its bare FP8 GEMM; "
                  "fp8_block also with a layernorm and with bias + gelu fused into the cast; not in the default set)");
  cmd->callback([o] { run_bench(*o); });
}

}  // namespace jitfuse::cli
