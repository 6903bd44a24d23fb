// A C++ inference host for an AOTInductor package whose graph calls jitfuse::forward: libtorch,
// libjitfuse_torch and libjitfuse only, no Python. Reads one input tensor, runs the package, writes the output.
//   jitfuse_aoti_run MODEL.pt2 SEQUENCES.jfseq INPUT.bin ROWS COLS OUTPUT.bin [TIMED_CALLS]
// INPUT.bin / OUTPUT.bin: raw bfloat16, row-major. TIMED_CALLS > 0 also times run() and its CUDA graph (latency
// per synchronised call, µs per call back to back) and checks the graph's output against run()'s.
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "jitfuse_torch.h"

namespace {

// Median µs from a call to its result on the GPU (each call synchronised), and µs per call of calls in a row.
template <class F>
void time_calls(const char* what, F&& fn, int calls) {
  for (int i = 0; i < 20; ++i) fn();
  c10::cuda::device_synchronize();
  std::vector<double> lat;
  lat.reserve(calls);
  for (int i = 0; i < calls; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    c10::cuda::device_synchronize();
    lat.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
  }
  std::nth_element(lat.begin(), lat.begin() + calls / 2, lat.end());
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < calls; ++i) fn();
  c10::cuda::device_synchronize();
  double b2b = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
  std::printf("jitfuse_aoti_run: %s: latency %.2f us, back-to-back %.2f us per call (%d calls)\n", what,
              lat[calls / 2], b2b, calls);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7) {
    std::cerr << "usage: " << argv[0] << " MODEL.pt2 SEQUENCES.jfseq INPUT.bin ROWS COLS OUTPUT.bin [TIMED_CALLS]\n";
    return 2;
  }
  try {
    const int n = jitfuse_torch::load_definitions(argv[2]);
    const int64_t rows = std::stoll(argv[4]), cols = std::stoll(argv[5]);
    std::ifstream in(argv[3], std::ios::binary);
    std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (static_cast<int64_t>(bytes.size()) != rows * cols * 2) {
      std::cerr << argv[3] << ": " << bytes.size() << " bytes, expected " << rows * cols * 2 << "\n";
      return 2;
    }
    at::Tensor x = at::from_blob(bytes.data(), {rows, cols}, at::TensorOptions().dtype(at::kBFloat16))
                       .to(at::Device(at::kCUDA, 0));
    // run_single_threaded: this host calls run() from one thread, and AOTInductor's multi-threaded runner
    // (a pool of model instances handed out by CUDA event queries) cannot be captured in a CUDA graph.
    torch::inductor::AOTIModelPackageLoader loader(argv[1], "model", /*run_single_threaded=*/true);
    std::vector<at::Tensor> outs = loader.run({x});
    at::Tensor y = outs.at(0).contiguous().to(at::kCPU);
    std::ofstream out(argv[6], std::ios::binary);
    out.write(static_cast<const char*>(y.data_ptr()), y.numel() * y.element_size());
    std::printf("jitfuse_aoti_run: %d sequence definitions, output %lld x %lld\n", n,
                static_cast<long long>(y.size(0)), static_cast<long long>(y.size(1)));
    const int calls = argc > 7 ? std::stoi(argv[7]) : 0;
    if (calls > 0) {
      time_calls("run()", [&] { loader.run({x}); }, calls);
      // The package captured in a CUDA graph (what a server does for batch-1 latency): warm-up on a side stream,
      // one capture, replays. jitfuse's ops are capture-safe once their programs are open (the calls above).
      try {
        c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool();
        at::cuda::CUDAGraph graph;
        std::vector<at::Tensor> graph_out;
        {
          c10::cuda::CUDAStreamGuard guard(side);
          for (int i = 0; i < 3; ++i) loader.run({x});
          side.synchronize();
          graph.capture_begin();
          graph_out = loader.run({x});
          graph.capture_end();
        }
        graph.replay();
        c10::cuda::device_synchronize();
        std::printf("jitfuse_aoti_run: CUDA graph replay output identical: %d\n",
                    graph_out.at(0).contiguous().to(at::kCPU).equal(y) ? 1 : 0);
        time_calls("CUDA graph replay", [&] { graph.replay(); }, calls);
      } catch (const std::exception& e) {
        std::printf("jitfuse_aoti_run: CUDA graph capture failed: %s\n", e.what());
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "jitfuse_aoti_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
