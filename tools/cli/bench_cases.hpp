// The cases of `jitfuse bench`, as a table: each has the name --case takes, whether it runs by default,
// and what it runs. Output order is table order (bench_cases.cpp).
#pragma once
#include <span>
#include <vector>

#include "bench_harness.hpp"

namespace jitfuse::cli::bench {

struct BenchCase {
  const char* name;
  bool by_default;  // off: rows that measure something else than the kernels, or long runs; --case runs it
  std::vector<Row> (*run)(const BenchEnv& env);
};

std::span<const BenchCase> bench_cases();

}  // namespace jitfuse::cli::bench
