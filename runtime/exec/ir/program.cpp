// The Program's own vocabulary (roles, storages, GEMM operands, collectives) and what is read off a
// finished Program (its saved set, its distinct kernels, parameter slots). Building one is compile.cpp's.
#include "exec/ir/program.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "common/error.hpp"

namespace jitfuse::exec {

std::string role_name(BufferRole r) {
  switch (r) {
    case BufferRole::input: return "input";
    case BufferRole::output: return "output";
    case BufferRole::extra_in: return "extra_in";
    case BufferRole::extra_out: return "extra_out";
    case BufferRole::grad_output: return "grad_output";
    case BufferRole::grad_input: return "grad_input";
    case BufferRole::grad_extra_out: return "grad_extra_out";
    case BufferRole::grad_extra_in: return "grad_extra_in";
    case BufferRole::param: return "param";
    case BufferRole::grad: return "grad";
    case BufferRole::recipe_state: return "recipe_state";
    case BufferRole::rng_state: return "rng_state";
    case BufferRole::activation: return "activation";
    case BufferRole::gradient: return "gradient";
    case BufferRole::saved_context: return "saved";
    case BufferRole::fp8: return "fp8";
    case BufferRole::temp: return "temp";
  }
  return "?";
}

std::string storage_name(Storage s) {
  switch (s) {
    case Storage::caller: return "caller";
    case Storage::saved_block: return "saved";
    case Storage::fwd_arena: return "fwd arena";
    case Storage::bwd_arena: return "bwd arena";
    case Storage::persistent: return "persistent";
  }
  return "?";
}

namespace {
using K = GemmOperandKind;
using C = cuda::GemmCall;
constexpr GemmOperandInfo kOperands[kGemmOperands] = {
    {GemmOperand::a, "a", &GemmStep::a, K::tensor, [](C& c, void* p) { c.a = p; }},
    {GemmOperand::b, "b", &GemmStep::b, K::tensor, [](C& c, void* p) { c.b = p; }},
    {GemmOperand::c, "c", &GemmStep::c, K::tensor, [](C& c, void* p) { c.c = p; }},
    {GemmOperand::d, "d", &GemmStep::d, K::tensor, [](C& c, void* p) { c.d = p; }},
    {GemmOperand::bias, "bias", &GemmStep::bias, K::tensor, [](C& c, void* p) { c.bias = p; }},
    {GemmOperand::aux, "aux", &GemmStep::aux, K::tensor, [](C& c, void* p) { c.aux = p; }},
    {GemmOperand::a_scale_inv, "a_scale_inv", &GemmStep::a_scale_inv, K::fp8_input,
     [](C& c, void* p) { if (c.fp8) c.fp8->a_scale_inv = static_cast<const float*>(p); }},
    {GemmOperand::b_scale_inv, "b_scale_inv", &GemmStep::b_scale_inv, K::fp8_input,
     [](C& c, void* p) { if (c.fp8) c.fp8->b_scale_inv = static_cast<const float*>(p); }},
    {GemmOperand::d_scale, "d_scale", &GemmStep::d_scale, K::fp8_output,
     [](C& c, void* p) { if (c.fp8) c.fp8->d_scale = static_cast<const float*>(p); }},
    {GemmOperand::d_amax, "d_amax", &GemmStep::d_amax, K::fp8_output,
     [](C& c, void* p) { if (c.fp8) c.fp8->d_amax = static_cast<float*>(p); }},
    {GemmOperand::d_history, "d_history", &GemmStep::d_history, K::executor, [](C&, void*) {}},
    {GemmOperand::d_scale_inv, "d_scale_inv", &GemmStep::d_scale_inv, K::executor, [](C&, void*) {}},
    {GemmOperand::workspace, "workspace", &GemmStep::workspace, K::workspace, [](C& c, void* p) { c.workspace = p; }},
    {GemmOperand::ones, "ones", &GemmStep::ones, K::executor, [](C&, void*) {}},
    {GemmOperand::route, "route", &GemmStep::route, K::executor, [](C&, void*) {}},
};
constexpr bool in_order() {
  for (int i = 0; i < kGemmOperands; ++i)
    if (static_cast<int>(kOperands[i].operand) != i) return false;
  return true;
}
static_assert(in_order(), "kOperands: one row per GemmOperand, in its order");
}  // namespace

const GemmOperandInfo& gemm_operand(GemmOperand o) { return kOperands[static_cast<int>(o)]; }

int GemmStep::operand(GemmOperand o) const { return this->*gemm_operand(o).field; }

std::vector<int> Program::saved_set() const {
  std::vector<int> out;
  if (!training) return out;
  // Buffers the backward reads that the forward produced or was given (a saved input aliases the caller's).
  std::vector<bool> bwd(buffers.size(), false);
  for (const auto& s : backward)
    for (int id : s.buffers())
      if (id >= 0) bwd[static_cast<size_t>(id)] = true;
  for (const auto& b : buffers) {
    const bool fwd_side = b.storage == Storage::saved_block || b.role == BufferRole::input ||
                          b.role == BufferRole::output ||
                          b.role == BufferRole::extra_in || b.role == BufferRole::extra_out;
    if (fwd_side && bwd[static_cast<size_t>(b.id)]) out.push_back(b.id);
  }
  return out;
}

std::vector<int> Step::buffers() const {
  std::vector<int> out;
  switch (kind) {
    case Kind::gemm:
      for (int i = 0; i < kGemmOperands; ++i) out.push_back(gemm.operand(static_cast<GemmOperand>(i)));
      break;
    case Kind::comm: out = {comm.send, comm.recv, comm.a2a.counts, comm.a2a.route}; break;
    case Kind::kernel:
      for (const auto& a : kernel->args)
        if (a.kind == KArg::Kind::buffer) out.push_back(a.buffer);
      break;
    case Kind::finalize: out = finalize.pairs; break;
    case Kind::fp8_update:
      for (const auto& e : fp8_update.entries) out.insert(out.end(), {e.partials, e.history, e.scale, e.scale_inv});
      break;
  }
  return out;
}

const char* step_kind_name(Step::Kind k) {
  switch (k) {
    case Step::Kind::gemm: return "gemm";
    case Step::Kind::kernel: return "kernel";
    case Step::Kind::comm: return "comm";
    case Step::Kind::finalize: return "finalize";
    case Step::Kind::fp8_update: return "fp8_update";
  }
  return "?";
}

bool Program::has_comm() const {
  for (const auto* steps : {&forward, &backward})
    for (const auto& s : *steps)
      if (s.kind == Step::Kind::comm) return true;
  return false;
}

const char* collective_name(Collective c) {
  switch (c) {
    case Collective::all_gather: return "all_gather";
    case Collective::reduce_scatter: return "reduce_scatter";
    case Collective::all_reduce: return "all_reduce";
    case Collective::broadcast: return "broadcast";
    case Collective::reduce: return "reduce";
    case Collective::all_to_all: return "all_to_all";
    case Collective::peer_push: return "peer_push";
    case Collective::peer_wait: return "peer_wait";
    case Collective::peer_ack: return "peer_ack";
    case Collective::peer_take: return "peer_take";
  }
  return "?";
}

int64_t CommStep::wire_bytes(int world_size) const {
  const int64_t w = world_size, bytes = count * static_cast<int64_t>(ops::dtype_bytes(dtype));
  if (w <= 1) return 0;
  switch (op) {
    case Collective::all_gather:                                 // (W-1)/W of the gathered W * count
    case Collective::reduce_scatter: return bytes * (w - 1);     // (W-1)/W of the input W * count
    case Collective::all_reduce: return 2 * (bytes / w) * (w - 1);
    case Collective::broadcast:
    case Collective::reduce: return bytes;  // a pipelined ring moves the chunk once over each link
    case Collective::all_to_all: return bytes / w * (w - 1);  // uniform routing: (W-1)/W of the rows leave
    case Collective::peer_push: return bytes;                  // one rank's rows to their owner
    case Collective::peer_wait:
    case Collective::peer_ack:
    case Collective::peer_take: return 0;  // its bytes crossed in the sender's push
  }
  return 0;
}

int Program::find(BufferRole role, int op, const std::string& name) const {
  for (const auto& b : buffers)
    if (b.role == role && b.op == op && (name.empty() || b.name == name)) return b.id;
  return -1;
}

std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> program_kernels(const Program& p) {
  std::vector<std::pair<codegen::KernelSpec, nlohmann::json>> out;
  // Sources are position independent, so the groups of every layer of a deep model ask for the same few
  // kernels: each distinct source is listed once (same source, same cache key), with the metadata of its
  // first use.
  std::set<std::string> seen;
  auto add = [&](const codegen::KernelSpec& spec, const std::string& source, const nlohmann::json& meta) {
    if (seen.insert(source).second) out.emplace_back(spec, meta);
  };
  for (const auto* steps : {&p.forward, &p.backward})
    for (const auto& s : *steps) {
      if (s.kind != Step::Kind::kernel) continue;
      const KernelStep& k = *s.kernel;
      add(k.spec, k.gen.source, k.meta);
    }
  return out;
}

int param_slot(const std::vector<ops::Op>& ops, int op, const std::string& name) {
  if (op < 0 || static_cast<size_t>(op) >= ops.size()) return -1;
  int base = 0;
  for (int o = 0; o < op; ++o) base += static_cast<int>(ops[static_cast<size_t>(o)].params.size());
  const auto& params = ops[static_cast<size_t>(op)].params;
  for (size_t j = 0; j < params.size(); ++j)
    if (params[j].name == name) return base + static_cast<int>(j);
  return -1;
}

size_t param_slot_count(const std::vector<ops::Op>& ops) {
  size_t n = 0;
  for (const auto& op : ops) n += op.params.size();
  return n;
}

}  // namespace jitfuse::exec
