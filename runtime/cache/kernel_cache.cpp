// KernelCache: memory tier -> disk tier -> compile, with in-process dedupe (one compile per key
// per process) and a per-key flock across processes. Disk trouble never fails a request.
#include "cache/kernel_cache.hpp"

#include <algorithm>
#include <atomic>
#include <future>
#include <mutex>
#include <numeric>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "cache/disk_io.hpp"
#include "cache/disk_store.hpp"
#include "cache/sha256.hpp"
#include "common/env.hpp"
#include "common/error.hpp"
#include "common/log.hpp"

namespace jitfuse::cache {

Config config_from_env() {
  Config c;
  if (auto d = env::get("JITFUSE_CACHE_DIR"); d && !d->empty()) {
    c.dir = *d;
  } else if (auto x = env::get("XDG_CACHE_HOME"); x && !x->empty() && x->front() == '/') {
    c.dir = *x + "/jitfuse";  // the XDG spec says to ignore a relative XDG_CACHE_HOME
  } else if (auto h = env::get("HOME"); h && !h->empty()) {
    c.dir = *h + "/.cache/jitfuse";
  }
  if (auto m = env::get("JITFUSE_CACHE_MAX_BYTES"); m && !m->empty())
    c.max_bytes = parse_byte_count(*m, "JITFUSE_CACHE_MAX_BYTES");
  return c;
}

namespace {

// Each field is a length-prefixed name then a length-prefixed value, so no two different
// requests can produce the same byte stream (e.g. options {"ab","c"} vs {"a","bc"}).
void put(Sha256& h, std::string_view bytes) {
  uint64_t n = bytes.size();
  char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  h.update(std::string_view(len, 8)).update(bytes);
}

}  // namespace

std::string cache_key(const KernelRequest& request) {
  Sha256 h;
  put(h, "jitfuse.kernel-key");
  put(h, "source");
  put(h, request.source);
  put(h, "options");
  put(h, std::to_string(request.options.size()));
  for (const auto& o : request.options) put(h, o);
  put(h, "nvrtc_version");
  put(h, request.nvrtc_version);
  put(h, "arch");
  put(h, request.arch);
  put(h, "format_version");
  put(h, std::to_string(kFormatVersion));
  return to_hex(h.finish());
}

std::vector<size_t> distinct(const std::vector<KernelRequest>& requests) {
  std::vector<size_t> out;
  std::unordered_set<std::string> keys;
  for (size_t i = 0; i < requests.size(); ++i)
    if (keys.insert(cache_key(requests[i])).second) out.push_back(i);
  return out;
}

using EntryPtr = std::shared_ptr<const Entry>;

struct KernelCache::Impl {
  Config config_;
  io::Layout layout_;
  std::atomic<bool> disk_enabled_{false};

  mutable std::mutex mu_;
  std::unordered_map<std::string, EntryPtr> memory_;
  std::unordered_map<std::string, std::shared_future<EntryPtr>> in_flight_;
  Stats stats_;

  explicit Impl(Config c) : config_(std::move(c)) {
    if (!config_.dir) return;
    std::string root = *config_.dir;
    while (root.size() > 1 && root.back() == '/') root.pop_back();
    layout_.root = root;
    config_.dir = root;
    try {
      for (const auto& d : {layout_.root, layout_.base(), layout_.locks_dir(), layout_.quarantine_dir()}) {
        io::make_dirs(d, 0700);
        if (std::string why = io::unsafe_reason(d); !why.empty()) {
          log().warn("kernel cache: not using the disk cache: {}. Kernels are cached in memory only.", why);
          return;
        }
      }
      io::probe_writable(layout_.base());
      disk_enabled_ = true;
    } catch (const std::exception& e) {
      log().warn("kernel cache: cannot use {} ({}). Kernels are cached in memory only.", layout_.root, e.what());
    }
  }

  // The one warning a cache emits when it loses its disk tier; later failures stay quiet.
  void disable_disk(const std::string& why) {
    if (disk_enabled_.exchange(false))
      log().warn("kernel cache: disk cache {} disabled: {}. Kernels are cached in memory only from now on.",
                 layout_.root, why);
  }

  void count(uint64_t Stats::*field) {
    std::lock_guard g(mu_);
    ++(stats_.*field);
  }

