// What `jitfuse explain --program` shows: every step (GEMM dims, layouts, epilogue; kernel grid and bytes),
// every buffer, the saved set, the arenas, and the napkin minimum time at a given bandwidth.
#include <algorithm>

#include <fmt/format.h>

#include "exec/ir/program.hpp"

namespace jitfuse::exec {
namespace {

using nlohmann::json;

// cuBLASLt's column-major view of the row-major linear products (cuda/cublaslt.cpp).
// The weight stored [k, n] (weight_layout in_out): W's operand is transposed the other way (wgrad: dW^T's).
const char* layout(cuda::GemmKind k, bool weight_t) {
  if (weight_t) return k == cuda::GemmKind::fwd ? "NN" : k == cuda::GemmKind::dgrad ? "TN" : "NT";
  switch (k) {
    case cuda::GemmKind::fwd: return "TN";
    case cuda::GemmKind::dgrad: return "NN";
    case cuda::GemmKind::wgrad: return "NT";
  }
  return "?";
}
const char* formula(cuda::GemmKind k, bool weight_t) {
  if (weight_t)
    return k == cuda::GemmKind::fwd     ? "y[m,n] = x[m,k] W[k,n]"
           : k == cuda::GemmKind::dgrad ? "dx[m,k] = dy[m,n] W[k,n]^T"
                                        : "dW[k,n] = x[m,k]^T dy[m,n]";
  switch (k) {
    case cuda::GemmKind::fwd: return "y[m,n] = x[m,k] W[n,k]^T";
    case cuda::GemmKind::dgrad: return "dx[m,k] = dy[m,n] W[n,k]";
    case cuda::GemmKind::wgrad: return "dW[n,k] = dy[m,n]^T x[m,k]";
  }
  return "?";
}
const char* kind_name(cuda::GemmKind k) {
  return k == cuda::GemmKind::fwd ? "fwd" : k == cuda::GemmKind::dgrad ? "dgrad" : "wgrad";
}

std::string bytes_text(double b) {
  if (b >= 1024.0 * 1024 * 1024) return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (b >= 1024.0 * 1024) return fmt::format("{:.2f} MiB", b / (1024.0 * 1024));
  if (b >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{:.0f} B", b);
}

// Napkin bytes of a GEMM: every operand read once, the output written once.
std::pair<int64_t, int64_t> gemm_bytes(const Program& p, const GemmStep& g) {
  int64_t r = 0, w = 0;
  const bool chunk = g.call.kind != cuda::GemmKind::wgrad && g.call.batch == 1 && g.a >= 0 && g.call.m < p.buffer(g.a).rows;
  if (chunk) {  // a row chunk of a pipelined GEMM (docs/parallel.md): its own rows
    const int64_t e = ops::dtype_bytes(g.call.dtype), m = g.call.m, n = g.call.n, k = g.call.k;
    const bool dgrad = g.call.kind == cuda::GemmKind::dgrad;
    return {(m * (dgrad ? n : k) + n * k) * e, m * (dgrad ? k : n) * e};
  }
  for (int id : {g.a, g.b, g.c, g.bias, g.aux}) {
    if (id < 0) continue;
    const bool out = (id == g.bias && (g.call.epilogue == cuda::Epilogue::bgradb ||
                                       g.call.epilogue == cuda::Epilogue::dgelu_bgrad ||
                                       g.call.epilogue == cuda::Epilogue::drelu_bgrad)) ||
                     (id == g.aux && (g.call.epilogue == cuda::Epilogue::gelu_aux_bias ||
                                      g.call.epilogue == cuda::Epilogue::gelu_aux ||
                                      g.call.epilogue == cuda::Epilogue::relu_aux_bias));
    (out ? w : r) += static_cast<int64_t>(p.buffer(id).bytes);
  }
  w += static_cast<int64_t>(p.buffer(g.d).bytes);
  if (g.call.beta != 0.f && g.c < 0) r += static_cast<int64_t>(p.buffer(g.d).bytes);
  return {r, w};
}

// A comm step's fields; returns the local bytes it reads and writes (each rank's side).
std::pair<int64_t, int64_t> comm_json(const Program& p, const CommStep& c, json& j) {
  const int64_t esz = ops::dtype_bytes(c.dtype), w = p.world_size;
  const bool peer = c.op == Collective::peer_push || c.op == Collective::peer_wait || c.op == Collective::peer_ack ||
                    c.op == Collective::peer_take;
  const int64_t sent = c.op == Collective::peer_wait || c.op == Collective::peer_ack
                           ? 0
                           : c.count * esz * (c.op == Collective::reduce_scatter ? w : 1);
  const int64_t got = c.op == Collective::peer_take ? c.count * esz
                      : peer                        ? 0
                                                    : c.count * esz * (c.op == Collective::all_gather ? w : 1);
  const int64_t wire = c.wire_bytes(p.world_size);
  // The copy-engine collectives' steps name the staging (cuda::PeerStaging), which is not a program buffer.
  auto name = [&](int id, const char* none) { return id >= 0 ? p.buffer(id).name : std::string(none); };
  j.update({{"kind", "comm"},
            {"collective", collective_name(c.op)},
            {"count", c.count},
            {"dtype", ops::dtype_name(c.dtype)},
            {"send", name(c.send, c.op == Collective::peer_take ? "peer staging" : "-")},
            {"recv", name(c.recv, c.op == Collective::peer_push ? "peer staging" : "-")},
            {"stream", "caller"},
            {"world_size", p.world_size},
            {"wire_bytes", wire},
            {"link_us", static_cast<double>(wire) / (kNvlinkGbs * 1e3)}});
  if (c.root >= 0) j["root"] = c.root;
  if (c.send_offset || c.recv_offset) j["offsets"] = {c.send_offset, c.recv_offset};
  if (c.op == Collective::all_to_all) {  // the bounds: the rows sent and received depend on the routing
    const auto& a = c.a2a;
    j["all_to_all"] = {{"direction", a.to_experts ? "to the experts" : "back from the experts"},
                       {"experts", a.experts},
                       {"token_rows", a.token_rows},
                       {"expert_rows", a.expert_rows},
                       {"counts", a.counts >= 0 ? p.buffer(a.counts).name : "none: capacity rows per rank and expert"},
                       {"all_gathers_counts", a.route >= 0}};
    const int64_t row = a.row * esz, token = a.token_rows * row, expert = a.expert_rows * row;
    return a.to_experts ? std::pair<int64_t, int64_t>{token, expert} : std::pair<int64_t, int64_t>{expert, token};
  }
  return {sent, got};
}

std::string comm_line(const json& s) {
  auto at = [&](const char* key, int i) {
    const int64_t off = s.contains("offsets") ? s["offsets"][i].get<int64_t>() : 0;
    return s[key].get<std::string>() + (off ? fmt::format("+{}", off) : "");
  };
  return fmt::format("comm  {} count={} {}{}\n             send={} recv={}; {} over the links, >= {:.1f} us",
                     s["collective"].get<std::string>(), s["count"].get<int64_t>(), s["dtype"].get<std::string>(),
                     s.contains("root") ? fmt::format(" root={}", s["root"].get<int>()) : std::string(), at("send", 0),
                     at("recv", 1), bytes_text(s["wire_bytes"].get<double>()), s["link_us"].get<double>());
}

std::pair<int64_t, int64_t> gemm_json(const Program& p, const GemmStep& g, json& j) {
  auto name = [&](int id) { return id >= 0 ? json(p.buffer(id).name) : json(nullptr); };
  j.update({{"gemm", kind_name(g.call.kind)},
            {"formula", formula(g.call.kind, g.call.weight_t)},
            {"m", g.call.m},
            {"n", g.call.n},
            {"k", g.call.k},
            {"layout", layout(g.call.kind, g.call.weight_t)},
            {"epilogue", cuda::epilogue_name(g.call.epilogue)},
            {"dtype", ops::dtype_name(g.call.dtype)},
            {"alpha", g.call.alpha},
            {"beta", g.call.beta},
            {"flops", g.flops()}});
  // The operands cuBLASLt takes: a..aux always (null: none); under FP8 the scale_inv of A and B, and an FP8
  // output's scale and amax where it has them. d_history, d_scale_inv, workspace and ones are not shown.
  json operands = json::object();
  for (int i = 0; i < kGemmOperands; ++i) {
    const auto& info = gemm_operand(static_cast<GemmOperand>(i));
    const int id = g.operand(info.operand);
    if (info.kind == GemmOperandKind::tensor || (g.call.fp8 && info.kind == GemmOperandKind::fp8_input) ||
        (g.call.fp8 && info.kind == GemmOperandKind::fp8_output && id >= 0))
      operands[info.name] = name(id);
  }
  j["operands"] = std::move(operands);
  if (g.bias_grad_fallback) j["fallback"] = "plain wgrad + ones^T dy when cuBLASLt has no BGRADB algorithm";
  // A strided [m, n] operand (a split_weight linear's half: rows of the whole output) and element offsets.
  if (g.call.ldy > g.call.n) j["ldy"] = g.call.ldy;
  if (g.a_offset || g.b_offset || g.d_offset)
    j["element_offsets"] = {{"a", g.a_offset}, {"b", g.b_offset}, {"d", g.d_offset}};
  if (g.call.batch > 1)
    j["batch"] = {{"count", g.call.batch}, {"stride_a", g.call.stride_a}, {"stride_b", g.call.stride_b},
                  {"stride_d", g.call.stride_d}};
  if (g.routed())  // a dropless grouped GEMM: every expert's, m the rows' bound; the rows come from the routing
    j["rows"] = {{"routing", name(g.route)}, {"experts", g.route_experts},
                 {"read", "on the host, once per pass (one stream synchronisation; no CUDA graph capture)"}};
  if (g.call.fp8) {
    j["fp8"] = {{"a", ops::dtype_name(g.call.fp8->a)}, {"b", ops::dtype_name(g.call.fp8->b)},
                {"fast_accum", g.call.fp8->fast_accum}};
    if (g.call.fp8->block_scaled()) {
      // fp8_block: the scales' blocks and the layout cuBLASLt reads them in (cuda::Fp8Scaling).
      auto scale_layout = [](cuda::Fp8Scaling s) {
        return s == cuda::Fp8Scaling::row128 ? "[K/128, rows] fp32 (one per 1x128 block, K-block outer)"
                                             : "[rows/128, K/128] fp32 (one per 128x128 block; rows of 4k scales)";
      };
      j["fp8"]["a_scales"] = {{"blocks", cuda::fp8_scaling_name(g.call.fp8->a_scaling)}, {"layout", scale_layout(g.call.fp8->a_scaling)}};
      j["fp8"]["b_scales"] = {{"blocks", cuda::fp8_scaling_name(g.call.fp8->b_scaling)}, {"layout", scale_layout(g.call.fp8->b_scaling)}};
    }
  }
  return gemm_bytes(p, g);
}

std::pair<int64_t, int64_t> kernel_json(const Program& p, const KernelStep& k, json& j) {
  const auto& L = k.spec.vec ? k.launch.vec : k.launch.scalar;
  json args = json::array();
  for (const auto& a : k.args) args.push_back(a.kind == KArg::Kind::buffer ? json(p.buffer(a.buffer).name) : json(nullptr));
  j.update({{"kernel", k.gen.kernel},
            {"skeleton", codegen::skeleton_name(k.spec.skeleton)},
            {"vector", k.spec.vec},
            {"grid", {L.gx, L.gy}},
            {"block", {L.bx, L.by}},
            {"rows", k.rows},
            {"args", args}});
  if (k.rows_route >= 0) j["rows_per_call"] = "the rows this rank's experts received (" + p.buffer(k.rows_route).name + ")";
  return {k.bytes_read, k.bytes_written};
}

// A finalize launch: every partial row of its gradients read, each gradient written once.
std::pair<int64_t, int64_t> finalize_json(const Program& p, const FinalizeStep& f, json& j) {
  using F = codegen::Finalize;
  json args = json::array();
  int64_t r = 0, w = 0;
  for (size_t i = 0; i < f.pairs.size(); ++i) {
    const Buffer& b = p.buffer(f.pairs[i]);
    args.push_back(b.name);
    (i % 2 ? w : r) += static_cast<int64_t>(b.bytes);
  }
  j.update({{"kernel", f.kernel},
            {"after_step", f.kernel_step},
            {"grid", {(f.cols + F::kCols - 1) / F::kCols, f.count}},
            {"block", {F::kThreads, 1}},
            {"args", args}});
  return {r, w};
}

// An FP8 recipe-state update: the amax partials read, each state's history (and scale, scale_inv) rolled.
std::pair<int64_t, int64_t> fp8_update_json(const Program& p, const Fp8UpdateStep& u, json& j) {
  json states = json::array();
  int64_t r = 0, w = 0;
  auto bytes = [&](int id) { return id >= 0 ? static_cast<int64_t>(p.buffer(id).bytes) : 0; };
  for (const auto& e : u.entries) {
    states.push_back({{"after_step", e.step}, {"partials", p.buffer(e.partials).name},
                      {"history", p.buffer(e.history).name}});
    r += bytes(e.partials) + bytes(e.history);
    w += bytes(e.history) + bytes(e.scale) + bytes(e.scale_inv);
  }
  j.update({{"batched", u.batched}, {"history_len", u.history_len}, {"states", states},
            {"launches", u.batched ? (u.entries.size() + codegen::kFp8Batch - 1) / codegen::kFp8Batch : 1}});
  return {r, w};
}

json step_json(const Program& p, const Step& s, double bw) {
  json j = {{"group", s.group}, {"what", s.what}, {"kind", step_kind_name(s.kind)}};
  std::pair<int64_t, int64_t> rw;
  switch (s.kind) {
    case Step::Kind::gemm: rw = gemm_json(p, s.gemm, j); break;
    case Step::Kind::comm: rw = comm_json(p, s.comm, j); break;
    case Step::Kind::kernel: rw = kernel_json(p, *s.kernel, j); break;
    case Step::Kind::finalize: rw = finalize_json(p, s.finalize, j); break;
    case Step::Kind::fp8_update: rw = fp8_update_json(p, s.fp8_update, j); break;
  }
  j["bytes_read"] = rw.first;
  j["bytes_written"] = rw.second;
  if (s.stream != 0) j["stream"] = "side";
  if (s.peer_path != 0) j["way"] = s.peer_path > 0 ? "peers" : "nccl";
  if (!s.waits.empty()) j["waits"] = s.waits;
  if (bw > 0) j["napkin_us"] = static_cast<double>(rw.first + rw.second) / (bw * 1e3);
  return j;
}

double pass_bytes(const json& steps) {
  double t = 0;
  for (const auto& s : steps) t += s["bytes_read"].get<double>() + s["bytes_written"].get<double>();
  return t;
}

}  // namespace

json program_json(const Program& p, double bw) {
  json out = {{"arch", p.arch}, {"training", p.training}, {"recipe", ops::recipe_name(p.recipe.kind)}};
  if (!p.group.empty()) out["parallel"] = {{"group", p.group}, {"world_size", p.world_size}, {"rank", p.rank},
                                           {"nvlink_gbs", kNvlinkGbs}};
  for (const auto& [key, steps] : {std::pair<const char*, const std::vector<Step>*>{"forward", &p.forward},
                                   {"backward", &p.backward}}) {
    json list = json::array();
    for (const auto& s : *steps) list.push_back(step_json(p, s, bw));
    out[key] = list;
  }
  json buffers = json::array();
  for (const auto& b : p.buffers)
    buffers.push_back({{"id", b.id},
                       {"name", b.name},
                       {"role", role_name(b.role)},
                       {"storage", storage_name(b.storage)},
                       {"dtype", ops::dtype_name(b.dtype)},
                       {"rows", b.rows},
                       {"cols", b.cols},
                       {"bytes", b.bytes},
                       {"offset", b.offset},
                       {"first_step", b.first},
                       {"last_step", b.last}});
  out["buffers"] = buffers;
  json saved = json::array();
  size_t saved_total = 0;
  for (int id : p.saved_set()) {
    saved.push_back({{"name", p.buffer(id).name}, {"bytes", p.buffer(id).bytes},
                     {"dtype", ops::dtype_name(p.buffer(id).dtype)}, {"storage", storage_name(p.buffer(id).storage)}});
    saved_total += p.buffer(id).bytes;
  }
  out["saved"] = {{"buffers", saved}, {"bytes", saved_total}, {"block_bytes", p.saved_bytes}};
  out["arena_bytes"] = {{"forward", p.fwd_arena}, {"backward", p.bwd_arena}};
  if (bw > 0) {
    out["bandwidth_gbs"] = bw;
    out["napkin_us"] = {{"forward", pass_bytes(out["forward"]) / (bw * 1e3)},
                        {"backward", pass_bytes(out["backward"]) / (bw * 1e3)}};
  }
  if (!p.group.empty()) {
    double f = 0, b = 0;
    for (const auto& s : out["forward"]) f += s.value("link_us", 0.0);
    for (const auto& s : out["backward"]) b += s.value("link_us", 0.0);
    out["link_us"] = {{"forward", f}, {"backward", b}};
  }
  return out;
}

namespace {
std::string gemm_line(const json& s) {
  std::string line = fmt::format("gemm {:<5} m={} n={} k={} {} {} {}", s["gemm"].get<std::string>(), s["m"].get<int64_t>(),
                     s["n"].get<int64_t>(), s["k"].get<int64_t>(), s["layout"].get<std::string>(),
                     s["dtype"].get<std::string>(), s["epilogue"].get<std::string>());
  if (s.contains("fp8"))
    line += fmt::format(" ({} x {}{})", s["fp8"]["a"].get<std::string>(), s["fp8"]["b"].get<std::string>(),
                        s["fp8"]["fast_accum"].get<bool>() ? ", fast accumulation" : "");
  if (s["alpha"].get<double>() != 1.0) line += fmt::format(" alpha={}", s["alpha"].get<double>());
  if (s["beta"].get<double>() != 0.0) line += fmt::format(" beta={}", s["beta"].get<double>());
  line += fmt::format(", {:.1f} GFLOP", s["flops"].get<double>() / 1e9);
  std::string ops_text;
  for (const auto& [k, v] : s["operands"].items()) {
    if (v.is_null()) continue;
    // A row block's element offset (of the operand's own type), as comm steps print theirs.
    const int64_t off = s.contains("element_offsets") && s["element_offsets"].contains(k)
                            ? s["element_offsets"][k].get<int64_t>()
                            : 0;
    ops_text += fmt::format(" {}={}{}", k, v.get<std::string>(), off ? fmt::format("+{}", off) : std::string());
  }
  line += "\n             " + ops_text.substr(1);
  return line;
}

// "fp8_update (batched) 3 state(s) of step(s) 0, 4, 7, 1 launch(es), history 16"
std::string fp8_update_line(const json& s) {
  std::string after;
  for (const auto& e : s["states"]) after += (after.empty() ? "" : ", ") + std::to_string(e["after_step"].get<int>());
  return fmt::format("fp8_update{} {} state(s) of step(s) {}, {} launch(es), history {}",
                     s["batched"].get<bool>() ? " (batched)" : "", s["states"].size(), after,
                     s["launches"].get<int>(), s["history_len"].get<int>());
}

std::string steps_text(const json& j) {
  std::string out;
  for (const char* pass : {"forward", "backward"}) {
    const auto& steps = j[pass];
    if (steps.empty()) continue;
    out += fmt::format("\n{} steps:\n", pass);
    int i = 0;
    for (const auto& s : steps) {
      std::string line;
      if (s["kind"] == "gemm") {
        line = gemm_line(s);
      } else if (s["kind"] == "comm") {
        line = comm_line(s);
      } else if (s["kind"] == "fp8_update") {
        line = fp8_update_line(s);
      } else {
        line = fmt::format("{} {} grid {}x{} block {}x{}{}", s["kind"].get<std::string>(), s["kernel"].get<std::string>(),
                           s["grid"][0].get<unsigned>(), s["grid"][1].get<unsigned>(), s["block"][0].get<unsigned>(),
                           s["block"][1].get<unsigned>(), s.value("vector", true) ? "" : " (scalar)");
        if (s.contains("after_step")) line += fmt::format(", the partials of step {}", s["after_step"].get<int>());
        std::string args;
        for (const auto& a : s["args"])
          if (!a.is_null()) args += " " + a.get<std::string>();
        line += "\n             args:" + args;
      }
      if (s.contains("stream") || s.contains("waits")) {
        std::string waits;
        for (const auto& w : s.value("waits", json::array())) waits += (waits.empty() ? "" : ", ") + w.dump();
        line += fmt::format("\n             on the {} stream{}", s.value("stream", std::string()) == "side" ? "side" : "caller's",
                            waits.empty() ? std::string() : ", after step " + waits);
      }
      if (s.contains("way"))
        line += s["way"] == "peers" ? "\n             runs where the ranks map each other's buffers (the peer path)"
                                    : "\n             runs where they do not (the NCCL path)";
      const int g = s["group"].get<int>();
      out += fmt::format("  {:>3}  {:<4} {}\n             {} | reads {}, writes {}, >= {:.1f} us\n", i++,
                         g < 0 ? std::string("end") : fmt::format("g{}", g), line, s["what"].get<std::string>(),
                         bytes_text(s["bytes_read"].get<double>()), bytes_text(s["bytes_written"].get<double>()),
                         s.value("napkin_us", 0.0));
    }
  }
  return out;
}

std::string buffers_text(const Program& p, const json& j, double bw) {
  std::string out = "\nbuffers:\n";
  out += fmt::format("  {:>3}  {:<26} {:<14} {:<9} {:<5} {:>14} {:>11} {:>11}  steps\n", "id", "name", "role",
                     "storage", "dtype", "rows x cols", "bytes", "offset");  // steps: an arena buffer's lifetime
  for (const auto& b : p.buffers) {
    const bool raw = b.bytes != static_cast<size_t>(b.rows * b.cols) * ops::dtype_bytes(b.dtype);
    out += fmt::format("  {:>3}  {:<26} {:<14} {:<9} {:<5} {:>14} {:>11} {:>11}  {}\n", b.id, b.name,
                       role_name(b.role), storage_name(b.storage), raw ? "bytes" : ops::dtype_name(b.dtype),
                       fmt::format("{}x{}", b.rows, b.cols), bytes_text(static_cast<double>(b.bytes)),
                       b.storage == Storage::caller ? std::string("-") : std::to_string(b.offset),
                       b.first < 0 || (b.storage != Storage::fwd_arena && b.storage != Storage::bwd_arena)
                           ? std::string("-")
                           : fmt::format("{}..{}", b.first, b.last));
  }
  const auto& sv = j["saved"];
  out += fmt::format("\nsaved for backward: {} buffers, {} ({} allocated by jitfuse, the rest are the caller's "
                     "tensors kept alive)\n",
                     sv["buffers"].size(), bytes_text(sv["bytes"].get<double>()),
                     bytes_text(sv["block_bytes"].get<double>()));
  for (const auto& b : sv["buffers"])
    out += fmt::format("  {:<26} {:>11}  {}\n", b["name"].get<std::string>(), bytes_text(b["bytes"].get<double>()),
                       b["storage"].get<std::string>());
  out += fmt::format("arena per call: forward {}, backward {}\n", bytes_text(static_cast<double>(p.fwd_arena)),
                     bytes_text(static_cast<double>(p.bwd_arena)));
  if (j.contains("napkin_us"))
    out += fmt::format("napkin minimum at {:.0f} GB/s: forward {:.1f} us, backward {:.1f} us\n", bw,
                       j["napkin_us"]["forward"].get<double>(), j["napkin_us"]["backward"].get<double>());
  if (j.contains("link_us"))
    out += fmt::format("collectives at {:.0f} GB/s NVLink: forward {:.1f} us, backward {:.1f} us\n", kNvlinkGbs,
                       j["link_us"]["forward"].get<double>(), j["link_us"]["backward"].get<double>());
  return out;
}

}  // namespace

std::string program_text(const Program& p, double bw) {
  json j = program_json(p, bw);
  std::string out = fmt::format("program ({}, {}, recipe {}; napkin times = bytes / {:.0f} GB/s):\n", p.arch,
                                p.training ? "training" : "inference", ops::recipe_name(p.recipe.kind), bw);
  if (!p.group.empty())
    out += fmt::format("tensor parallel: group '{}', rank {} of {}; collectives run by NCCL (or, the peer_* steps, by "
                       "copy engines) on the caller's or the side stream, link times = bytes over the links / {:.0f} "
                       "GB/s (NVLink 4, one direction)\n",
                       p.group, p.rank, p.world_size, kNvlinkGbs);
  out += steps_text(j);
  out += buffers_text(p, j, bw);
  return out;
}

}  // namespace jitfuse::exec
