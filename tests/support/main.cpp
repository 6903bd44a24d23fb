// Catch2 main for the CPU test programs (unit, nvrtc).
#define CATCH_CONFIG_MAIN
#include <catch2/catch.hpp>
