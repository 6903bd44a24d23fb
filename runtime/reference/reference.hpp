// Float64 CPU reference of every basic op, forward and backward. Row-major tensors flattened to
// rows x cols (the last dim is cols). These are the ground truth for every GPU test.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace jitfuse::reference {

using Vec = std::vector<double>;
using CSpan = std::span<const double>;

// ---- pointwise activations: y = f(x); dx = f'(x) * dy ----
// kinds: "gelu_tanh", "gelu_erf", "relu", "silu", "qgelu" (x*sigmoid(1.702x)), "srelu" (relu(x)^2),
//        "identity"
double act_fwd(const std::string& kind, double x);
double act_bwd(const std::string& kind, double x, double dy);  // x is the op's INPUT

// ---- gated: input [rows, 2n] split in halves a = x[:, :n], b = x[:, n:]; y = act(a) * b ----
// kinds: "swiglu" (silu), "geglu" (gelu_tanh), "reglu" (relu)
Vec gated_fwd(const std::string& kind, CSpan x, int64_t rows, int64_t n);
Vec gated_bwd(const std::string& kind, CSpan x, CSpan dy, int64_t rows, int64_t n);  // dx [rows, 2n]

// ---- bias: y = x + b[col]; db = sum_rows dy ----
Vec bias_fwd(CSpan x, CSpan b, int64_t rows, int64_t cols);
Vec col_sum(CSpan dy, int64_t rows, int64_t cols);

// ---- linear: y = x W^T, x [M,K], W [N,K] ----
Vec linear_fwd(CSpan x, CSpan w, int64_t m, int64_t n, int64_t k);
Vec linear_dgrad(CSpan dy, CSpan w, int64_t m, int64_t n, int64_t k);  // dx = dy W   [M,K]
Vec linear_wgrad(CSpan dy, CSpan x, int64_t m, int64_t n, int64_t k);  // dW = dy^T x [N,K]

// ---- norms over the last dim. gamma_eff = zero_centered ? 1 + gamma : gamma ----
struct NormFwd {
  Vec y, mean, rstd;  // mean is all zeros for rmsnorm
};
struct NormBwd {
  Vec dx, dgamma, dbeta;  // dbeta empty for rmsnorm
};
NormFwd layernorm_fwd(CSpan x, CSpan gamma, CSpan beta, int64_t rows, int64_t cols, double eps,
                      bool zero_centered);
NormBwd layernorm_bwd(CSpan x, CSpan gamma, CSpan dy, int64_t rows, int64_t cols, double eps,
                      bool zero_centered);
NormFwd rmsnorm_fwd(CSpan x, CSpan gamma, int64_t rows, int64_t cols, double eps, bool zero_centered);
NormBwd rmsnorm_bwd(CSpan x, CSpan gamma, CSpan dy, int64_t rows, int64_t cols, double eps,
                    bool zero_centered);

// ---- cross_entropy over rows of logits x [rows, V] with integer labels y [rows] ----
// z = softcap > 0 ? softcap tanh(x / softcap) : x; lse_r = log sum_j exp(z_rj);
// loss_r = lse_r - (1 - eps) z_r[y_r] - (eps / V) sum_j z_rj + z_loss lse_r^2 (eps = label_smoothing),
// 0 for rows whose label is ignore_index; a label outside [0, V) otherwise gives NaN.
// reduction "mean": sum_r loss_r / (rows not ignored) (NaN when every row is ignored, as PyTorch);
// "sum": sum_r loss_r; "none": loss_r per row.
struct CrossEntropyAttrs {
  std::string reduction = "mean";
  int64_t ignore_index = -100;
  double label_smoothing = 0, z_loss = 0, softcap = 0;
};
struct CrossEntropyFwd {
  Vec loss;      // [rows] ("none") or [1]
  Vec lse;       // [rows], 0 for ignored rows
  int64_t count = 0;  // rows not ignored
};
CrossEntropyFwd cross_entropy_fwd(CSpan x, const std::vector<int64_t>& labels, int64_t rows, int64_t v,
                                  const CrossEntropyAttrs& a);
// dx [rows, V] for the upstream gradient dy ([rows] for "none", [1] otherwise):
// dz_rj = g_r ((1 + 2 z_loss lse_r) softmax(z_r)_j - (1 - eps) [j == y_r] - eps / V), g_r = dy_r ("none"),
// dy_0 ("sum") or dy_0 / count ("mean"); dx = dz (1 - (z / softcap)^2) with softcap; 0 for ignored rows.
Vec cross_entropy_bwd(CSpan x, const std::vector<int64_t>& labels, CSpan dy, int64_t rows, int64_t v,
                      const CrossEntropyAttrs& a);

