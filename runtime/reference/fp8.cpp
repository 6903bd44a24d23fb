// Fp8Reference: the FP8 operand casts of the GPU, on the reference's values, with their own recipe state
// (so calls before a compared one advance it as they advance the GPU's).
#include "reference/fp8.hpp"

#include <algorithm>
#include <cmath>

#include "reference/reference.hpp"

namespace jitfuse::reference {

Fp8Reference::Fp8Reference(const ops::Recipe& r)
    : block_(r.is_block()), delayed_(r.kind == ops::RecipeKind::fp8_delayed), len_(std::max(1, r.amax_history)),
      margin_(std::ldexp(1.0f, r.margin)) {}

namespace {

// The block cast's scale: 2^floor(log2(448 / amax)) in float, at most 2^126; 1 for amax 0 or non-finite.
float block_scale(float amax) {
  if (!(amax > 0.f) || !(amax < 3.0e38f)) return 1.f;
  const float s = std::min(448.f / amax, std::ldexp(1.0f, 126));
  int e = 0;
  std::frexp(s, &e);  // s = f * 2^e, f in [0.5, 1)
  return std::ldexp(1.0f, e - 1);
}

}  // namespace

void Fp8Reference::block_cast(const std::string& tensor, Vec& v, int64_t rows, int64_t cols) const {
  // Block (r0, c0) of size br x bc: its amax in float, its scale, codes = RNE(x * scale) saturated.
  auto cast = [&](int64_t r0, int64_t c0, int64_t br, int64_t bc) {
    float amax = 0.f;
    for (int64_t r = r0; r < std::min(rows, r0 + br); ++r)
      for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c)
        amax = std::max(amax, std::fabs(static_cast<float>(v[static_cast<size_t>(r * cols + c)])));
    const float scale = block_scale(amax), inv = 1.f / scale;
    for (int64_t r = r0; r < std::min(rows, r0 + br); ++r)
      for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c) {
        double& x = v[static_cast<size_t>(r * cols + c)];
        x = e4m3_value(e4m3_bits(static_cast<double>(static_cast<float>(x) * scale))) * static_cast<double>(inv);
      }
  };
  // Weights 128x128; the transposed copies ("_t") 128x1 (128 rows of a column); the rest 1x128.
  const bool weight = tensor == "weight", cols_blocks = tensor == "input_t" || tensor == "grad_output_t";
  const int64_t br = weight || cols_blocks ? 128 : 1, bc = weight || !cols_blocks ? 128 : 1;
  for (int64_t r0 = 0; r0 < rows; r0 += br)
    for (int64_t c0 = 0; c0 < cols; c0 += bc) cast(r0, c0, br, bc);
}

void Fp8Reference::operator()(int op, const std::string& tensor, Vec& v, int64_t rows, int64_t cols) {
  if (block_) return block_cast(tensor, v, rows, cols);
  const bool e5m2 = tensor == "grad_output";
  const float fmax = e5m2 ? 57344.f : 448.f;
  auto& st = state_[{op, tensor}];
  if (st.hist.empty()) st.hist.assign(static_cast<size_t>(len_), 0.f);
  float amax = 0.f;
  for (double x : v) amax = std::max(amax, std::fabs(static_cast<float>(x)));
  const float scale = delayed_ ? st.scale : scale_of(amax, fmax);
  const float scale_inv = 1.f / scale;
  for (double& x : v) {
    const double c = static_cast<double>(static_cast<float>(x) * scale);
    x = (e5m2 ? e5m2_value(e5m2_bits(c)) : e4m3_value(e4m3_bits(c))) * static_cast<double>(scale_inv);
  }
  if (delayed_) {
    for (size_t i = st.hist.size() - 1; i > 0; --i) st.hist[i] = st.hist[i - 1];
    st.hist[0] = amax;
    st.scale = scale_of(*std::max_element(st.hist.begin(), st.hist.end()), fmax);
  }
}

float Fp8Reference::scale_of(float amax, float fmax) const {
  return amax > 0.f && amax < 3.0e38f ? fmax / amax / margin_ : 1.f;
}

}  // namespace jitfuse::reference