  // A verified entry for `key`, or null. Damaged files are only moved aside under the key lock
  // (`locked`): otherwise we could move a good entry that another process just published.
  EntryPtr try_load(const std::string& key, bool locked) {
    if (!disk_enabled_) return nullptr;
    std::string path = layout_.entry_path(key);
    std::optional<std::string> bytes;
    std::string refused;
    try {
      bytes = read_entry_file(path, /*owner_check=*/true, &refused);
    } catch (const std::exception& e) {
      disable_disk(e.what());
      return nullptr;
    }
    std::string problem;
    if (!refused.empty()) {
      problem = fmt::format("{}: {}", path, refused);
    } else if (!bytes) {
      return nullptr;
    } else {
      try {
        Entry e = parse_entry(*bytes, path);
        if (e.key == key) {
          io::record_hit(layout_.use_path(key));
          return std::make_shared<const Entry>(std::move(e));
        }
        problem = fmt::format("{}: holds key {}", path, e.key);
      } catch (const Error& e) {
        problem = e.what();
      }
    }
    if (locked) {
      try {
        std::string moved = io::quarantine(path, layout_.quarantine_dir(), key);
        log().warn("kernel cache: {}; moved it to {} and recompiling", problem, moved.empty() ? "(gone)" : moved);
      } catch (const std::exception& e) {
        log().warn("kernel cache: {}; could not move it aside ({}); recompiling", problem, e.what());
      }
    }
    return nullptr;
  }

  EntryPtr make_entry(const std::string& key, const KernelRequest& req, CompileResult&& r) {
    auto e = std::make_shared<Entry>();
    e->key = key;
    if (req.meta.is_object()) {
      e->meta = req.meta;
    } else {
      e->meta = nlohmann::json::object();
      if (!req.meta.is_null()) e->meta["request_meta"] = req.meta;
    }
    std::string now = io::iso_time(io::now_ns());
    e->meta["arch"] = req.arch;
    e->meta["nvrtc_version"] = req.nvrtc_version;
    e->meta["options"] = req.options;
    e->meta["compile_ms"] = r.compile_ms;
    e->meta["created"] = now;
    e->meta["last_used"] = now;
    e->meta["hits"] = 0;
    if (!r.log.empty()) e->meta["compile_log"] = r.log;
    e->source = req.source;
    e->cubin = std::move(r.cubin);
    return e;
  }

  void store(const EntryPtr& e) {
    if (!disk_enabled_) return;
    try {
      io::make_dirs(layout_.shard_dir(e->key), 0700);
      io::write_file_atomic(layout_.entry_path(e->key), serialize_entry(*e));
      // Runs while we still hold e->key's lock, so prune skips the entry we just wrote.
      if (config_.max_bytes) prune(layout_.root, config_.max_bytes);
    } catch (const std::exception& ex) {
      disable_disk(ex.what());
    }
  }

