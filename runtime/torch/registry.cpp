// The registry of the C++ ops: sequences per (key, device), their jf_program handles per (input shape,
// training), the resolver a host installs for keys it defines lazily, and C++-side definitions.
#include "jitfuse_torch.h"

#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <sstream>

namespace jitfuse_torch {

#ifndef JF_TORCH_BUILT_FOR
#define JF_TORCH_BUILT_FOR "unknown"
#endif

const char* built_for_torch() { return JF_TORCH_BUILT_FOR; }

namespace {

std::string dims_str(c10::IntArrayRef d) {
  std::ostringstream o;
  o << '[';
  for (size_t i = 0; i < d.size(); ++i) o << (i ? ", " : "") << d[i];
  o << ']';
  return o.str();
}

at::ScalarType scalar_of(DLDataType d) {
  switch (d.code) {
    case 0: return d.bits == 64 ? at::kLong : d.bits == 32 ? at::kInt : at::kChar;  // kDLInt
    case 1: return at::kByte;                                                      // kDLUInt
    case 2: return d.bits == 16 ? at::kHalf : d.bits == 64 ? at::kDouble : at::kFloat;  // kDLFloat
    case 4: return at::kBFloat16;                                                  // kDLBfloat
    case 10: return at::kFloat8_e4m3fn;                                            // DLPack 1.0 kDLFloat8_e4m3fn
    default: TORCH_CHECK(false, "jitfuse: the library reported a tensor of DLPack type code ", int(d.code),
                         " that PyTorch cannot hold");
  }
}

std::vector<int64_t> shape_of(const jf_tensor_info& t) { return std::vector<int64_t>(t.shape, t.shape + t.ndim); }

struct Definition {
  std::string document, recipe;
  std::vector<std::pair<int, std::string>> params;
  std::vector<bool> accumulate;
  int n_extra_inputs = 0, n_extra_outputs = 0;
  std::string name;
  bool fp8_output = false;
};

std::mutex g_mu;
std::map<std::pair<int64_t, int>, std::shared_ptr<Sequence>> g_sequences;
std::map<int64_t, Definition> g_definitions;
std::map<int, jf_context> g_contexts;  // C++ definitions' contexts, one per device, kept for the process
std::function<bool(int64_t, int)> g_resolver;
std::atomic<bool> g_env_loaded{false};  // $JITFUSE_TORCH_SEQUENCES read (on the first unknown key)
thread_local bool t_fp8_promise = false;

[[noreturn]] void fail_call(const char* fn, const std::string& seq_name) {
  const char* msg = jf_last_error();
  TORCH_CHECK(false, "jitfuse: ", fn, " (sequence '", seq_name, "'): ", msg ? msg : "");
}

at::ScalarType dtype_of_recipe(const std::string& recipe) {
  if (recipe == "fp32") return at::kFloat;
  if (recipe == "fp16") return at::kHalf;
  return at::kBFloat16;  // bf16 and the FP8 recipes (bf16 activations)
}

// A sequence from a C++ definition, on `device` (the caller made it current).
std::shared_ptr<Sequence> create_defined(int64_t key, int device, const Definition& d) {
  jf_context& ctx = g_contexts[device];
  if (!ctx && jf_context_create(&ctx) != JF_OK) fail_call("jf_context_create", "key " + std::to_string(key));
  auto s = std::make_shared<Sequence>();
  s->key = key;
  s->device = device;
  s->name = d.name.empty() ? "key " + std::to_string(key) : d.name;
  if (jf_sequence_create(ctx, d.document.c_str(), d.recipe.c_str(), &s->seq) != JF_OK)
    fail_call("jf_sequence_create", s->name);
  s->owns_seq = true;
  s->dtype = dtype_of_recipe(d.recipe);
  s->params = d.params;
  for (auto& [op, n] : d.params) s->param_labels.push_back("op " + std::to_string(op) + " " + n);
  for (bool a : d.accumulate) s->accumulate.push_back(a ? 1 : 0);
  s->accumulate.resize(s->params.size(), 0);
  s->n_extra_inputs = d.n_extra_inputs;
  s->n_extra_outputs = d.n_extra_outputs;
  s->fp8 = d.recipe == "fp8_delayed" || d.recipe == "fp8_current" || d.recipe == "fp8_block";
  s->fp8_output = d.fp8_output;
  s->last_op = jf_sequence_num_ops(s->seq) - 1;
  return s;
}

}  // namespace

Program::~Program() {
  if (handle) jf_program_close(handle);
}

Sequence::~Sequence() {
  { std::lock_guard<std::mutex> g(mu_); programs_.clear(); }
  if (owns_seq && seq) jf_sequence_destroy(seq);
}

std::shared_ptr<Program> Sequence::program(c10::IntArrayRef shape, bool training, void* stream) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto& p : programs_)
    if (p->training == training && c10::IntArrayRef(p->shape) == shape) return p;
  // Opening prepares (plan, compile or cache load, module load): never inside a CUDA-graph capture, where
  // the library answers JF_ERR_NOT_PREPARED before touching the stream.
  auto p = std::make_shared<Program>();
  p->shape = shape.vec();
  p->training = training;
  jf_status st = jf_program_open(seq, p->shape.data(), static_cast<int>(p->shape.size()), training ? 1 : 0,
                                 static_cast<jf_stream>(stream), &p->handle);
  if (st == JF_ERR_NOT_PREPARED)
    TORCH_CHECK(false, "jitfuse: sequence '", name, "' is not prepared for input ", dims_str(shape), " (",
                training ? "training" : "inference", ") and a CUDA graph is being captured; run it once with this "
                "shape, or call Sequential.prepare(shape), before the capture");
  if (st != JF_OK) fail_call("jf_program_open", name);
  jf_program_info info{};
  if (jf_program_get_info(p->handle, &info) != JF_OK) fail_call("jf_program_get_info", name);
  TORCH_CHECK(info.n_outputs == 1 + n_extra_outputs, "jitfuse: sequence '", name, "': ", info.n_outputs - 1,
              " extra outputs, the module expects ", n_extra_outputs);
  p->out_shape = shape_of(info.outputs[0]);
  p->out_dtype = scalar_of(info.outputs[0].dtype);
  for (int i = 1; i < info.n_outputs; ++i)
    p->extra_outputs.emplace_back(shape_of(info.outputs[i]), scalar_of(info.outputs[i].dtype));
  TORCH_CHECK(info.n_params == static_cast<int>(params.size()), "jitfuse: sequence '", name, "': the module passes ",
              params.size(), " parameters, the library's program has ", info.n_params);
  for (auto& [op, pname] : params) {  // their shapes and dtypes the library checks at every call
    bool hit = false;
    for (int i = 0; i < info.n_params; ++i) hit = hit || (info.params[i].op_index == op && pname == info.params[i].name);
    TORCH_CHECK(hit, "jitfuse: sequence '", name, "': op ", op, " has no parameter '", pname, "' in the library");
  }
  TORCH_CHECK(!info.uses_rng || info.rng_offset_advance == 1, "jitfuse: sequence '", name,
              "' advances the Philox offset by ", info.rng_offset_advance, " per call; this package assumes 1");
  p->saved_bytes = training ? info.saved_bytes : 0;
  p->forward_workspace = info.forward_workspace_bytes;
  p->backward_workspace = info.backward_workspace_bytes;
  programs_.push_back(p);
  return p;
}

