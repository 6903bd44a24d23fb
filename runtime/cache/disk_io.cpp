// POSIX plumbing for the disk tier (see disk_io.hpp): every syscall error becomes Error(io_error)
// with the path and errno text, so KernelCache can decide to fall back to memory only.
#include "cache/disk_io.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <thread>

#include "cache/disk_store.hpp"
#include "common/error.hpp"
#include "common/file_read.hpp"

namespace jitfuse::cache::io {

std::string Layout::base() const { return root + "/v" + std::to_string(kFormatVersion); }
std::string Layout::shard_dir(const std::string& key) const { return base() + "/" + key.substr(0, 2); }
std::string Layout::entry_path(const std::string& key) const { return shard_dir(key) + "/" + key + kEntrySuffix; }
std::string Layout::use_path(const std::string& key) const { return shard_dir(key) + "/" + key + kUseSuffix; }
std::string Layout::locks_dir() const { return base() + "/locks"; }
std::string Layout::lock_path(const std::string& key) const { return locks_dir() + "/" + key + ".lock"; }
std::string Layout::quarantine_dir() const { return base() + "/quarantine"; }

std::string errno_text(int err) { return std::strerror(err); }

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string iso_time(int64_t unix_ns) {
  std::time_t t = static_cast<std::time_t>(unix_ns / 1000000000);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

bool is_key(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

void make_dirs(const std::string& path, mode_t mode) {
  if (path.empty()) fail(Status::io_error, "empty cache directory path");
  for (size_t pos = 1; pos <= path.size(); ++pos) {
    if (pos != path.size() && path[pos] != '/') continue;
    std::string prefix = path.substr(0, pos);
    if (::mkdir(prefix.c_str(), mode) != 0 && errno != EEXIST)
      fail(Status::io_error, "cannot create directory {}: {}", prefix, errno_text(errno));
  }
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    fail(Status::io_error, "cannot create directory {}: {}", path, errno_text(errno));
  if (!S_ISDIR(st.st_mode)) fail(Status::io_error, "{} exists and is not a directory", path);
}

std::string unsafe_reason(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return fmt::format("{}: {}", dir, errno_text(errno));
  if (!S_ISDIR(st.st_mode)) return fmt::format("{} is not a directory", dir);
  // Anyone who can write here can plant a CUBIN that this process would load and run.
  if (st.st_uid != ::geteuid())
    return fmt::format("{} is owned by uid {}, not by this user (uid {}): a poisoned entry would run foreign "
                       "code on the GPU; use a directory you own (JITFUSE_CACHE_DIR)",
                       dir, st.st_uid, ::geteuid());
  if (st.st_mode & 022)
    return fmt::format("{} is writable by group or others (mode {:04o}): a poisoned entry would run foreign code "
                       "on the GPU; run `chmod go-w {}` or use another JITFUSE_CACHE_DIR",
                       dir, st.st_mode & 07777, dir);
  return {};
}

namespace {

struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
};

void write_all(int fd, const std::string& bytes, const std::string& path) {
  size_t off = 0;
  while (off < bytes.size()) {
    ssize_t n = ::write(fd, bytes.data() + off, bytes.size() - off);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail(Status::io_error, "cannot write {}: {}", path, errno_text(errno));
    off += static_cast<size_t>(n);
  }
}

std::string parent_dir(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string base_name(const std::string& path) {
  auto slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

int64_t mtime_ns(const struct stat& st) {
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

}  // namespace

std::optional<std::string> read_file(const std::string& path, bool owner_check, std::string* refused,
                                     uint64_t max_bytes, std::string (*precheck)(const files::RegularFile&)) {
  std::string why;
  auto refuse = [&](std::string reason) -> std::optional<std::string> {
    if (!refused) fail(Status::io_error, "{}: {}", path, reason);
    *refused = std::move(reason);
    return std::nullopt;
  };
  std::optional<files::RegularFile> f = files::RegularFile::open(path, &why);
  if (!f) return why.empty() ? std::nullopt : refuse(why);
  const struct stat& st = f->stat();
  if (owner_check && (st.st_uid != ::geteuid() || (st.st_mode & 022)))
    return refuse(fmt::format("owned by uid {} with mode {:04o}; only files this user alone can write are loaded",
                              st.st_uid, st.st_mode & 07777));
  if (f->size() > max_bytes)
    return refuse(fmt::format("{} bytes, more than the {} bytes a cache file may have", f->size(), max_bytes));
  if (precheck)
    if (std::string problem = precheck(*f); !problem.empty()) return refuse(problem);
  return f->read_all(max_bytes, "cache file");
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  std::string tmp = parent_dir(path) + "/." + base_name(path) + kTempMarker + "XXXXXX";
  int fd = ::mkstemp(tmp.data());  // 0600: nobody else may read or replace it
  if (fd < 0) fail(Status::io_error, "cannot create a temporary file beside {}: {}", path, errno_text(errno));
  try {
    Fd f(fd);
    write_all(f.fd, bytes, tmp);
    // Without fsync a crash after rename can leave a zero-length "published" entry.
    if (::fsync(f.fd) != 0) fail(Status::io_error, "cannot fsync {}: {}", tmp, errno_text(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int err = errno;
    ::unlink(tmp.c_str());
    fail(Status::io_error, "cannot publish {}: {}", path, errno_text(err));
  }
}

void probe_writable(const std::string& dir) {
  std::string tmp = dir + "/.probe" + kTempMarker + "XXXXXX";
  int fd = ::mkstemp(tmp.data());
  if (fd < 0) fail(Status::io_error, "cannot write in {}: {}", dir, errno_text(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

// Saturates the hit count at 1 MiB of sidecar so a hot entry cannot grow its sidecar forever.
static constexpr off_t kMaxUseBytes = 1 << 20;

void record_hit(const std::string& use_path) {
  Fd f(::open(use_path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC | O_NONBLOCK, 0600));
  if (f.fd < 0) return;  // O_NONBLOCK: a FIFO planted here fails (ENXIO) instead of hanging the hit
  struct stat st {};
  if (::fstat(f.fd, &st) == 0 && st.st_size >= kMaxUseBytes) {
    ::futimens(f.fd, nullptr);  // still mark it used for LRU
    return;
  }
  // One O_APPEND byte is atomic across processes: no lock, no read-modify-write.
  [[maybe_unused]] ssize_t n = ::write(f.fd, "h", 1);
}

Usage read_usage(const std::string& use_path, int64_t entry_mtime_ns) {
  Usage u;
  u.last_used_ns = entry_mtime_ns;
  struct stat st {};
  if (::stat(use_path.c_str(), &st) == 0) {
    u.hits = static_cast<uint64_t>(st.st_size);
    u.last_used_ns = std::max(u.last_used_ns, mtime_ns(st));
  }
  return u;
}

std::string quarantine(const std::string& path, const std::string& quarantine_dir, const std::string& key) {
  make_dirs(quarantine_dir, 0700);
  std::string dest = fmt::format("{}/{}.{}{}", quarantine_dir, key, now_ns(), kEntrySuffix);
  if (::rename(path.c_str(), dest.c_str()) != 0) {
    if (errno == ENOENT) return {};  // someone else already moved or replaced it
    fail(Status::io_error, "cannot move {} to {}: {}", path, dest, errno_text(errno));
  }
  return dest;
}

FileLock::FileLock(FileLock&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }

FileLock& FileLock::operator=(FileLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_;
    path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

FileLock::~FileLock() { release(); }

void FileLock::release() {
  if (fd_ >= 0) ::close(fd_);  // closing the last descriptor drops the flock
  fd_ = -1;
}

void FileLock::unlink_file() {
  if (fd_ >= 0) ::unlink(path_.c_str());
}

namespace {

// True when `fd` is still the file at `path` (prune/clear may have unlinked it while we waited).
bool still_linked(int fd, const std::string& path) {
  struct stat a {}, b {};
  if (::fstat(fd, &a) != 0 || ::stat(path.c_str(), &b) != 0) return false;
  return a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

}  // namespace

FileLock FileLock::acquire(const std::string& path, double timeout_s) {
  using clock = std::chrono::steady_clock;
  auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
  auto backoff = std::chrono::microseconds(500);
  for (;;) {
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) fail(Status::io_error, "cannot open lock file {}: {}", path, errno_text(errno));
    // Polling rather than a blocking flock lets a hung (alive but stuck) holder time out.
    for (;;) {
      if (::flock(fd, LOCK_EX | LOCK_NB) == 0) break;
      int err = errno;
      if (err == EINTR) continue;
      if (err != EWOULDBLOCK) {
        ::close(fd);
        fail(Status::io_error, "cannot lock {}: {}", path, errno_text(err));
      }
      if (clock::now() >= deadline) {
        ::close(fd);
        return FileLock();
      }
      std::this_thread::sleep_for(backoff);
      backoff = std::min(backoff * 2, std::chrono::microseconds(20000));
    }
    if (still_linked(fd, path)) {
      FileLock l;
      l.fd_ = fd;
      l.path_ = path;
      return l;
    }
    ::close(fd);
  }
}

FileLock FileLock::try_acquire(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd < 0) return FileLock();
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || !still_linked(fd, path)) {
    ::close(fd);
    return FileLock();
  }
  FileLock l;
  l.fd_ = fd;
  l.path_ = path;
  return l;
}

}  // namespace jitfuse::cache::io
