// Hostile files and JSON for the common readers: FIFOs, devices, directories and sparse giants are refused
// without blocking or reading them; deep nesting and huge counts are refused with a location, in linear time.
#include <catch2/catch.hpp>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>

#include "common/error.hpp"
#include "common/file_read.hpp"
#include "common/json_util.hpp"
#include "common/text.hpp"
#include "ops/sequence.hpp"
#include "rules/rule.hpp"

using namespace jitfuse;

namespace {

struct Scratch {
  std::string path;
  Scratch() {
    char tmpl[] = "/tmp/jf-untrusted-XXXXXX";
    REQUIRE(::mkdtemp(tmpl));
    path = tmpl;
  }
  ~Scratch() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string sub(const std::string& n) const { return path + "/" + n; }
};

// Status and message of the Error `f` throws; fails the test when it throws nothing.
template <typename F>
std::pair<Status, std::string> error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return {e.status(), e.what()};
  }
  FAIL("no error thrown");
  return {};
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

TEST_CASE("bounded reader: FIFO, device, directory, sparse giant, missing", "[common][untrusted]") {
  Scratch s;
  const std::string fifo = s.sub("f.json");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto t0 = std::chrono::steady_clock::now();
  auto [st, msg] = error_of([&] { json_util::read_file(fifo); });
  CHECK(seconds_since(t0) < 2.0);  // refused without waiting for a writer
  CHECK(st == Status::io_error);
  CHECK_THAT(msg, Catch::Contains(fifo) && Catch::Contains("is a FIFO, not a regular file"));

  std::tie(st, msg) = error_of([&] { json_util::read_file("/dev/zero"); });
  CHECK(st == Status::io_error);
  CHECK_THAT(msg, Catch::Contains("'/dev/zero': it is a character device, not a regular file"));

  std::tie(st, msg) = error_of([&] { json_util::read_file(s.path); });
  CHECK_THAT(msg, Catch::Contains("is a directory, not a regular file"));

  const std::string sparse = s.sub("sparse.json");
  int fd = ::open(sparse.c_str(), O_CREAT | O_WRONLY, 0600);
  REQUIRE(fd >= 0);
  REQUIRE(::ftruncate(fd, off_t(64) << 30) == 0);  // 64 GiB, no blocks
  ::close(fd);
  std::tie(st, msg) = error_of([&] { json_util::read_file(sparse); });
  CHECK(st == Status::io_error);
  CHECK_THAT(msg, Catch::Contains(sparse) && Catch::Contains("68719476736 bytes, more than the limit of 67108864"));

  std::tie(st, msg) = error_of([&] { json_util::read_file(s.sub("missing.json")); });
  CHECK_THAT(msg, Catch::Contains("missing.json") && Catch::Contains("no such file"));

  std::ofstream(s.sub("ok.json")) << "{\"ops\": []}";
  CHECK(json_util::read_file(s.sub("ok.json")) == "{\"ops\": []}");
}

TEST_CASE("rules: a FIFO or /dev/zero given as a rules path is an error, not a hang", "[common][untrusted]") {
  Scratch s;
  const std::string fifo = s.sub("rules.json");
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  auto rs = rules::RuleSet::with_builtins();
  for (const std::string& p : {fifo, std::string("/dev/zero")}) {
    auto errs = rs.load_path(p);
    REQUIRE(errs.size() == 1);
    CHECK_THAT(errs[0].to_string(), Catch::Contains(p) && Catch::Contains("not a regular file"));
  }
}

TEST_CASE("text: UTF-8 validation, shortened values, sanitized messages", "[common][untrusted]") {
  CHECK(text::valid_utf8("gelu \xc3\xbc \xe2\x82\xac \xf0\x9f\x98\x80"));
  CHECK_FALSE(text::valid_utf8("a\xff"));
  CHECK_FALSE(text::valid_utf8("\xc0\xaf"));          // overlong '/'
  CHECK_FALSE(text::valid_utf8("\xed\xa0\x80"));      // surrogate
  CHECK_FALSE(text::valid_utf8("\xf4\x90\x80\x80"));  // above U+10FFFF
  CHECK_FALSE(text::valid_utf8("\xe2\x82"));          // truncated
  CHECK(text::shorten("ge\xfflu\n") == "ge\\xfflu\\x0a");
  std::string longv(100000, 'x');
  CHECK(text::shorten(longv, 10) == "xxxxxxxxxx... (100000 bytes in all)");
  std::string m = text::sanitize_message("bad \xff\xfe path\nnext", 100);
  CHECK(m == "bad \xef\xbf\xbd\xef\xbf\xbd path\nnext");
  CHECK(text::valid_utf8(text::sanitize_message(std::string(200000, '\xff'), 1000)));
  CHECK(text::sanitize_message(std::string(5000, 'a'), 1000).size() < 1100);
}

