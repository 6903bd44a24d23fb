// FP8 recipe-state update launches (update.hpp).
#include "exec/run/fp8/update.hpp"

#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::exec::fp8 {

void launch_update(CUfunction update, const UpdateEntry& e, int history_len, CUstream stream) {
  const void* part = e.partials;
  int parts = e.count;
  void* hist = e.history;
  void* scale = e.scale;
  void* scale_inv = e.scale_inv;
  int len = history_len;
  void* up[] = {&part, &parts, &hist, &len, &scale, &scale_inv};
  cuda::check(cuda::driver().cuLaunchKernel(update, 1, 1, 1, 1024, 1, 1, 0, stream, up, nullptr),
              "cuLaunchKernel(fp8 update)");
}

void UpdateBatch::add(CUfunction kernel, int history_len, const UpdateEntry& e) {
  if (kernel) {
    fn_ = kernel;
    len_ = history_len;
  }
  entries_.push_back(e);
}

void UpdateBatch::launch(CUstream stream) {
  if (entries_.empty()) return;
  if (!fn_) fail(Status::internal, "FP8 recipe-state updates queued in a pass that ran no batched cast");
  const auto& d = cuda::driver();
  for (size_t at = 0; at < entries_.size(); at += codegen::kFp8Batch) {
    codegen::Fp8BatchParams p{};
    p.len = len_;
    for (size_t i = at; i < entries_.size() && i < at + codegen::kFp8Batch; ++i, ++p.n) {
      const UpdateEntry& e = entries_[i];
      p.part[p.n] = e.partials;
      p.hist[p.n] = e.history;
      p.scale[p.n] = e.scale;
      p.scale_inv[p.n] = e.scale_inv;
      p.count[p.n] = e.count;
    }
    void* args[] = {&p};
    cuda::check(d.cuLaunchKernel(fn_, static_cast<unsigned>(p.n), 1, 1, 1024, 1, 1, 0, stream, args, nullptr),
                "cuLaunchKernel(fp8 batch update)");
  }
  entries_.clear();
}

}  // namespace jitfuse::exec::fp8
