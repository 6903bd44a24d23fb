// The on-disk tier: entry files, their format, locks, listing, verification and eviction.
// Used by KernelCache and directly by the `jitfuse cache` CLI.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/kernel_cache.hpp"

namespace jitfuse::cache {

// Increment when the entry file layout changes (tests/golden pins it).
inline constexpr uint32_t kFormatVersion = 1;

struct EntryInfo {
  std::string key;
  std::string path;
  uint64_t bytes = 0;
  nlohmann::json meta;
  std::string problem;  // empty when the entry verifies, else what is wrong
};

// Serialize / parse one entry file's bytes. parse throws Error(io_error) naming what is damaged.
std::string serialize_entry(const Entry& e);
Entry parse_entry(const std::string& bytes, const std::string& where);

std::vector<EntryInfo> list_entries(const std::string& dir);  // never throws on a damaged entry
std::optional<Entry> read_entry(const std::string& dir, const std::string& key_or_prefix);
uint64_t prune(const std::string& dir, uint64_t max_bytes);    // LRU; returns bytes removed
uint64_t clear(const std::string& dir);                        // returns entries removed

}  // namespace jitfuse::cache
