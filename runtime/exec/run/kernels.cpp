// Template stitching, cache requests, NVRTC compilation and module loading.
#include "exec/run/kernels.hpp"

#include <algorithm>
#include <set>
#include <sstream>

#include "common/embedded.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "cuda/driver.hpp"
#include "cuda/nvrtc.hpp"

namespace jitfuse::exec {

TemplateStore::TemplateStore() {
  for (const auto& f : embedded::templates) files_[std::string(f.path)] = std::string(f.content);
}

void TemplateStore::add(const std::string& name, const std::string& content) {
  auto& text = files_[name];
  if (text == content) return;
  text = content;
  ++generation_;
}

const std::string& TemplateStore::get(const std::string& name) const {
  auto it = files_.find(name);
  if (it == files_.end())
    fail(Status::invalid_argument, "template '{}' not found: built-in templates live in templates/, user templates "
         "come with the rules file that declares the op", name);
  return it->second;
}

namespace {
void stitch_into(const TemplateStore& store, const std::string& text, std::set<std::string>& seen, std::string& out) {
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    auto p = line.find("#include \"");
    if (p != std::string::npos && line.find_first_not_of(' ') == p) {
      auto q = line.find('"', p + 10);
      std::string name = line.substr(p + 10, q - p - 10);
      if (seen.insert(name).second) {
        out += "// ---- begin template " + name + "\n";
        stitch_into(store, store.get(name), seen, out);
        out += "// ---- end template " + name + "\n";
      }
      continue;
    }
    if (line.rfind("#pragma once", 0) == 0) continue;
    out += line;
    out += '\n';
  }
}
}  // namespace

std::string TemplateStore::stitch(const std::string& source) const {
  std::set<std::string> seen;
  std::string out;
  stitch_into(*this, source, seen, out);
  return out;
}

Target target_for_arch(const std::string& arch) {
  auto t = cuda::target_for(arch);
  if (t.ptx) log().info("NVRTC {} does not know {}: emitting PTX for {} (the driver JITs it)", cuda::nvrtc_version(), arch, t.arch);
  return {arch, t.options(), cuda::nvrtc_version()};
}

std::vector<bool> variants_of(const codegen::KernelSpec& spec, Variants v) {
  if (!spec.vec) return {false};
  if (v == Variants::all) return {true, false};
  return {true};
}

KernelLibrary::KernelLibrary(cache::KernelCache& cache, const TemplateStore& templates, cache::CompileFn compile)
    : cache_(cache), templates_(templates), compile_(std::move(compile)) {}

KernelLibrary::~KernelLibrary() {
  if (auto* d = cuda::try_driver())
    for (auto& [where, by_source] : modules_)
      for (auto& [source, variants] : by_source)
        for (auto& m : variants)
          if (m.mod) d->cuModuleUnload(m.mod);
}

cache::KernelRequest KernelLibrary::request(const codegen::KernelSpec& spec, const Target& target,
                                            const nlohmann::json& meta, bool vector) const {
  return request(codegen::generate(spec), spec, target, meta, vector);
}

cache::KernelRequest KernelLibrary::request(const codegen::Generated& g, const codegen::KernelSpec& spec,
                                            const Target& target, const nlohmann::json& meta, bool vector) const {
  if (vector && !g.vec)
    fail(Status::internal, "kernel {} has no vector variant (its shape does not allow one)", g.kernel);
  cache::KernelRequest r;
  r.source = templates_.stitch(g.source);
  r.options = target.options;
  for (auto& o : codegen::Generated::options(vector)) r.options.push_back(std::move(o));
  r.arch = target.arch;
  r.nvrtc_version = target.nvrtc_version;
  r.meta = meta;
  r.meta["kernel"] = g.kernel;
  r.meta["variant"] = vector ? "vector" : "scalar";
  r.meta["skeleton"] = codegen::skeleton_name(spec.skeleton);
  r.meta["direction"] = spec.dir == codegen::Direction::forward ? "forward" : "backward";
  r.meta["dtype"] = spec.dtype;
  r.meta["cols"] = spec.cols;
  r.meta["vector"] = spec.vec;
  // Every entry point of the module: the variant's, then the finalize and FP8 update kernels.
  nlohmann::json fns = nlohmann::json::array();
  fns.push_back(g.entry(vector));
  for (const auto& f : g.finalize)
    if (f.slot == 0) fns.push_back(f.kernel);  // a kernel shared by several gradients once
  if (!g.fp8_update.empty()) fns.push_back(g.fp8_update);
  r.meta["functions"] = fns;
  // NVRTC time on the 2-core machine (docs/cache.md, "Cold start"): kernels that reduce over rows into
  // per-block partials (norm and bias backward) take 2-4x the others, norms 1.5-2x; starting them first
  // keeps a warmup's last kernel from compiling alone.
  r.cost_hint = (g.launch.persistent ? 2.0 : 0.0) + (spec.skeleton == codegen::Skeleton::rownorm ? 1.0 : 0.0);
  return r;
}

