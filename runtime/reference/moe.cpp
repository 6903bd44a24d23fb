// Float64 reference of the mixture-of-experts ops (issue 43): routing top-k tokens to expert-contiguous
// rows and back, grouped linears over those rows, and the gated op scaled per row. Plain loops: the ground
// truth the grouped GEMMs and the permute kernels are checked against.
#include <algorithm>
#include <numeric>
#include <string>

#include "reference/checks.hpp"
#include "reference/reference.hpp"

namespace jitfuse::reference {
namespace {

int64_t check_splits(const char* fn, std::span<const int64_t> splits, int64_t rows) {
  int64_t sum = 0;
  for (size_t g = 0; g < splits.size(); ++g) {
    if (splits[g] < 0) detail::bad_arg(fn, "split " + std::to_string(g) + " is negative (" + std::to_string(splits[g]) + ")");
    sum += splits[g];
  }
  if (rows >= 0 && sum != rows)
    detail::bad_arg(fn, "the splits sum to " + std::to_string(sum) + " rows, the tensor has " + std::to_string(rows));
  return sum;
}

// f(g, first row, rows) for each group in order.
template <typename F>
void each_group(std::span<const int64_t> splits, F&& f) {
  int64_t row0 = 0;
  for (size_t g = 0; g < splits.size(); ++g) {
    f(static_cast<int64_t>(g), row0, splits[g]);
    row0 += splits[g];
  }
}

void check_routing(const char* fn, const MoeRouting& r) {
  if (static_cast<int64_t>(r.dest.size()) != r.tokens * r.topk)
    detail::bad_arg(fn, "the routing's dest has " + std::to_string(r.dest.size()) + " entries, expected tokens x topk");
}

}  // namespace

MoeRouting moe_route(std::span<const int64_t> idx, int64_t tokens, int64_t topk, int64_t experts, int64_t capacity) {
  const char* fn = "moe_route";
  detail::elems(fn, tokens, topk);
  if (experts <= 0) detail::bad_arg(fn, "experts must be positive (got " + std::to_string(experts) + ")");
  if (static_cast<int64_t>(idx.size()) != tokens * topk)
    detail::bad_arg(fn, "idx has " + std::to_string(idx.size()) + " entries, expected tokens x topk = " +
                            std::to_string(tokens * topk));
  MoeRouting r;
  r.tokens = tokens;
  r.topk = topk;
  r.experts = experts;
  r.splits.assign(static_cast<size_t>(experts), 0);
  r.dest.assign(idx.size(), -1);
  std::vector<int64_t> slot_in_expert(idx.size(), -1);
  for (size_t i = 0; i < idx.size(); ++i) {  // (token, slot) order: first come, first kept
    const int64_t e = idx[i];
    if (e < 0 || e >= experts)
      detail::bad_arg(fn, "token " + std::to_string(i / static_cast<size_t>(topk)) + " slot " +
                              std::to_string(i % static_cast<size_t>(topk)) + " routes to expert " + std::to_string(e) +
                              ", outside [0, " + std::to_string(experts) + ")");
    if (capacity >= 0 && r.splits[static_cast<size_t>(e)] >= capacity) continue;  // dropped
    slot_in_expert[i] = r.splits[static_cast<size_t>(e)]++;
  }
  std::vector<int64_t> start(static_cast<size_t>(experts), 0);
  for (int64_t e = 1; e < experts; ++e) start[static_cast<size_t>(e)] = start[static_cast<size_t>(e - 1)] + r.splits[static_cast<size_t>(e - 1)];
  const int64_t rows = std::accumulate(r.splits.begin(), r.splits.end(), int64_t{0});
  r.src.assign(static_cast<size_t>(rows), -1);
  for (size_t i = 0; i < idx.size(); ++i) {
    if (slot_in_expert[i] < 0) continue;
    const int64_t row = start[static_cast<size_t>(idx[i])] + slot_in_expert[i];
    r.dest[i] = row;
    r.src[static_cast<size_t>(row)] = static_cast<int64_t>(i) / topk;
  }
  return r;
}

MoeRouting moe_pad_routing(const MoeRouting& r, int64_t capacity) {
  if (capacity < 1) detail::bad_arg("moe_pad_routing", "the padded layout needs a capacity >= 1");
  MoeRouting p = r;
  p.src.assign(static_cast<size_t>(r.experts * capacity), -1);
  std::vector<int64_t> padded_row(r.src.size());  // packed row -> its padded row
  int64_t start = 0;
  for (int64_t e = 0; e < r.experts; ++e) {  // packed rows [start, start + splits[e]) -> [e C, e C + splits[e])
    const int64_t n = r.splits[static_cast<size_t>(e)];
    for (int64_t q = 0; q < n; ++q) {
      padded_row[static_cast<size_t>(start + q)] = e * capacity + q;
      p.src[static_cast<size_t>(e * capacity + q)] = r.src[static_cast<size_t>(start + q)];
    }
    start += n;
  }
  for (size_t i = 0; i < r.dest.size(); ++i)
    if (r.dest[i] >= 0) p.dest[i] = padded_row[static_cast<size_t>(r.dest[i])];
  return p;
}

Vec moe_permute_fwd(CSpan x, const MoeRouting& r, int64_t hidden) {
  const char* fn = "moe_permute_fwd";
  detail::expect_shape(fn, "x", x, r.tokens, hidden);
  Vec y(detail::elems(fn, r.rows(), hidden));
  for (int64_t row = 0; row < r.rows(); ++row) {
    const int64_t t = r.src[static_cast<size_t>(row)];
    if (t < 0) continue;  // a padded row: zero
    for (int64_t c = 0; c < hidden; ++c) y[static_cast<size_t>(row * hidden + c)] = x[static_cast<size_t>(t * hidden + c)];
  }
  return y;
}

Vec moe_permute_bwd(CSpan dy, const MoeRouting& r, int64_t hidden) {
  const char* fn = "moe_permute_bwd";
  check_routing(fn, r);
  detail::expect_shape(fn, "dy", dy, r.rows(), hidden);
  Vec dx(detail::elems(fn, r.tokens, hidden), 0.0);
  for (size_t i = 0; i < r.dest.size(); ++i) {
    if (r.dest[i] < 0) continue;
    const int64_t t = static_cast<int64_t>(i) / r.topk;
    for (int64_t c = 0; c < hidden; ++c) dx[static_cast<size_t>(t * hidden + c)] += dy[static_cast<size_t>(r.dest[i] * hidden + c)];
  }
  return dx;
}

Vec moe_unpermute_fwd(CSpan y, CSpan probs, const MoeRouting& r, int64_t hidden) {
  const char* fn = "moe_unpermute_fwd";
  check_routing(fn, r);
  detail::expect_shape(fn, "y", y, r.rows(), hidden);
  detail::expect_shape(fn, "probs", probs, r.tokens, r.topk);
  Vec out(detail::elems(fn, r.tokens, hidden), 0.0);
  for (size_t i = 0; i < r.dest.size(); ++i) {
    if (r.dest[i] < 0) continue;
    const int64_t t = static_cast<int64_t>(i) / r.topk;
    for (int64_t c = 0; c < hidden; ++c)
      out[static_cast<size_t>(t * hidden + c)] += probs[i] * y[static_cast<size_t>(r.dest[i] * hidden + c)];
  }
  return out;
}

MoeUnpermuteBwd moe_unpermute_bwd(CSpan dout, CSpan y, CSpan probs, const MoeRouting& r, int64_t hidden) {
  const char* fn = "moe_unpermute_bwd";
  check_routing(fn, r);
  detail::expect_shape(fn, "dout", dout, r.tokens, hidden);
  detail::expect_shape(fn, "y", y, r.rows(), hidden);
  detail::expect_shape(fn, "probs", probs, r.tokens, r.topk);
  MoeUnpermuteBwd b;
  b.dy.assign(detail::elems(fn, r.rows(), hidden), 0.0);
  b.dprobs.assign(r.dest.size(), 0.0);
  for (size_t i = 0; i < r.dest.size(); ++i) {
    if (r.dest[i] < 0) continue;
    const int64_t t = static_cast<int64_t>(i) / r.topk;
    double d = 0;
    for (int64_t c = 0; c < hidden; ++c) {
      const size_t o = static_cast<size_t>(t * hidden + c), p = static_cast<size_t>(r.dest[i] * hidden + c);
      b.dy[p] = probs[i] * dout[o];
      d += dout[o] * y[p];
    }
    b.dprobs[i] = d;
  }
  return b;
}

Vec grouped_linear_fwd(CSpan x, CSpan w, std::span<const int64_t> splits, int64_t n, int64_t k) {
  const char* fn = "grouped_linear_fwd";
  const int64_t m = check_splits(fn, splits, -1), g = static_cast<int64_t>(splits.size());
  detail::expect_shape(fn, "x", x, m, k);
  detail::expect_shape(fn, "w", w, g * n, k);
  Vec y(detail::elems(fn, m, n), 0.0);
  each_group(splits, [&](int64_t gi, int64_t row0, int64_t rows) {
    const Vec yg = linear_fwd(x.subspan(static_cast<size_t>(row0 * k), static_cast<size_t>(rows * k)),
                              w.subspan(static_cast<size_t>(gi * n * k), static_cast<size_t>(n * k)), rows, n, k);
    std::copy(yg.begin(), yg.end(), y.begin() + row0 * n);
  });
  return y;
}

Vec grouped_linear_dgrad(CSpan dy, CSpan w, std::span<const int64_t> splits, int64_t n, int64_t k) {
  const char* fn = "grouped_linear_dgrad";
  const int64_t m = check_splits(fn, splits, -1), g = static_cast<int64_t>(splits.size());
  detail::expect_shape(fn, "dy", dy, m, n);
  detail::expect_shape(fn, "w", w, g * n, k);
  Vec dx(detail::elems(fn, m, k), 0.0);
  each_group(splits, [&](int64_t gi, int64_t row0, int64_t rows) {
    const Vec d = linear_dgrad(dy.subspan(static_cast<size_t>(row0 * n), static_cast<size_t>(rows * n)),
                               w.subspan(static_cast<size_t>(gi * n * k), static_cast<size_t>(n * k)), rows, n, k);
    std::copy(d.begin(), d.end(), dx.begin() + row0 * k);
  });
  return dx;
}

Vec grouped_linear_wgrad(CSpan dy, CSpan x, std::span<const int64_t> splits, int64_t n, int64_t k) {
  const char* fn = "grouped_linear_wgrad";
  const int64_t m = check_splits(fn, splits, -1), g = static_cast<int64_t>(splits.size());
  detail::expect_shape(fn, "dy", dy, m, n);
  detail::expect_shape(fn, "x", x, m, k);
  Vec dw(detail::elems(fn, g * n, k), 0.0);  // an empty group's gradient is zero
  each_group(splits, [&](int64_t gi, int64_t row0, int64_t rows) {
    const Vec d = linear_wgrad(dy.subspan(static_cast<size_t>(row0 * n), static_cast<size_t>(rows * n)),
                               x.subspan(static_cast<size_t>(row0 * k), static_cast<size_t>(rows * k)), rows, n, k);
    std::copy(d.begin(), d.end(), dw.begin() + gi * n * k);
  });
  return dw;
}

Vec grouped_bias_fwd(CSpan y, CSpan b, std::span<const int64_t> splits, int64_t n) {
  const char* fn = "grouped_bias_fwd";
  const int64_t m = check_splits(fn, splits, -1), g = static_cast<int64_t>(splits.size());
  detail::expect_shape(fn, "y", y, m, n);
  detail::expect_shape(fn, "b", b, g, n);
  Vec out(y.begin(), y.end());
  each_group(splits, [&](int64_t gi, int64_t row0, int64_t rows) {
    for (int64_t row = row0; row < row0 + rows; ++row)
      for (int64_t c = 0; c < n; ++c) out[static_cast<size_t>(row * n + c)] += b[static_cast<size_t>(gi * n + c)];
  });
  return out;
}

Vec grouped_col_sum(CSpan dy, std::span<const int64_t> splits, int64_t n) {
  const char* fn = "grouped_col_sum";
  const int64_t m = check_splits(fn, splits, -1), g = static_cast<int64_t>(splits.size());
  detail::expect_shape(fn, "dy", dy, m, n);
  Vec db(detail::elems(fn, g, n), 0.0);
  each_group(splits, [&](int64_t gi, int64_t row0, int64_t rows) {
    for (int64_t row = row0; row < row0 + rows; ++row)
      for (int64_t c = 0; c < n; ++c) db[static_cast<size_t>(gi * n + c)] += dy[static_cast<size_t>(row * n + c)];
  });
  return db;
}

Vec scaled_gated_fwd(const std::string& kind, CSpan x, CSpan scale, int64_t rows, int64_t n) {
  detail::expect_shape("scaled_gated_fwd", "scale", scale, rows, 1);
  Vec y = gated_fwd(kind, x, rows, n);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) y[static_cast<size_t>(r * n + c)] *= scale[static_cast<size_t>(r)];
  return y;
}

ScaledGatedBwd scaled_gated_bwd(const std::string& kind, CSpan x, CSpan scale, CSpan dy, int64_t rows, int64_t n) {
  const char* fn = "scaled_gated_bwd";
  detail::expect_shape(fn, "scale", scale, rows, 1);
  detail::expect_shape(fn, "dy", dy, rows, n);
  ScaledGatedBwd b;
  const Vec g = gated_fwd(kind, x, rows, n);  // act(a) * b, unscaled
  Vec sdy(dy.begin(), dy.end());
  b.dscale.assign(static_cast<size_t>(rows), 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) {
      const size_t i = static_cast<size_t>(r * n + c);
      b.dscale[static_cast<size_t>(r)] += dy[i] * g[i];
      sdy[i] *= scale[static_cast<size_t>(r)];
    }
  b.dx = gated_bwd(kind, x, sdy, rows, n);
  return b;
}

}  // namespace jitfuse::reference
