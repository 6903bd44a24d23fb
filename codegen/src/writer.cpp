// Shared emitter helpers: argument lists, literals, the prelude every kernel opens with, finalize kernels.
#include "writer.hpp"

#include <algorithm>
#include <cmath>
#include <stdexcept>

namespace jitfuse::codegen {

std::string skeleton_name(Skeleton s) {
  switch (s) {
    case Skeleton::elementwise: return "elementwise";
    case Skeleton::gated: return "gated";
    case Skeleton::rownorm: return "rownorm";
    case Skeleton::cast_transpose: return "cast_transpose";
    case Skeleton::cross_entropy: return "cross_entropy";
    case Skeleton::moe: return "moe";
  }
  return "?";
}

namespace {
constexpr std::pair<Key, const char*> kKeys[] = {
    {Key::input, "input"}, {Key::output, "output"}, {Key::mean, "mean"}, {Key::rstd, "rstd"},
    {Key::mask, "mask"},   {Key::lse, "lse"},       {Key::scale, "scale"}, {Key::dx, "dx"},
    {Key::dW, "dW"},       {Key::db, "db"},         {Key::weight, "weight"}, {Key::bias, "bias"},
    {Key::channel, "channel"}, {Key::route, "route"}, {Key::stats, "stats"},
    {Key::weight2, "weight2"}};
}  // namespace

const char* key_name(Key k) {
  for (const auto& [key, name] : kKeys)
    if (key == k) return name;
  return "";
}

std::optional<Key> parse_key(std::string_view name) {
  for (const auto& [key, n] : kKeys)
    if (name == n) return key;
  return std::nullopt;
}

namespace detail {

void Args::ptr(Arg::Role role, int op, const std::string& name, const std::string& c_name, const std::string& type,
               bool writes) {
  if (role == Arg::Role::param || role == Arg::Role::saved || role == Arg::Role::partials)
    throw std::logic_error("codegen: argument '" + c_name + "' is bound by (op, key): pass its codegen::Key");
  if (has(c_name)) return;
  args_.push_back({role, op, name, writes});
  decls_.push_back(fmt::format("{}{}* __restrict__ {}", writes ? "" : "const ", type, c_name));
  names_.push_back(c_name);
}

void Args::ptr(Arg::Role role, int op, Key key, const std::string& c_name, const std::string& type, bool writes) {
  if (key == Key::none) throw std::logic_error("codegen: keyed argument '" + c_name + "' without a key");
  if (has(c_name)) return;
  args_.push_back({role, op, key_name(key), writes, key});
  decls_.push_back(fmt::format("{}{}* __restrict__ {}", writes ? "" : "const ", type, c_name));
  names_.push_back(c_name);
}

void Args::scalar(Arg::Role role, int op, const std::string& name, const std::string& c_name,
                  const std::string& type) {
  if (has(c_name)) return;
  args_.push_back({role, op, name, false});
  decls_.push_back(fmt::format("{} {}", type, c_name));
  names_.push_back(c_name);
}

void Args::staged(int op, int slot, const std::string& c_name, const std::string& type) {
  if (has(c_name)) return;
  Arg a{Arg::Role::staged, op, "staged", false};
  a.slot = slot;
  args_.push_back(a);
  decls_.push_back(fmt::format("const {}* __restrict__ {}", type, c_name));
  names_.push_back(c_name);
}

std::string Args::decl() const {
  std::string out;
  for (size_t i = 0; i < decls_.size(); ++i) out += (i ? ", " : "") + decls_[i];
  return out;
}

bool Args::has(const std::string& c_name) const {
  return std::find(names_.begin(), names_.end(), c_name) != names_.end();
}

std::string comment_text(const std::string& s) {
  std::string out;
  auto hex = [&](unsigned char c) { out += fmt::format("\\x{:02x}", c); };
  size_t end = s.size();  // trailing blanks after a backslash would still let it splice: look past them
  while (end > 0 && (s[end - 1] == ' ' || s[end - 1] == '\t')) --end;
  for (size_t i = 0; i < s.size(); ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    bool splice = c == '\\' && i + 1 == end;
    bool trigraph = c == '/' && i >= 2 && s[i - 1] == '?' && s[i - 2] == '?';
    if (c < 0x20 || c >= 0x7f || splice || trigraph) {
      hex(c);
    } else {
      out += static_cast<char>(c);
    }
  }
  return out;
}

std::string num(double v) {
  if (!std::isfinite(v)) throw std::invalid_argument("codegen: non-finite constant");
  std::string s = fmt::format("{:.9g}", v);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s + "f";
}

std::string storage_struct(const std::string& dtype) {
  if (dtype == "fp32") return "jf_f32";
  if (dtype == "fp16") return "jf_f16";
  if (dtype == "bf16") return "jf_bf16";
  throw std::invalid_argument("codegen: unsupported dtype " + dtype);
}

std::string consts_suffix(const std::vector<double>& consts) {
  std::string out;
  for (double c : consts) out += ", " + num(c);
  return out;
}

std::vector<std::string> headers_for(const KernelSpec& spec) {
  std::vector<std::string> out = {"skeletons/common.cuh"};
  auto add = [&](const std::string& h) {
    if (!h.empty() && std::find(out.begin(), out.end(), h) == out.end()) out.push_back(h);
  };
  for (auto& [h, _] : spec.headers) add(h);
  auto stages = spec.pre;
  stages.insert(stages.end(), spec.post.begin(), spec.post.end());
  for (auto& s : stages)
    if (s.kind == Stage::Kind::dropout) add("ops/dropout.cuh");
  if (spec.fp8) {  // every FP8 cast uses the format-generic functions of fp8_operand.cuh
    add("ops/fp8.cuh");
    add("ops/fp8_operand.cuh");
  }
  if (spec.skeleton == Skeleton::cast_transpose) add(spec.fp8 && spec.fp8->block ? "skeletons/block_cast.cuh" : "skeletons/cast_transpose.cuh");
  if (spec.skeleton == Skeleton::cross_entropy) add("skeletons/cross_entropy.cuh");
  if (spec.skeleton == Skeleton::moe) add("skeletons/moe.cuh");
  if (spec.peers) add("skeletons/peer.cuh");
  return out;
}

std::string kernel_name(const KernelSpec& spec) {
  std::string stem = spec.label.empty() ? skeleton_name(spec.skeleton) : spec.label;
  for (auto& c : stem)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return fmt::format("jf_{}_{}", stem, spec.dir == Direction::forward ? "fwd" : "bwd");
}

void emit_prelude(Writer& w, const KernelSpec& spec, const std::vector<std::string>& headers) {
  w.line("// Generated by jitfuse codegen. Do not edit: regenerate from the KernelSpec.");
  w.line("// skeleton {}, {}, dtype {}, cols {}, {}{}", skeleton_name(spec.skeleton),
         spec.dir == Direction::forward ? "forward" : "backward", spec.dtype, spec.cols,
         spec.vec ? "16-byte vector entry point (scalar with -DJF_SCALAR)" : "scalar entry point only",
         spec.rule.empty() ? "" : ", rule " + comment_text(spec.rule));
  w.line("// op N: the N-th op of this kernel (not its index in the sequence: one kernel serves every depth)");
  for (auto& h : headers) w.line("#include \"{}\"", h);
  w.line("typedef {} DT;", storage_struct(spec.dtype));
  w.line("typedef DT::storage ST;");
  w.line("");
  w.mark();
}

// Both variants of a kernel are one source and two NVRTC programs (codegen::Generated): the vector one
// by default, the scalar one under -DJF_SCALAR, so a plan that can take the vector path never compiles
// the scalar one (about half of a layer's NVRTC time) unless a call needs it. Each variant is the same
// text under its own JF_VEC, so its SASS is what it was as a program of its own.
void emit_variants(Writer& w, const KernelSpec& spec, const std::string& kernel, const std::string& scalar) {
  const std::string& all = w.str();
  const std::string prelude = all.substr(0, w.marked()), body = all.substr(w.marked());
  const std::string sig = " " + kernel + "(";
  const size_t at = body.find(sig);
  if (at == std::string::npos || body.find(sig, at + 1) != std::string::npos)
    throw std::logic_error("codegen: the kernel text must declare " + kernel + " exactly once");
  std::string scalar_body = body;
  scalar_body.replace(at, sig.size(), " " + scalar + "(");
  std::string out = prelude;
  if (spec.vec)
    out += "#ifndef JF_SCALAR\n#define JF_VEC true\n" + body + "#undef JF_VEC\n#else\n#define JF_VEC false\n" +
           scalar_body + "#undef JF_VEC\n#endif\n";
  else
    out += "#define JF_VEC false\n" + scalar_body;
  Writer v;
  v.raw(out);
  w = v;
}

namespace {

// The finalize kernel's signature: one (partials, grad) pair, or `count` pairs of which blockIdx.y picks one
// (several gradients of one width in one launch: one fewer launch and tail each).
void emit_finalize_signature(Writer& w, const std::string& kernel, int count) {
  constexpr int kT = Finalize::kThreads;
  if (count == 1) {
    w.line("extern \"C\" __global__ void __launch_bounds__({}) {}(const float* __restrict__ part, ST* __restrict__ grad, "
           "int parts, int accumulate) {{", kT, kernel);
    w.open();
    return;
  }
  std::string params;
  for (int i = 0; i < count; ++i)
    params += fmt::format("const float* __restrict__ part{0}, ST* __restrict__ grad{0}, ", i);
  w.line("// launch: grid.y {} (one per gradient)", count);
  w.line("extern \"C\" __global__ void __launch_bounds__({}) {}({}int parts, int accumulate) {{", kT, kernel, params);
  w.open();
  std::string part = "part" + std::to_string(count - 1), grad = "grad" + std::to_string(count - 1);
  for (int i = count - 2; i >= 0; --i) {
    part = fmt::format("blockIdx.y == {0} ? part{0} : {1}", i, part);
    grad = fmt::format("blockIdx.y == {0} ? grad{0} : {1}", i, grad);
  }
  w.line("const float* __restrict__ part = {};", part);
  w.line("ST* __restrict__ grad = {};", grad);
}

// Each thread's sums of its V columns over every ny-th part, into 4 interleaved accumulators. Eight parts
// per thread per round, all loads issued before the first add (396 parts of a 4096-wide grad are one
// round: one L2 round trip instead of one per part).
void emit_finalize_part_sums(Writer& w, int64_t cols, int v, int ny) {
  w.line("float s[4][{}];", v);
  w.line("#pragma unroll");
  w.line("for (int u = 0; u < 4; ++u) for (int e = 0; e < {}; ++e) s[u][e] = 0.f;", v);
  w.line("if (c < {}) {{", cols);
  w.open();
  w.line("for (int p0 = ty; p0 < parts; p0 += {}) {{", 8 * ny);
  w.open();
  if (v == 4) {
    w.line("const float4* q = reinterpret_cast<const float4*>(part + c);");
    w.line("float4 a[8];");
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 8; ++u) a[u] = p0 + u * {0} < parts ? q[(jf_i64)(p0 + u * {0}) * {1}] : make_float4(0.f, 0.f, 0.f, 0.f);",
           ny, cols / 4);
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 8; ++u) {{ s[u & 3][0] += a[u].x; s[u & 3][1] += a[u].y; s[u & 3][2] += a[u].z; s[u & 3][3] += a[u].w; }}");
  } else {
    w.line("float a[8];");
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 8; ++u) a[u] = p0 + u * {0} < parts ? part[(jf_i64)(p0 + u * {0}) * {1} + c] : 0.f;", ny, cols);
    w.line("#pragma unroll");
    w.line("for (int u = 0; u < 8; ++u) s[u & 3][0] += a[u];");
  }
  w.close();
  w.line("}}");
  w.close();
  w.line("}}");
}

