// POSIX plumbing for the disk tier: the directory layout, safe directories, atomic publication,
// per-key flock locks and the hit sidecars. Internal to runtime/cache/ and the `jitfuse cache` CLI.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <optional>
#include <string>

namespace jitfuse::files {
class RegularFile;
}

namespace jitfuse::cache::io {

// <root>/v1/<key[0:2]>/<key>.jfk   entry (self-contained, see disk_store.cpp)
// <root>/v1/<key[0:2]>/<key>.use   hit sidecar: one byte appended per disk hit; its mtime is last_used
// <root>/v1/locks/<key>.lock       per-key flock target
// <root>/v1/quarantine/            damaged entries moved aside for inspection
// "v1" is "v" + kFormatVersion, so a build with a new format never reads old files.
struct Layout {
  std::string root;

  std::string base() const;
  std::string shard_dir(const std::string& key) const;
  std::string entry_path(const std::string& key) const;
  std::string use_path(const std::string& key) const;
  std::string locks_dir() const;
  std::string lock_path(const std::string& key) const;
  std::string quarantine_dir() const;
};

inline constexpr const char* kEntrySuffix = ".jfk";
inline constexpr const char* kUseSuffix = ".use";
inline constexpr const char* kTempMarker = ".tmp.";

std::string errno_text(int err);
int64_t now_ns();
std::string iso_time(int64_t unix_ns);  // "2026-01-02T03:04:05Z" (UTC, whole seconds)
bool is_key(const std::string& s);      // 64 lowercase hex chars

// mkdir -p; directories it creates get `mode`. Throws Error(io_error) naming the path.
void make_dirs(const std::string& path, mode_t mode);

// Empty when `dir` is a directory we own that nobody else can write, else the reason it is unsafe.
// A missing directory is reported as such (callers create it first).
std::string unsafe_reason(const std::string& dir);

// Creates and removes a temp file in `dir`; throws Error(io_error) when the directory cannot be written.
void probe_writable(const std::string& dir);

// Largest entry file jitfuse reads; a real one (source + cubin) is well under a few MiB.
inline constexpr uint64_t kMaxEntryBytes = 256ull << 20;

// Whole file, or nullopt when it does not exist. Opened without blocking and read only when it is a
// regular file of at most max_bytes. A file that is not regular, too large or (with `owner_check`) not
// owned by us alone is refused: with `refused` the reason lands there and nullopt is returned, without
// it Error(io_error) is thrown. Throws Error(io_error) on any other failure.
// `precheck`, when given, looks at the open file before its body is read (e.g. that the lengths in a
// header add up to the file size) and returns a non-empty reason to refuse it.
std::optional<std::string> read_file(const std::string& path, bool owner_check = false,
                                     std::string* refused = nullptr, uint64_t max_bytes = kMaxEntryBytes,
                                     std::string (*precheck)(const files::RegularFile&) = nullptr);

// Publishes `bytes` at `path`: write a temp file in the same directory, fsync, rename over.
// Readers see the old file or the new one, never half of one. Throws Error(io_error).
void write_file_atomic(const std::string& path, const std::string& bytes);

// Hit bookkeeping kept beside the entry so a hit never rewrites the entry itself.
void record_hit(const std::string& use_path);  // best effort: failures are ignored
struct Usage {
  uint64_t hits = 0;
  int64_t last_used_ns = 0;
};
Usage read_usage(const std::string& use_path, int64_t entry_mtime_ns);

// Moves a damaged file into `quarantine_dir` under a unique name; returns the new path.
std::string quarantine(const std::string& path, const std::string& quarantine_dir, const std::string& key);

// An exclusive flock on a lock file. The kernel drops it when the holder dies, so a crashed
// compiler never wedges the cache. Re-checks the inode after locking so that a lock file
// unlinked by prune/clear (while held) cannot split waiters across two inodes.
class FileLock {
 public:
  FileLock() = default;
  FileLock(FileLock&& o) noexcept;
  FileLock& operator=(FileLock&& o) noexcept;
  FileLock(const FileLock&) = delete;
  FileLock& operator=(const FileLock&) = delete;
  ~FileLock();

  // Waits up to timeout_s (polling with backoff); returns an unheld lock on timeout.
  // Throws Error(io_error) when the lock file cannot be opened at all.
  static FileLock acquire(const std::string& path, double timeout_s);
  static FileLock try_acquire(const std::string& path);  // never waits

  bool held() const { return fd_ >= 0; }
  void unlink_file();  // removes the lock file; only while held
  void release();

 private:
  int fd_ = -1;
  std::string path_;
};

}  // namespace jitfuse::cache::io
