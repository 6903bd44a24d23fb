// Logging through spdlog; the level comes from JITFUSE_LOG_LEVEL (trace|debug|info|warn|error|off).
// Every module logs through jitfuse::log() so one logger carries the "jitfuse" name.
#pragma once
#include <spdlog/spdlog.h>

namespace jitfuse {
spdlog::logger& log();
}  // namespace jitfuse
