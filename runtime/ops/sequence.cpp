// Parsing sequence files and inferring shapes op by op.
#include "ops/sequence.hpp"

#include "common/error.hpp"
#include "common/json_util.hpp"
#include "common/text.hpp"

namespace jitfuse::ops {

SequenceDef parse_sequence(const std::string& text, const std::string& where, const Registry& registry) {
  nlohmann::json j = json_util::parse(text, where);
  json_util::Locator locator(text);  // one per text: locating every op stays linear in the file
  auto at = [&](const std::string& ptr) { return locator.where(where, ptr); };
  if (!j.is_object()) fail(Status::parse_error, "{}: a sequence file is a JSON object with \"ops\"", at(""));
  if (j.contains("format") && j["format"] != "jitfuse.sequence/1")
    fail(Status::parse_error, "{}: unsupported format {}: this build reads \"jitfuse.sequence/1\"", at("/format"),
         jitfuse::text::shorten(j["format"].dump()));
  if (!j.contains("ops") || !j["ops"].is_array() || j["ops"].empty())
    fail(Status::parse_error, "{}: \"ops\" must be a non-empty array of ops", at(""));
  if (j["ops"].size() > kMaxOps)
    fail(Status::parse_error, "{}: the sequence has {} ops, more than the limit of {}: split it", at("/ops"),
         j["ops"].size(), kMaxOps);
  SequenceDef def;
  if (j.contains("name") && !j["name"].is_string())  // j.value() would throw nlohmann's type_error instead
    fail(Status::parse_error, "{}: \"name\" must be a string", at("/name"));
  def.name = j.value("name", "sequence");
  // The name is quoted in every later message about this sequence: keep it a name.
  if (def.name.size() > kMaxNameBytes)
    fail(Status::parse_error, "{}: \"name\" '{}' is longer than {} bytes", at("/name"), jitfuse::text::shorten(def.name),
         kMaxNameBytes);
  if (j.contains("fp8")) {
    const auto& f = j["fp8"];
    if (!f.is_object()) fail(Status::parse_error, "{}: \"fp8\" must be an object like {{\"amax_history_len\": 16, \"margin\": 0}}", at("/fp8"));
    for (const auto& [k, v] : f.items()) {
      const bool hist = k == "amax_history_len";
      if (!hist && k != "margin")
        fail(Status::parse_error, "{}: unknown key '{}' in \"fp8\"; known: amax_history_len, margin", at("/fp8"),
             jitfuse::text::shorten(k));
      const int lo = hist ? 1 : 0, hi = hist ? kMaxAmaxHistory : kMaxFp8Margin;
      if (!v.is_number_integer() || v.get<int64_t>() < lo || v.get<int64_t>() > hi)
        fail(Status::parse_error, "{}: \"{}\" must be an integer from {} to {}, not {}", at("/fp8/" + k), k, lo, hi,
             jitfuse::text::shorten(v.dump()));
      (hist ? def.fp8_amax_history : def.fp8_margin) = static_cast<int>(v.get<int64_t>());
    }
  }
  nlohmann::json canon = nlohmann::json::array();
  for (size_t i = 0; i < j["ops"].size(); ++i) {
    const auto& o = j["ops"][i];
    std::string ptr = "/ops/" + std::to_string(i);
    std::string loc = fmt::format("{}: op {}", at(ptr), i);
    if (!o.is_object() || !o.contains("op") || !o["op"].is_string())
      fail(Status::parse_error, "{}: each op is an object with a string \"op\"", loc);
    std::string kind = o["op"];
    const OpKind* info = registry.find(kind);
    if (!info) {
      std::string known;
      for (auto& n : registry.names()) known += (known.empty() ? "" : ", ") + n;
      fail(Status::invalid_argument, "{}: unknown op '{}'; known ops: {} (declare new pointwise ops in a rules file)",
           loc, jitfuse::text::shorten(kind), known);
    }
    OpDef d;
    d.index = static_cast<int>(i);
    d.kind = kind;
    d.info = info;
    // Attribute errors point at the attribute itself (a key with '/' or '~' cannot be in the kind's list).
    auto where_attr = [&](const std::string& attr) {
      return fmt::format("{}: op {} ({})", o.contains(attr) ? at(ptr + "/" + attr) : at(ptr), i, kind);
    };
    d.attrs = validate_attrs(*info, o, fmt::format("{} ({})", loc, kind), where_attr);
    if (info->family == Family::add_extra_input) ++def.extra_inputs;
    if (info->family == Family::make_extra_output) ++def.extra_outputs;
    nlohmann::json c = d.attrs;
    c["op"] = kind;
    canon.push_back(c);
    def.ops.push_back(std::move(d));
  }
  def.canonical = canon.dump();
  return def;
}

SequenceDef parse_sequence_file(const std::string& path, const Registry& registry) {
  return parse_sequence(json_util::read_file(path), path, registry);
}

std::vector<Op> infer(const SequenceDef& def, const Shape& input) {
  if (input.empty() || input.size() > kMaxDims)
    fail(Status::invalid_argument, "sequence '{}': the input shape has {} dims; it needs 1 to {}", def.name,
         input.size(), kMaxDims);
  for (size_t i = 0; i < input.size(); ++i)
    if (input[i] <= 0)
      fail(Status::invalid_argument, "sequence '{}': dim {} of the input shape {} is {}; every dim must be positive",
           def.name, i, shape_str(input), input[i]);
  numel(input);  // throws when the element count overflows
  std::vector<Op> ops;
  Shape cur = input;
  int extra_in = 0, extra_out = 0;
  for (const auto& d : def.ops) {
    Op op;
    op.index = d.index;
    op.kind = d.kind;
    op.info = d.info;
    op.family = d.info->family;
    op.attrs = d.attrs;
    op.in = cur;
    op.out = cur;
    if (op.family == Family::pointwise) {
      op.saved = {d.info->saves};
      op.functor = d.info->functor;
      op.template_file = d.info->template_file;
      for (auto& a : d.info->const_attrs) op.consts.push_back(op.num(a.c_str()));
    }
    if (op.family == Family::add_extra_input) op.extra_slot = extra_in++;
    if (op.family == Family::make_extra_output) op.extra_slot = extra_out++;
    if (d.info->infer) d.info->infer(op);
    cur = op.out;
    ops.push_back(std::move(op));
  }
  return ops;
}

void apply_recipe(const SequenceDef& def, Recipe& recipe) {
  if (!recipe.is_fp8()) return;
  // fp8_current keeps a history of one entry (this call's amax); the length applies to fp8_delayed.
  if (def.fp8_amax_history > 0 && recipe.kind == RecipeKind::fp8_delayed) recipe.amax_history = def.fp8_amax_history;
  if (def.fp8_margin >= 0) recipe.margin = def.fp8_margin;
  const std::string rn = recipe_name(recipe.kind);
  for (const auto& op : def.ops) {
    if (op.kind == "quantize" && op.index + 1 != static_cast<int>(def.ops.size()))
      fail(Status::invalid_argument,
           "sequence '{}': op {} (quantize) under recipe {} must be the last op: its E4M3 output is the sequence's "
           "output (split the sequence after it)", def.name, op.index, rn);
  }
}

}  // namespace jitfuse::ops
