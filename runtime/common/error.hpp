// The one exception type used inside libjitfuse; the C ABI turns it into a status code.
// Messages say what was wrong, where (file:line:col, op index) and what to do.
#pragma once
#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace jitfuse {

// Mirrors jf_status in jitfuse.h (kept in sync by a static_assert in api/).
enum class Status : int {
  ok = 0,
  invalid_argument = 1,
  parse_error = 2,
  unsupported = 3,
  compile_error = 4,
  cuda_error = 5,
  io_error = 6,
  out_of_memory = 7,
  no_device = 8,
  internal = 9,
  not_prepared = 10,  // a call inside a CUDA-graph capture needs a shape that was never prepared
};

class Error : public std::runtime_error {
 public:
  Error(Status status, std::string message) : std::runtime_error(std::move(message)), status_(status) {}
  Status status() const { return status_; }

 private:
  Status status_;
};

template <typename... Args>
[[noreturn]] void fail(Status status, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(status, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace jitfuse
