// Catch2 main for the GPU tests: exits with the skip code CTest registers when no GPU is present,
// so CI reports these tests as skipped, never as passed.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>
#include <cstring>

#include "support/gpu.hpp"

int main(int argc, char** argv) {
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strncmp(argv[i], "--list", 6) == 0;
  if (!listing) {
    std::string why;
    if (!jitfuse::test::gpu_available(&why)) {
      std::printf("SKIP: no GPU present (%s)\n", why.c_str());
      return JF_SKIP_CODE;
    }
  }
  return Catch::Session().run(argc, argv);
}
