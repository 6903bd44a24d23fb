// Parsing sequence files and inferring shapes op by op.
#include "ops/sequence.hpp"

#include <cctype>
#include <functional>
#include <map>

#include "common/error.hpp"
#include "common/json_util.hpp"
#include "common/text.hpp"

namespace jitfuse::ops {

namespace {

using At = std::function<std::string(const std::string&)>;  // JSON pointer -> "file:line:col"

bool channel_name_ok(const std::string& n) {
  if (n.empty() || n.size() > kMaxChannelName) return false;
  for (char ch : n)
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '.' && ch != '-') return false;
  return true;
}

std::string checked_channel_name(const nlohmann::json& v, const std::string& where) {
  if (!v.is_string() || !channel_name_ok(v.get<std::string>()))
    fail(Status::parse_error, "{}: a channel name is a string of 1 to {} characters from A-Z a-z 0-9 _ . -, not {}",
         where, kMaxChannelName, jitfuse::text::shorten(v.dump()));
  return v.get<std::string>();
}

// Takes "channel" and "returned" out of op i's object (they are the sequence's wiring, not attributes).
void read_channel_keys(nlohmann::json& o, OpDef& d, const At& at, const std::string& ptr, size_t i) {
  const Family fam = d.info->family;
  const bool fork = fam == Family::make_extra_output, reader = fam == Family::add_extra_input;
  for (const char* key : {"channel", "returned"}) {
    if (!o.contains(key)) continue;
    const std::string where = fmt::format("{}: op {} ({})", at(ptr + "/" + key), i, d.kind);
    if (!fork && !reader)
      fail(Status::parse_error, "{}: \"{}\" belongs to make_extra_output (writes a channel) and add_extra_input "
           "(reads one), not to {}", where, key, d.kind);
    if (std::string(key) == "channel") {
      d.channel = checked_channel_name(o[key], where);
    } else {
      if (!fork) fail(Status::parse_error, "{}: \"returned\" belongs to make_extra_output", where);
      if (!o[key].is_boolean()) fail(Status::parse_error, "{}: \"returned\" must be true or false", where);
      d.returned = o[key].get<bool>();
    }
    o.erase(key);
  }
  if (d.returned && d.channel.empty())
    fail(Status::parse_error, "{}: op {} ({}): \"returned\" needs a \"channel\" (a make_extra_output without one "
         "is always the caller's extra output)", at(ptr + "/returned"), i, d.kind);
}

void read_input_channels(const nlohmann::json& j, SequenceDef& def, const At& at) {
  if (!j.contains("input_channels")) return;
  const auto& a = j["input_channels"];
  if (!a.is_array() || a.size() > kMaxOps)
    fail(Status::parse_error, "{}: \"input_channels\" must be an array of channel names", at("/input_channels"));
  for (size_t k = 0; k < a.size(); ++k) {
    const std::string where = fmt::format("{}: input_channels[{}]", at("/input_channels/" + std::to_string(k)), k);
    std::string n = checked_channel_name(a[k], where);
    for (const auto& m : def.input_channels)
      if (m == n) fail(Status::parse_error, "{}: channel '{}' is declared twice in \"input_channels\"", where, n);
    def.input_channels.push_back(std::move(n));
  }
}

WiringSlot slot_of(const OpDef& d, const char* kind) { return WiringSlot{d.json_index, d.index, d.channel, kind}; }

// Every channel has one source (an earlier make_extra_output, or "input_channels") and at least one use;
// numbers the caller's extra tensors (SequenceDef::extra_input_slots / extra_output_slots, and the counts).
void check_channels(SequenceDef& def, const At& at) {
  std::map<std::string, int> writer, reads;  // writer: op index (-1: the caller's)
  for (const auto& n : def.input_channels) writer[n] = -1;
  auto op_at = [&](const OpDef& d, const char* key) {
    return fmt::format("{}: op {} ({})", at("/ops/" + std::to_string(d.json_index) + "/" + key), d.index, d.kind);
  };
  auto& ins = def.extra_input_slots;
  for (const auto& d : def.ops) {
    const Family fam = d.info->family;
    if (fam == Family::make_extra_output) {
      if (d.channel.empty() || d.returned) def.extra_output_slots.push_back(slot_of(d, d.returned ? "returned" : "output"));
      if (d.channel.empty()) continue;
      if (auto it = writer.find(d.channel); it != writer.end())
        fail(Status::invalid_argument, "{}: channel '{}' already has a source ({}): a channel has one source; name "
             "this one differently", op_at(d, "channel"), d.channel,
             it->second < 0 ? std::string("\"input_channels\"") : "op " + std::to_string(it->second));
      writer[d.channel] = d.index;
    }
    if (d.info->takes_extra_input) {
      if (!d.info->extra_input_grad) def.nograd_extra_inputs.push_back(static_cast<int>(ins.size()));
      ins.push_back(slot_of(d, d.info->extra_input_name.c_str()));
    }
    if (fam != Family::add_extra_input) continue;
    if (d.channel.empty()) {
      ins.push_back(slot_of(d, "add"));
      continue;
    }
    auto it = writer.find(d.channel);
    if (it == writer.end()) {
      int later = -1;
      for (const auto& e : def.ops)
        if (later < 0 && e.index > d.index && e.channel == d.channel && e.info->family == Family::make_extra_output)
          later = e.index;
      fail(Status::invalid_argument, "{}: channel '{}' is read before anything writes it: {}", op_at(d, "channel"),
           d.channel,
           later >= 0 ? fmt::format("its make_extra_output is op {}, after this reader; a source comes before its "
                                    "readers", later)
                      : std::string("write it with an earlier make_extra_output {\"channel\": \"...\"} or declare it "
                                    "in \"input_channels\""));
    }
    if (it->second < 0 && reads[d.channel] == 0) ins.push_back(slot_of(d, "channel"));
    ++reads[d.channel];
  }
  def.extra_inputs = static_cast<int>(ins.size());
  def.extra_outputs = static_cast<int>(def.extra_output_slots.size());
  for (const auto& d : def.ops)
    if (d.info->family == Family::make_extra_output && !d.channel.empty() && !d.returned && reads[d.channel] == 0)
      fail(Status::invalid_argument, "{}: channel '{}' is never read: read it with add_extra_input {{\"channel\": "
           "\"{}\"}} after this op, or set \"returned\": true to hand it to the caller", op_at(d, "channel"),
           d.channel, d.channel);
  for (size_t k = 0; k < def.input_channels.size(); ++k)
    if (reads[def.input_channels[k]] == 0)
      fail(Status::invalid_argument, "{}: input_channels[{}]: input channel '{}' is never read: read it with "
           "add_extra_input {{\"channel\": \"{}\"}} or remove it", at("/input_channels/" + std::to_string(k)), k,
           def.input_channels[k], def.input_channels[k]);
}

// The channels of a sequence check_channels accepted: input channels first (declared order), then each
// make_extra_output's channel in op order, with their readers.
void list_channels(SequenceDef& def) {
  std::map<std::string, size_t> at;
  for (const auto& n : def.input_channels) {
    at[n] = def.channels.size();
    def.channels.push_back(WiringChannel{n, -1, {}, false});
  }
  for (const auto& d : def.ops) {
    if (d.channel.empty()) continue;
    if (d.info->family == Family::make_extra_output) {
      at[d.channel] = def.channels.size();
      def.channels.push_back(WiringChannel{d.channel, d.json_index, {}, d.returned});
    } else {
      def.channels[at.at(d.channel)].readers.push_back(d.json_index);
    }
  }
}

// A loss (OpKind::last_only) ends the sequence: nothing after it has a value to take.
void check_last_only(const SequenceDef& def, const At& at) {
  for (const auto& d : def.ops)
    if (d.info->last_only && d.index + 1 != static_cast<int>(def.ops.size()))
      fail(Status::invalid_argument, "{}: op {} ({}) must be the sequence's last op (it turns the stream into a loss); "
           "op {} ({}) follows it: end the sequence at op {}", at("/ops/" + std::to_string(d.json_index)), d.index,
           d.kind, d.index + 1, def.ops[static_cast<size_t>(d.index) + 1].kind, d.index);
}

// A parallel linear's collectives, where Megatron puts them (docs/parallel.md): column + SP gathers its
// input's sequence shards (backward: reduce-scatters dgrad); column alone copies its input to every rank
// (backward: all-reduces dgrad); row + SP reduce-scatters its partial sums into sequence shards (backward:
// gathers dy); row alone all-reduces them. A bias after a row-parallel linear follows the reduction, so it
// is added once. Also checks that every comm op and parallel linear names the same group.
void add_parallel(SequenceDef& def, OpDef d, const Registry& registry, const At& at) {
  const std::string where = fmt::format("{}: op {} ({})", at("/ops/" + std::to_string(d.json_index)), d.index, d.kind);
  std::string tp = "none";
  bool sp = false;
  if (d.info->family == Family::linear && d.attrs.contains("tensor_parallel")) {
    tp = d.attrs["tensor_parallel"].get<std::string>();
    sp = d.attrs["sequence_parallel"].get<bool>();
  }
  if (tp != "none" || d.info->family == Family::comm) {
    const std::string g = d.attrs["group"].get<std::string>();
    if (!channel_name_ok(g))
      fail(Status::invalid_argument, "{}: group '{}': a group name is 1 to {} characters from A-Z a-z 0-9 _ . -", where,
           jitfuse::text::shorten(g), kMaxChannelName);
    if (!def.group.empty() && def.group != g)
      fail(Status::invalid_argument, "{}: group '{}', but an earlier op of this sequence uses group '{}': one "
           "sequence runs on one communicator; split it where the group changes", where, g, def.group);
    def.group = g;
  }
  auto insert = [&](const char* kind, nlohmann::json attrs) {
    OpDef c;
    c.index = static_cast<int>(def.ops.size());
    c.json_index = d.json_index;
    c.inserted_for = d.index;
    c.kind = kind;
    c.info = registry.find(kind);
    attrs["group"] = def.group;
    c.attrs = validate_attrs(*c.info, attrs, where);
    def.ops.push_back(std::move(c));
  };
  if (tp == "column") {
    d.index = static_cast<int>(def.ops.size()) + 1;
    insert(sp ? "all_gather" : "all_reduce", sp ? nlohmann::json::object() : nlohmann::json{{"direction", "backward"}});
    def.ops.back().inserted_for = d.index;
    def.ops.push_back(std::move(d));
  } else if (tp == "row") {
    def.ops.push_back(std::move(d));
    insert(sp ? "reduce_scatter" : "all_reduce", sp ? nlohmann::json::object() : nlohmann::json{{"direction", "forward"}});
  } else {
    def.ops.push_back(std::move(d));
  }
}

// A loss reads its logits whole, unless it says they are this rank's vocabulary shard: "vocab_parallel" exactly
// when the logits come from a column-parallel linear (a bias may sit between), whose group it then shares.
void check_vocab_parallel(const SequenceDef& def, const OpDef& d, const std::string& where) {
  if (d.info->family != Family::loss) return;
  const bool vp = d.attrs.value("vocab_parallel", false);
  size_t k = def.ops.size();
  if (k > 0 && def.ops[k - 1].kind == "bias") --k;
  const bool column = k > 0 && def.ops[k - 1].info->family == Family::linear &&
                      def.ops[k - 1].attrs.value("tensor_parallel", "none") == "column";
  if (column && !vp)
    fail(Status::invalid_argument, "{}: op {} ({}) reads the logits of op {}, a column-parallel linear: they are "
         "this rank's shard of the vocabulary; set \"vocab_parallel\": true (the rows' statistics are then "
         "gathered over the group) or make the linear one rank's", where, d.index, d.kind, def.ops[k - 1].index);
  if (vp && !column)
    fail(Status::invalid_argument, "{}: op {} ({}): \"vocab_parallel\": true needs its logits from a "
         "column-parallel linear right before it (a bias may sit between): the head split by vocabulary over the "
         "ranks", where, d.index, d.kind);
}

// The document's shape: an object in format jitfuse.sequence/1 with 1 to kMaxOps ops.
void check_document(const nlohmann::json& j, const At& at) {
  if (!j.is_object()) fail(Status::parse_error, "{}: a sequence file is a JSON object with \"ops\"", at(""));
  if (j.contains("format") && j["format"] != "jitfuse.sequence/1")
    fail(Status::parse_error, "{}: unsupported format {}: this build reads \"jitfuse.sequence/1\"", at("/format"),
         jitfuse::text::shorten(j["format"].dump()));
  if (!j.contains("ops") || !j["ops"].is_array() || j["ops"].empty())
    fail(Status::parse_error, "{}: \"ops\" must be a non-empty array of ops", at(""));
  if (j["ops"].size() > kMaxOps)
    fail(Status::parse_error, "{}: the sequence has {} ops, more than the limit of {}: split it", at("/ops"),
         j["ops"].size(), kMaxOps);
}

void read_name(const nlohmann::json& j, SequenceDef& def, const At& at) {
  if (j.contains("name") && !j["name"].is_string())  // j.value() would throw nlohmann's type_error instead
    fail(Status::parse_error, "{}: \"name\" must be a string", at("/name"));
  def.name = j.value("name", "sequence");
  // The name is quoted in every later message about this sequence: keep it a name.
  if (def.name.size() > kMaxNameBytes)
    fail(Status::parse_error, "{}: \"name\" '{}' is longer than {} bytes", at("/name"), jitfuse::text::shorten(def.name),
         kMaxNameBytes);
}

// The FP8 recipes' settings of this sequence ("fp8": amax_history_len, margin), each range-checked.
void read_fp8(const nlohmann::json& j, SequenceDef& def, const At& at) {
  if (!j.contains("fp8")) return;
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

// Op i of the file: its kind looked up, its channel keys and attributes validated (errors at the attribute
// itself), its canonical form appended to `canon`, and the op added with a parallel linear's collectives.
void read_op(const nlohmann::json& o, size_t i, SequenceDef& def, nlohmann::json& canon, const Registry& registry,
             const At& at) {
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
  d.index = static_cast<int>(def.ops.size());
  d.json_index = static_cast<int>(i);
  d.kind = kind;
  d.info = info;
  // Attribute errors point at the attribute itself (a key with '/' or '~' cannot be in the kind's list).
  auto where_attr = [&](const std::string& attr) {
    return fmt::format("{}: op {} ({})", o.contains(attr) ? at(ptr + "/" + attr) : at(ptr), i, kind);
  };
  nlohmann::json attrs = o;
  read_channel_keys(attrs, d, at, ptr, i);
  d.attrs = validate_attrs(*info, attrs, fmt::format("{} ({})", loc, kind), where_attr);
  // A linear on one rank keeps the attributes it had before tensor parallelism (plan and cache keys unchanged).
  if (info->family == Family::linear && d.attrs["tensor_parallel"] == "none") {
    if (d.attrs["sequence_parallel"].get<bool>())
      fail(Status::invalid_argument, "{}: op {} (linear): \"sequence_parallel\": true needs \"tensor_parallel\": "
           "\"column\" or \"row\"", where_attr("sequence_parallel"), d.index);
    for (const char* k : {"tensor_parallel", "sequence_parallel", "group"}) d.attrs.erase(k);
  }
  // A loss on one rank's whole vocabulary keeps its attributes of before vocab parallelism (plan and cache keys).
  if (info->family == Family::loss && !d.attrs.value("vocab_parallel", false)) d.attrs.erase("vocab_parallel");
  check_vocab_parallel(def, d, where_attr("vocab_parallel"));
  nlohmann::json c = d.attrs;
  c["op"] = kind;
  if (!d.channel.empty()) c["channel"] = d.channel;
  if (d.returned) c["returned"] = true;
  canon.push_back(c);
  add_parallel(def, std::move(d), registry, at);
}

}  // namespace

SequenceDef parse_sequence(const std::string& text, const std::string& where, const Registry& registry) {
  nlohmann::json j = json_util::parse(text, where);
  json_util::Locator locator(text);  // one per text: locating every op stays linear in the file
  const At at = [&](const std::string& ptr) { return locator.where(where, ptr); };
  check_document(j, at);
  SequenceDef def;
  read_name(j, def, at);
  read_fp8(j, def, at);
  nlohmann::json canon = nlohmann::json::array();
  for (size_t i = 0; i < j["ops"].size(); ++i) read_op(j["ops"][i], i, def, canon, registry, at);
  read_input_channels(j, def, at);
  check_channels(def, at);
  list_channels(def);
  check_last_only(def, at);
  def.canonical = def.input_channels.empty() ? canon.dump()
                                             : nlohmann::json{{"input_channels", def.input_channels}, {"ops", canon}}.dump();
  return def;
}

SequenceDef parse_sequence_file(const std::string& path, const Registry& registry) {
  return parse_sequence(json_util::read_file(path), path, registry);
}

nlohmann::json wiring_json(const SequenceDef& def) {
  auto slots = [](const std::vector<WiringSlot>& v) {
    nlohmann::json a = nlohmann::json::array();
    for (size_t k = 0; k < v.size(); ++k)
      a.push_back({{"slot", k}, {"op", v[k].op}, {"index", v[k].index}, {"kind", v[k].kind},
                   {"channel", v[k].channel.empty() ? nlohmann::json(nullptr) : nlohmann::json(v[k].channel)}});
    return a;
  };
  nlohmann::json channels = nlohmann::json::array();
  for (const auto& c : def.channels)
    channels.push_back({{"name", c.name}, {"source", c.source}, {"readers", c.readers}, {"returned", c.returned}});
  return {{"extra_inputs", slots(def.extra_input_slots)},
          {"extra_outputs", slots(def.extra_output_slots)},
          {"channels", std::move(channels)},
          {"input_channels", def.input_channels}};
}

namespace {
// Op `op`'s caller slot and channel wiring (check_channels made sure every channel has its source).
// The channels seen so far while inferring: by name, the op holding the channel's value (its fork, or the
// first reader of a caller's channel) and its latest reader. One lookup per op: linear in the sequence.
struct ChannelState {
  int src = -1, last_reader = -1;
};

void wire_extras(const OpDef& d, Op& op, std::vector<Op>& before, int& extra_in, int& extra_out,
                 std::map<std::string, ChannelState>& channels) {
  op.channel = d.channel;
  op.returned = d.returned;
  if (op.family == Family::make_extra_output && (d.channel.empty() || d.returned)) op.extra_slot = extra_out++;
  if (op.family == Family::make_extra_output && !d.channel.empty()) channels[d.channel].src = op.index;
  if (d.info->takes_extra_input) op.extra_slot = extra_in++;
  if (op.family != Family::add_extra_input) return;
  if (d.channel.empty()) {
    op.extra_slot = extra_in++;
    return;
  }
  ChannelState& ch = channels[d.channel];
  if (ch.src < 0) {  // the first reader of a caller's channel owns its extra input
    ch.src = op.index;
    op.extra_slot = extra_in++;
  }
  op.channel_src = ch.src;
  Op* src = ch.src == op.index ? &op : &before[static_cast<size_t>(ch.src)];
  ++src->channel_readers;
  if (ch.last_reader >= 0) before[static_cast<size_t>(ch.last_reader)].grad_accumulate = true;  // now not the last
  ch.last_reader = op.index;
  if (src->family == Family::make_extra_output && src->returned) src->grad_two_parts = true;
  if (src->in != op.in)
    shape_error(op, fmt::format("channel '{}' holds {} (from {}), this op's input is {}", op.channel,
                                shape_str(src->in), src->label(), shape_str(op.in)));
}
}  // namespace

// A moe_unpermute reads the routing of the moe_permute before it: the latest one not yet combined.
// A grouped_linear between a moe_permute and its unpermute runs on that permute's expert rows (grouped: optional).
// Expert parallelism: a moe_dispatch reads its moe_permute's routing; a grouped_linear or moe_combine between a
// moe_dispatch and its combine reads the dispatch's (this rank's experts); a moe_combine closes its dispatch.
namespace {
void route_to_permute(Op& op, const Op& perm) {
  op.route_op = perm.index;
  op.route_in = {rows_of(perm.in), cols_of(perm.in)};
  op.route_topk = perm.attrs.at("top_k").get<int64_t>();
  op.route_rows = rows_of(perm.out);
  op.route_experts = perm.attrs.at("num_experts").get<int64_t>();
  op.route_packed = perm.str("layout") == "packed";
  op.route_splits_at = 2 * op.route_topk * rows_of(perm.in);  // after dest [T k] and src [T k]
}

void route_to_dispatch(Op& op, const Op& disp) {
  if (op.kind == "moe_unpermute" || op.kind == "moe_dispatch")
    fail(Status::invalid_argument, "{}: {} before it sends the rows to the ranks owning their experts: put a "
         "moe_combine after the experts' ops, before this op", op.label(), disp.label());
  const int64_t e = disp.route_experts, w = disp.world_size;
  op.route_op = disp.index;
  op.route_in = {rows_of(disp.in), cols_of(disp.in)};
  op.route_topk = disp.route_topk;
  op.route_rows = rows_of(disp.out);
  op.route_experts = e / w;
  op.route_packed = disp.route_packed;  // padded: this rank's experts' equal groups of W C rows
  op.route_splits_at = w * (e + 2);  // after every rank's rows per expert and its two bounds [W (E + 2)]
}
}  // namespace

static void pair_route(Op& op, const std::vector<Op>& before, bool grouped = false) {
  int combined = 0;  // moe_combines met walking back whose dispatch is not reached yet
  for (auto it = before.rbegin(); it != before.rend(); ++it) {
    if (it->kind == "moe_combine") ++combined;
    if (it->kind == "moe_dispatch" && combined > 0) --combined;
    else if (it->kind == "moe_dispatch") return route_to_dispatch(op, *it);
    if (it->kind == "moe_unpermute") {
      if (grouped) return;
      if (op.kind == "moe_combine") break;
      fail(Status::invalid_argument, "{}: the moe_permute before it is combined by {} already: each moe_permute has "
           "one moe_unpermute, after it", op.label(), it->label());
    }
    if (it->kind != "moe_permute") continue;
    if (op.kind == "moe_combine") break;
    return route_to_permute(op, *it);
  }
  if (grouped) return;
  if (op.kind == "moe_combine")
    fail(Status::invalid_argument, "{}: no moe_dispatch before it: moe_combine sends back the rows a moe_dispatch "
         "sent (moe_permute, moe_dispatch, the experts' ops, moe_combine, moe_unpermute)", op.label());
  fail(Status::invalid_argument, "{}: no moe_permute before it: {} the rows a moe_permute dispatched (put the "
       "experts' ops between the two)", op.label(),
       op.kind == "moe_dispatch" ? "moe_dispatch sends" : "moe_unpermute combines");
}

std::vector<Op> infer(const SequenceDef& def, const Shape& input, const Parallel& par) {
  if (par.world_size < 1 || par.world_size > kMaxWorldSize || par.rank < 0 || par.rank >= par.world_size)
    fail(Status::invalid_argument, "sequence '{}': rank {} of world size {}: the world size is 1 to {} and the rank "
         "0 to world size - 1", def.name, par.rank, par.world_size, kMaxWorldSize);
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
  std::map<std::string, ChannelState> channels;
  for (const auto& d : def.ops) {
    Op op;
    op.index = d.index;
    op.inserted_for = d.inserted_for;
    op.world_size = par.world_size;
    op.rank = par.rank;
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
    wire_extras(d, op, ops, extra_in, extra_out, channels);
    if (d.kind == "moe_unpermute" || d.kind == "moe_dispatch" || d.kind == "moe_combine") pair_route(op, ops);
    if (d.kind == "grouped_linear") pair_route(op, ops, true);
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
    if (op.info->family == Family::moe || op.info->family == Family::grouped_linear)
      fail(Status::unsupported,
           "sequence '{}': op {} ({}) under recipe {}: the token routing has no FP8 form yet; run the expert block "
           "in bf16", def.name, op.index, op.kind, rn);
    if (op.info->family == Family::loss)
      fail(Status::unsupported,
           "sequence '{}': op {} ({}) under recipe {}: a loss has no FP8 form; run the LM head and its loss in a "
           "bf16 sequence of their own", def.name, op.index, op.kind, rn);
    if (op.kind == "linear" && op.attrs.value("weight_layout", "out_in") == "in_out")
      fail(Status::unsupported,
           "sequence '{}': op {} (linear) under recipe {}: weight_layout \"in_out\" has no FP8 form (FP8 GEMMs read "
           "both operands along K); store the weight [out_features, in_features] under an FP8 recipe",
           def.name, op.index, rn);
    if (op.kind == "linear" && op.attrs.value("split_weight", false))
      fail(Status::unsupported,
           "sequence '{}': op {} (linear) under recipe {}: split_weight has no FP8 form (the weight is cast as one "
           "tensor); join the two weights into one [out_features, in_features] weight under an FP8 recipe",
           def.name, op.index, rn);
    if (op.kind == "quantize" && op.index + 1 != static_cast<int>(def.ops.size()))
      fail(Status::invalid_argument,
           "sequence '{}': op {} (quantize) under recipe {} must be the last op: its E4M3 output is the sequence's "
           "output (split the sequence after it)", def.name, op.index, rn);
  }
}

}  // namespace jitfuse::ops
