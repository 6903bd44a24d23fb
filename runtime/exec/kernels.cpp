// Template stitching, cache requests, NVRTC compilation and module loading.
#include "exec/kernels.hpp"

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

KernelLibrary::KernelLibrary(cache::KernelCache& cache, const TemplateStore& templates)
    : cache_(cache), templates_(templates) {}

KernelLibrary::~KernelLibrary() {
  if (auto* d = cuda::try_driver())
    for (auto& [where, by_source] : modules_)
      for (auto& [source, m] : by_source) d->cuModuleUnload(m.mod);
}

cache::KernelRequest KernelLibrary::request(const codegen::KernelSpec& spec, const Target& target,
                                            const nlohmann::json& meta) const {
  return request(codegen::generate(spec), spec, target, meta);
}

cache::KernelRequest KernelLibrary::request(const codegen::Generated& g, const codegen::KernelSpec& spec,
                                            const Target& target, const nlohmann::json& meta) const {
  cache::KernelRequest r;
  r.source = templates_.stitch(g.source);
  r.options = target.options;
  r.arch = target.arch;
  r.nvrtc_version = target.nvrtc_version;
  r.meta = meta;
  r.meta["kernel"] = g.kernel;
  r.meta["skeleton"] = codegen::skeleton_name(spec.skeleton);
  r.meta["direction"] = spec.dir == codegen::Direction::forward ? "forward" : "backward";
  r.meta["dtype"] = spec.dtype;
  r.meta["cols"] = spec.cols;
  r.meta["vector"] = spec.vec;
  // Every entry point of the module: the variants, then the finalize and FP8 update kernels.
  nlohmann::json fns = nlohmann::json::array();
  if (g.vec) fns.push_back(g.kernel);
  fns.push_back(g.scalar_kernel);
  for (const auto& f : g.finalize) fns.push_back(f.kernel);
  if (!g.fp8_update.empty()) fns.push_back(g.fp8_update);
  r.meta["functions"] = fns;
  // NVRTC time on the 2-core machine (docs/cache.md, "Cold start"): kernels that reduce over rows into
  // per-block partials (norm and bias backward) take 2-4x the others, norms 1.5-2x; starting them first
  // keeps a warmup's last kernel from compiling alone.
  r.cost_hint = (g.launch.persistent ? 2.0 : 0.0) + (spec.skeleton == codegen::Skeleton::rownorm ? 1.0 : 0.0);
  return r;
}

cache::CompileFn KernelLibrary::compiler() const {
  return [](const cache::KernelRequest& r) {
    auto out = cuda::compile(r.source, r.meta.value("kernel", std::string("jitfuse")) + ".cu", {}, r.options);
    if (!out.log.empty()) log().debug("NVRTC log for {}:\n{}", r.meta.value("kernel", ""), out.log);
    return cache::CompileResult{out.binary, out.log, out.ms};
  };
}

void KernelLibrary::prefetch(const std::vector<std::pair<codegen::KernelSpec, nlohmann::json>>& specs,
                             const Target& target, unsigned threads) {
  std::vector<cache::KernelRequest> all, reqs;
  for (const auto& [spec, meta] : specs) all.push_back(request(spec, target, meta));
  for (size_t i : cache::distinct(all)) reqs.push_back(std::move(all[i]));
  cache_.get_or_compile_all(reqs, compiler(), threads);
}

std::shared_ptr<const cache::Entry> KernelLibrary::entry(const codegen::Generated& gen,
                                                         const codegen::KernelSpec& spec, const Target& target,
                                                         const nlohmann::json& meta) {
  return cache_.get_or_compile(request(gen, spec, target, meta), compiler());
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
  auto pick = [&](const Module& m) -> const LoadedKernel& { return vector ? *m.vec : *m.scalar; };
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& by_source = modules_[where];
    auto it = by_source.find(gen.source);
    if (it != by_source.end()) return pick(it->second);
  }
  auto entry = this->entry(gen, spec, target, meta);
  const auto& d = cuda::driver();
  std::lock_guard<std::mutex> lock(mu_);
  auto& by_source = modules_[where];
  auto it = by_source.find(gen.source);
  if (it != by_source.end()) return pick(it->second);
  Module m;
  cuda::check(d.cuModuleLoadData(&m.mod, entry->cubin.data()), "cuModuleLoadData");
  auto get = [&](const std::string& name) {
    CUfunction fn = nullptr;
    cuda::check(d.cuModuleGetFunction(&fn, m.mod, name.c_str()), "cuModuleGetFunction");
    return fn;
  };
  auto entry_point = [&](bool vec) {
    auto lk = std::make_unique<LoadedKernel>();
    lk->gen = gen;
    lk->key = entry->key;
    lk->vector = vec;
    lk->fn = get(gen.entry(vec));
    const auto& L = gen.launch;
    cuda::check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&lk->blocks_per_sm, lk->fn, L.bx * L.by, 0),
                "cuOccupancyMaxActiveBlocksPerMultiprocessor");
    lk->blocks_per_sm = std::max(1, lk->blocks_per_sm);
    // by name: the kernel is shared by groups at any depth, so not by op index
    for (const auto& f : gen.finalize) lk->finalize[f.kernel] = get(f.kernel);
    if (!gen.fp8_update.empty()) lk->fp8_update = get(gen.fp8_update);
    return lk;
  };
  try {
    if (gen.vec) m.vec = entry_point(true);
    m.scalar = entry_point(false);
  } catch (...) {
    d.cuModuleUnload(m.mod);  // a module missing an entry point is never kept
    throw;
  }
  return pick(by_source.emplace(gen.source, std::move(m)).first->second);
}

}  // namespace jitfuse::exec
