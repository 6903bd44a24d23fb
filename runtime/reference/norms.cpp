// Float64 reference of layernorm and rmsnorm over the last dim, forward and backward.
// Statistics use two passes (mean, then centred squares) so the reference has no cancellation.
#include <cmath>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

// Shared validation; norms divide by cols, so an empty row is an error rather than a NaN.
void check_norm(const char* fn, CSpan x, CSpan gamma, int64_t rows, int64_t cols, double eps) {
  if (cols <= 0) detail::bad_arg(fn, "cols = " + std::to_string(cols) + "; a norm needs cols >= 1");
  if (!(eps >= 0.0) || !std::isfinite(eps)) {
    detail::bad_arg(fn, "eps = " + std::to_string(eps) + "; eps must be finite and >= 0");
  }
  detail::expect_shape(fn, "x", x, rows, cols);
  detail::expect_shape(fn, "gamma", gamma, 1, cols);
}

// g = zero_centered ? 1 + gamma : gamma; the gradient w.r.t. gamma equals the one w.r.t. g.
Vec effective_gamma(CSpan gamma, bool zero_centered) {
  Vec g(gamma.begin(), gamma.end());
  if (zero_centered) {
    for (double& v : g) v += 1.0;
  }
  return g;
}

// Per-row mean (zero when !center) and rstd = 1/sqrt(mean((x - mean)^2) + eps).
void row_stats(CSpan x, std::size_t r, std::size_t c, double eps, bool center, double& mean,
               double& rstd) {
  const double* xr = x.data() + r * c;
  mean = 0.0;
  if (center) {
    for (std::size_t j = 0; j < c; ++j) mean += xr[j];
    mean /= static_cast<double>(c);
  }
  double ss = 0.0;
  for (std::size_t j = 0; j < c; ++j) ss += (xr[j] - mean) * (xr[j] - mean);
  rstd = 1.0 / std::sqrt(ss / static_cast<double>(c) + eps);
}

// y = (x - mean) * rstd * g (+ beta); rmsnorm is the same with mean forced to 0 and no beta.
NormFwd norm_fwd(const char* fn, CSpan x, CSpan gamma, CSpan beta, int64_t rows, int64_t cols,
                 double eps, bool zero_centered, bool center) {
  check_norm(fn, x, gamma, rows, cols, eps);
  if (center) detail::expect_shape(fn, "beta", beta, 1, cols);
  const auto ur = static_cast<std::size_t>(rows), uc = static_cast<std::size_t>(cols);
  const Vec g = effective_gamma(gamma, zero_centered);
  NormFwd out{Vec(x.size()), Vec(ur, 0.0), Vec(ur)};
  for (std::size_t r = 0; r < ur; ++r) {
    row_stats(x, r, uc, eps, center, out.mean[r], out.rstd[r]);
    for (std::size_t j = 0; j < uc; ++j) {
      const double xhat = (x[r * uc + j] - out.mean[r]) * out.rstd[r];
      out.y[r * uc + j] = xhat * g[j] + (center ? beta[j] : 0.0);
    }
  }
  return out;
}

// With dxhat = dy * g:
//   layernorm: dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
//   rmsnorm:   dx = rstd * (dxhat               - xhat * mean(dxhat * xhat))
// The mean(dxhat) term comes from d(mean)/dx, which rmsnorm does not have.
NormBwd norm_bwd(const char* fn, CSpan x, CSpan gamma, CSpan dy, int64_t rows, int64_t cols,
                 double eps, bool zero_centered, bool center) {
  check_norm(fn, x, gamma, rows, cols, eps);
  detail::expect_shape(fn, "dy", dy, rows, cols);
  const auto ur = static_cast<std::size_t>(rows), uc = static_cast<std::size_t>(cols);
  const Vec g = effective_gamma(gamma, zero_centered);
  NormBwd out{Vec(x.size()), Vec(uc, 0.0), center ? Vec(uc, 0.0) : Vec{}};
  Vec xhat(uc);
  for (std::size_t r = 0; r < ur; ++r) {
    double mean = 0.0, rstd = 0.0;
    row_stats(x, r, uc, eps, center, mean, rstd);
    double sum_dxhat = 0.0, sum_dxhat_xhat = 0.0;
    for (std::size_t j = 0; j < uc; ++j) {
      const double d = dy[r * uc + j];
      xhat[j] = (x[r * uc + j] - mean) * rstd;
      sum_dxhat += d * g[j];
      sum_dxhat_xhat += d * g[j] * xhat[j];
      out.dgamma[j] += d * xhat[j];
      if (center) out.dbeta[j] += d;
    }
    const double m1 = center ? sum_dxhat / static_cast<double>(uc) : 0.0;
    const double m2 = sum_dxhat_xhat / static_cast<double>(uc);
    for (std::size_t j = 0; j < uc; ++j) {
      out.dx[r * uc + j] = rstd * (dy[r * uc + j] * g[j] - m1 - xhat[j] * m2);
    }
  }
  return out;
}

}  // namespace

NormFwd layernorm_fwd(CSpan x, CSpan gamma, CSpan beta, int64_t rows, int64_t cols, double eps,
                      bool zero_centered) {
  return norm_fwd("layernorm_fwd", x, gamma, beta, rows, cols, eps, zero_centered, true);
}

NormBwd layernorm_bwd(CSpan x, CSpan gamma, CSpan dy, int64_t rows, int64_t cols, double eps,
                      bool zero_centered) {
  return norm_bwd("layernorm_bwd", x, gamma, dy, rows, cols, eps, zero_centered, true);
}

NormFwd rmsnorm_fwd(CSpan x, CSpan gamma, int64_t rows, int64_t cols, double eps,
                    bool zero_centered) {
  return norm_fwd("rmsnorm_fwd", x, gamma, {}, rows, cols, eps, zero_centered, false);
}

NormBwd rmsnorm_bwd(CSpan x, CSpan gamma, CSpan dy, int64_t rows, int64_t cols, double eps,
                    bool zero_centered) {
  return norm_bwd("rmsnorm_bwd", x, gamma, dy, rows, cols, eps, zero_centered, false);
}

}  // namespace jitfuse::reference