void Sequence::watch(bool on) {
  std::lock_guard<std::mutex> g(mu_);
  watched_.clear();
  watching_.store(on, std::memory_order_relaxed);
}

std::vector<std::string> Sequence::watched() {
  std::lock_guard<std::mutex> g(mu_);
  return watched_;
}

void Sequence::record_locked(const char* call) {
  std::lock_guard<std::mutex> g(mu_);
  if (watching_.load(std::memory_order_relaxed)) watched_.emplace_back(call);
}

void register_sequence(std::shared_ptr<Sequence> s) {
  std::lock_guard<std::mutex> g(g_mu);
  g_sequences[{s->key, s->device}] = std::move(s);
}

void forget(int64_t key) {
  std::vector<std::shared_ptr<Sequence>> dropped;  // destroyed outside the lock
  std::lock_guard<std::mutex> g(g_mu);
  for (auto it = g_sequences.begin(); it != g_sequences.end();) {
    if (it->first.first == key) {
      dropped.push_back(std::move(it->second));
      it = g_sequences.erase(it);
    } else {
      ++it;
    }
  }
  g_definitions.erase(key);
}

int registered_device(int64_t key) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_sequences.lower_bound({key, std::numeric_limits<int>::min()});
  return it != g_sequences.end() && it->first.first == key ? it->first.second : -1;
}

void set_resolver(std::function<bool(int64_t, int)> resolver) {
  std::lock_guard<std::mutex> g(g_mu);
  g_resolver = std::move(resolver);
}

