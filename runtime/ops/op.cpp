// Shapes, attribute validation and the registry of op kinds.
#include "ops/op.hpp"

#include <cfloat>
#include <cmath>
#include <sstream>

#include "common/error.hpp"
#include "common/text.hpp"

namespace jitfuse::ops {

int64_t numel(const Shape& s) {
  int64_t n = 1;
  for (auto d : s)
    if (__builtin_mul_overflow(n, d, &n))  // a wrapped product would pass every later size check
      fail(Status::invalid_argument, "shape {} has more elements than a signed 64-bit count can hold", shape_str(s));
  return n;
}
int64_t cols_of(const Shape& s) { return s.empty() ? 1 : s.back(); }
int64_t rows_of(const Shape& s) { return s.empty() ? 1 : numel(s) / std::max<int64_t>(1, s.back()); }

std::string shape_str(const Shape& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) out += (i ? "x" : "") + std::to_string(s[i]);
  return out.empty() ? "scalar" : out;
}

Shape parse_shape(const std::string& text) {
  Shape s;
  std::string tok;
  for (size_t i = 0; i <= text.size(); ++i) {
    if (i == text.size() || text[i] == 'x' || text[i] == ',' || text[i] == 'X') {
      if (tok.empty()) fail(Status::invalid_argument, "bad shape '{}': expected dims like 8192x4096", jitfuse::text::shorten(text));
      size_t used = 0;
      long long v = 0;
      try {
        v = std::stoll(tok, &used);
      } catch (...) {
        used = 0;
      }
      if (used != tok.size() || v <= 0)
        fail(Status::invalid_argument, "bad shape '{}': '{}' is not a positive integer", jitfuse::text::shorten(text),
             jitfuse::text::shorten(tok));
      s.push_back(v);
      tok.clear();
    } else if (text[i] != ' ') {
      tok += text[i];
    }
  }
  return s;
}

std::string family_name(Family f) {
  switch (f) {
    case Family::linear: return "linear";
    case Family::bias: return "bias";
    case Family::pointwise: return "pointwise";
    case Family::gated: return "gated";
    case Family::norm: return "norm";
    case Family::dropout: return "dropout";
    case Family::add_extra_input: return "add_extra_input";
    case Family::make_extra_output: return "make_extra_output";
    case Family::comm: return "comm";
    case Family::loss: return "loss";
    case Family::moe: return "moe";
    case Family::grouped_linear: return "grouped_linear";
  }
  return "?";
}

std::string Op::label() const {
  if (inserted_for >= 0) return fmt::format("op {} ({}, inserted for op {})", index, kind, inserted_for);
  return fmt::format("op {} ({})", index, kind);
}

void shape_error(const Op& op, const std::string& what) {
  fail(Status::invalid_argument, "{}: shape mismatch: {} (input shape {})", op.label(), what, shape_str(op.in));
}

namespace {
std::string type_name(AttrSpec::Type t) {
  switch (t) {
    case AttrSpec::Type::number: return "a number";
    case AttrSpec::Type::integer: return "an integer";
    case AttrSpec::Type::boolean: return "true or false";
    case AttrSpec::Type::string: return "a string";
    case AttrSpec::Type::shape: return "an array of integers";
  }
  return "?";
}
}  // namespace

std::string float_range_problem(double v) {
  if (!std::isfinite(v)) return "a finite number";
  if (std::fabs(v) > static_cast<double>(FLT_MAX)) return fmt::format("a number within float range (|x| <= {:g})", FLT_MAX);
  if (v != 0 && std::fabs(v) < static_cast<double>(FLT_MIN))
    return fmt::format("0 or a number of magnitude >= {:g} (smaller ones are flushed to zero in float)", FLT_MIN);
  return "";
}

