// A C++ inference host for an AOTInductor package whose graph calls jitfuse::forward: libtorch,
// libjitfuse_torch and libjitfuse only, no Python. Reads one input tensor, runs the package, writes the output.
//   jitfuse_aoti_run MODEL.pt2 SEQUENCES.jfseq INPUT.bin ROWS COLS OUTPUT.bin [TIMED_CALLS]
// INPUT.bin / OUTPUT.bin: raw bfloat16, row-major. TIMED_CALLS > 0 also prints the µs per call of run().
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAFunctions.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "jitfuse_torch.h"

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
    torch::inductor::AOTIModelPackageLoader loader(argv[1]);
    std::vector<at::Tensor> outs = loader.run({x});
    at::Tensor y = outs.at(0).contiguous().to(at::kCPU);
    std::ofstream out(argv[6], std::ios::binary);
    out.write(static_cast<const char*>(y.data_ptr()), y.numel() * y.element_size());
    std::printf("jitfuse_aoti_run: %d sequence definitions, output %lld x %lld\n", n,
                static_cast<long long>(y.size(0)), static_cast<long long>(y.size(1)));
    const int calls = argc > 7 ? std::stoi(argv[7]) : 0;
    if (calls > 0) {
      for (int i = 0; i < 20; ++i) loader.run({x});
      c10::cuda::device_synchronize();
      auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < calls; ++i) loader.run({x});
      c10::cuda::device_synchronize();
      double us = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() / calls;
      std::printf("jitfuse_aoti_run: %.2f us per call (%d calls)\n", us, calls);
    }
  } catch (const std::exception& e) {
    std::cerr << "jitfuse_aoti_run: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
