// JITFUSE_VERIFY: every fused group's result compared, on the GPU's stream, with the unfused program of the
// same ops run on the same inputs (a shadow run with its own memory); the first difference beyond the
// recipe's tolerance is reported once through the log, with the group, rule, tensor and error.
#pragma once
#include <cuda.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "exec/run/executor.hpp"

namespace jitfuse::exec {

// What a context's verification found so far (shared by its sequences).
struct VerifyLog {
  std::mutex mu;
  int groups_compared = 0;
  int tensors_compared = 0;
  int failures = 0;
  std::string first;  // the first failure, as logged
  std::vector<std::string> skipped;  // why some groups were not compared (once per reason)
  void note_skip(const std::string& why);
};

// The shadow (unfused) run of one call; a training forward hands its state on to the backward.
class Shadow {
 public:
  Shadow(std::shared_ptr<const Prepared> fused, std::shared_ptr<const Prepared> reference, VerifyLog& log,
         Runtime& rt);
  ~Shadow();
  Shadow(const Shadow&) = delete;
  Shadow& operator=(const Shadow&) = delete;

  // The observers a fused call runs with (run_forward / run_backward): they bind this shadow run to the
  // call's tensors and run and compare each group after the fused one. Live for that call only.
  std::unique_ptr<CallObserver> forward_observer(const ForwardArgs& fa);
  std::unique_ptr<CallObserver> backward_observer(const BackwardArgs& ba);

  // Binds the reference program's tensors: the caller's inputs and parameters, scratch for its outputs.
  void begin_forward(const ForwardArgs& fa, const std::vector<void*>& fused_ptr);
  // Before the fused forward group `gi` runs: a copy of its input (its steps may reuse that memory).
  void forward_input(int gi, const std::vector<void*>& fused_ptr, CUstream stream);
  // After the fused forward group `gi` ran: the unfused ops of the group on the same input, compared.
  void forward_group(int gi, const std::vector<void*>& fused_ptr, CUstream stream);
  void begin_backward(const BackwardArgs& ba, const std::vector<void*>& fused_ptr);
  void backward_input(int gi, const std::vector<void*>& fused_ptr, CUstream stream);
  void backward_group(int gi, const std::vector<void*>& fused_ptr, CUstream stream);

 private:
  void* scratch(size_t bytes);
  void bind_pass(bool forward, const std::vector<void*>& fused_ptr);
  void run_group(bool forward, int gi, const std::vector<void*>& fused_ptr, CUstream stream);
  void copy_in(int fused_id, int ref_id, const std::vector<void*>& fused_ptr, CUstream stream);
  void run_ops(bool forward, int b, int e, CUstream stream);
  void compare(const char* pass, int gi, const std::string& tensor, const void* fused, const void* ref, int buffer,
               bool gemm, CUstream stream);

  std::shared_ptr<const Prepared> fused_, ref_;
  VerifyLog& log_;
  Runtime& rt_;
  std::vector<void*> ptr_;  // the reference program's pointers
  std::vector<void*> owned_;
  bool failed_ = false;
};

}  // namespace jitfuse::exec
