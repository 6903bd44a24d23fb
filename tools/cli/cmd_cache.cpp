// `jitfuse cache ls|show|stats|verify|prune|clear`: inspect and maintain the on-disk kernel cache.
// Every subcommand takes --dir (default: JITFUSE_CACHE_DIR, else the XDG cache dir) and --json.
#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cache/disk_io.hpp"
#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "commands.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "cuda/cubin_info.hpp"

namespace jitfuse::cli {
namespace {

using nlohmann::json;

struct CacheArgs {
  std::string dir;
  bool json = false;
};

std::string resolve_dir(const CacheArgs& a) {
  if (!a.dir.empty()) return a.dir;
  auto c = cache::config_from_env();  // throws, naming the variable, on a bad JITFUSE_CACHE_MAX_BYTES
  if (!c.dir) fail(Status::invalid_argument, "no cache directory: set JITFUSE_CACHE_DIR (or HOME), or pass --dir");
  return *c.dir;
}

std::string human_bytes(uint64_t n) {
  static const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(n);
  int u = 0;
  while (v >= 1024 && u < 4) v /= 1024, ++u;
  return u == 0 ? fmt::format("{} B", n) : fmt::format("{:.1f} {}", v, kUnits[u]);
}

// Metadata values as table cells: ops joined by '+', shapes by 'x', missing as '-'.
std::string cell(const json& meta, const char* field, const char* sep) {
  if (!meta.is_object() || !meta.contains(field)) return "-";
  const json& v = meta[field];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_array()) {
    std::string out;
    for (const auto& x : v) out += (out.empty() ? "" : sep) + (x.is_string() ? x.get<std::string>() : x.dump());
    return out.empty() ? "-" : out;
  }
  if (v.is_object()) {  // e.g. dtypes {"in":"bf16","out":"bf16"}
    std::string out;
    for (const auto& [k, x] : v.items()) out += (out.empty() ? "" : ",") + k + "=" + (x.is_string() ? x.get<std::string>() : x.dump());
    return out;
  }
  return v.dump();
}

std::string age(int64_t unix_ns) {
  int64_t s = (cache::io::now_ns() - unix_ns) / 1000000000;
  if (s < 0) s = 0;
  if (s < 120) return fmt::format("{}s ago", s);
  if (s < 7200) return fmt::format("{}m ago", s / 60);
  if (s < 172800) return fmt::format("{}h ago", s / 3600);
  return fmt::format("{}d ago", s / 86400);
}

void print_table(const std::vector<std::vector<std::string>>& rows) {
  std::vector<size_t> w;
  for (const auto& r : rows)
    for (size_t i = 0; i < r.size(); ++i) {
      if (w.size() <= i) w.push_back(0);
      w[i] = std::max(w[i], r[i].size());
    }
  for (const auto& r : rows) {
    std::string line;
    for (size_t i = 0; i < r.size(); ++i) line += i + 1 == r.size() ? r[i] : fmt::format("{:<{}}  ", r[i], w[i]);
    fmt::print("{}\n", line);
  }
}

json info_json(const cache::EntryInfo& i) {
  json j = {{"key", i.key}, {"path", i.path}, {"bytes", i.bytes}, {"hits", i.hits}, {"meta", i.meta}};
  if (!i.problem.empty()) j["problem"] = i.problem;
  return j;
}

void cmd_ls(const CacheArgs& a) {
  const std::string dir = resolve_dir(a);
  auto entries = cache::scan_entries(dir, /*verify=*/false);  // header only: fast on big caches
  std::sort(entries.begin(), entries.end(), [](const auto& x, const auto& y) {
    return std::tie(y.last_used_ns, x.key) < std::tie(x.last_used_ns, y.key);  // most recently used first
  });
  if (a.json) {
    json out = json::array();
    for (const auto& e : entries) out.push_back(info_json(e));
    fmt::print("{}\n", out.dump(2, ' ', false, json::error_handler_t::replace));
    return;
  }
  if (entries.empty()) {
    fmt::print("no kernel cache entries in {}\n", dir);
    return;
  }
  std::vector<std::vector<std::string>> rows{
      {"KEY", "RULE", "OPS", "RECIPE", "SHAPE", "ARCH", "VARIANT", "SIZE", "COMPILE", "LAST USED"}};
  for (const auto& e : entries) {
    if (!e.problem.empty()) {
      rows.push_back({e.key.substr(0, 12), "(damaged: " + e.problem + ")"});
      continue;
    }
    const json& m = e.meta;
    std::string ms = m.contains("compile_ms") && m["compile_ms"].is_number()
                         ? fmt::format("{:.0f} ms", m["compile_ms"].get<double>())
                         : "-";
    rows.push_back({e.key.substr(0, 12), cell(m, "rule", ","), cell(m, "ops", "+"), cell(m, "recipe", ","),
                    cell(m, "shape", "x"), cell(m, "arch", ","), cell(m, "variant", ","), human_bytes(e.bytes), ms,
                    age(e.last_used_ns)});
  }
  print_table(rows);
}

std::string find_on_path(const std::string& tool) {
  for (const auto& d : env::split_path(env::get("PATH").value_or("")))
    if (std::string p = d + "/" + tool; ::access(p.c_str(), X_OK) == 0) return p;
  return {};
}

// cuobjdump reads files only, so the CUBIN goes through a private temp file.
void print_sass(const cache::Entry& e) {
  std::string tool = find_on_path("cuobjdump");
  if (tool.empty())
    fail(Status::unsupported,
         "cuobjdump was not found on PATH, so SASS cannot be shown; add the CUDA toolkit's bin directory "
         "(e.g. /usr/local/cuda/bin) to PATH");
  std::string tmp = "/tmp/jitfuse-sass-XXXXXX.cubin";
  int fd = ::mkstemps(tmp.data(), 6);
  if (fd < 0) fail(Status::io_error, "cannot create a temporary file for cuobjdump: {}", cache::io::errno_text(errno));
  bool ok = ::write(fd, e.cubin.data(), e.cubin.size()) == ssize_t(e.cubin.size());
  ::close(fd);
  int status = -1;
  if (ok) {
    std::fflush(stdout);
    pid_t pid = ::fork();
    if (pid == 0) {
      ::execl(tool.c_str(), tool.c_str(), "-sass", tmp.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    if (pid > 0) ::waitpid(pid, &status, 0);
  }
  ::unlink(tmp.c_str());
  if (!ok) fail(Status::io_error, "cannot write the CUBIN to {}", tmp);
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail(Status::internal, "{} -sass failed on entry {} (exit status {})", tool, e.key.substr(0, 12), status);
}

// What each entry point costs an SM, read from the CUBIN (no GPU or cuobjdump needed).
json resources_json(const cache::Entry& e) {
  const cuda::CubinResources r = cuda::read_cubin_resources(e.cubin);
  json ks = json::array();
  for (const auto& k : r.kernels)
    ks.push_back({{"name", k.name}, {"registers", k.registers}, {"frame_bytes", k.frame_bytes},
                  {"static_shared_bytes", k.static_shared_bytes}});
  json j = {{"kernels", ks}};
  if (!r.error.empty()) j["error"] = r.error;
  return j;
}

void print_resources(const cache::Entry& e) {
  const cuda::CubinResources r = cuda::read_cubin_resources(e.cubin);
  fmt::print("resources      as ptxas recorded them in the CUBIN (registers and stack frame per thread; static "
             "shared per block, with the 1 KiB sm_80+ reserves)\n");
  for (const auto& k : r.kernels)
    fmt::print("  {}  registers {}  stack frame {}  static shared {}\n", k.name,
               k.registers < 0 ? std::string("?") : std::to_string(k.registers),
               k.frame_bytes < 0 ? std::string("?") : human_bytes(static_cast<uint64_t>(k.frame_bytes)),
               human_bytes(static_cast<uint64_t>(k.static_shared_bytes)));
  if (!r.error.empty()) fmt::print("  (not read: {})\n", r.error);
}

struct ShowArgs {
  std::string key;
  bool source = false, ptx = false, sass = false;
};

void cmd_show(const CacheArgs& a, const ShowArgs& s) {
  const std::string dir = resolve_dir(a);
  auto e = cache::read_entry(dir, s.key);
  if (!e) fail(Status::invalid_argument, "no kernel cache entry matches '{}' in {} (see `jitfuse cache ls`)", s.key, dir);
  const std::string path = cache::entry_path(dir, e->key);
  if (s.ptx) {
    if (!e->meta.contains("ptx") || !e->meta["ptx"].is_string())
      fail(Status::unsupported,
           "entry {} has no PTX: the cache stores the compiled CUBIN only; use --sass to disassemble it",
           e->key.substr(0, 12));
    fmt::print("{}", e->meta["ptx"].get<std::string>());
    return;
  }
  if (s.sass) return print_sass(*e);
  if (a.json) {
    json j = {{"key", e->key},
              {"path", path},
              {"meta", e->meta},
              {"source_bytes", e->source.size()},
              {"cubin_bytes", e->cubin.size()},
              {"resources", resources_json(*e)}};
    if (s.source) j["source"] = e->source;
    fmt::print("{}\n", j.dump(2, ' ', false, json::error_handler_t::replace));
    return;
  }
  if (s.source) {
    fmt::print("{}", e->source);
    return;
  }
  fmt::print("key            {}\npath           {}\nsource         {}\ncubin          {}\n", e->key, path,
             human_bytes(e->source.size()), human_bytes(e->cubin.size()));
  for (const auto& [k, v] : e->meta.items()) {
    if (k == "compile_log" || k == "ptx") continue;
    fmt::print("{:<15}{}\n", k, v.is_string() ? v.get<std::string>() : v.dump());
  }
  print_resources(*e);
  if (e->meta.contains("compile_log")) fmt::print("compile log:\n{}\n", e->meta["compile_log"].get<std::string>());
}

void cmd_stats(const CacheArgs& a) {
  const std::string dir = resolve_dir(a);
  auto entries = cache::scan_entries(dir, /*verify=*/false);
  uint64_t bytes = 0, hits = 0, damaged = 0;
  for (const auto& e : entries) {
    bytes += e.bytes;
    hits += e.hits;
    damaged += !e.problem.empty();
  }
  uint64_t quarantined = cache::quarantined_count(dir);
  std::string problem = std::filesystem::exists(dir) ? cache::dir_problem(dir) : "";
  if (a.json) {
    json j = {{"dir", dir},       {"entries", entries.size()}, {"bytes", bytes},
              {"hits", hits},     {"quarantined", quarantined}, {"damaged", damaged}};
    if (!problem.empty()) j["unsafe"] = problem;
    fmt::print("{}\n", j.dump(2, ' ', false, json::error_handler_t::replace));
    return;
  }
  fmt::print("directory    {}\nentries      {}\nbytes        {} ({})\nhits         {}\nquarantined  {}\n", dir,
             entries.size(), human_bytes(bytes), bytes, hits, quarantined);
  if (damaged) fmt::print("damaged      {} (run `jitfuse cache verify`)\n", damaged);
  if (!problem.empty()) fmt::print("warning: jitfuse will not use this directory: {}\n", problem);
}

void cmd_verify(const CacheArgs& a) {
  const std::string dir = resolve_dir(a);
  auto entries = cache::list_entries(dir);  // full read: checksum of every byte
  std::vector<const cache::EntryInfo*> bad;
  for (const auto& e : entries)
    if (!e.problem.empty()) bad.push_back(&e);
  if (a.json) {
    json d = json::array();
    for (auto* e : bad) d.push_back({{"key", e->key}, {"path", e->path}, {"problem", e->problem}});
    fmt::print("{}\n", json{{"dir", dir}, {"checked", entries.size()}, {"damaged", d}}.dump(2, ' ', false, json::error_handler_t::replace));
  } else {
    for (auto* e : bad) fmt::print("DAMAGED  {}  {}\n", e->key.substr(0, 12), e->problem);
    fmt::print("checked {} entries in {}: {} damaged\n", entries.size(), dir, bad.size());
  }
  if (!bad.empty()) throw CLI::RuntimeError(1);  // jitfuse moves them aside on next use
}

void cmd_prune(const CacheArgs& a, const std::string& max_text) {
  const std::string dir = resolve_dir(a);
  uint64_t max_bytes = cache::parse_byte_count(max_text, "--max-bytes");
  uint64_t removed = cache::prune(dir, max_bytes);
  auto left = cache::scan_entries(dir, false);
  uint64_t bytes = 0;
  for (const auto& e : left) bytes += e.bytes;
  if (a.json) {
    fmt::print("{}\n", json{{"removed_bytes", removed}, {"entries", left.size()}, {"bytes", bytes}}.dump(2, ' ', false, json::error_handler_t::replace));
    return;
  }
  fmt::print("removed {}; {} {} ({}) remain in {}\n", human_bytes(removed), left.size(),
             left.size() == 1 ? "entry" : "entries", human_bytes(bytes), dir);
}

void cmd_clear(const CacheArgs& a) {
  const std::string dir = resolve_dir(a);
  uint64_t removed = cache::clear(dir);
  if (a.json)
    fmt::print("{}\n", json{{"removed", removed}}.dump(2, ' ', false, json::error_handler_t::replace));
  else
    fmt::print("removed {} entries from {}\n", removed, dir);
}

CLI::App* leaf(CLI::App* parent, const char* name, const char* what, const std::shared_ptr<CacheArgs>& a) {
  CLI::App* sub = parent->add_subcommand(name, what);
  sub->add_option("--dir", a->dir, "cache directory (default: $JITFUSE_CACHE_DIR, else $XDG_CACHE_HOME/jitfuse)");
  sub->add_flag("--json", a->json, "machine-readable output");
  return sub;
}

}  // namespace

void add_cache_commands(CLI::App& app) {
  CLI::App* cache = app.add_subcommand("cache", "inspect and maintain the on-disk kernel cache");
  cache->require_subcommand(1);
  auto a = std::make_shared<CacheArgs>();

  leaf(cache, "ls", "list entries, most recently used first", a)->callback([a] { cmd_ls(*a); });

  auto s = std::make_shared<ShowArgs>();
  CLI::App* show = leaf(cache, "show", "one entry's metadata, source, PTX or SASS", a);
  show->add_option("key", s->key, "a key or unique key prefix (see `cache ls`)")->required();
  auto* src = show->add_flag("--source", s->source, "print the CUDA source");
  auto* ptx = show->add_flag("--ptx", s->ptx, "print the PTX, when the entry has it");
  auto* sass = show->add_flag("--sass", s->sass, "disassemble the CUBIN with cuobjdump -sass");
  src->excludes(ptx)->excludes(sass);
  ptx->excludes(sass);
  show->callback([a, s] { cmd_show(*a, *s); });

  leaf(cache, "stats", "entries, bytes, hits, quarantined entries", a)->callback([a] { cmd_stats(*a); });
  leaf(cache, "verify", "check every entry's checksum; exit 1 on damage", a)->callback([a] { cmd_verify(*a); });

  auto max = std::make_shared<std::string>();
  CLI::App* prune = leaf(cache, "prune", "evict least recently used entries down to a size", a);
  prune->add_option("--max-bytes", *max, "size to shrink to, e.g. 500M or 2G (0 removes everything)")->required();
  prune->callback([a, max] { cmd_prune(*a, *max); });

  leaf(cache, "clear", "remove every entry", a)->callback([a] { cmd_clear(*a); });
}

}  // namespace jitfuse::cli
