// Emission of op stages (forward and backward) over one 8-element chunk held in registers; shared by
// the elementwise, gated, rownorm and cast_transpose skeletons.
#pragma once
#include <map>

#include "writer.hpp"

namespace jitfuse::codegen::detail {

// Where a chunk sits: flat element index of its first element, its column, the tensor width, the row.
struct ChunkCtx {
  std::string var;     // float[8] holding the values (forward) or gradients (backward)
  std::string base;    // flat index expression of element 0 (jf_i64)
  std::string col;     // column expression of element 0
  int64_t width = 0;   // columns of the tensor at this point
  std::string half;    // "" or "_a"/"_b": suffix for per-thread caches in gated kernels
  std::string col_off; // compile-time column offset of this half within the tensor ("0" or "N")
  std::string row = "r";
  // Tensors already loaded ahead of the stage chain (several loads in flight): pointer -> float[8] name.
  const std::map<std::string, std::string>* preloaded = nullptr;
};

// Pointers of the per-element tensors a stage chain reads (extra inputs forward; saved tensors and
// extra-output grads backward), so a skeleton can issue their loads together with its input's.
std::vector<std::string> chain_reads(const std::vector<Stage>& stages, Direction dir);

// Per-thread state declared before the row loop: bias caches (forward), accumulators (backward).
struct Setup {
  Writer pre_loop;       // declarations before the row loop
  struct Acc {
    std::string var;     // float[8]
    std::string partial; // pointer name
    int64_t width;       // partial row width
    std::string col_off; // column offset within the partial row
  };
  std::vector<Acc> accs;
  std::vector<Finalize> finalize;
};

// Writes setup.pre_loop at w's indentation (the kernel body's, before the row loop).
void emit_pre_loop(Writer& w, const Setup& setup);
// The start of a kernel over column chunks of 8 (elementwise, gated, cast_transpose): the thread's first
// column c0, whether it is in the tensor (`active`), how many of its 8 are (`n`), then setup.pre_loop and
// the FP8 prologue `fp8_setup`.
void emit_chunk_prologue(Writer& w, const Setup& setup, const std::string& fp8_setup, int bx, int64_t cols);
void emit_stage_fwd(Writer& w, Args& args, Setup& setup, const Stage& s, const ChunkCtx& c);
void emit_stage_bwd(Writer& w, Args& args, Setup& setup, const Stage& s, const ChunkCtx& c);
// Sums each accumulator over the block's threadIdx.y rows into one partial row (columns < cols).
void emit_accumulator_flush(Writer& w, const Setup& setup, int bx, int by, int64_t cols, const std::string& part_index);
// The kernel's output: a store of `var` at out + index, or, with an FP8 cast, its amax and/or FP8 codes.
// `codes` (a jf_u32[2]; FP8 casts only): the codes are converted into it first, for the skeleton to reuse
// (cast_transpose stages them for the transposed store).
void emit_out_store(Writer& w, const KernelSpec& spec, const std::string& index, const std::string& var,
                    const std::string& codes = "");
// FP8: the output pointer type, the scale/amax arguments and per-thread state (before the row loop).
std::string out_type(const KernelSpec& spec);
// FP8 cast_transpose: declares the Role::fp8_colwise argument (the transposed codes); returns its C name.
std::string fp8_colwise_arg(Args& args, const KernelSpec& spec);
void emit_fp8_prologue(Writer& w, Args& args, const KernelSpec& spec);
// FP8: folds the per-thread amax into the amax argument (after the row loop; every thread).
void emit_fp8_epilogue(Writer& w, const KernelSpec& spec);
// FP8: "2^margin" as a float literal (the scale's divisor).
std::string fp8_margin_pow2(const Fp8Spec& q);
// The recipe-state update kernel named `kernel` that runs after a cast kernel with this FP8 spec (amax_only:
// fp8_current's amax; else fp8_delayed's history roll, batched for GEMM operands), from its template
// templates/kernels/fp8_update.cu (fp8_update.cpp).
void emit_fp8_update(Writer& w, const std::string& kernel, const Fp8Spec& q);
// Writes the kernel once per variant (emit_variants), appends the FP8 update and finalize kernels of
// `setup` to `w` and fills g.finalize, g.args and g.source.
void finish(Writer& w, Setup& setup, const Args& args, Generated& g, const KernelSpec& spec);
// Registers partials + finalize for a parameter grad reduced over rows.
std::string declare_accumulator(Args& args, Setup& setup, int op, Key param, int64_t width,
                                const std::string& col_off, const std::string& half);

}  // namespace jitfuse::codegen::detail
