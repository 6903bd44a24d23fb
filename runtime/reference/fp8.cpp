// Fp8Reference: the FP8 operand casts of the GPU, on the reference's values, with their own recipe state
// (so calls before a compared one advance it as they advance the GPU's).
#include "reference/fp8.hpp"

#include <algorithm>
#include <cmath>

#include "reference/reference.hpp"

namespace jitfuse::reference {

Fp8Reference::Fp8Reference(const ops::Recipe& r)
    : delayed_(r.kind == ops::RecipeKind::fp8_delayed), len_(std::max(1, r.amax_history)),
      margin_(std::ldexp(1.0f, r.margin)) {}

void Fp8Reference::operator()(int op, const std::string& tensor, Vec& v) {
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
