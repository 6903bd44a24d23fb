// Reading files jitfuse did not write (rules, sequences, templates, cache entries) without trusting them:
// regular files only, opened without blocking (a FIFO never hangs us), size-capped before a byte is read.
#pragma once
#include <sys/stat.h>

#include <cstdint>
#include <optional>
#include <string>

namespace jitfuse::files {

// Caps for text files the user hands us. A JSON rules or sequence file of 64 MiB is already absurd
// (the largest built-in file is a few KiB); a template of 1 MiB likewise.
inline constexpr uint64_t kMaxJsonFileBytes = 64ull << 20;
inline constexpr uint64_t kMaxTemplateFileBytes = 1ull << 20;

// An open regular file: O_RDONLY | O_NONBLOCK | O_CLOEXEC, then fstat. Owns the descriptor.
class RegularFile {
 public:
  // nullopt when the path does not exist (ENOENT). Throws Error(io_error) naming the path when it cannot
  // be opened or is not a regular file (directory, FIFO, socket, device), saying which it is; with
  // `not_regular`, a file that is not regular returns nullopt and the reason ("it is a FIFO, ...") lands there instead.
  static std::optional<RegularFile> open(const std::string& path, std::string* not_regular = nullptr);

  RegularFile(RegularFile&& o) noexcept;
  RegularFile& operator=(RegularFile&&) = delete;
  RegularFile(const RegularFile&) = delete;
  ~RegularFile();

  const struct stat& stat() const { return st_; }
  uint64_t size() const { return static_cast<uint64_t>(st_.st_size); }
  const std::string& path() const { return path_; }

  // Up to `n` bytes at `offset` (fewer at end of file). Throws Error(io_error) on a read error.
  std::string pread(uint64_t offset, size_t n) const;
  // The whole file; throws Error(io_error) if it is (or grows while read) larger than max_bytes.
  std::string read_all(uint64_t max_bytes, const char* what) const;

 private:
  RegularFile(int fd, std::string path, const struct stat& st) : fd_(fd), path_(std::move(path)), st_(st) {}
  int fd_ = -1;
  std::string path_;
  struct stat st_ {};
};

// "a FIFO", "a directory", ... for an st_mode that is not a regular file.
const char* file_kind(mode_t mode);

// The whole of a regular file of at most max_bytes. Throws Error(io_error) naming the path and `what`
// ("rules file", "sequence file") when it is missing, not a regular file, unreadable or too large.
std::string read_regular(const std::string& path, uint64_t max_bytes, const char* what);

}  // namespace jitfuse::files
