// Each CLI command family registers its subcommands on the root app; main.cpp only wires them.
#pragma once
#include <CLI/CLI.hpp>

namespace jitfuse::cli {
void add_info_commands(CLI::App& app);     // version, doctor
void add_rules_commands(CLI::App& app);    // rules list|validate
void add_plan_commands(CLI::App& app);     // explain, codegen, warmup
void add_explain_command(CLI::App& app);   // explain (tools/cli/cmd_explain.cpp)
void add_cache_commands(CLI::App& app);    // cache ls|show|stats|verify|prune|clear
void add_bench_commands(CLI::App& app);    // bench
}  // namespace jitfuse::cli
