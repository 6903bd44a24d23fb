// One error prefix and exit-code convention for every command (docs/cli.md, "Exit codes"): an error that
// stops a command prints "jitfuse <command>: error: <message>" and exits 2; "no" answers exit 1.
#include "unit/rules/rules_test_util.hpp"

using jf_test::run_cli;

TEST_CASE("the same sequence error gives the same prefix and exit code in every planning command", "[cli]") {
  jf_test::TempDir dir;
  std::string text = "{\"format\": \"jitfuse.sequence/1\", \"ops\": [\n  {\"op\": \"gelux\"}\n]}";
  std::string seq = dir.write("bad.json", text);
  std::string where = jf_test::loc(seq, text, "{\"op\": \"gelux\"}");
  for (std::string cmd : {"explain", "codegen", "warmup", "check"}) {
    auto r = run_cli(cmd + " '" + seq + "' --recipe bf16 --shape 8x64 --arch sm_90", "JITFUSE_CACHE_DIR=" + dir.path() + "/c");
    INFO(cmd << ": " << r.out);
    CHECK(r.status == 2);
    CHECK_THAT(r.out, Catch::Contains("jitfuse " + cmd + ": error: " + where + ": op 0: unknown op 'gelux'"));
  }
}

TEST_CASE("errors of the rules and cache commands follow the convention too", "[cli]") {
  jf_test::TempDir dir;
  // rules validate: an invalid file is a "no" (exit 1); the errors are listed on stdout.
  std::string bad = dir.write("bad.json", "{\"format\": \"jitfuse.rules/1\", \"rules\": 3}");
  auto r = run_cli("rules validate --no-compile '" + bad + "'");
  CHECK(r.status == 1);
  // A bad option value that the command itself rejects: exit 2 with the command's prefix.
  r = run_cli("explain '" + bad + "' --recipe bf17 --shape 8x64");
  CHECK(r.status == 2);
  CHECK_THAT(r.out, Catch::Contains("jitfuse explain: error: "));
  // Usage errors stay with the argument parser (non-zero, not 1 or 2).
  r = run_cli("rules validate");
  CHECK(r.status != 0);
  CHECK(r.status != 1);
  CHECK(r.status != 2);
}
