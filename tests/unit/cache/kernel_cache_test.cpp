// KernelCache behaviour: which tier answers, how often the compiler runs, the thread pool,
// compile errors, metadata, hit bookkeeping, and LRU eviction under max_bytes.
#include <catch2/catch.hpp>

#include <future>
#include <map>
#include <mutex>
#include <set>

#include "cache/disk_io.hpp"
#include "cache/disk_store.hpp"
#include "cache/kernel_cache.hpp"
#include "cache_test_util.hpp"

using namespace jitfuse;
using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

TEST_CASE("memory hit, disk hit and compile counts", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("cache");
  FakeCompiler fc;
  auto req = make_request(1);
  LogCapture cap;

  KernelCache c1(Config{dir});
  REQUIRE(c1.disk_enabled());
  Origin o{};
  auto e1 = c1.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::compiled);
  CHECK(fc.calls == 1);
  CHECK(e1->cubin == expected_cubin(req));
  CHECK(e1->source == req.source);
  CHECK(e1->key == cache_key(req));

  auto e2 = c1.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::memory);
  CHECK(e2 == e1);  // the very same object: a memory hit copies nothing
  CHECK(fc.calls == 1);

  KernelCache c2(Config{dir});
  auto e3 = c2.get_or_compile(req, fc.fn(), &o);
  CHECK(o == Origin::disk);
  CHECK(fc.calls == 1);
  CHECK(e3->cubin == e1->cubin);
  CHECK(e3->source == e1->source);
  CHECK(e3->meta["rule"] == "bias_gelu_1");

  Stats s1 = c1.stats(), s2 = c2.stats();
  CHECK(s1.compiled == 1);
  CHECK(s1.misses == 1);
  CHECK(s1.memory_hits == 1);
  CHECK(s1.disk_hits == 0);
  CHECK(s2.disk_hits == 1);
  CHECK(s2.compiled == 0);

  auto infos = list_entries(dir);
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].problem.empty());
  CHECK(infos[0].hits == 1);  // one disk hit (c2); memory hits are not written to disk
  CHECK(infos[0].meta["hits"] == 1);
  CHECK(infos[0].path == entry_path(dir, e1->key));
  CHECK(cap.warnings().empty());
}

TEST_CASE("entry metadata: request meta plus compile facts", "[cache]") {
  TempDir tmp;
  FakeCompiler fc;
  auto req = make_request(2);
  KernelCache c(Config{tmp.sub("c")});
  auto e = c.get_or_compile(req, fc.fn());
  const auto& m = e->meta;
  for (const char* k : {"rule", "ops", "recipe", "dtypes", "shape"}) CHECK(m.at(k) == req.meta.at(k));
  CHECK(m.at("arch") == "sm_90a");
  CHECK(m.at("nvrtc_version") == "13.0");
  CHECK(m.at("options") == nlohmann::json(req.options));
  CHECK(m.at("compile_ms") == 12.5);
  CHECK(m.at("hits") == 0);
  CHECK(m.at("created").get<std::string>().size() == 20);  // 2026-01-02T03:04:05Z
  CHECK(m.at("last_used") == m.at("created"));
  auto back = read_entry(tmp.sub("c"), e->key.substr(0, 10));
  REQUIRE(back);
  CHECK(back->meta.at("rule") == req.meta.at("rule"));
  CHECK(back->cubin == e->cubin);
}

TEST_CASE("memory-only cache compiles once per cache and touches no disk", "[cache]") {
  FakeCompiler fc;
  KernelCache c(Config{});
  CHECK_FALSE(c.disk_enabled());
  CHECK_FALSE(c.dir().has_value());
  Origin o{};
  c.get_or_compile(make_request(1), fc.fn(), &o);
  CHECK(o == Origin::compiled);
  c.get_or_compile(make_request(1), fc.fn(), &o);
  CHECK(o == Origin::memory);
  KernelCache c2(Config{});
  c2.get_or_compile(make_request(1), fc.fn(), &o);
  CHECK(o == Origin::compiled);
  CHECK(fc.calls == 2);
}

TEST_CASE("threads of one cache asking for one key compile it once", "[cache]") {
  TempDir tmp;
  FakeCompiler fc;
  fc.sleep_ms = 50;
  KernelCache c(Config{tmp.sub("c")});
  std::vector<std::future<std::shared_ptr<const Entry>>> fs;
  for (int t = 0; t < 8; ++t)
    fs.push_back(std::async(std::launch::async, [&] { return c.get_or_compile(make_request(7), fc.fn()); }));
  std::set<const Entry*> distinct;
  for (auto& f : fs) distinct.insert(f.get().get());
  CHECK(fc.calls == 1);
  CHECK(distinct.size() == 1);
  CHECK(c.stats().compiled == 1);
  CHECK(c.stats().memory_hits == 7);
}

