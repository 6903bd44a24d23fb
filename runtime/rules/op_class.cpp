// Op classes of the rule language ("@pointwise", "@activation", ...): named sets of op kinds, derived from
// what each kind declares (its family; user ops are pointwise activations), so one rule covers user ops too.
#include <algorithm>

#include "rules/rule.hpp"

namespace jitfuse::rules {
namespace {

// Built-in activations; every user-declared op is one as well (it is a pointwise y = f(x) the user named).
bool builtin_activation(const std::string& name) {
  return name == "gelu" || name == "relu" || name == "silu" || name == "qgelu" || name == "srelu";
}

}  // namespace

std::vector<std::string> class_names() { return {"activation", "elementwise", "gated", "norm", "pointwise"}; }

bool class_exists(const std::string& cls) {
  auto names = class_names();
  return std::find(names.begin(), names.end(), cls) != names.end();
}

// Membership, one line per class (docs/rules.md, "Op classes", lists the same):
// - pointwise:   family pointwise: y = f(x) elementwise (activations, scale, identity, quantize, reshape, user ops)
// - activation:  the pointwise activations gelu, relu, silu, qgelu, srelu and every user-declared op
// - elementwise: pointwise plus bias, dropout, add_extra_input, make_extra_output (what one elementwise pass runs)
// - gated:       swiglu, geglu, reglu
// - norm:        layernorm, rmsnorm
bool in_class(const std::string& cls, const ops::OpKind& k) {
  using ops::Family;
  if (cls == "pointwise") return k.family == Family::pointwise;
  if (cls == "activation") return k.family == Family::pointwise && (k.user_declared || builtin_activation(k.name));
  if (cls == "elementwise")
    return k.family == Family::pointwise || k.family == Family::bias || k.family == Family::dropout ||
           k.family == Family::add_extra_input || k.family == Family::make_extra_output;
  if (cls == "gated") return k.family == Family::gated;
  if (cls == "norm") return k.family == Family::norm;
  return false;
}

std::string class_members_text(const std::string& cls) {
  if (cls == "pointwise") return "gelu, relu, silu, qgelu, srelu, scale, identity, quantize, reshape and user ops";
  if (cls == "activation") return "gelu, relu, silu, qgelu, srelu and user ops";
  if (cls == "elementwise") return "every @pointwise op, bias, dropout, add_extra_input and make_extra_output";
  if (cls == "gated") return "swiglu, geglu, reglu";
  if (cls == "norm") return "layernorm, rmsnorm";
  return "";
}

bool PatternElem::accepts(const ops::OpKind* kind, const std::string& name) const {
  if (std::find(kinds.begin(), kinds.end(), name) != kinds.end()) return true;
  return kind && std::any_of(classes.begin(), classes.end(), [&](const std::string& c) { return in_class(c, *kind); });
}

}  // namespace jitfuse::rules