  // Disk, then (under the key lock) disk again, then compile. Only `compile` may throw out of here.
  EntryPtr load_or_compile(const std::string& key, const KernelRequest& req, const CompileFn& compile,
                           Origin& origin) {
    origin = Origin::disk;
    if (EntryPtr e = try_load(key, false)) {
      count(&Stats::disk_hits);
      return e;
    }
    count(&Stats::misses);
    io::FileLock lock;
    if (disk_enabled_) {
      try {
        lock = io::FileLock::acquire(layout_.lock_path(key), config_.lock_timeout_s);
        if (!lock.held())
          log().warn("kernel cache: waited {}s for another process compiling {}; compiling it here too",
                     config_.lock_timeout_s, key.substr(0, 12));
      } catch (const std::exception& ex) {
        disable_disk(ex.what());
      }
      if (lock.held()) {
        if (EntryPtr e = try_load(key, true)) {  // another process compiled it while we waited
          count(&Stats::disk_hits);
          return e;
        }
      }
    }
    origin = Origin::compiled;
    CompileResult r = compile(req);
    count(&Stats::compiled);
    EntryPtr e = make_entry(key, req, std::move(r));
    store(e);
    return e;
  }
};

KernelCache::KernelCache(Config config) : impl_(std::make_unique<Impl>(std::move(config))) {}
KernelCache::~KernelCache() = default;

std::shared_ptr<const Entry> KernelCache::get_or_compile(const KernelRequest& request, const CompileFn& compile,
                                                         Origin* origin) {
  Impl& m = *impl_;
  std::string key = cache_key(request);
  std::promise<EntryPtr> promise;
  std::shared_future<EntryPtr> waiting;
  {
    std::lock_guard g(m.mu_);
    if (auto it = m.memory_.find(key); it != m.memory_.end()) {
      ++m.stats_.memory_hits;
      if (origin) *origin = Origin::memory;
      return it->second;
    }
    if (auto it = m.in_flight_.find(key); it != m.in_flight_.end()) {
      waiting = it->second;
    } else {
      m.in_flight_.emplace(key, promise.get_future().share());
    }
  }
  if (waiting.valid()) {
    // Another thread of this cache is already on it: share its result (or its compile error).
    EntryPtr e = waiting.get();
    m.count(&Stats::memory_hits);
    if (origin) *origin = Origin::memory;
    return e;
  }
  try {
    Origin o = Origin::compiled;
    EntryPtr e = m.load_or_compile(key, request, compile, o);
    {
      std::lock_guard g(m.mu_);
      m.memory_.emplace(key, e);
      m.in_flight_.erase(key);
    }
    promise.set_value(e);
    if (origin) *origin = o;
    return e;
  } catch (...) {
    {
      std::lock_guard g(m.mu_);
      m.in_flight_.erase(key);
    }
    promise.set_exception(std::current_exception());
    throw;
  }
}

std::vector<std::shared_ptr<const Entry>> KernelCache::get_or_compile_all(
    const std::vector<KernelRequest>& requests, const CompileFn& compile, unsigned threads,
    std::vector<Origin>* origins, const std::function<void(size_t, size_t)>& progress) {
  const size_t n = requests.size();
  std::vector<EntryPtr> results(n);
  std::vector<Origin> got(n, Origin::compiled);
  std::vector<std::exception_ptr> errors(n);
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  const size_t workers = std::min<size_t>(threads, n);

  // Longest first: with as many workers as cores, a long compile picked up last would run alone at the end.
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return requests[a].cost_hint > requests[b].cost_hint; });
  std::atomic<size_t> next{0};
  std::mutex progress_mu;
  size_t done = 0;
  auto work = [&] {
    for (size_t k; (k = next.fetch_add(1)) < n;) {
      const size_t i = order[k];
      try {
        results[i] = get_or_compile(requests[i], compile, &got[i]);
      } catch (...) {
        errors[i] = std::current_exception();
      }
      std::lock_guard g(progress_mu);
      ++done;
      if (progress) {
        try {
          progress(done, n);
        } catch (...) {
          if (!errors[i]) errors[i] = std::current_exception();
        }
      }
    }
  };
  // The calling thread is one of the workers; a failed thread start just means fewer workers.
  std::vector<std::thread> pool;
  for (size_t t = 1; t < workers; ++t) {
    try {
      pool.emplace_back(work);
    } catch (const std::system_error& e) {
      log().warn("kernel cache: could not start a compile thread ({}); continuing with {}", e.what(), t);
      break;
    }
  }
  work();
  for (auto& t : pool) t.join();

  size_t failed = std::count_if(errors.begin(), errors.end(), [](auto& e) { return bool(e); });
  for (size_t i = 0; i < n; ++i) {
    if (!errors[i]) continue;
    if (failed == 1) std::rethrow_exception(errors[i]);
    // Several failed: every one is logged, and the first is thrown saying how many there were.
    for (size_t j = i + 1; j < n; ++j) {
      if (!errors[j]) continue;
      try {
        std::rethrow_exception(errors[j]);
      } catch (const std::exception& e) {
        log().error("kernel cache: kernel #{} of {} failed too: {}", j, n, e.what());
      }
    }
    try {
      std::rethrow_exception(errors[i]);
    } catch (const Error& e) {
      throw Error(e.status(), fmt::format("{}\n(kernel #{}; {} of {} kernels failed, the others are logged)", e.what(),
                                          i, failed, n));
    }
  }
  if (origins) *origins = std::move(got);
  return results;
}

Stats KernelCache::stats() const {
  std::lock_guard g(impl_->mu_);
  return impl_->stats_;
}

bool KernelCache::disk_enabled() const { return impl_->disk_enabled_; }

std::optional<std::string> KernelCache::dir() const { return impl_->config_.dir; }

}  // namespace jitfuse::cache
