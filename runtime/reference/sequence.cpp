// Chaining the per-op float64 references through a sequence: values forward, gradients backward.
#include "reference/sequence.hpp"

#include <map>
#include <stdexcept>

namespace jitfuse::reference {
namespace {

using ops::Family;

std::string act_kind(const ops::Op& op) {
  if (op.kind == "gelu") return op.str("approximate") == "tanh" ? "gelu_tanh" : "gelu_erf";
  if (op.kind == "identity" || op.kind == "quantize" || op.kind == "reshape") return "identity";
  if (op.info && op.info->user_declared)
    throw std::invalid_argument(op.label() + ": user-declared ops have no float64 reference; compare fused against "
                                "unfused (JITFUSE_DISABLE_FUSION=1) instead");
  return op.kind;
}

const Vec& param(const SeqInputs& in, const ops::Op& op, const char* name) {
  auto it = in.params.find({op.index, name});
  if (it == in.params.end()) throw std::invalid_argument(op.label() + ": reference needs parameter " + name);
  return it->second;
}

// A [rows, cols] row-major matrix transposed.
Vec transposed(const Vec& a, int64_t rows, int64_t cols) {
  Vec t(a.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[static_cast<size_t>(c * rows + r)] = a[static_cast<size_t>(r * cols + c)];
  return t;
}

// A linear's weight as [out_features, in_features] (weight_layout "in_out" stores it transposed).
Vec linear_weight(const SeqInputs& in, const ops::Op& op) {
  const Vec& w = param(in, op, "weight");
  if (op.split_weight()) {  // [weight; weight2]: the outputs' two halves
    Vec both = w;
    const Vec& w2 = param(in, op, "weight2");
    both.insert(both.end(), w2.begin(), w2.end());
    return both;
  }
  return op.weight_in_out() ? transposed(w, ops::cols_of(op.in), ops::cols_of(op.out)) : w;
}

bool dropout_active(const ops::Op& op) { return op.flag("training") && op.num("p") > 0; }

// One process holds one rank: the float64 reference of a collective exists at world size 1 (the identity).
void one_rank(const ops::Op& op) {
  if (op.world_size != 1)
    throw std::invalid_argument(op.label() + ": the float64 reference runs one rank; at world size " +
                                std::to_string(op.world_size) + " compare against the single-GPU sequence instead");
}

CrossEntropyAttrs ce_attrs(const ops::Op& op) {
  CrossEntropyAttrs a;
  a.reduction = op.str("reduction");
  a.ignore_index = op.attrs.at("ignore_index").get<int64_t>();
  a.label_smoothing = op.num("label_smoothing");
  a.z_loss = op.num("z_loss");
  a.softcap = op.num("softcap");
  return a;
}

// The labels of a cross_entropy: its extra input, integers held as doubles (exact below 2^53).
std::vector<int64_t> labels_of(const SeqInputs& in, const ops::Op& op) {
  const Vec& l = in.extra_in.at(static_cast<size_t>(op.extra_slot));
  std::vector<int64_t> out(l.size());
  for (size_t i = 0; i < l.size(); ++i) out[i] = static_cast<int64_t>(l[i]);
  return out;
}

// The routing of a moe op (a moe_permute, or the permute a moe_unpermute reads): from the permute's indices.
MoeRouting routing_of(const std::vector<ops::Op>& ops, const SeqInputs& in, const ops::Op& op) {
  const ops::Op* p = &op;  // through a moe_dispatch (one rank: its experts' rows are the permute's)
  while (p->kind != "moe_permute") p = &ops.at(static_cast<size_t>(p->route_op));
  const ops::Op& perm = *p;
  const Vec& raw = in.extra_in.at(static_cast<size_t>(perm.extra_slot));
  std::vector<int64_t> idx(raw.size());
  for (size_t i = 0; i < raw.size(); ++i) idx[i] = static_cast<int64_t>(raw[i]);
  const int64_t cap = perm.attrs.at("capacity").get<int64_t>();
  MoeRouting r = moe_route(idx, ops::rows_of(perm.in), perm.attrs.at("top_k").get<int64_t>(),
                           perm.attrs.at("num_experts").get<int64_t>(), cap);
  return perm.str("layout") == "padded" ? moe_pad_routing(r, cap) : r;
}

// The first `rows` rows of a [.., cols] tensor, and a [rows, cols] tensor padded with zero rows to `total`.
Vec head_rows(const Vec& v, int64_t rows, int64_t cols) { return Vec(v.begin(), v.begin() + rows * cols); }
Vec pad_rows(Vec v, int64_t total, int64_t cols) {
  v.resize(static_cast<size_t>(total * cols), 0.0);
  return v;
}

// moe_permute: the rows in expert order, zero past the kept ones; moe_unpermute: the probabilities' combine.
Vec moe_fwd(const std::vector<ops::Op>& ops, const SeqInputs& in, const ops::Op& op, const Vec& v) {
  const MoeRouting r = routing_of(ops, in, op);
  const int64_t cols = ops::cols_of(op.in);
  if (op.kind == "moe_permute") return pad_rows(moe_permute_fwd(v, r, cols), ops::rows_of(op.out), cols);
  return moe_unpermute_fwd(head_rows(v, r.rows(), cols), in.extra_in.at(static_cast<size_t>(op.extra_slot)), r, cols);
}

// The moe ops' input gradients (and moe_unpermute's dprobs into its extra input's gradient).
Vec moe_bwd(const std::vector<ops::Op>& ops, const SeqInputs& in, const ops::Op& op, const Vec& x, const Vec& dy,
            SeqGrads& g) {
  const MoeRouting r = routing_of(ops, in, op);
  const int64_t cols = ops::cols_of(op.in);
  if (op.kind == "moe_permute") return moe_permute_bwd(head_rows(dy, r.rows(), cols), r, cols);
  MoeUnpermuteBwd b = moe_unpermute_bwd(dy, head_rows(x, r.rows(), cols),
                                        in.extra_in.at(static_cast<size_t>(op.extra_slot)), r, cols);
  g.grad_extra_in.at(static_cast<size_t>(op.extra_slot)) = std::move(b.dprobs);
  return pad_rows(std::move(b.dy), ops::rows_of(op.in), cols);
}

// A collective on one rank: the identity, but for moe_dispatch's bound on the rows it receives (zero past the
// rows it got; the rows past the bound must be zero, as the routing left them, or the executor refuses the call).
Vec resize_rows(Vec v, const ops::Shape& from, const ops::Shape& to) {
  const int64_t cols = ops::cols_of(from);
  if (ops::rows_of(to) < ops::rows_of(from))
    for (size_t i = static_cast<size_t>(ops::rows_of(to) * cols); i < v.size(); ++i)
      if (v[i] != 0.0) throw std::invalid_argument("a moe_dispatch's max_rows is below the rows the routing sends");
  return pad_rows(std::move(v), ops::rows_of(to), cols);
}

// A grouped_linear's groups: equal, rows / G each.
std::vector<int64_t> equal_groups(const ops::Op& op) {
  const int64_t g = op.attrs.at("num_groups").get<int64_t>();
  return std::vector<int64_t>(static_cast<size_t>(g), ops::rows_of(op.in) / g);
}

// After a packed moe_permute a grouped_linear's groups are the experts' kept rows (the rows after them zero).
bool routed_groups(const ops::Op& op) { return op.route_op >= 0 && op.route_packed; }

Vec grouped_fwd(const std::vector<ops::Op>& ops, const SeqInputs& in, const ops::Op& op, const Vec& v) {
  const int64_t n = ops::cols_of(op.out), k = ops::cols_of(op.in);
  if (!routed_groups(op)) return grouped_linear_fwd(v, param(in, op, "weight"), equal_groups(op), n, k);
  const MoeRouting r = routing_of(ops, in, op);
  return pad_rows(grouped_linear_fwd(head_rows(v, r.rows(), k), param(in, op, "weight"), r.splits, n, k),
                  ops::rows_of(op.out), n);
}

// dx, and dW into g.
Vec grouped_bwd(const std::vector<ops::Op>& ops, const SeqInputs& in, const ops::Op& op, const Vec& x, const Vec& dy,
                SeqGrads& g) {
  const int64_t n = ops::cols_of(op.out), k = ops::cols_of(op.in);
  if (!routed_groups(op)) {
    const auto splits = equal_groups(op);
    g.grad_params[{op.index, "weight"}] = grouped_linear_wgrad(dy, x, splits, n, k);
    return grouped_linear_dgrad(dy, param(in, op, "weight"), splits, n, k);
  }
  const MoeRouting r = routing_of(ops, in, op);
  const Vec dyh = head_rows(dy, r.rows(), n);
  g.grad_params[{op.index, "weight"}] = grouped_linear_wgrad(dyh, head_rows(x, r.rows(), k), r.splits, n, k);
  return pad_rows(grouped_linear_dgrad(dyh, param(in, op, "weight"), r.splits, n, k), ops::rows_of(op.in), k);
}

// A norm's dx, and its dgamma (and dbeta) into g.
Vec norm_bwd(const ops::Op& op, const SeqInputs& in, const Vec& x, const Vec& dy, SeqGrads& g) {
  const int64_t rows = ops::rows_of(op.in), cols = ops::cols_of(op.in);
  NormBwd b = op.kind == "layernorm" ? layernorm_bwd(x, param(in, op, "weight"), dy, rows, cols, op.num("eps"),
                                                     op.flag("zero_centered_gamma"))
                                     : rmsnorm_bwd(x, param(in, op, "weight"), dy, rows, cols, op.num("eps"),
                                                   op.flag("zero_centered_gamma"));
  g.grad_params[{op.index, "weight"}] = b.dgamma;
  if (op.kind == "layernorm") g.grad_params[{op.index, "bias"}] = b.dbeta;
  return b.dx;
}

}  // namespace

SeqForward sequence_forward(const std::vector<ops::Op>& ops, const SeqInputs& in) {
  SeqForward f;
  Vec v = in.input;
  std::map<int, Vec> channels;  // by fork op: the value it wrote into its channel
  for (const auto& op : ops) {
    f.values.push_back(v);
    const int64_t rows = ops::rows_of(op.in), cols = ops::cols_of(op.in);
    switch (op.family) {
      case Family::linear:
        if (in.quantize) {
          if (in.transposed_copies) in.quantize(op.index, "input_t", f.quantized[{op.index, "input_t"}] = v, rows, cols);
          Vec& xq = f.quantized[{op.index, "input"}] = v;
          Vec& wq = f.quantized[{op.index, "weight"}] = param(in, op, "weight");
          in.quantize(op.index, "input", xq, rows, cols);
          in.quantize(op.index, "weight", wq, ops::cols_of(op.out), cols);
          v = linear_fwd(xq, wq, rows, ops::cols_of(op.out), cols);
        } else {
          v = linear_fwd(v, linear_weight(in, op), rows, ops::cols_of(op.out), cols);
        }
        break;
      case Family::bias: v = bias_fwd(v, param(in, op, "bias"), rows, cols); break;
      case Family::pointwise:
        if (op.kind == "scale") {
          for (double& x : v) x *= op.consts.at(0);
        } else {
          const std::string k = act_kind(op);
          for (double& x : v) x = act_fwd(k, x);
        }
        break;
      case Family::gated: {
        std::string k = op.kind;
        v = gated_fwd(k, v, rows, cols / 2);
        break;
      }
      case Family::norm:
        if (op.kind == "layernorm")
          v = layernorm_fwd(v, param(in, op, "weight"), param(in, op, "bias"), rows, cols, op.num("eps"),
                            op.flag("zero_centered_gamma")).y;
        else
          v = rmsnorm_fwd(v, param(in, op, "weight"), rows, cols, op.num("eps"), op.flag("zero_centered_gamma")).y;
        break;
      case Family::dropout:
        if (dropout_active(op)) {
          auto mask = dropout_mask(op.attrs["seed"].get<uint64_t>() ^ in.rng_seed, in.rng_offset, static_cast<int64_t>(v.size()),
                                   op.num("p"));
          v = dropout_fwd(v, mask, op.num("p"));
        }
        break;
      case Family::add_extra_input: {
        const int src = op.channel_src >= 0 ? op.channel_src : op.index;  // a channel's source, else its own
        const Vec& e = ops[src].family == Family::make_extra_output ? channels.at(src)
                                                                     : in.extra_in.at(ops[src].extra_slot);
        for (size_t i = 0; i < v.size(); ++i) v[i] += e[i];
        break;
      }
      case Family::comm: one_rank(op); v = resize_rows(std::move(v), op.in, op.out); break;
      case Family::loss: v = cross_entropy_fwd(v, labels_of(in, op), rows, cols, ce_attrs(op)).loss; break;
      case Family::moe: v = moe_fwd(ops, in, op, v); break;
      case Family::grouped_linear: v = grouped_fwd(ops, in, op, v); break;
      case Family::make_extra_output:
        if (!op.channel.empty()) channels[op.index] = v;
        if (op.extra_slot < 0) break;
        if (f.extra_out.size() <= static_cast<size_t>(op.extra_slot)) f.extra_out.resize(op.extra_slot + 1);
        f.extra_out[op.extra_slot] = v;
        break;
    }
  }
  f.values.push_back(v);
  f.output = v;
  return f;
}

SeqGrads sequence_backward(const std::vector<ops::Op>& ops, const SeqInputs& in, const SeqForward& fwd,
                           const Vec& grad_output, const std::vector<Vec>& grad_extra_out) {
  SeqGrads g;
  g.grad_extra_in.resize(in.extra_in.size());
  Vec dy = grad_output;
  std::map<int, Vec> channel_grads;  // by fork op: the sum of its channel's readers' gradients
  for (int i = static_cast<int>(ops.size()) - 1; i >= 0; --i) {
    const auto& op = ops[i];
    const Vec& x = fwd.values[i];
    const int64_t rows = ops::rows_of(op.in), cols = ops::cols_of(op.in);
    switch (op.family) {
      case Family::linear: {
        const int64_t n = ops::cols_of(op.out);
        if (in.quantize) {
          Vec dyt;
          if (in.transposed_copies) in.quantize(i, "grad_output_t", dyt = dy, rows, n);
          in.quantize(i, "grad_output", dy, rows, n);
          g.grad_params[{i, "weight"}] = in.transposed_copies
                                             ? linear_wgrad(dyt, fwd.quantized.at({i, "input_t"}), rows, n, cols)
                                             : linear_wgrad(dy, fwd.quantized.at({i, "input"}), rows, n, cols);
          dy = linear_dgrad(dy, fwd.quantized.at({i, "weight"}), rows, n, cols);
          break;
        }
        Vec dw = linear_wgrad(dy, x, rows, n, cols);
        if (op.split_weight()) {
          const auto mid = dw.begin() + static_cast<std::ptrdiff_t>(dw.size() / 2);
          g.grad_params[{i, "weight"}] = Vec(dw.begin(), mid);
          g.grad_params[{i, "weight2"}] = Vec(mid, dw.end());
        } else {
          g.grad_params[{i, "weight"}] = op.weight_in_out() ? transposed(dw, n, cols) : dw;
        }
        dy = linear_dgrad(dy, linear_weight(in, op), rows, n, cols);
        break;
      }
      case Family::bias: g.grad_params[{i, "bias"}] = col_sum(dy, rows, cols); break;
      case Family::pointwise:
        if (op.kind == "scale") {
          for (double& d : dy) d *= op.consts.at(0);
        } else {
          const std::string k = act_kind(op);
          for (size_t j = 0; j < dy.size(); ++j) dy[j] = act_bwd(k, x[j], dy[j]);
        }
        break;
      case Family::gated: dy = gated_bwd(op.kind, x, dy, rows, cols / 2); break;
      case Family::norm: dy = norm_bwd(op, in, x, dy, g); break;
      case Family::dropout:
        if (dropout_active(op)) {
          auto mask = dropout_mask(op.attrs["seed"].get<uint64_t>() ^ in.rng_seed, in.rng_offset, static_cast<int64_t>(dy.size()),
                                   op.num("p"));
          dy = dropout_bwd(dy, mask, op.num("p"));
        }
        break;
      case Family::add_extra_input: {  // a channel's readers sum their gradients at its source
        const int src = op.channel_src >= 0 ? op.channel_src : op.index;
        Vec& acc = ops[src].family == Family::make_extra_output ? channel_grads[src]
                                                                : g.grad_extra_in.at(ops[src].extra_slot);
        if (acc.empty()) acc.assign(dy.size(), 0.0);
        for (size_t j = 0; j < dy.size(); ++j) acc[j] += dy[j];
        break;
      }
      case Family::comm: one_rank(op); dy = resize_rows(std::move(dy), op.out, op.in); break;
      case Family::loss: dy = cross_entropy_bwd(x, labels_of(in, op), dy, rows, cols, ce_attrs(op)); break;
      case Family::moe: dy = moe_bwd(ops, in, op, x, dy, g); break;
      case Family::grouped_linear: dy = grouped_bwd(ops, in, op, x, dy, g); break;
      case Family::make_extra_output: {
        if (op.extra_slot >= 0) {
          const Vec& de = grad_extra_out.at(op.extra_slot);
          for (size_t j = 0; j < dy.size(); ++j) dy[j] += de[j];
        }
        if (auto it = channel_grads.find(op.index); it != channel_grads.end())
          for (size_t j = 0; j < dy.size(); ++j) dy[j] += it->second[j];
        break;
      }
    }
  }
  g.grad_input = dy;
  return g;
}

}  // namespace jitfuse::reference
