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

void TemplateStore::add(const std::string& name, const std::string& content) { files_[name] = content; }

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
    for (auto& [k, m] : modules_) d->cuModuleUnload(m);
}

cache::KernelRequest KernelLibrary::request(const codegen::KernelSpec& spec, const Target& target,
                                            const nlohmann::json& meta) const {
  codegen::Generated g = codegen::generate(spec);
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

const LoadedKernel& KernelLibrary::load(const codegen::KernelSpec& spec, const Target& target,
                                        const nlohmann::json& meta) {
  cache::KernelRequest req = request(spec, target, meta);
  // Modules belong to a device's context: the same kernel is loaded once per device (and shared by every
  // group, at any depth, and every sequence that generates its source).
  const std::string key = cache::cache_key(req) + "@" + std::to_string(cuda::current_ordinal());
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = loaded_.find(key);
    if (it != loaded_.end()) return *it->second;
  }
  auto entry = cache_.get_or_compile(req, compiler());
  // (the cache key proper is entry->key; `key` adds the device)
  const auto& d = cuda::driver();
  std::lock_guard<std::mutex> lock(mu_);
  auto it = loaded_.find(key);
  if (it != loaded_.end()) return *it->second;
  CUmodule mod = nullptr;
  cuda::check(d.cuModuleLoadData(&mod, entry->cubin.data()), "cuModuleLoadData");
  modules_[key] = mod;
  auto lk = std::make_unique<LoadedKernel>();
  lk->gen = codegen::generate(spec);
  lk->key = entry->key;
  cuda::check(d.cuModuleGetFunction(&lk->fn, mod, lk->gen.kernel.c_str()), "cuModuleGetFunction");
  const auto& L = lk->gen.launch;
  cuda::check(d.cuOccupancyMaxActiveBlocksPerMultiprocessor(&lk->blocks_per_sm, lk->fn, L.bx * L.by, 0),
              "cuOccupancyMaxActiveBlocksPerMultiprocessor");
  lk->blocks_per_sm = std::max(1, lk->blocks_per_sm);
  for (auto& f : lk->gen.finalize) {
    CUfunction fn;
    cuda::check(d.cuModuleGetFunction(&fn, mod, f.kernel.c_str()), "cuModuleGetFunction");
    lk->finalize[f.kernel] = fn;  // by name: the kernel is shared by groups at any depth, so not by op index
  }
  if (!lk->gen.fp8_update.empty())
    cuda::check(d.cuModuleGetFunction(&lk->fp8_update, mod, lk->gen.fp8_update.c_str()), "cuModuleGetFunction");
  auto& ref = *lk;
  loaded_[key] = std::move(lk);
  return ref;
}

}  // namespace jitfuse::exec
