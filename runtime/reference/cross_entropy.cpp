// Float64 reference of cross_entropy (reference.hpp): logsumexp per row with the max subtracted, the smoothed target,
// the z-loss and Gemma-2's soft-capping, forward and backward.
#include <cmath>
#include <limits>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

void check_ce(const char* fn, CSpan x, const std::vector<int64_t>& labels, int64_t rows, int64_t v,
              const CrossEntropyAttrs& a) {
  if (v <= 0) detail::bad_arg(fn, "V = " + std::to_string(v) + "; cross_entropy needs V >= 1");
  detail::expect_shape(fn, "x", x, rows, v);
  if (static_cast<int64_t>(labels.size()) != rows)
    detail::bad_arg(fn,
                    "labels has " + std::to_string(labels.size()) + " entries for " + std::to_string(rows) + " rows");
  if (a.reduction != "mean" && a.reduction != "sum" && a.reduction != "none")
    detail::bad_arg(fn, "reduction '" + a.reduction + "'; expected mean, sum or none");
  if (!(a.label_smoothing >= 0 && a.label_smoothing < 1)) detail::bad_arg(fn, "label_smoothing must be in [0, 1)");
  if (!(a.z_loss >= 0) || !(a.softcap >= 0)) detail::bad_arg(fn, "z_loss and softcap must be >= 0");
}

// z of one row (soft-capped or not).
Vec row_z(CSpan x, int64_t r, int64_t v, double cap) {
  Vec z(x.begin() + r * v, x.begin() + (r + 1) * v);
  if (cap > 0)
    for (double& e : z) e = cap * std::tanh(e / cap);
  return z;
}

double logsumexp(const Vec& z) {
  double m = -std::numeric_limits<double>::infinity();
  for (double e : z) m = std::max(m, e);
  double s = 0;
  for (double e : z) s += std::exp(e - m);
  return m + std::log(s);
}

}  // namespace

CrossEntropyFwd cross_entropy_fwd(CSpan x, const std::vector<int64_t>& labels, int64_t rows, int64_t v,
                                  const CrossEntropyAttrs& a) {
  check_ce("cross_entropy_fwd", x, labels, rows, v, a);
  const double eps = a.label_smoothing;
  CrossEntropyFwd out;
  out.lse.assign(static_cast<size_t>(rows), 0.0);
  Vec per_row(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t y = labels[static_cast<size_t>(r)];
    if (y == a.ignore_index) continue;
    ++out.count;
    const Vec z = row_z(x, r, v, a.softcap);
    const double lse = logsumexp(z);
    double sum_z = 0;
    for (double e : z) sum_z += e;
    const double zy = y >= 0 && y < v ? z[static_cast<size_t>(y)] : kNaN;
    out.lse[static_cast<size_t>(r)] = lse;
    per_row[static_cast<size_t>(r)] =
        lse - (1 - eps) * zy - eps / static_cast<double>(v) * sum_z + a.z_loss * lse * lse;
  }
  if (a.reduction == "none") {
    out.loss = per_row;
  } else {
    double s = 0;
    for (double l : per_row) s += l;
    out.loss = {a.reduction == "sum" ? s : s / static_cast<double>(out.count)};  // 0 / 0 = NaN, as PyTorch
  }
  return out;
}

Vec cross_entropy_bwd(CSpan x, const std::vector<int64_t>& labels, CSpan dy, int64_t rows, int64_t v,
                      const CrossEntropyAttrs& a) {
  check_ce("cross_entropy_bwd", x, labels, rows, v, a);
  const bool none = a.reduction == "none";
  detail::expect_shape("cross_entropy_bwd", "dy", dy, none ? rows : 1, 1);
  int64_t count = 0;
  for (int64_t y : labels) count += y != a.ignore_index;
  const double eps = a.label_smoothing, inv_v = 1.0 / static_cast<double>(v);
  Vec dx(x.size(), 0.0);
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t y = labels[static_cast<size_t>(r)];
    if (y == a.ignore_index) continue;
    const double g = none                   ? dy[static_cast<size_t>(r)]
                     : a.reduction == "sum" ? dy[0]
                                            : dy[0] / static_cast<double>(count);
    const Vec z = row_z(x, r, v, a.softcap);
    const double lse = logsumexp(z);
    const bool in_range = y >= 0 && y < v;
    for (int64_t j = 0; j < v; ++j) {
      const double zj = z[static_cast<size_t>(j)];
      double d = (1 + 2 * a.z_loss * lse) * std::exp(zj - lse) - eps * inv_v - (j == y ? 1 - eps : 0.0);
      if (!in_range) d = kNaN;
      if (a.softcap > 0) d *= 1 - (zj / a.softcap) * (zj / a.softcap);
      dx[static_cast<size_t>(r * v + j)] = g * d;
    }
  }
  return dx;
}

}  // namespace jitfuse::reference