// ---- dropout: Philox4x32-10, bit-exact with templates/ops/dropout.cuh ----
// Element i (flattened row-major index): c = i / 4 (uint64); r = philox4x32_10(
//   counter = {lo32(c), hi32(c), lo32(offset), hi32(offset)}, key = {lo32(seed), hi32(seed)})[i % 4];
// kept iff p == 0 or r < keep_threshold(p).
uint32_t keep_threshold(double p);  // floor((1-p) * 2^32), saturated to 0xffffffff
std::vector<uint8_t> dropout_mask(uint64_t seed, uint64_t offset, int64_t numel, double p);  // 1 = kept
Vec dropout_fwd(CSpan x, const std::vector<uint8_t>& mask, double p);   // y = x * mask / (1-p)
Vec dropout_bwd(CSpan dy, const std::vector<uint8_t>& mask, double p);  // dx = dy * mask / (1-p)
void philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]);

// ---- rounding to a storage dtype ("fp32", "fp16", "bf16"), round-to-nearest-even ----
double round_to(const std::string& dtype, double v);
// FP8 E4M3 (the "fn" variant: no infinities, NaN = S.1111.111, max 448): round to nearest even, saturate.
uint8_t e4m3_bits(double v);
double e4m3_value(uint8_t bits);
// FP8 E5M2 (IEEE-like: infinities and NaNs, max finite 57344): round to nearest even, saturate to +-57344
// (the device's satfinite casts and cuBLASLt's FP8 outputs; NaN stays NaN).
uint8_t e5m2_bits(double v);
double e5m2_value(uint8_t bits);
void round_all(const std::string& dtype, Vec& v);
// ---- mixture of experts (issue 43): token routing, grouped linears, the scaled gated op ----
// Routing of T tokens to top-k of E experts: idx [T, k] expert ids. The permuted tensor is expert-contiguous:
// expert 0's rows first, each expert's rows in (token, slot) order. With capacity >= 0 an expert keeps its
// first `capacity` rows in that order and drops the rest (dest -1; they add nothing when combined).
struct MoeRouting {
  int64_t tokens = 0, topk = 0, experts = 0;
  std::vector<int64_t> splits;  // [E] rows per expert (after the capacity)
  std::vector<int64_t> dest;    // [T * k] (t, j) -> its row in the permuted tensor, -1 if dropped
  std::vector<int64_t> src;     // [rows] permuted row -> its token
  int64_t rows() const { return static_cast<int64_t>(src.size()); }
};
MoeRouting moe_route(std::span<const int64_t> idx, int64_t tokens, int64_t topk, int64_t experts,
                     int64_t capacity = -1);
// The capacity layout of a routing made with `capacity` >= 1: expert e's rows at [e C, e C + splits[e]) of E C rows
// (src -1 for the rows between: zero in the permuted tensor).
MoeRouting moe_pad_routing(const MoeRouting& r, int64_t capacity);
Vec moe_permute_fwd(CSpan x, const MoeRouting& r, int64_t hidden);   // [rows, H]: y[dest(t, j)] = x[t]
Vec moe_permute_bwd(CSpan dy, const MoeRouting& r, int64_t hidden);  // [T, H]: dx[t] = sum_j dy[dest(t, j)]
// out[t] = sum_j probs[t, j] y[dest(t, j)]; probs [T, k].
Vec moe_unpermute_fwd(CSpan y, CSpan probs, const MoeRouting& r, int64_t hidden);
struct MoeUnpermuteBwd {
  Vec dy;      // [rows, H]: dy[dest(t, j)] = probs[t, j] dout[t]
  Vec dprobs;  // [T, k]: <dout[t], y[dest(t, j)]>, 0 where dropped
};
MoeUnpermuteBwd moe_unpermute_bwd(CSpan dout, CSpan y, CSpan probs, const MoeRouting& r, int64_t hidden);
// Grouped linear: rows group-contiguous by `splits` (sum = M), weight [G, N, K]; group g: y_g = x_g W_g^T.
Vec grouped_linear_fwd(CSpan x, CSpan w, std::span<const int64_t> splits, int64_t n, int64_t k);
Vec grouped_linear_dgrad(CSpan dy, CSpan w, std::span<const int64_t> splits, int64_t n, int64_t k);  // [M, K]
Vec grouped_linear_wgrad(CSpan dy, CSpan x, std::span<const int64_t> splits, int64_t n, int64_t k);  // [G, N, K]
Vec grouped_bias_fwd(CSpan y, CSpan b, std::span<const int64_t> splits, int64_t n);  // b [G, N]
Vec grouped_col_sum(CSpan dy, std::span<const int64_t> splits, int64_t n);         // db [G, N]
// Scaled gated op (TE's ScaledSwiGLU): x [rows, 2n], y = scale[r] * act(a) * b; kinds as gated_fwd.
Vec scaled_gated_fwd(const std::string& kind, CSpan x, CSpan scale, int64_t rows, int64_t n);
struct ScaledGatedBwd {
  Vec dx;      // [rows, 2n]
  Vec dscale;  // [rows]: sum_c dy * act(a) * b
};
ScaledGatedBwd scaled_gated_bwd(const std::string& kind, CSpan x, CSpan scale, CSpan dy, int64_t rows, int64_t n);

// Storage bytes of a dtype (what the GPU reads and writes) from/to doubles.
std::vector<uint8_t> encode(const std::string& dtype, CSpan v);
Vec decode(const std::string& dtype, const std::vector<uint8_t>& bytes);

}  // namespace jitfuse::reference
