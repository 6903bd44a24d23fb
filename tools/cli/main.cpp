// The `jitfuse` command line: wires the command families together and turns errors into messages
// on stderr and a non-zero exit code.
#include <cstdio>

#include "commands.hpp"
#include "common/error.hpp"

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
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const jitfuse::Error& e) {
    std::fprintf(stderr, "jitfuse: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "jitfuse: internal error: %s\n", e.what());
    return 3;
  }
  return 0;
}