TEST_CASE("get_or_compile_all: bounded pool, order, origins, progress", "[cache]") {
  TempDir tmp;
  FakeCompiler fc;
  fc.sleep_ms = 20;
  std::vector<KernelRequest> reqs;
  for (int i = 0; i < 12; ++i) reqs.push_back(make_request(i));
  reqs.push_back(make_request(3));  // a duplicate: one compile, same result
  KernelCache c(Config{tmp.sub("c")});
  std::vector<std::pair<size_t, size_t>> calls;
  std::vector<Origin> origins;
  auto out = c.get_or_compile_all(reqs, fc.fn(), 3, &origins,
                                  [&](size_t done, size_t total) { calls.emplace_back(done, total); });
  REQUIRE(out.size() == reqs.size());
  for (size_t i = 0; i < reqs.size(); ++i) {
    INFO(i);
    REQUIRE(out[i]);
    CHECK(out[i]->source == reqs[i].source);
    CHECK(out[i]->cubin == expected_cubin(reqs[i]));
  }
  CHECK(out[12] == out[3]);
  CHECK(fc.calls == 12);
  CHECK(fc.max_active <= 3);
  CHECK(fc.max_active >= 2);  // they sleep, so a working pool overlaps them
  REQUIRE(origins.size() == reqs.size());
  CHECK(std::count(origins.begin(), origins.end(), Origin::compiled) == 12);
  REQUIRE(calls.size() == reqs.size());
  for (size_t i = 0; i < calls.size(); ++i) {
    CHECK(calls[i].first == i + 1);
    CHECK(calls[i].second == reqs.size());
  }

  // Second round: all from memory, and a single-thread pool works too.
  auto again = c.get_or_compile_all(reqs, fc.fn(), 1, &origins);
  CHECK(std::count(origins.begin(), origins.end(), Origin::memory) == 13);
  CHECK(again == out);
  CHECK(c.get_or_compile_all({}, fc.fn(), 4).empty());
}

TEST_CASE("get_or_compile_all starts the costliest requests first", "[cache]") {
  TempDir tmp;
  std::vector<KernelRequest> reqs;
  for (int i = 0; i < 6; ++i) reqs.push_back(make_request(i));
  reqs[1].cost_hint = 3;
  reqs[4].cost_hint = 3;
  reqs[5].cost_hint = 1;
  std::mutex mu;
  std::vector<std::string> started;
  CompileFn fn = [&](const KernelRequest& r) {
    std::lock_guard<std::mutex> lock(mu);
    started.push_back(r.source);
    return CompileResult{expected_cubin(r), "", 1};
  };
  KernelCache c(Config{tmp.sub("c")});
  auto out = c.get_or_compile_all(reqs, fn, 1);
  // One worker: highest hint first, ties in request order; results stay in request order.
  const std::vector<size_t> want = {1, 4, 5, 0, 2, 3};
  REQUIRE(started.size() == want.size());
  for (size_t k = 0; k < want.size(); ++k) CHECK(started[k] == reqs[want[k]].source);
  for (size_t i = 0; i < reqs.size(); ++i) CHECK(out[i]->source == reqs[i].source);
  // The hint is not part of the key.
  KernelRequest other = reqs[0];
  other.cost_hint = 7;
  CHECK(cache_key(other) == cache_key(reqs[0]));
}

TEST_CASE("a compile error propagates, is not cached, and does not stop the others", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  auto bad = make_request(5);
  bad.source = "#error nope\n";
  KernelCache c(Config{dir});
  try {
    c.get_or_compile(bad, fc.fn());
    FAIL("no compile error");
  } catch (const Error& e) {
    CHECK(e.status() == Status::compile_error);
  }
  CHECK_THROWS_AS(c.get_or_compile(bad, fc.fn()), Error);
  CHECK(fc.calls == 2);  // failures are retried, never cached
  CHECK(list_entries(dir).empty());

  std::vector<KernelRequest> reqs{make_request(1), bad, make_request(2)};
  try {
    c.get_or_compile_all(reqs, fc.fn(), 2);
    FAIL("no compile error");
  } catch (const Error& e) {
    CHECK(e.status() == Status::compile_error);
  }
  CHECK(list_entries(dir).size() == 2);  // the good ones were still compiled and stored
  Origin o{};
  c.get_or_compile(make_request(2), fc.fn(), &o);
  CHECK(o == Origin::memory);
  CHECK(c.disk_enabled());
}

TEST_CASE("disk hits update last_used and hits without rewriting the entry", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  auto req = make_request(4);
  std::string key;
  {
    KernelCache c(Config{dir});
    key = c.get_or_compile(req, fc.fn())->key;
  }
  const std::string path = entry_path(dir, key);
  age_file(path, 3600);
  const std::string before = read_all(path);
  struct stat st0 {};
  ::stat(path.c_str(), &st0);
  for (int i = 0; i < 3; ++i) {
    KernelCache c(Config{dir});
    Origin o{};
    c.get_or_compile(req, fc.fn(), &o);
    CHECK(o == Origin::disk);
  }
  struct stat st1 {};
  ::stat(path.c_str(), &st1);
  CHECK(read_all(path) == before);
  CHECK(st1.st_mtim.tv_sec == st0.st_mtim.tv_sec);  // the entry itself was not touched
  auto infos = list_entries(dir);
  REQUIRE(infos.size() == 1);
  CHECK(infos[0].hits == 3);
  CHECK(infos[0].last_used_ns / 1000000000 > st0.st_mtim.tv_sec + 3000);
  CHECK(fc.calls == 1);
}

