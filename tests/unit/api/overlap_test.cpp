// The C ABI's overlap check (api/arg_check.cpp: check_no_overlap) with the in-place gradients of
// jf_program_grad_aliases: a gradient marked as sitting exactly where the program lets it over the saved
// buffer may overlap that buffer and nothing else; every other overlap with a written tensor is refused.
#include <catch2/catch.hpp>

#include <vector>

#include "api/arg_check.hpp"

using jitfuse::api::Span;
using jitfuse::api::SpanName;

namespace {

Span span(const char* kind, uintptr_t b, uintptr_t e, bool written) {
  Span s;
  s.name = SpanName{kind};
  s.begin = b;
  s.end = e;
  s.written = written;
  return s;
}

}  // namespace

TEST_CASE("the overlap check lets a gradient sit over the saved buffer only where the program allows it", "[api]") {
  Span saved = span("saved buffer", 0x10000, 0x20000, false);
  saved.saved_buffer = true;
  Span dx = span("grad_input", 0x10000, 0x10400, true);
  Span dw = span("grads", 0x10400, 0x18000, true);
  dx.over_saved = dw.over_saved = true;
  std::vector<Span> ok = {saved, dx, dw, span("input", 0x30000, 0x30400, false)};
  CHECK_NOTHROW(jitfuse::api::check_no_overlap(ok));

  // Not marked (not the program's place): the gradient over the saved buffer is refused, naming both.
  Span stray = dx;
  stray.over_saved = false;
  std::vector<Span> bad = {saved, stray};
  CHECK_THROWS_WITH(jitfuse::api::check_no_overlap(bad),
                    Catch::Contains("grad_input") && Catch::Contains("saved buffer") && Catch::Contains("overlaps"));

  // Two gradients over the saved buffer that overlap each other: refused even though both are marked.
  Span dw_over_dx = dw;
  dw_over_dx.begin = 0x10200;
  std::vector<Span> clash = {saved, dx, dw_over_dx};
  CHECK_THROWS_WITH(jitfuse::api::check_no_overlap(clash), Catch::Contains("both are"));

  // A marked gradient still may not overlap any other tensor (the input, say).
  Span input = span("input", 0x10000, 0x10100, false);
  std::vector<Span> over_input = {saved, dx, input};
  CHECK_THROWS_WITH(jitfuse::api::check_no_overlap(over_input), Catch::Contains("input"));
}