cache::CompileFn KernelLibrary::compiler() const {
  if (compile_) return compile_;
  return [](const cache::KernelRequest& r) {
    auto out = cuda::compile(r.source, r.meta.value("kernel", std::string("jitfuse")) + ".cu", {}, r.options);
    if (!out.log.empty()) log().debug("NVRTC log for {}:\n{}", r.meta.value("kernel", ""), out.log);
    return cache::CompileResult{out.binary, out.log, out.ms};
  };
}

void KernelLibrary::prefetch(const std::vector<std::pair<codegen::KernelSpec, nlohmann::json>>& specs,
                             const Target& target, unsigned threads, Variants variants) {
  std::vector<cache::KernelRequest> all, reqs;
  for (const auto& [spec, meta] : specs) {
    const codegen::Generated g = codegen::generate(spec);
    for (bool vector : variants_of(spec, variants)) all.push_back(request(g, spec, target, meta, vector));
  }
  for (size_t i : cache::distinct(all)) reqs.push_back(std::move(all[i]));
  cache_.get_or_compile_all(reqs, compiler(), threads);
}

std::shared_ptr<const cache::Entry> KernelLibrary::entry(const codegen::Generated& gen,
                                                         const codegen::KernelSpec& spec, const Target& target,
                                                         const nlohmann::json& meta, bool vector) {
  return cache_.get_or_compile(request(gen, spec, target, meta, vector), compiler());
}

const LoadedKernel& KernelLibrary::load(const codegen::Generated& gen, const codegen::KernelSpec& spec,
                                        const Target& target, const nlohmann::json& meta, bool vector) {
  if (vector && !gen.vec)
    fail(Status::internal, "kernel {} has no vector variant (its shape does not allow one)", gen.kernel);
  // Modules belong to a device's context: the same kernel is loaded once per device (and shared by every
  // group, at any depth, and every sequence that generates its source).
  std::string where;
  for (const auto& o : target.options) where += o + " ";
  where += "templates " + std::to_string(templates_.generation()) + " @" + std::to_string(cuda::current_ordinal());
  const size_t slot = vector ? 1 : 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& by_source = modules_[where];
    auto it = by_source.find(gen.source);
    if (it != by_source.end() && it->second[slot].kernel) return *it->second[slot].kernel;
  }
  auto entry = this->entry(gen, spec, target, meta, vector);
  const auto& d = cuda::driver();
  std::lock_guard<std::mutex> lock(mu_);
  Module& m = modules_[where][gen.source][slot];
  if (m.kernel) return *m.kernel;  // another thread loaded it meanwhile
  CUmodule mod = nullptr;
  cuda::check(d.cuModuleLoadData(&mod, entry->cubin.data()), "cuModuleLoadData");
  try {
    auto get = [&](const std::string& name) {
      CUfunction fn = nullptr;
      cuda::check(d.cuModuleGetFunction(&fn, mod, name.c_str()), "cuModuleGetFunction");
      return fn;
    };
    auto lk = std::make_unique<LoadedKernel>();
    lk->gen = gen;
    lk->key = entry->key;
    lk->vector = vector;
    lk->fn = get(gen.entry(vector));
    const auto& L = gen.launch;
    cuda::check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&lk->blocks_per_sm, lk->fn, L.bx * L.by, 0),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    lk->blocks_per_sm = std::max(1, lk->blocks_per_sm);
    // by position, looked up by name: the kernel is shared by groups at any depth, so not by op index
    for (const auto& f : gen.finalize) lk->finalize.push_back(get(f.kernel));
    if (!gen.fp8_update.empty()) lk->fp8_update = get(gen.fp8_update);
    m.kernel = std::move(lk);
  } catch (...) {
    d.cuModuleUnload(mod);  // a module missing an entry point is never kept
    throw;
  }
  m.mod = mod;
  return *m.kernel;
}

}  // namespace jitfuse::exec
