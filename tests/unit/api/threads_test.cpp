// Many threads on one context through the C ABI (CPU only): creating and explaining sequences, loading
// rules, hitting errors, and sharing a disk cache. Run under TSan by tools/sanitize.sh; here it checks results.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "../cache/cache_test_util.hpp"
#include "jitfuse/jitfuse.h"

using namespace jitfuse::cache;
using namespace jitfuse::cache::test;

TEST_CASE("C ABI: 8 threads create, explain, load rules, fail and share a cache concurrently", "[api][threads]") {
  jf_context ctx = nullptr;
  REQUIRE(jf_context_create(&ctx) == JF_OK);
  TempDir tmp;
  const std::string cache_dir = tmp.sub("cache");
  const std::string rules_dir = std::string(JF_SOURCE_DIR) + "/docs/examples/softplus";
  FakeCompiler fc;
  KernelCache shared(Config{cache_dir});
  std::atomic<int> failures{0};
  std::mutex mu;
  std::string first_failure;  // Catch2's assertions are not thread-safe: collect, check after the join
  auto fail_if_at = [&](bool bad, int line) {
    if (!bad) return;
    if (++failures == 1) {
      std::lock_guard<std::mutex> g(mu);
      first_failure = "line " + std::to_string(line) + ": " + jf_last_error();
    }
  };
#define fail_if(bad) fail_if_at((bad), __LINE__)
  constexpr int kThreads = 8, kRounds = 20;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        jf_sequence seq = nullptr;
        const char* json = (r % 2) ? "{\"ops\": [{\"op\": \"linear\", \"in_features\": 8, \"out_features\": 8}, "
                                     "{\"op\": \"bias\"}, {\"op\": \"gelu\"}]}"
                                   : "{\"ops\": [{\"op\": \"bias\"}, {\"op\": \"relu\"}, {\"op\": \"dropout\", \"p\": 0.1}]}";
        fail_if(jf_sequence_create(ctx, json, "bf16", &seq) != JF_OK);
        int64_t shape[2] = {16, 8};
        const char* out = nullptr;
        fail_if(seq && jf_sequence_explain(seq, shape, 2, r % 3 != 0, 90, &out) != JF_OK);
        fail_if(seq && (!out || std::string(out).find("forward") == std::string::npos));
        jf_sequence_destroy(seq);
        // Errors are per thread: each sees its own message.
        jf_sequence bad = nullptr;
        std::string unknown = "{\"ops\": [{\"op\": \"nope" + std::to_string(t) + "\"}]}";
        fail_if(jf_sequence_create(ctx, unknown.c_str(), "bf16", &bad) != JF_ERR_INVALID_ARGUMENT);
        fail_if(std::string(jf_last_error()).find("unknown op 'nope" + std::to_string(t) + "'") == std::string::npos);
        if (r % 5 == t % 5) {
          int n = -1;
          fail_if(jf_context_load_rules(ctx, rules_dir.c_str(), &n) != JF_OK);
        }
        jf_builder b = nullptr;
        fail_if(jf_builder_create("threads", &b) != JF_OK);
        fail_if(jf_builder_add(b, "gelu\xff", nullptr) != JF_ERR_INVALID_ARGUMENT);
        fail_if(jf_builder_add(b, "gelu", nullptr) != JF_OK);
        jf_sequence built = nullptr;
        fail_if(jf_builder_finish(b, ctx, "bf16", &built) != JF_OK);
        jf_sequence_destroy(built);
        jf_builder_destroy(b);
        // The shared cache: every thread asks for the same few kernels; each is compiled once.
        auto e = shared.get_or_compile(make_request(r % 4), fc.fn());
        fail_if(!e || e->cubin != expected_cubin(make_request(r % 4)));
        // And a second cache object on the same directory, as another context would have.
        KernelCache other(Config{cache_dir});
        fail_if(other.get_or_compile(make_request(r % 4), fc.fn()) == nullptr);
      }
    });
  }
  for (auto& th : threads) th.join();
#undef fail_if
  INFO(first_failure);
  CHECK(failures == 0);
  CHECK(fc.calls == 4);
  CHECK(list_entries(cache_dir).size() == 4);
  jf_context_destroy(ctx);
}
