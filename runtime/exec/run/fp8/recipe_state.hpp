// The FP8 state of one sequence on one device, with one owner: the recipe states (a quantize op's, and
// each FP8 operand of each linear's GEMMs: scale, scale_inv, amax history), the persistent FP8 copies of
// the weights, which forward last cast each copy from which weight pointer, and the binding of all of it
// into a program's buffers. The C ABI (api::Sequence) holds one per device; nothing else allocates FP8
// state or looks it up.
#pragma once
#include <cuda.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>

#include "exec/ir/fp8/names.hpp"
#include "exec/ir/program.hpp"
#include "ops/sequence.hpp"

namespace jitfuse::exec::fp8 {

// The device buffers of one recipe state (one allocation, kept across calls).
struct State {
  float* scale = nullptr;      // [1] the factor applied before the cast
  float* scale_inv = nullptr;  // [1] dequantizes the last cast (an operand's GEMM reads its copy's own)
  float* history = nullptr;    // [len] amax history, newest first (fp8_current: len 1, this call's amax)
  int len = 0;
};

// Which weight pointer a persistent FP8 copy was last cast from (null: never written). Shared by every
// program of the sequence that reads the copy; read and written without a lock by concurrent calls.
using CastFrom = std::atomic<const void*>;

// The persistent FP8 weight copies one program reads and the parameter slots their weights come from,
// resolved once when the program is bound: what lets a call decide whether its weight casts may be skipped
// with no lookup and no lock (WeightCopies::unchanged).
class WeightCopies {
 public:
  struct Use {
    CastFrom* cast_from = nullptr;
    int slot = -1;  // the weight's parameter slot (param_slot), -1: none
  };
  // Whether a forward may skip its weight casts: the host says the weights did not change AND every copy
  // was written by an earlier forward from the same weight pointer. When it may not, records that this
  // forward (which casts) writes them from `params` (the call's, by slot).
  bool unchanged(const std::vector<const void*>& params, bool host_says) const;
  std::vector<Use> uses;
};

// What binding a program to the state gives its prepare: every recipe-state and persistent buffer of the
// program with its device pointer, and the program's weight copies.
struct Binding {
  std::vector<std::pair<int, void*>> buffers;
  WeightCopies weights;
};

class RecipeState {
 public:
  // Allocates and initialises (scale = scale_inv = 1, history 0) every state of `def` under `recipe` on the
  // current device: uploaded on `stream` and synchronised (a one-time setup of prepare).
  RecipeState(const ops::SequenceDef& def, const ops::Recipe& recipe, CUstream stream);
  ~RecipeState();
  RecipeState(const RecipeState&) = delete;
  RecipeState& operator=(const RecipeState&) = delete;

  // The state of op `op`'s `operand` (none: a quantize op's). Throws invalid_argument if it has none.
  const State& state(int op, Operand operand) const;
  // Allocates the persistent FP8 weight copies `p` reads that no earlier program did, then returns every
  // recipe-state and persistent buffer of `p` with its device pointer and its weight copies: what its
  // calls bind (PrepareWith). The state outlives the binding (the sequence owns both).
  Binding bind(const Program& p);

 private:
  using StateKey = std::pair<int, Operand>;
  using CopyKey = std::tuple<int, Operand, Part>;
  struct Copy {
    void* ptr = nullptr;
    size_t bytes = 0;
    std::unique_ptr<CastFrom> cast_from = std::make_unique<CastFrom>(nullptr);  // stable address for bindings
  };
  std::mutex mu_;
  std::map<StateKey, State> states_;
  std::map<CopyKey, Copy> copies_;
};

}  // namespace jitfuse::exec::fp8
