// The on-disk tier: entry files, their format, locks, listing, verification and eviction.
// Used by KernelCache and directly by the `jitfuse cache` CLI.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "cache/kernel_cache.hpp"

namespace jitfuse::cache {

// Increment when the entry file layout changes (tests/golden pins it), or when generated sources change in a
// way that leaves every entry of the old version unreachable (it moves the cache to v<N>/, in every key).
//   1: the first format.
//   2: the layout of 1; the quantize op's E4M3 kernels use the format-generic FP8 functions, as every other
//      FP8 cast does (its sources no longer keep the text of version 1's keys).
inline constexpr uint32_t kFormatVersion = 2;

struct EntryInfo {
  std::string key;
  std::string path;
  uint64_t bytes = 0;
  nlohmann::json meta;
  std::string problem;  // empty when the entry verifies, else what is wrong
  uint64_t hits = 0;          // disk hits recorded in the entry's sidecar (also in meta["hits"])
  int64_t last_used_ns = 0;   // unix ns; LRU order (also in meta["last_used"], ISO 8601)
};

// Serialize / parse one entry file's bytes. parse throws Error(io_error) naming what is damaged.
std::string serialize_entry(const Entry& e);
Entry parse_entry(const std::string& bytes, const std::string& where);

// An entry file's bytes, or nullopt when it does not exist. Before the body is read: regular file only
// (never blocks on a FIFO), at most io::kMaxEntryBytes, magic, version and the four field lengths adding
// up to the file size. Refusals go to *refused (nullopt returned) or, without it, throw Error(io_error).
std::optional<std::string> read_entry_file(const std::string& path, bool owner_check = false,
                                           std::string* refused = nullptr);

std::vector<EntryInfo> list_entries(const std::string& dir);  // never throws on a damaged entry
// nullopt when nothing matches; Error(invalid_argument) for an ambiguous prefix, Error(io_error) when damaged.
std::optional<Entry> read_entry(const std::string& dir, const std::string& key_or_prefix);
uint64_t prune(const std::string& dir, uint64_t max_bytes);    // LRU; returns bytes removed
uint64_t clear(const std::string& dir);                        // returns entries removed

// verify=false reads only each entry's header and metadata (fast listing); `problem` then only
// reports damage in that part. list_entries(dir) is scan_entries(dir, true).
std::vector<EntryInfo> scan_entries(const std::string& dir, bool verify);
std::string entry_path(const std::string& dir, const std::string& key);
uint64_t quarantined_count(const std::string& dir);
// Empty when `dir` is safe to load kernels from (ours, not group/other-writable), else why not.
std::string dir_problem(const std::string& dir);
// "1048576", "512M", "2G", "2GiB" (powers of 1024). Throws Error(invalid_argument) naming `what`.
uint64_t parse_byte_count(const std::string& text, const std::string& what);

}  // namespace jitfuse::cache
