// Float64 reference of bias add and of the linear layer (y = x W^T) with its dgrad and wgrad.
// Plain triple loops: these sizes are test-sized and the point is being obviously right, not fast.
#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {

// y[r, c] = x[r, c] + b[c]
Vec bias_fwd(CSpan x, CSpan b, int64_t rows, int64_t cols) {
  detail::expect_shape("bias_fwd", "x", x, rows, cols);
  detail::expect_shape("bias_fwd", "b", b, 1, cols);
  const auto uc = static_cast<std::size_t>(cols);
  Vec y(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) y[i] = x[i] + b[i % uc];
  return y;
}

// db[c] = sum_r dy[r, c]
Vec col_sum(CSpan dy, int64_t rows, int64_t cols) {
  detail::expect_shape("col_sum", "dy", dy, rows, cols);
  const auto uc = static_cast<std::size_t>(cols);
  Vec db(uc, 0.0);
  for (std::size_t i = 0; i < dy.size(); ++i) db[i % uc] += dy[i];
  return db;
}

// y[i, j] = sum_k x[i, k] W[j, k]
Vec linear_fwd(CSpan x, CSpan w, int64_t m, int64_t n, int64_t k) {
  detail::expect_shape("linear_fwd", "x", x, m, k);
  detail::expect_shape("linear_fwd", "w", w, n, k);
  const auto um = static_cast<std::size_t>(m), un = static_cast<std::size_t>(n),
             uk = static_cast<std::size_t>(k);
  Vec y(um * un, 0.0);
  for (std::size_t i = 0; i < um; ++i) {
    for (std::size_t j = 0; j < un; ++j) {
      double acc = 0.0;
      for (std::size_t p = 0; p < uk; ++p) acc += x[i * uk + p] * w[j * uk + p];
      y[i * un + j] = acc;
    }
  }
  return y;
}

// dx[i, p] = sum_j dy[i, j] W[j, p]
Vec linear_dgrad(CSpan dy, CSpan w, int64_t m, int64_t n, int64_t k) {
  detail::expect_shape("linear_dgrad", "dy", dy, m, n);
  detail::expect_shape("linear_dgrad", "w", w, n, k);
  const auto um = static_cast<std::size_t>(m), un = static_cast<std::size_t>(n),
             uk = static_cast<std::size_t>(k);
  Vec dx(um * uk, 0.0);
  for (std::size_t i = 0; i < um; ++i) {
    for (std::size_t j = 0; j < un; ++j) {
      const double g = dy[i * un + j];
      for (std::size_t p = 0; p < uk; ++p) dx[i * uk + p] += g * w[j * uk + p];
    }
  }
  return dx;
}

// dW[j, p] = sum_i dy[i, j] x[i, p]
Vec linear_wgrad(CSpan dy, CSpan x, int64_t m, int64_t n, int64_t k) {
  detail::expect_shape("linear_wgrad", "dy", dy, m, n);
  detail::expect_shape("linear_wgrad", "x", x, m, k);
  const auto um = static_cast<std::size_t>(m), un = static_cast<std::size_t>(n),
             uk = static_cast<std::size_t>(k);
  Vec dw(un * uk, 0.0);
  for (std::size_t i = 0; i < um; ++i) {
    for (std::size_t j = 0; j < un; ++j) {
      const double g = dy[i * un + j];
      for (std::size_t p = 0; p < uk; ++p) dw[j * uk + p] += g * x[i * uk + p];
    }
  }
  return dw;
}

}  // namespace jitfuse::reference
