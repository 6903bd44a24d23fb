// `jitfuse codegen`, `jitfuse warmup` and `jitfuse check`: generated sources, ahead-of-time
// compilation into the kernel cache (no GPU needed), and the end-to-end run against the reference.
#include <cstdio>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "api/handles.hpp"
#include "cli_common.hpp"
#include "commands.hpp"
#include "common/error.hpp"
#include "cuda/driver.hpp"
#include "exec/run/executor.hpp"
#include "fuser/explain.hpp"
#include "common/json_util.hpp"
#include "harness/check.hpp"

namespace jitfuse::cli {
namespace {

struct PlanOpts {
  std::vector<std::string> seqs, shapes, rules;
  std::string recipe, arch;
  bool inference = false, json = false, compile = false, verify = false;
  bool all_variants = false;  // warmup: the scalar fallbacks of vector-capable kernels too
  unsigned jobs = 0;
};

void add_plan_options(CLI::App* cmd, PlanOpts& o, bool many) {
  if (many) {
    cmd->add_option("SEQ", o.seqs, "Sequence files (jitfuse.sequence/1)")->required();
    cmd->add_option("--shape", o.shapes, "Input shapes, e.g. 8192x4096 (repeatable)")->required();
  } else {
    cmd->add_option("SEQ", o.seqs, "Sequence file (jitfuse.sequence/1)")->required()->expected(1);
    cmd->add_option("--shape", o.shapes, "Input shape, e.g. 8192x4096")->required()->expected(1);
  }
  cmd->add_option("--recipe", o.recipe, "Recipe: fp32, fp16, bf16, fp8_delayed, fp8_current or fp8_block")->required();
  cmd->add_option("--arch", o.arch, "Target GPU arch (default: this GPU, else sm_90)");
  cmd->add_option("--rules", o.rules, "Extra rule directories or files");
  cmd->add_flag("--inference", o.inference, "Forward only, no saved context");
}

struct Collected {
  std::vector<cache::KernelRequest> requests;  // distinct (one per cache key)
  std::vector<std::string> labels;             // of each request's first use
};

// Every kernel variant a prepared program loads (`needed`: the vector one where the shape allows it, else
// the scalar one), or every variant (`all`). A kernel shared by several programs (sequences, shapes) is
// listed once, as a prepared context loads it.
Collected collect(const PlanOpts& o, const rules::RuleSet& rs, const exec::TemplateStore& templates,
                  const exec::Target& target, exec::Variants variants) {
  Collected all;
  cache::KernelCache scratch(cache::Config{});
  exec::KernelLibrary lib(scratch, templates);
  for (const auto& seq : o.seqs)
    for (const auto& shape : o.shapes) {
      Planned p = plan_file(rs, seq, o.recipe, shape, parse_arch(target.arch), !o.inference);
      for (auto& [spec, meta] : exec::program_kernels(*p.program)) {
        const codegen::Generated g = codegen::generate(spec);
        for (bool vector : exec::variants_of(spec, variants)) {
          all.requests.push_back(lib.request(g, spec, target, meta, vector));
          all.labels.push_back(seq + " " + shape + ": " + g.entry(vector));
        }
      }
    }
  Collected c;
  for (size_t i : cache::distinct(all.requests)) {
    c.requests.push_back(std::move(all.requests[i]));
    c.labels.push_back(std::move(all.labels[i]));
  }
  return c;
}

void progress_bar(size_t done, size_t total) {
  const int width = 30;
  int filled = total ? static_cast<int>(width * done / total) : width;
  std::fprintf(stderr, "\r[%.*s%*s] %zu/%zu kernels", filled, "==============================", width - filled, "",
               done, total);
  if (done == total) std::fprintf(stderr, "\n");
}

void run_codegen(const PlanOpts& o) {
  auto rs = load_rules(o.rules);
  auto templates = templates_for(rs);
  exec::Target target = exec::target_for_arch(default_arch(o.arch));
  Collected c = collect(o, rs, templates, target, exec::Variants::needed);
  nlohmann::json out = nlohmann::json::array();
  cache::KernelCache scratch(cache::Config{});
  exec::KernelLibrary lib(scratch, templates);
  for (size_t i = 0; i < c.requests.size(); ++i) {
    const auto& r = c.requests[i];
    nlohmann::json k = {{"kernel", r.meta["kernel"]}, {"meta", r.meta}, {"key", cache::cache_key(r)}};
    if (o.compile) {
      auto res = lib.compiler()(r);
      k["cubin_bytes"] = res.cubin.size();
      k["compile_ms"] = res.compile_ms;
    }
    if (o.json) {
      k["source"] = r.source;
      out.push_back(k);
    } else {
      std::printf("// ===== %s (key %.12s)%s\n%s\n", c.labels[i].c_str(), k["key"].get<std::string>().c_str(),
                  o.compile ? fmt::format(", compiled for {}: {} bytes in {:.0f} ms", target.arch,
                                          k["cubin_bytes"].get<size_t>(), k["compile_ms"].get<double>()).c_str() : "",
                  r.source.c_str());
    }
  }
  if (o.json) std::printf("%s\n", out.dump(2).c_str());
}

// NVRTC reports lines of the stitched kernel source ("jf_x_fwd.cu(104): error"); a line inside a user
// template (between stitch's "// ---- begin template user/x.cuh" markers) is mapped back to the template's
// own file:line and quoted. Lines outside user templates stay as they are.
std::string map_kernel_log(const std::string& what, const std::string& source, const rules::RuleSet& rs) {
  std::vector<std::string> src;
  {
    std::istringstream in(source);
    for (std::string l; std::getline(in, l);) src.push_back(l);
  }
  std::string out;
  std::istringstream in(what);
  for (std::string line; std::getline(in, line);) {
    out += line + "\n";
    size_t open = line.find(".cu(");
    size_t close = open == std::string::npos ? std::string::npos : line.find(')', open);
    if (close == std::string::npos) continue;
    std::string num = line.substr(open + 4, close - open - 4);
    if (num.empty() || num.size() > 8 || num.find_first_not_of("0123456789") != std::string::npos) continue;
    size_t n = std::stoul(num);
    if (n == 0 || n > src.size()) continue;
    for (size_t i = n - 1; i-- > 0;) {  // the nearest marker above the line
      if (src[i].rfind("// ---- end template ", 0) == 0) break;
      if (src[i].rfind("// ---- begin template ", 0) != 0) continue;
      std::string key = src[i].substr(23);
      const ops::OpKind* op = nullptr;
      for (const auto& name : rs.registry().names()) {
        const ops::OpKind* k = rs.registry().find(name);
        if (k->user_declared && k->template_file == key) op = k;
      }
      auto tpl = rs.user_templates().find(key);
      if (!op || tpl == rs.user_templates().end() || tpl->second.find("#include") != std::string::npos) break;
      // Stitching drops "#pragma once" lines: count them back in.
      std::istringstream t(tpl->second);
      size_t kept = 0, at = 0;
      std::string tl;
      while (kept < n - 1 - i && std::getline(t, tl)) {
        ++at;
        if (tl.rfind("#pragma once", 0) != 0) ++kept;
      }
      out += fmt::format("  (in {}:{}: {})\n", op->template_path.empty() ? key : op->template_path, at,
                         n - 1 < src.size() ? src[n - 1] : "");
      break;
    }
  }
  return out;
}

void run_warmup(const PlanOpts& o) {
  auto rs = load_rules(o.rules);
  auto templates = templates_for(rs);
  exec::Target target = exec::target_for_arch(default_arch(o.arch));
  Collected c = collect(o, rs, templates, target, o.all_variants ? exec::Variants::all : exec::Variants::needed);
  cache::KernelCache kc(cache::config_from_env());
  exec::KernelLibrary lib(kc, templates);
  std::vector<cache::Origin> origins;
  unsigned jobs = o.jobs ? o.jobs : std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
  try {
    kc.get_or_compile_all(c.requests, lib.compiler(), jobs, &origins,
                          o.json ? std::function<void(size_t, size_t)>() : progress_bar);
  } catch (const Error& e) {
    // The cache rethrows only the first failure: ask each kernel again (the good ones are in memory now) and
    // report every one that fails, with its label and its errors mapped back to user templates.
    std::vector<std::string> failures;
    for (size_t i = 0; i < c.requests.size(); ++i) {
      try {
        kc.get_or_compile(c.requests[i], lib.compiler());
      } catch (const Error& ke) {
        failures.push_back(fmt::format("kernel #{} ({}): {}", i, c.labels[i],
                                       map_kernel_log(ke.what(), c.requests[i].source, rs)));
      }
    }
    if (failures.empty()) throw;
    for (const auto& f : failures) std::fprintf(stderr, "%s\n", f.c_str());
    fail(e.status(), "{} of {} kernels failed (each listed above)", failures.size(), c.requests.size());
  }
  size_t compiled = 0, disk = 0, memory = 0;
  for (auto og : origins) {
    compiled += og == cache::Origin::compiled;
    disk += og == cache::Origin::disk;
    memory += og == cache::Origin::memory;
  }
  if (o.json) {
    nlohmann::json j = {{"arch", target.arch}, {"variants", o.all_variants ? "all" : "needed"},
                        {"kernels", c.requests.size()}, {"compiled", compiled},
                        {"loaded_from_disk", disk}, {"already_in_memory", memory},
                        {"cache_dir", kc.dir() ? nlohmann::json(*kc.dir()) : nlohmann::json()},
                        {"disk_enabled", kc.disk_enabled()}};
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("%zu compiled, %zu loaded from disk, %zu already in memory (arch %s, cache %s)\n", compiled, disk,
                memory, target.arch.c_str(), kc.disk_enabled() && kc.dir() ? kc.dir()->c_str() : "memory only");
  }
}

int run_check(const PlanOpts& o) {
  auto rs = load_rules(o.rules);
  std::string arch = default_arch(o.arch);
  Planned p = plan_file(rs, o.seqs[0], o.recipe, o.shapes[0], parse_arch(arch), !o.inference);
  std::printf("sequence '%s': %zu ops, input %s, recipe %s\n", p.def.name.c_str(), p.ops.size(), o.shapes[0].c_str(),
              o.recipe.c_str());
  for (auto [title, groups] : {std::pair{"forward", &p.plan.forward}, std::pair{"backward", &p.plan.backward}}) {
    if (o.inference && std::string(title) == "backward") continue;
    std::printf("%s groups:\n", title);
    for (const auto& g : *groups)
      std::printf("  [%d, %d) %-40s %s\n", g.begin, g.end, fuser::group_ops(g, p.ops).c_str(),
                  g.rule.empty() ? "unfused" : (g.rule + ": " + fuser::impl_text(g)).c_str());
  }
  PlanOpts w = o;
  w.arch = arch;
  std::printf("compiling the generated kernels with NVRTC for %s:\n", arch.c_str());
  run_warmup(w);
  std::string why;
  if (!cuda::try_driver(&why)) {
    std::printf("no GPU present (%s): kernels generated and compiled; running them needs a GPU\n", why.c_str());
    return 0;
  }
  if (ops::parse_recipe(o.recipe).is_fp8()) {
    std::printf("kernels generated and compiled; the run against the float64 reference covers the plain recipes "
                "(the FP8 casts are checked by the gpu test tier, jf_gpu_tests \"[fp8]\"): rerun with --recipe bf16\n");
    return 0;
  }
  // User-declared ops have no float64 reference: their fused run is compared with the unfused run of the
  // same ops on the GPU instead (JITFUSE_VERIFY), and the outputs are checked for unwritten elements.
  std::string user_ops;
  for (const auto& op : p.ops)
    if (op.info->user_declared && user_ops.find(op.kind) == std::string::npos)
      user_ops += (user_ops.empty() ? "" : ", ") + op.kind;
  const bool verify = o.verify || !user_ops.empty();
  jf_context ctx = nullptr;
  if (verify) setenv("JITFUSE_VERIFY", "1", 1);  // read when the context is created
  if (jf_context_create(&ctx) != JF_OK) fail(Status::internal, "jf_context_create: {}", jf_last_error());
  struct Guard {
    jf_context c;
    ~Guard() { jf_context_destroy(c); }
  } guard{ctx};
  for (const auto& r : o.rules) jf_context_load_rules(ctx, r.c_str(), nullptr);
  harness::CheckOptions co;
  co.recipe = o.recipe;
  co.shape = ops::parse_shape(o.shapes[0]);
  co.backward = !o.inference;
  co.no_reference = !user_ops.empty();
  // A sequence with collectives runs on a one-rank NCCL communicator (the float64 reference holds one rank).
  struct CommGuard {
    jf_comm c = nullptr;
    ~CommGuard() { jf_comm_destroy(c); }
  } comm;
  if (!p.def.group.empty()) {
    uint8_t id[JF_COMM_ID_BYTES];
    if (jf_comm_unique_id(id, sizeof id) != JF_OK || jf_comm_create(id, sizeof id, 1, 0, &comm.c) != JF_OK)
      fail(Status::unsupported, "the sequence runs collectives on group '{}': {}", p.def.group, jf_last_error());
    co.comm = comm.c;
  }
  auto rep = harness::check_sequence(ctx, rs.registry(), json_util::read_file(o.seqs[0]), co);
  if (co.no_reference)
    std::printf("ran on %s; the sequence uses user-declared ops (%s), which have no float64 reference: every "
                "output was checked for unwritten elements (outputs poisoned), and the fused groups were compared "
                "with the unfused run of the same ops on the GPU (JITFUSE_VERIFY):\n%s",
                cuda::current_device().name.c_str(), user_ops.c_str(), rep.table().c_str());
  else
    std::printf("ran on %s against the float64 reference (fresh random inputs, outputs poisoned):\n%s",
                cuda::current_device().name.c_str(), rep.table().c_str());
  bool verified = true;
  if (const exec::VerifyLog* v = api::context_of(ctx).verify_log()) {
    std::printf("JITFUSE_VERIFY: %d fused groups compared with their unfused ops on the GPU (%d tensors): %s\n",
                v->groups_compared, v->tensors_compared,
                v->failures ? ("FIRST DIFFERENCE: " + v->first).c_str() : "no difference beyond the tolerance");
    for (const auto& why : v->skipped) std::printf("  not compared: %s\n", why.c_str());
    verified = v->failures == 0;
  }
  const bool pass = rep.pass() && verified;
  std::printf("%s\n", pass ? "PASS" : "FAIL");
  return pass ? 0 : 1;
}

}  // namespace

void add_plan_commands(CLI::App& app) {
  {
    auto o = std::make_shared<PlanOpts>();
    auto* cmd = app.add_subcommand("codegen", "Print the generated CUDA source of every kernel a sequence needs");
    add_plan_options(cmd, *o, false);
    cmd->add_flag("--json", o->json, "Machine-readable output");
    cmd->add_flag("--compile", o->compile, "Also compile each kernel with NVRTC and report its size and time");
    cmd->callback([o] { run_codegen(*o); });
  }
  {
    auto o = std::make_shared<PlanOpts>();
    auto* cmd = app.add_subcommand("warmup", "Compile every kernel these sequences and shapes need into the cache "
                                             "(NVRTC only, no GPU needed)");
    add_plan_options(cmd, *o, true);
    cmd->add_flag("--json", o->json, "Machine-readable summary");
    cmd->add_option("--jobs", o->jobs, "Parallel compiles (default: min(8, cores))");
    cmd->add_flag("--all-variants", o->all_variants,
                  "Also compile the scalar fallback of every kernel that has a vector variant (by default a process "
                  "compiles it when a call first passes a tensor that is not 16-byte aligned)");
    cmd->callback([o] { run_warmup(*o); });
  }
  {
    auto o = std::make_shared<PlanOpts>();
    auto* cmd = app.add_subcommand("check", "Plan a sequence, show the fusion decisions, compile its kernels and, "
                                            "with a GPU, run them against the float64 reference");
    add_plan_options(cmd, *o, false);
    cmd->add_flag("--verify", o->verify,
                  "Also compare every fused group with its unfused ops on the GPU (JITFUSE_VERIFY=1) and report the "
                  "first that differs");
    cmd->callback([o] {
      int rc = run_check(*o);
      if (rc) throw CLI::RuntimeError(rc);
    });
  }
}

}  // namespace jitfuse::cli
