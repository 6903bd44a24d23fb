// The `jitfuse` command line: wires the command families together and turns errors into messages
// on stderr and a non-zero exit code, the same way for every command (docs/cli.md, "Exit codes").
#include <cstdio>
#include <string>

#include "commands.hpp"
#include "common/error.hpp"

namespace {

// "jitfuse explain", "jitfuse rules validate": the command that ran, for the one error prefix.
std::string command_path(CLI::App& app) {
  std::string path = "jitfuse";
  CLI::App* at = &app;
  while (true) {
    CLI::App* next = nullptr;
    for (CLI::App* sub : at->get_subcommands())
      if (sub->parsed()) next = sub;
    if (!next) break;
    path += " " + next->get_name();
    at = next;
  }
  return path;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"jitfuse: JSON fusion rules + CUDA kernel templates, compiled with NVRTC and cached"};
  app.require_subcommand(1);
  app.set_version_flag("--version", JITFUSE_VERSION_STRING);
  jitfuse::cli::add_info_commands(app);
  jitfuse::cli::add_rules_commands(app);
  jitfuse::cli::add_explain_command(app);
  jitfuse::cli::add_plan_commands(app);
  jitfuse::cli::add_cache_commands(app);
  jitfuse::cli::add_bench_commands(app);
  // Exit codes: 0 ok; 1 the command ran and its answer is "no" (invalid rules, FAIL, cache damage);
  // 2 an error stopped it ("<command>: error: ..."); 3 a bug ("<command>: internal error: ...");
  // usage errors keep CLI11's codes (106 for a missing required option, ...).
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const jitfuse::Error& e) {
    std::fprintf(stderr, "%s: error: %s\n", command_path(app).c_str(), e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: internal error: %s\n", command_path(app).c_str(), e.what());
    return 3;
  }
  return 0;
}
