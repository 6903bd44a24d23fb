// The one bounded reader for untrusted files: open non-blocking, fstat, refuse anything but a regular
// file, check the size cap, then read at most cap + 1 bytes (a file may grow between fstat and read).
#include "common/file_read.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/error.hpp"

namespace jitfuse::files {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISLNK(mode)) return "a symbolic link";
  if (S_ISREG(mode)) return "a regular file";
  return "not a regular file";
}

std::optional<RegularFile> RegularFile::open(const std::string& path, std::string* not_regular) {
  // O_NONBLOCK: opening a FIFO with no writer would otherwise wait forever; on a regular file it is a no-op.
  int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return std::nullopt;
    fail(Status::io_error, "cannot open '{}': {}", path, std::strerror(err));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    fail(Status::io_error, "cannot stat '{}': {}", path, std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    if (not_regular) {
      *not_regular = fmt::format("it is {}, not a regular file", file_kind(st.st_mode));
      return std::nullopt;
    }
    fail(Status::io_error, "'{}' is {}, not a regular file: only regular files are read", path, file_kind(st.st_mode));
  }
  return RegularFile(fd, path, st);
}

RegularFile::RegularFile(RegularFile&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)), st_(o.st_) { o.fd_ = -1; }

RegularFile::~RegularFile() {
  if (fd_ >= 0) ::close(fd_);
}

std::string RegularFile::pread(uint64_t offset, size_t n) const {
  std::string out(n, '\0');
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd_, out.data() + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) fail(Status::io_error, "cannot read '{}': {}", path_, std::strerror(errno));
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  out.resize(got);
  return out;
}

std::string RegularFile::read_all(uint64_t max_bytes, const char* what) const {
  auto too_big = [&](uint64_t n, const char* qual) {
    fail(Status::io_error, "{} '{}' is {}{} bytes, more than the limit of {} bytes: split it or check that it is the "
         "file you meant", what, path_, qual, n, max_bytes);
  };
  if (size() > max_bytes) too_big(size(), "");
  // One byte past the cap tells a file that grew after fstat from one that did not.
  std::string bytes = pread(0, static_cast<size_t>(max_bytes < size() + 4096 ? max_bytes + 1 : size() + 4096));
  if (bytes.size() > max_bytes) too_big(max_bytes, "more than ");
  if (bytes.size() == size() + 4096) {  // grew by more than our slack: read the rest, still bounded
    std::string more = pread(bytes.size(), static_cast<size_t>(max_bytes + 1 - bytes.size()));
    bytes += more;
    if (bytes.size() > max_bytes) too_big(max_bytes, "more than ");
  }
  return bytes;
}

std::string read_regular(const std::string& path, uint64_t max_bytes, const char* what) {
  std::string why;
  std::optional<RegularFile> f = RegularFile::open(path, &why);
  if (!why.empty()) fail(Status::io_error, "cannot read {} '{}': {}", what, path, why);
  if (!f) fail(Status::io_error, "cannot read {} '{}': no such file; check the path", what, path);
  return f->read_all(max_bytes, what);
}

}  // namespace jitfuse::files
