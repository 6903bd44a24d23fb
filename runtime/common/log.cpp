// The shared "jitfuse" logger, created once, writing to stderr at the level of JITFUSE_LOG_LEVEL.
#include "common/log.hpp"

#include <spdlog/sinks/stdout_color_sinks.h>

#include "common/env.hpp"

namespace jitfuse {

spdlog::logger& log() {
  static std::shared_ptr<spdlog::logger> logger = [] {
    auto sink = std::make_shared<spdlog::sinks::stderr_color_sink_mt>();
    auto l = std::make_shared<spdlog::logger>("jitfuse", sink);
    l->set_pattern("[jitfuse %^%l%$] %v");
    std::string level = env::get("JITFUSE_LOG_LEVEL").value_or("warn");
    auto lv = spdlog::level::from_str(level);
    if (lv == spdlog::level::off && level != "off") lv = spdlog::level::warn;
    l->set_level(lv);
    return l;
  }();
  return *logger;
}

}  // namespace jitfuse