// The block's sum per column in a fixed order, then the store. 256 threads: column threadIdx.x % 16 of
// group threadIdx.x / 16 sums ny / 16 rows of jf_fs in order, then the first 16 threads add the 16 group
// sums.
void emit_finalize_block_sum(Writer& w, int64_t cols, int v, int ny) {
  constexpr int kC = Finalize::kCols, kT = Finalize::kThreads;
  w.line("#pragma unroll");
  w.line("for (int e = 0; e < {}; ++e) jf_fs[ty][tx * {} + e] = (s[0][e] + s[1][e]) + (s[2][e] + s[3][e]);", v, v);
  w.line("__syncthreads();");
  w.line("const int fc = threadIdx.x % {}, fg = threadIdx.x / {};", kC, kC);
  w.line("float t = 0.f;");
  w.line("#pragma unroll");
  w.line("for (int y = 0; y < {}; ++y) t += jf_fs[fg * {} + y][fc];", ny / (kT / kC), ny / (kT / kC));
  w.line("__syncthreads();");
  w.line("jf_fs[fg][fc] = t;");
  w.line("__syncthreads();");
  w.line("const int col = blockIdx.x * {} + fc;", kC);
  w.line("if (fg != 0 || col >= {}) return;", cols);
  w.line("float r = 0.f;");
  w.line("#pragma unroll");
  w.line("for (int y = 0; y < {}; ++y) r += jf_fs[y][fc];", kT / kC);
  w.line("if (accumulate) r += DT::load(grad[col]);");
  w.line("grad[col] = DT::store(r);");
}

}  // namespace