TEST_CASE("max_bytes evicts least recently used entries", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  fc.pad = 10000;  // ~10 KB per entry
  const uint64_t cap = 25000;
  auto keys = std::vector<std::string>{};
  auto path_of = [&](int i) { return entry_path(dir, cache_key(make_request(i))); };
  {
    KernelCache c(Config{dir, cap});
    c.get_or_compile(make_request(0), fc.fn());
    age_file(path_of(0), 300);
    c.get_or_compile(make_request(1), fc.fn());
    age_file(path_of(1), 200);
    c.get_or_compile(make_request(2), fc.fn());  // over the cap: the oldest (0) goes
  }
  CHECK_FALSE(std::filesystem::exists(path_of(0)));
  CHECK(std::filesystem::exists(path_of(1)));
  CHECK(std::filesystem::exists(path_of(2)));

  age_file(path_of(2), 100);
  {
    KernelCache c(Config{dir, cap});
    Origin o{};
    c.get_or_compile(make_request(1), fc.fn(), &o);  // a hit makes 1 the most recent
    CHECK(o == Origin::disk);
    c.get_or_compile(make_request(3), fc.fn());  // now 2 is the least recently used
  }
  CHECK(std::filesystem::exists(path_of(1)));
  CHECK_FALSE(std::filesystem::exists(path_of(2)));
  CHECK(std::filesystem::exists(path_of(3)));
  uint64_t total = 0;
  for (auto& i : list_entries(dir)) total += i.bytes;
  CHECK(total <= cap);
  CHECK(fc.calls == 4);
}

TEST_CASE("prune and clear", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  fc.pad = 1000;
  {
    KernelCache c(Config{dir});
    for (int i = 0; i < 5; ++i) {
      c.get_or_compile(make_request(i), fc.fn());
      age_file(entry_path(dir, cache_key(make_request(i))), 1000 - i * 100);  // 0 is oldest
    }
  }
  auto sizes = list_entries(dir);
  REQUIRE(sizes.size() == 5);
  uint64_t total = 0;
  for (auto& i : sizes) total += i.bytes;
  CHECK(prune(dir, total) == 0);
  uint64_t removed = prune(dir, total - 1);
  CHECK(removed > 0);
  CHECK_FALSE(std::filesystem::exists(entry_path(dir, cache_key(make_request(0)))));
  CHECK(list_entries(dir).size() == 4);

  {
    // A held key lock means a process is working on that key: prune leaves it alone.
    io::Layout layout{dir};
    auto lock = io::FileLock::try_acquire(layout.lock_path(cache_key(make_request(4))));
    REQUIRE(lock.held());
    prune(dir, 0);
    auto left = list_entries(dir);
    REQUIRE(left.size() == 1);
    CHECK(left[0].key == cache_key(make_request(4)));
  }
  CHECK(clear(dir) == 1);
  CHECK(list_entries(dir).empty());
  CHECK(clear(dir) == 0);
  CHECK(clear(tmp.sub("does-not-exist")) == 0);
  CHECK(list_entries(tmp.sub("does-not-exist")).empty());
}

TEST_CASE("read_entry by prefix: unique, ambiguous, missing, not hex", "[cache]") {
  TempDir tmp;
  const std::string dir = tmp.sub("c");
  FakeCompiler fc;
  KernelCache c(Config{dir});
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) keys.push_back(c.get_or_compile(make_request(i), fc.fn())->key);
  auto e = read_entry(dir, keys[7]);
  REQUIRE(e);
  CHECK(e->key == keys[7]);
  auto upper = keys[7].substr(0, 12);
  for (auto& ch : upper) ch = static_cast<char>(std::toupper(ch));
  CHECK(read_entry(dir, upper)->key == keys[7]);
  CHECK_THROWS_WITH(read_entry(dir, ""), Catch::Contains("not a cache key"));
  CHECK_THROWS_WITH(read_entry(dir, "xyz"), Catch::Contains("not a cache key"));
  // With 40 keys some single hex digit is shared by several of them.
  std::map<char, int> first;
  for (auto& k : keys) ++first[k[0]];
  auto shared = std::find_if(first.begin(), first.end(), [](auto& p) { return p.second > 1; });
  REQUIRE(shared != first.end());
  CHECK_THROWS_WITH(read_entry(dir, std::string(1, shared->first)), Catch::Contains("matches"));
  std::string missing = keys[0];
  missing[63] = missing[63] == '0' ? '1' : '0';
  CHECK_FALSE(read_entry(dir, missing).has_value());
}