TEST_CASE("JSON: nesting deeper than the limit is refused with a location, without recursion", "[common][untrusted]") {
  std::string ok = std::string(json_util::kMaxDepth, '[') + std::string(json_util::kMaxDepth, ']');
  CHECK_NOTHROW(json_util::parse(ok, "x.json"));
  std::string deep = "{\"ops\": [\n" + std::string(1000000, '[');  // 1M deep, never closed
  auto [st, msg] = error_of([&] { json_util::parse(deep, "x.json"); });
  CHECK(st == Status::parse_error);
  CHECK_THAT(msg, Catch::StartsWith("x.json:2:63: JSON nested more than 64 levels deep"));
  // Brackets inside strings do not count.
  std::string in_string = "[\"" + std::string(1000, '[') + "\"]";
  CHECK_NOTHROW(json_util::parse(in_string, "x.json"));
}

TEST_CASE("sequences: deep values, too many ops, huge values are refused, and locations are linear", "[common][untrusted]") {
  ops::Registry reg;
  // A reshape `shape` 100k deep, and a 1M-deep value before a bad op: no stack overflow.
  std::string reshape = "{\"ops\": [{\"op\": \"reshape\", \"shape\": " + std::string(100000, '[') + "4" +
                        std::string(100000, ']') + "}]}";
  auto [st, msg] = error_of([&] { ops::parse_sequence(reshape, "s.json", reg); });
  CHECK(st == Status::parse_error);
  CHECK_THAT(msg, Catch::StartsWith("s.json:1:") && Catch::Contains("nested more than 64 levels"));
  std::string before = "{\"ops\": [{\"op\": \"bias\", \"x\": " + std::string(1000000, '[') +
                       std::string(1000000, ']') + "}, {\"op\": \"nope\"}]}";
  std::tie(st, msg) = error_of([&] { ops::parse_sequence(before, "s.json", reg); });
  CHECK(st == Status::parse_error);
  CHECK_THAT(msg, Catch::Contains("nested more than 64 levels"));

  // A reshape with too many dims, and a value echoed in a message is shortened.
  std::string many_dims = "{\"ops\": [{\"op\": \"reshape\", \"shape\": [1";
  for (int i = 0; i < 20; ++i) many_dims += ",1";
  many_dims += "]}]}";
  std::tie(st, msg) = error_of([&] { ops::parse_sequence(many_dims, "s.json", reg); });
  CHECK(st == Status::invalid_argument);
  CHECK_THAT(msg, Catch::StartsWith("s.json:1:") && Catch::Contains("op 0 (reshape)") &&
                      Catch::Contains("attribute 'shape'") && Catch::Contains("at most 16 dims"));
  std::string long_kind = "{\"ops\": [{\"op\": \"" + std::string(1 << 20, 'g') + "\"}]}";
  std::tie(st, msg) = error_of([&] { ops::parse_sequence(long_kind, "s.json", reg); });
  CHECK(st == Status::invalid_argument);
  CHECK_THAT(msg, Catch::Contains("unknown op 'gggg") && Catch::Contains("(1048576 bytes in all)"));
  CHECK(msg.size() < 2000);

  // 100k ops parse in linear time (was > 90 s); 100k + 1 are refused with a clear error.
  std::string big = "{\"ops\": [\n";
  for (size_t i = 0; i < ops::kMaxOps; ++i) big += i ? ",\n{\"op\": \"gelu\"}" : "{\"op\": \"gelu\"}";
  auto t0 = std::chrono::steady_clock::now();
  auto def = ops::parse_sequence(big + "]}", "big.json", reg);
  CHECK(def.ops.size() == ops::kMaxOps);
  CHECK(seconds_since(t0) < 10.0);
  big += ",\n{\"op\": \"nope\"}]}";
  std::tie(st, msg) = error_of([&] { ops::parse_sequence(big, "big.json", reg); });
  CHECK(st == Status::parse_error);
  CHECK_THAT(msg, Catch::StartsWith("big.json:1:9: the sequence has 100001 ops, more than the limit of 100000"));
  // Errors deep in a long sequence still name their line, and quickly.
  std::string late = "{\"ops\": [\n";
  for (int i = 0; i < 50000; ++i) late += "{\"op\": \"gelu\"},\n";
  late += "{\"op\": \"gelux\"}]}";
  t0 = std::chrono::steady_clock::now();
  std::tie(st, msg) = error_of([&] { ops::parse_sequence(late, "late.json", reg); });
  CHECK(seconds_since(t0) < 5.0);
  CHECK_THAT(msg, Catch::StartsWith("late.json:50002:1: op 50000: unknown op 'gelux'"));
}

TEST_CASE("shapes: element counts that overflow int64 are errors, not 0 elements", "[common][untrusted]") {
  ops::Registry reg;
  auto def = ops::parse_sequence("{\"ops\": [{\"op\": \"gelu\"}]}", "s.json", reg);
  auto [st, msg] = error_of([&] { ops::infer(def, {int64_t(1) << 40, int64_t(1) << 40}); });
  CHECK(st == Status::invalid_argument);
  CHECK_THAT(msg, Catch::Contains("shape 1099511627776x1099511627776 has more elements than a signed 64-bit count"));
  std::tie(st, msg) = error_of([&] { ops::infer(def, {4, 0}); });
  CHECK_THAT(msg, Catch::Contains("dim 1 of the input shape 4x0 is 0; every dim must be positive"));
  std::tie(st, msg) = error_of([&] { ops::infer(def, ops::Shape(17, 1)); });
  CHECK_THAT(msg, Catch::Contains("the input shape has 17 dims; it needs 1 to 16"));
}
