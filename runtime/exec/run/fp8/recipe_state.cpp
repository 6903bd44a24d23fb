// FP8 names (names.hpp) and the per-(sequence, device) FP8 state (recipe_state.hpp).
#include "exec/run/fp8/recipe_state.hpp"

#include <algorithm>

#include "common/error.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"

namespace jitfuse::exec::fp8 {

const char* name(Operand o) {
  switch (o) {
    case Operand::input: return "input";
    case Operand::weight: return "weight";
    case Operand::grad_output: return "grad_output";
    case Operand::none: break;
  }
  return "";
}

const char* name(Part p) {
  switch (p) {
    case Part::scale: return "scale";
    case Part::scale_inv: return "scale_inv";
    case Part::history: return "amax_history";
    case Part::row: return "row";
    case Part::col: return "col";
    case Part::col_scale_inv: return "col_scale_inv";
  }
  return "?";
}

std::optional<Operand> parse_operand(std::string_view s) {
  if (s.empty()) return Operand::none;
  for (Operand o : kOperands)
    if (s == name(o)) return o;
  return std::nullopt;
}

ops::DType output_dtype(const ops::Recipe& recipe, std::string_view last_op_kind) {
  return recipe.is_fp8() && last_op_kind == "quantize" ? ops::DType::e4m3 : recipe.dtype;
}

RecipeState::RecipeState(const ops::SequenceDef& def, const ops::Recipe& recipe, CUstream stream) {
  const auto& d = cuda::driver();
  const int len = std::max(1, recipe.amax_history);
  std::vector<float> init(2 + static_cast<size_t>(len), 0.f);
  init[0] = init[1] = 1.f;
  auto make = [&](int op, Operand o) {
    CUdeviceptr p = 0;
    cuda::check(d.cuMemAlloc(&p, init.size() * sizeof(float)), "cuMemAlloc(FP8 recipe state)");
    State st;
    st.scale = reinterpret_cast<float*>(p);
    st.scale_inv = st.scale + 1;
    st.history = st.scale + 2;
    st.len = len;
    states_[{op, o}] = st;  // owned (freed by the destructor) from here on
    // Ordered with the stream: a synchronous cuMemcpyHtoD from pageable memory may still be in flight when
    // a kernel on a non-blocking stream reads the state. Synchronised below, once.
    cuda::check(d.cuMemcpyHtoDAsync(p, init.data(), init.size() * sizeof(float), stream),
                "cuMemcpyHtoDAsync(FP8 recipe state)");
  };
  try {
    for (const auto& op : def.ops) {
      if (op.kind == "quantize") make(op.index, Operand::none);
      if (op.kind == "linear")
        for (Operand o : kOperands) make(op.index, o);
    }
    cuda::check(d.cuStreamSynchronize(stream), "cuStreamSynchronize(FP8 recipe state)");
  } catch (...) {
    for (auto& [key, st] : states_) d.cuMemFree(reinterpret_cast<CUdeviceptr>(st.scale));
    throw;
  }
}

RecipeState::~RecipeState() {
  if (auto* d = cuda::try_driver()) {
    for (auto& [key, st] : states_) d->cuMemFree(reinterpret_cast<CUdeviceptr>(st.scale));  // one block each
    for (auto& [key, c] : copies_) d->cuMemFree(reinterpret_cast<CUdeviceptr>(c.ptr));
  }
}

const State& RecipeState::state(int op, Operand operand) const {
  auto it = states_.find({op, operand});
  if (it == states_.end())
    fail(Status::invalid_argument, "op {} has no FP8 recipe state{}", op,
         operand == Operand::none ? "" : std::string(" for its ") + name(operand));
  return it->second;
}

Binding RecipeState::bind(const Program& p) {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& d = cuda::driver();
  Binding out;
  for (const auto& b : p.buffers) {
    if (b.storage == Storage::persistent) {
      auto& c = copies_[{b.op, b.fp8_operand, b.fp8_part}];
      if (!c.ptr) {
        CUdeviceptr ptr = 0;
        cuda::check(d.cuMemAlloc(&ptr, std::max<size_t>(b.bytes, 16)), "cuMemAlloc(FP8 weight copy)");
        c.ptr = reinterpret_cast<void*>(ptr);
        c.bytes = b.bytes;
      } else if (c.bytes != b.bytes) {  // weights have one shape per sequence: every program asks the same
        fail(Status::internal, "persistent buffer {}: {} bytes, earlier {}", b.name, b.bytes, c.bytes);
      }
      out.buffers.emplace_back(b.id, c.ptr);
      out.weights.uses.push_back({c.cast_from.get(), param_slot(p.ops, b.op, "weight")});
      continue;
    }
    if (b.role != BufferRole::recipe_state) continue;
    auto it = states_.find({b.op, b.fp8_operand});
    if (it == states_.end())
      fail(Status::internal, "{}: no FP8 recipe state{}", p.ops.at(static_cast<size_t>(b.op)).label(),
           b.fp8_operand == Operand::none ? "" : std::string(" for its ") + name(b.fp8_operand));
    const State& st = it->second;
    out.buffers.emplace_back(b.id, b.fp8_part == Part::scale       ? static_cast<void*>(st.scale)
                                   : b.fp8_part == Part::scale_inv ? static_cast<void*>(st.scale_inv)
                                                                   : static_cast<void*>(st.history));
  }
  return out;
}

bool WeightCopies::unchanged(const std::vector<const void*>& params, bool host_says) const {
  auto source = [&](const Use& u) -> const void* {
    return u.slot >= 0 && static_cast<size_t>(u.slot) < params.size() ? params[static_cast<size_t>(u.slot)] : nullptr;
  };
  // Skipped only if every copy this program reads was cast, by an earlier forward, from the same pointer.
  bool ok = host_says;
  for (const auto& u : uses) {
    if (!ok) break;
    const void* from = u.cast_from->load(std::memory_order_acquire);
    ok = from && from == source(u);
  }
  if (ok) {
    log().debug("FP8 weights unchanged: the weight casts are skipped");
    return true;
  }
  for (const auto& u : uses) u.cast_from->store(source(u), std::memory_order_release);  // this forward casts
  return false;
}

}  // namespace jitfuse::exec::fp8