void emit_finalize(Writer& w, const std::string& kernel, int64_t cols, int count) {
  constexpr int kC = Finalize::kCols, kT = Finalize::kThreads;
  // A block of 256 threads takes 16 columns. Each thread owns V consecutive columns (V = 4, one 16-byte
  // load per part, when cols % 4 == 0; the partials buffer is 256-byte aligned) and every ny-th part,
  // eight parts' loads in flight; the ny sums per column are then added in a fixed order (groups of
  // 4, then the 16 group sums), so the result is deterministic. H100, 396 parts x 4096 columns: 7.0 us
  // per finalize with 32 columns per block and one 4-byte load per part (128 blocks), see
  // docs/benchmarks.md "Backward".
  const int v = cols % 4 == 0 ? 4 : 1;
  const int tx_n = kC / v, ny = kT / tx_n;
  w.line("// grad[c] (+)= sum over parts of partials[p][c]: the second half of a deterministic column sum");
  w.line("// launch: grid ceil({} / {}), block {}", cols, kC, kT);
  emit_finalize_signature(w, kernel, count);
  w.line("__shared__ float jf_fs[{}][{}];", ny, kC);
  w.line("const int tx = threadIdx.x % {}, ty = threadIdx.x / {};", tx_n, tx_n);
  w.line("const int c = blockIdx.x * {} + tx * {};", kC, v);
  emit_finalize_part_sums(w, cols, v, ny);
  emit_finalize_block_sum(w, cols, v, ny);
  w.close();
  w.line("}}");
}

}  // namespace detail
}  // namespace jitfuse::codegen
