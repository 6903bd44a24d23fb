// `jitfuse bench`: placeholder registration, filled in by the benchmark work (issue: codegen speed).
#include "commands.hpp"

namespace jitfuse::cli {
void add_bench_commands(CLI::App& app) { (void)app; }
}  // namespace jitfuse::cli
