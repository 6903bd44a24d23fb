// libFuzzer target for the C ABI's argument checks and the text/JSON guards under them: DLTensor structs,
// shape arrays and C strings built from the bytes, then the JSON limits and locator on the rest.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "api/arg_check.hpp"
#include "common/error.hpp"
#include "common/json_util.hpp"
#include "common/text.hpp"

namespace {

using jitfuse::Error;

// A check that passes must have established what it promises; anything else is a finding.
void expect(bool ok) {
  if (!ok) std::abort();
}

bool dims_ok(const int64_t* shape, int ndim) {
  if (ndim < 1 || ndim > static_cast<int>(jitfuse::ops::kMaxDims) || !shape) return false;
  __int128 n = 1;
  for (int i = 0; i < ndim; ++i) {
    if (shape[i] <= 0) return false;
    n *= shape[i];
    if (n > INT64_MAX) return false;
  }
  return true;
}

void fuzz_tensor(FuzzedDataProvider& p) {
  DLTensor t{};
  int ndim = p.ConsumeIntegralInRange<int>(-4, 40);
  t.ndim = p.ConsumeBool() ? ndim : p.ConsumeIntegral<int32_t>();
  size_t have = static_cast<size_t>(std::max(0, std::min(t.ndim, 40)));
  std::vector<int64_t> shape(have), strides(have);
  for (auto& d : shape) d = p.ConsumeBool() ? p.ConsumeIntegralInRange<int64_t>(-2, 1 << 20) : p.ConsumeIntegral<int64_t>();
  for (auto& s : strides) s = p.ConsumeIntegral<int64_t>();
  // The shape array is never shorter than ndim says (that would be the host's bug, not ours to find);
  // a NULL shape with ndim > 0 is exactly what used to crash: it must be refused, not read.
  t.shape = have > 0 && have == static_cast<size_t>(t.ndim) && p.ConsumeIntegralInRange<int>(0, 7) ? shape.data()
                                                                                                    : nullptr;
  t.strides = t.shape && p.ConsumeBool() ? strides.data() : nullptr;
  t.dtype = {p.ConsumeIntegral<uint8_t>(), p.ConsumeIntegral<uint8_t>(), p.ConsumeIntegral<uint16_t>()};
  // Any int a C host could store, outside the enum's range included (copied, not converted).
  int device_type = p.ConsumeBool() ? p.ConsumeIntegralInRange<int>(0, 20) : p.ConsumeIntegral<int>();
  std::memcpy(&t.device.device_type, &device_type, sizeof device_type);
  t.device.device_id = p.ConsumeIntegral<int32_t>();
  static char storage[16];
  t.data = p.ConsumeBool() ? storage : nullptr;
  t.byte_offset = p.ConsumeIntegral<uint64_t>();
  try {
    jitfuse::api::check_dltensor(p.ConsumeBool() ? &t : nullptr, "fuzz");
    expect(dims_ok(t.shape, t.ndim) && t.data && t.dtype.lanes == 1);
  } catch (const Error& e) {
    expect(e.status() == jitfuse::Status::invalid_argument && jitfuse::text::valid_utf8(e.what()));
  }
  try {
    jitfuse::ops::Shape s = jitfuse::api::checked_shape(t.shape, t.ndim, "shape");
    expect(dims_ok(t.shape, t.ndim) && s.size() == static_cast<size_t>(t.ndim));
  } catch (const Error& e) {
    expect(e.status() == jitfuse::Status::invalid_argument);
  }
}

void fuzz_text(const std::string& s) {
  std::string c = s.c_str();  // up to the first NUL, as a C string argument would be
  try {
    jitfuse::api::check_name(c.c_str(), "name");
    expect(jitfuse::text::valid_utf8(c) && c.size() <= jitfuse::api::kMaxNameBytes);
  } catch (const Error& e) {
    expect(jitfuse::text::valid_utf8(e.what()) && std::string(e.what()).size() < 400);
  }
  std::string sh = jitfuse::text::shorten(s, 40);
  expect(jitfuse::text::valid_utf8(sh) && sh.size() <= 40 + 4 + 40);
  std::string m = jitfuse::text::sanitize_message(s, 1000);
  expect(jitfuse::text::valid_utf8(m) && m.size() <= 1000 + 64);
}

void fuzz_json(const std::string& s) {
  try {
    nlohmann::json j = jitfuse::json_util::parse(s, "fuzz.json");
    jitfuse::json_util::Locator loc(s);
    // Walk a few pointers that exist and a few that do not: never a crash, and found ones are in range.
    std::vector<std::string> ptrs = {"", "/ops", "/ops/0", "/ops/0/op", "/rules/1/pattern/0", "/x~1y", "/0/0/0/0"};
    for (const auto& ptr : ptrs) {
      auto l = loc.locate(ptr);
      expect(l.line >= 0 && l.col >= 0);
    }
  } catch (const Error& e) {
    expect(e.status() == jitfuse::Status::parse_error && jitfuse::text::valid_utf8(e.what()) &&
           std::string(e.what()).size() < 1000);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  uint8_t mode = p.ConsumeIntegral<uint8_t>();
  if (mode & 1) fuzz_tensor(p);
  std::string rest = p.ConsumeRemainingBytesAsString();
  if (mode & 2) fuzz_text(rest);
  fuzz_json(rest);
  return 0;
}
