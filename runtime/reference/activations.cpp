// Float64 reference of the pointwise activations and the gated (GLU) ops, forward and backward.
// Derivatives are closed-form so the finite-difference tests check them independently.
#include <cmath>
#include <numbers>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

enum class Act { gelu_tanh, gelu_erf, relu, silu, qgelu, srelu, identity };

// Resolved once per call so the gated loops do not compare strings per element.
Act parse_act(const char* fn, const std::string& kind) {
  if (kind == "gelu_tanh") return Act::gelu_tanh;
  if (kind == "gelu_erf") return Act::gelu_erf;
  if (kind == "relu") return Act::relu;
  if (kind == "silu") return Act::silu;
  if (kind == "qgelu") return Act::qgelu;
  if (kind == "srelu") return Act::srelu;
  if (kind == "identity") return Act::identity;
  detail::bad_arg(fn,
                  "unknown activation kind '" + kind +
                      "'; expected one of gelu_tanh, gelu_erf, relu, silu, qgelu, srelu, identity");
}

// The gated kinds name their activation; the linear half is always b.
Act parse_gated(const char* fn, const std::string& kind) {
  if (kind == "swiglu") return Act::silu;
  if (kind == "geglu") return Act::gelu_tanh;
  if (kind == "reglu") return Act::relu;
  detail::bad_arg(fn, "unknown gated kind '" + kind + "'; expected one of swiglu, geglu, reglu");
}

// exp(-x) overflowing to inf for very negative x gives 1/inf = 0, so this form needs no split.
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

constexpr double kGeluC = 0.7978845608028654;  // sqrt(2/pi)
constexpr double kGeluA = 0.044715;
constexpr double kQgeluK = 1.702;

double fwd(Act a, double x) {
  switch (a) {
    case Act::gelu_tanh:  // 0.5 x (1 + tanh(c (x + 0.044715 x^3)))
      return 0.5 * x * (1.0 + std::tanh(kGeluC * (x + kGeluA * x * x * x)));
    case Act::gelu_erf:  // 0.5 x (1 + erf(x / sqrt2))
      return 0.5 * x * (1.0 + std::erf(x * std::numbers::sqrt2 / 2.0));
    case Act::relu:
      return x > 0 ? x : 0.0;
    case Act::silu:  // x sigmoid(x)
      return x * sigmoid(x);
    case Act::qgelu:  // x sigmoid(1.702 x)
      return x * sigmoid(kQgeluK * x);
    case Act::srelu:  // relu(x)^2
      return x > 0 ? x * x : 0.0;
    case Act::identity:
      return x;
  }
  return 0.0;  // unreachable: every enumerator is handled above
}

// f'(x); at the relu/srelu kink x == 0 the derivative is taken as 0 (matches the device templates).
double deriv(Act a, double x) {
  switch (a) {
    case Act::gelu_tanh: {
      // d/dx 0.5x(1+t) = 0.5(1+t) + 0.5x(1-t^2) c (1 + 3*0.044715 x^2)
      const double t = std::tanh(kGeluC * (x + kGeluA * x * x * x));
      return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kGeluC * (1.0 + 3.0 * kGeluA * x * x);
    }
    case Act::gelu_erf: {
      // Phi(x) + x phi(x)
      const double cdf = 0.5 * (1.0 + std::erf(x * std::numbers::sqrt2 / 2.0));
      const double pdf = std::exp(-0.5 * x * x) * std::numbers::inv_sqrtpi / std::numbers::sqrt2;
      return cdf + x * pdf;
    }
    case Act::relu:
      return x > 0 ? 1.0 : 0.0;
    case Act::silu: {  // s (1 + x (1 - s))
      const double s = sigmoid(x);
      return s * (1.0 + x * (1.0 - s));
    }
    case Act::qgelu: {  // s + k x s (1 - s), s = sigmoid(k x)
      const double s = sigmoid(kQgeluK * x);
      return s + kQgeluK * x * s * (1.0 - s);
    }
    case Act::srelu:
      return x > 0 ? 2.0 * x : 0.0;
    case Act::identity:
      return 1.0;
  }
  return 0.0;  // unreachable
}

}  // namespace

double act_fwd(const std::string& kind, double x) { return fwd(parse_act("act_fwd", kind), x); }

double act_bwd(const std::string& kind, double x, double dy) {
  return deriv(parse_act("act_bwd", kind), x) * dy;
}

// y[r, j] = act(x[r, j]) * x[r, n + j]
Vec gated_fwd(const std::string& kind, CSpan x, int64_t rows, int64_t n) {
  const Act a = parse_gated("gated_fwd", kind);
  detail::expect_shape("gated_fwd", "x", x, rows, detail::elems("gated_fwd", n, 2));
  const auto un = static_cast<std::size_t>(n);
  Vec y(detail::elems("gated_fwd", rows, n));
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    const double* xa = x.data() + r * 2 * un;
    const double* xb = xa + un;
    for (std::size_t j = 0; j < un; ++j) y[r * un + j] = fwd(a, xa[j]) * xb[j];
  }
  return y;
}

// da = act'(a) * b * dy (first half), db = act(a) * dy (second half)
Vec gated_bwd(const std::string& kind, CSpan x, CSpan dy, int64_t rows, int64_t n) {
  const Act a = parse_gated("gated_bwd", kind);
  detail::expect_shape("gated_bwd", "x", x, rows, detail::elems("gated_bwd", n, 2));
  detail::expect_shape("gated_bwd", "dy", dy, rows, n);
  const auto un = static_cast<std::size_t>(n);
  Vec dx(x.size());
  for (std::size_t r = 0; r < static_cast<std::size_t>(rows); ++r) {
    const double* xa = x.data() + r * 2 * un;
    const double* xb = xa + un;
    const double* g = dy.data() + r * un;
    double* da = dx.data() + r * 2 * un;
    double* db = da + un;
    for (std::size_t j = 0; j < un; ++j) {
      da[j] = deriv(a, xa[j]) * xb[j] * g[j];
      db[j] = fwd(a, xa[j]) * g[j];
    }
  }
  return dx;
}

}  // namespace jitfuse::reference