nlohmann::json validate_attrs(const OpKind& kind, const nlohmann::json& attrs, const std::string& where,
                              const std::function<std::string(const std::string&)>& where_attr) {
  if (!attrs.is_object()) fail(Status::invalid_argument, "{}: an op must be a JSON object", where);
  nlohmann::json out = nlohmann::json::object();
  for (auto& [key, value] : attrs.items()) {
    if (key == "op" || key == "name" || key == "comment") continue;
    bool known = false;
    for (auto& a : kind.attrs) known |= a.name == key;
    if (!known) {
      std::string list;
      for (auto& a : kind.attrs) list += (list.empty() ? "" : ", ") + a.name;
      fail(Status::invalid_argument, "{}: unknown attribute '{}' for op '{}'; known attributes: {}", where,
           jitfuse::text::shorten(key),
           kind.name, list.empty() ? "none" : list);
    }
  }
  for (const auto& a : kind.attrs) {
    if (!attrs.contains(a.name)) {
      if (a.default_value.is_null())
        fail(Status::invalid_argument, "{}: op '{}' needs attribute '{}' ({})", where, kind.name, a.name,
             type_name(a.type));
      out[a.name] = a.default_value;
      continue;
    }
    const auto& v = attrs.at(a.name);
    auto bad = [&](const std::string& expected) {
      fail(Status::invalid_argument, "{}: attribute '{}' of op '{}': expected {}, got {}",
           where_attr ? where_attr(a.name) : where, a.name, kind.name, expected,
           jitfuse::text::shorten(v.dump(-1, ' ', true, nlohmann::json::error_handler_t::replace)));
    };
    switch (a.type) {
      case AttrSpec::Type::number:
      case AttrSpec::Type::integer: {
        if (!v.is_number()) bad(type_name(a.type));
        double d = v.get<double>();
        if (a.type == AttrSpec::Type::integer && (!v.is_number_integer() || d != static_cast<double>(v.get<int64_t>())))
          bad(type_name(a.type));
        if (a.type == AttrSpec::Type::number)
          if (std::string p = float_range_problem(d); !p.empty()) bad(p);
        if (a.min && (a.min_exclusive ? d <= *a.min : d < *a.min))
          bad(fmt::format("a value {} {}", a.min_exclusive ? ">" : ">=", *a.min));
        if (a.max && (a.max_exclusive ? d >= *a.max : d > *a.max))
          bad(fmt::format("a value {} {}", a.max_exclusive ? "<" : "<=", *a.max));
        break;
      }
      case AttrSpec::Type::boolean:
        if (!v.is_boolean()) bad(type_name(a.type));
        break;
      case AttrSpec::Type::string: {
        if (!v.is_string()) bad(type_name(a.type));
        if (!a.choices.empty()) {
          bool ok = false;
          for (auto& c : a.choices) ok |= c == v.get<std::string>();
          if (!ok) {
            std::string list;
            for (auto& c : a.choices) list += (list.empty() ? "" : "|") + c;
            bad("one of " + list);
          }
        }
        break;
      }
      case AttrSpec::Type::shape:
        if (!v.is_array() || v.empty()) bad(type_name(a.type));
        if (v.size() > kMaxDims) bad(fmt::format("at most {} dims", kMaxDims));
        for (auto& d : v)
          if (!d.is_number_integer() || (d.get<int64_t>() <= 0 && d.get<int64_t>() != -1))
            bad("positive integers (or one -1)");
        break;
    }
    out[a.name] = v;
  }
  return out;
}

Registry::Registry() {
  register_linear(*this);
  register_bias(*this);
  register_activations(*this);
  register_norms(*this);
  register_dropout(*this);
  register_structural(*this);
  register_comm(*this);
  register_cross_entropy(*this);
  register_moe(*this);
}

void Registry::add(OpKind kind) {
  auto it = kinds_.find(kind.name);
  if (it != kinds_.end() && !it->second->user_declared)
    fail(Status::invalid_argument, "{}: op '{}' is built in and cannot be redeclared; pick another name",
         kind.declared_in, kind.name);
  std::string name = kind.name;  // not kinds_[kind.name] = ...(std::move(kind)): the right side runs first
  // Sequences parsed earlier point at the kind they were parsed with: a redeclared op keeps the old one
  // alive for them instead of leaving their pointers dangling.
  if (it != kinds_.end()) retired_.push_back(it->second);
  kinds_[name] = std::make_shared<OpKind>(std::move(kind));
}

const OpKind* Registry::find(const std::string& name) const {
  auto it = kinds_.find(name);
  return it == kinds_.end() ? nullptr : it->second.get();
}

std::vector<std::string> Registry::names() const {
  std::vector<std::string> out;
  for (auto& [k, v] : kinds_) out.push_back(k);
  return out;
}

}  // namespace jitfuse::ops
