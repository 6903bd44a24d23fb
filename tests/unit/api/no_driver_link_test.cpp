// libjitfuse must load on a machine without the NVIDIA driver: it dlopens libcuda.so.1 and must never
// list libcuda (the toolkit's link stub) as NEEDED, in any build type (a Debug build once did).
#include <catch2/catch.hpp>

#include <string>

#include "support/run_command.hpp"

TEST_CASE("libjitfuse.so has no NEEDED libcuda (the driver is dlopen'ed)", "[api][link]") {
  auto r = jitfuse::test::run_command(std::string("readelf -d '") + JF_LIB_PATH + "' 2>&1");
  REQUIRE(r.status == 0);
  INFO(r.out);
  REQUIRE_THAT(r.out, Catch::Contains("(NEEDED)"));
  CHECK_THAT(r.out, Catch::Contains("libnvrtc"));
  CHECK_THAT(r.out, !Catch::Contains("libcuda.so"));
  // And the built library resolves every NEEDED entry without a driver stub on the search path.
  auto l = jitfuse::test::run_command(std::string("ldd '") + JF_LIB_PATH + "' 2>&1");
  INFO(l.out);
  CHECK_THAT(l.out, !Catch::Contains("libcuda.so") && !Catch::Contains("not found"));
}
