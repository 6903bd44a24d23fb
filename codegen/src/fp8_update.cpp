// The FP8 recipe-state update kernel that follows a cast kernel: which one a spec needs and the values it
// is filled with; its text is templates/kernels/fp8_update.cu.
#include "kernel_templates.hpp"
#include "stages.hpp"

namespace jitfuse::codegen::detail {
namespace {

const std::string kTemplate = "kernels/fp8_update.cu";

// The shared body of the delayed kernels, as a value for their ${history_roll} line (no final newline).
std::string history_roll(const Fp8Spec& q, const std::string& part, const std::string& count,
                         const std::string& if_scale_inv, const std::string& scale_inv, const std::string& scale) {
  std::string text = fill_template(template_section(kTemplate, "history_roll"),
                                   {{"part", part},
                                    {"count", count},
                                    {"if_scale_inv", if_scale_inv},
                                    {"scale_inv", scale_inv},
                                    {"scale", scale},
                                    {"e5m2", q.e5m2 ? "true" : "false"},
                                    {"margin_pow2", fp8_margin_pow2(q)}});
  if (!text.empty() && text.back() == '\n') text.pop_back();
  return text;
}

}  // namespace

void emit_fp8_update(Writer& w, const std::string& kernel, const Fp8Spec& q) {
  if (q.amax_only) {
    w.raw(fill_template(template_section(kTemplate, "current_amax"), {{"kernel", kernel}}));
    return;
  }
  const std::string format = q.e5m2 ? "E5M2" : "E4M3", format_max = q.e5m2 ? "57344" : "448";
  if (q.tensor.empty()) {
    // A quantize op's state holds scale_inv, written here (1 / the scale the cast used) before the scale moves.
    w.raw(fill_template(template_section(kTemplate, "delayed"),
                        {{"kernel", kernel},
                         {"format", format},
                         {"format_max", format_max},
                         {"history_roll", history_roll(q, "part", "count", "", "scale_inv[0]", "scale[0]")}}));
    return;
  }
  // FP8 GEMM operands and outputs: one launch per pass updates every state the pass quantised into (one
  // block each, up to kFp8Batch), after the pass's last step: a cast or a GEMM uses the stored scale, so the
  // update can wait, and the recipe state costs one small kernel per pass instead of one per tensor. A cast
  // wrote the scale_inv it used with its codes (an operand's scale_inv belongs to its FP8 tensor); a GEMM
  // that writes FP8 (a quantize op's state) cannot, so its entry carries the state's scale_inv, written
  // here before the scale moves (null for casts). The descriptors travel by value (JfFp8Batch, 584 bytes
  // of kernel parameters).
  w.raw(fill_template(template_section(kTemplate, "delayed_batch"),
                      {{"kernel", kernel},
                       {"format", format},
                       {"format_max", format_max},
                       {"batch", std::to_string(kFp8Batch)},
                       {"history_roll", history_roll(q, "b.part[t]", "b.count[t]", "if (b.scale_inv[t]) ",
                                                     "b.scale_inv[t][0]", "b.scale[t][0]")}}));
}

}  // namespace jitfuse::codegen::detail
