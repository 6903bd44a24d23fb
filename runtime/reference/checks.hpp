// Argument checks shared by the reference op families (private to runtime/reference/).
// The reference is every GPU test's ground truth: a bad shape must fail loudly, not read OOB.
#pragma once
#include <cstdint>
#include <limits>
#include <span>
#include <stdexcept>
#include <string>

namespace jitfuse::reference::detail {

[[noreturn]] inline void bad_arg(const char* fn, const std::string& what) {
  throw std::invalid_argument(std::string("jitfuse::reference::") + fn + ": " + what);
}

// rows * cols as a size, rejecting negative dims and products that overflow.
inline std::size_t elems(const char* fn, int64_t rows, int64_t cols) {
  if (rows < 0 || cols < 0) {
    bad_arg(fn, "negative shape [" + std::to_string(rows) + ", " + std::to_string(cols) +
                    "]; dims must be >= 0");
  }
  if (cols != 0 && rows > std::numeric_limits<int64_t>::max() / cols) {
    bad_arg(fn,
            "shape [" + std::to_string(rows) + ", " + std::to_string(cols) + "] overflows int64");
  }
  return static_cast<std::size_t>(rows * cols);
}

// Checks that a flattened tensor named `name` holds exactly rows x cols elements.
inline void expect_shape(const char* fn, const char* name, std::span<const double> t, int64_t rows,
                         int64_t cols) {
  const std::size_t want = elems(fn, rows, cols);
  if (t.size() != want) {
    bad_arg(fn, std::string(name) + " has " + std::to_string(t.size()) + " elements, expected [" +
                    std::to_string(rows) + ", " + std::to_string(cols) +
                    "] = " + std::to_string(want) + "; check the shape arguments");
  }
}

}  // namespace jitfuse::reference::detail