void define(int64_t key, const std::string& document, const std::string& recipe,
            const std::vector<std::pair<int, std::string>>& params, const std::vector<bool>& accumulate,
            int n_extra_inputs, int n_extra_outputs, const std::string& name, bool fp8_output) {
  TORCH_CHECK(key > 0, "jitfuse: define: the key must be positive, got ", key);
  std::lock_guard<std::mutex> g(g_mu);
  g_definitions[key] =
      Definition{document, recipe, params, accumulate, n_extra_inputs, n_extra_outputs, name, fp8_output};
}

namespace {

std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep)) out.push_back(cur);
  if (!s.empty() && s.back() == sep) out.emplace_back();
  return out;
}

int64_t parse_int(const std::string& t, const std::string& where) {
  try {
    size_t used = 0;
    long long v = std::stoll(t, &used);
    if (used == t.size()) return v;
  } catch (const std::exception&) {
  }
  TORCH_CHECK(false, "jitfuse: ", where, ": '", t, "' is not an integer");
}

}  // namespace

// One line per key, tab-separated: key, recipe, n_extra_inputs, n_extra_outputs, fp8_output (0/1), name,
// parameters ("op:name:accumulate" joined by ',', or '-'), the sequence document (one-line JSON).
int load_definitions(const std::string& path) {
  std::ifstream f(path);
  TORCH_CHECK(f.good(), "jitfuse: cannot read the sequence definitions file '", path, "'");
  std::string line;
  std::getline(f, line);
  TORCH_CHECK(line == "jitfuse.torch_sequences/1", "jitfuse: '", path,
              "' is not a jitfuse.torch_sequences/1 file (first line: '", line.substr(0, 40), "')");
  int n = 0, lineno = 1;
  while (std::getline(f, line)) {
    ++lineno;
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(lineno);
    auto fld = split(line, '\t');
    TORCH_CHECK(fld.size() == 8, "jitfuse: ", where, ": expected 8 tab-separated fields, found ", fld.size());
    std::vector<std::pair<int, std::string>> params;
    std::vector<bool> acc;
    if (fld[6] != "-") {
      for (auto& p : split(fld[6], ',')) {
        auto parts = split(p, ':');
        TORCH_CHECK(parts.size() == 3, "jitfuse: ", where, ": parameter '", p, "' is not op:name:accumulate");
        params.emplace_back(static_cast<int>(parse_int(parts[0], where)), parts[1]);
        acc.push_back(parts[2] == "1");
      }
    }
    define(parse_int(fld[0], where), fld[7], fld[1], params, acc, static_cast<int>(parse_int(fld[2], where)),
           static_cast<int>(parse_int(fld[3], where)), fld[5], fld[4] == "1");
    ++n;
  }
  return n;
}

std::shared_ptr<Sequence> sequence(int64_t key, int device) {
  std::function<bool(int64_t, int)> resolver;
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_sequences.find({key, device});
    if (it != g_sequences.end()) return it->second;
    auto d = g_definitions.find(key);
    if (d != g_definitions.end()) {
      c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
      auto s = create_defined(key, device, d->second);
      g_sequences[{key, device}] = s;
      return s;
    }
    resolver = g_resolver;
  }
  if (!g_env_loaded) {  // a C++ host's definitions, named by the environment
    std::string files;
    {
      std::lock_guard<std::mutex> g(g_mu);
      if (!g_env_loaded) {
        g_env_loaded = true;
        const char* env = std::getenv("JITFUSE_TORCH_SEQUENCES");
        files = env ? env : "";
      }
    }
    for (auto& path : split(files, ':'))
      if (!path.empty()) load_definitions(path);
    if (!files.empty()) return sequence(key, device);
  }
  // The host defines it (the Python package registers the sequence of its module); outside the lock, since
  // the resolver registers.
  if (resolver && resolver(key, device)) {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_sequences.find({key, device});
    if (it != g_sequences.end()) return it->second;
  }
  TORCH_CHECK(false, "jitfuse: unknown sequence key ", key, " on cuda:", device,
              ": the module that defined it was not created in this process (a C++ host defines it with "
              "jitfuse_torch::define)");
}

bool set_fp8_promise(bool on) {
  bool was = t_fp8_promise;
  t_fp8_promise = on;
  return was;
}

bool fp8_promise() { return t_fp8_promise; }

}  // namespace jitfuse_torch
