// Source-writing helpers shared by the skeleton emitters: an indenting line writer, argument lists,
// and number formatting that round-trips (constants reach source only as typed numbers).
#pragma once
#include <string>
#include <vector>

#include <fmt/format.h>

#include "jitfuse/codegen/kernel_spec.hpp"

namespace jitfuse::codegen::detail {

class Writer {
 public:
  template <typename... A>
  void line(fmt::format_string<A...> f, A&&... a) {
    out_.append(indent_ * 2, ' ');
    out_ += fmt::format(f, std::forward<A>(a)...);
    out_ += '\n';
  }
  void raw(const std::string& s) { out_ += s; }
  void open() { ++indent_; }
  void close() { --indent_; }
  const std::string& str() const { return out_; }
  // Remembers where the text written so far ends (emit_prelude: where the kernel starts).
  void mark() { mark_ = out_.size(); }
  size_t marked() const { return mark_; }

 private:
  std::string out_;
  int indent_ = 0;
  size_t mark_ = 0;
};

// Kernel arguments: their C declarations and their binding descriptions, in one order.
class Args {
 public:
  void ptr(Arg::Role role, int op, const std::string& name, const std::string& c_name, const std::string& type,
           bool writes);
  // A keyed argument (param, saved, partials, a channel's gradient): bound by (op, key).
  void ptr(Arg::Role role, int op, Key key, const std::string& c_name, const std::string& type, bool writes);
  void scalar(Arg::Role role, int op, const std::string& name, const std::string& c_name, const std::string& type);
  // Staged tensor `slot` of this rank's peer staging (Stage::Kind::staged_add), read.
  void staged(int op, int slot, const std::string& c_name, const std::string& type);
  std::string decl() const;  // "const ST* __restrict__ in, ..."
  const std::vector<Arg>& args() const { return args_; }
  bool has(const std::string& c_name) const;

 private:
  std::vector<Arg> args_;
  std::vector<std::string> decls_, names_;
};

// Text from a rule or sequence (math notes, op kinds, rule names) made safe for the inside of one `//`
// comment: control characters, non-ASCII bytes and a backslash that would end the line (splicing the next
// source line into the comment) become \xNN, as does the '/' of a "??/" trigraph. Plain printable ASCII is
// kept as is, so the comments of the built-in rules do not change.
std::string comment_text(const std::string& s);
std::string num(double v);  // float literal with 9 significant digits: "1.702f", never text from a rule
std::string storage_struct(const std::string& dtype);  // "jf_bf16"
std::string consts_suffix(const std::vector<double>& consts);  // ", 0.5f, 2f"
// The comment header, the template includes and the dtype typedefs; marks `w` where the kernel starts.
void emit_prelude(Writer& w, const KernelSpec& spec, const std::vector<std::string>& headers);
// Writes the kernel text that `w` holds after its prelude once per variant: under `kernel` with
// `#define JF_VEC true` (when spec.vec), then under `scalar` with `#define JF_VEC false`, each in its
// branch of `#ifndef JF_SCALAR` (one variant per NVRTC program).
void emit_variants(Writer& w, const KernelSpec& spec, const std::string& kernel, const std::string& scalar);
std::vector<std::string> headers_for(const KernelSpec& spec);
// A finalize kernel over `count` gradients of `cols` columns (Finalize): one (partials, grad) pair each.
void emit_finalize(Writer& w, const std::string& kernel, int64_t cols, int count);
std::string kernel_name(const KernelSpec& spec);

}  // namespace jitfuse::codegen::detail
