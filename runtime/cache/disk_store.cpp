// The entry file format (serialize/parse) and whole-directory operations: listing, verification,
// LRU pruning and clearing. KernelCache and the `jitfuse cache` CLI share all of it.
#include "cache/disk_store.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <filesystem>
#include <limits>

#include "cache/disk_io.hpp"
#include "cache/sha256.hpp"
#include "common/error.hpp"
#include "common/file_read.hpp"
#include "common/little_endian.hpp"

namespace jitfuse::cache {

namespace fs = std::filesystem;

// Entry file layout, version kFormatVersion (all integers little-endian):
//   magic     8 bytes   "JFKENTRY"
//   version   u32       kFormatVersion
//   key       u64 length + 64 hex chars
//   meta      u64 length + JSON (compact, keys sorted: nlohmann's default object order)
//   source    u64 length + CUDA C++ source
//   cubin     u64 length + CUBIN image
//   checksum  32 bytes  sha256 of every byte before it
// Any change to this list must increment kFormatVersion and regenerate tests/golden/cache/.
static constexpr char kMagic[8] = {'J', 'F', 'K', 'E', 'N', 'T', 'R', 'Y'};
static constexpr size_t kChecksumBytes = 32;

namespace {

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_field(std::string& out, std::string_view bytes) {
  uint64_t n = bytes.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  out.append(bytes);
}

[[noreturn]] void damaged(const std::string& where, const std::string& what) {
  fail(Status::io_error, "{}: damaged kernel cache entry: {}", where, what);
}

// Bounds-checked little-endian reader; every overrun is reported as damage, never UB.
struct Reader {
  const std::string& b;
  const std::string& where;
  size_t pos = 0;

  uint64_t uint(int bytes, const char* what) {
    if (b.size() - pos < size_t(bytes))
      damaged(where, fmt::format("truncated at byte {} while reading the {} (file has {} bytes)", pos, what,
                                 b.size()));
    const uint64_t v = load_le(b, pos, bytes);
    pos += bytes;
    return v;
  }

  std::string field(const char* name) {
    uint64_t n = uint(8, fmt::format("{} length", name).c_str());
    if (n > b.size() - pos)
      damaged(where, fmt::format("truncated or corrupt: the {} field claims {} bytes but only {} remain", name, n,
                                 b.size() - pos));
    std::string s = b.substr(pos, n);
    pos += n;
    return s;
  }
};

// Magic, version, key and metadata: shared by the full parse and the header-only listing.
void parse_head(Reader& r, Entry& e) {
  if (r.b.size() < sizeof kMagic || std::memcmp(r.b.data(), kMagic, sizeof kMagic) != 0)
    damaged(r.where, "not a jitfuse kernel cache entry (bad magic)");
  r.pos = sizeof kMagic;
  uint64_t version = r.uint(4, "format version");
  if (version != kFormatVersion)
    damaged(r.where, fmt::format("entry format version {}, this build reads version {}", version, kFormatVersion));
  e.key = r.field("key");
  if (!io::is_key(e.key)) damaged(r.where, "the key field is not 64 hex characters");
  std::string meta = r.field("meta");
  try {
    e.meta = nlohmann::json::parse(meta);
  } catch (const nlohmann::json::exception& ex) {
    damaged(r.where, fmt::format("metadata is not valid JSON ({})", ex.what()));
  }
  if (!e.meta.is_object()) damaged(r.where, "metadata is not a JSON object");
}

// magic(8) + version(4) + key length(8) + key(64) + meta length(8)
constexpr size_t kMetaLenAt = 8 + 4 + 8 + 64;
// Metadata is a few hundred bytes; a header claiming more is damage, not something to allocate.
constexpr uint64_t kMaxMetaBytes = 1 << 20;

uint64_t le64(const std::string& b, size_t at) { return load_le(b, at, 8); }

// The entry's layout from its header alone (a few preads): empty when magic, version and the field
// lengths fit the file size exactly, else what is wrong. Nothing is read past the length fields.
std::string check_layout(const files::RegularFile& f) {
  const uint64_t size = f.size();
  std::string head = f.pread(0, 12);
  if (head.size() < 12 || std::memcmp(head.data(), kMagic, sizeof kMagic) != 0)
    return "not a jitfuse kernel cache entry (bad magic)";
  uint32_t version = 0;
  for (int i = 0; i < 4; ++i) version |= uint32_t(uint8_t(head[8 + i])) << (8 * i);
  if (version != kFormatVersion)
    return fmt::format("entry format version {}, this build reads version {}", version, kFormatVersion);
  uint64_t pos = 12;
  for (const char* name : {"key", "meta", "source", "cubin"}) {
    std::string len = f.pread(pos, 8);
    if (len.size() < 8) return fmt::format("truncated at byte {} while reading the {} length", pos, name);
    uint64_t n = le64(len, 0);
    pos += 8;
    if (n > size - pos)
      return fmt::format("truncated or corrupt: the {} field claims {} bytes but only {} remain", name, n, size - pos);
    pos += n;
  }
  if (size - pos != kChecksumBytes)
    return fmt::format("the header's field lengths leave {} bytes for the {}-byte checksum", size - pos,
                       kChecksumBytes);
  return {};
}

// Reads just enough of an entry file for parse_head: the fixed header, then the metadata. Never blocks
// (regular files only) and never reads more than kMaxMetaBytes of metadata.
std::string read_head_bytes(const std::string& path) {
  std::string why;
  std::optional<files::RegularFile> f = files::RegularFile::open(path, &why);
  if (!f) damaged(path, why.empty() ? "removed while being read" : why);
  std::string b = f->pread(0, 4096);
  if (b.size() >= kMetaLenAt + 8) {
    uint64_t meta_len = le64(b, kMetaLenAt);
    if (meta_len > kMaxMetaBytes) damaged(path, fmt::format("the meta field claims {} bytes", meta_len));
    uint64_t want = kMetaLenAt + 8 + meta_len;
    if (want <= f->size() && want > b.size()) b += f->pread(b.size(), static_cast<size_t>(want - b.size()));
  }
  return b;
}

int64_t mtime_ns(const fs::path& p) {
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) return 0;
  return int64_t(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec;
}

uint64_t size_of(const fs::path& p) {
  std::error_code ec;
  auto n = fs::file_size(p, ec);
  return ec ? 0 : n;
}

// Every "<base>/<xx>/<key>.jfk" path, in key order.
std::vector<std::pair<std::string, fs::path>> entry_files(const io::Layout& layout) {
  std::vector<std::pair<std::string, fs::path>> out;
  std::error_code ec;
  for (fs::directory_iterator shard(layout.base(), ec), end; !ec && shard != end; shard.increment(ec)) {
    std::string name = shard->path().filename().string();
    if (name.size() != 2 || !shard->is_directory(ec)) continue;
    std::error_code ec2;
    for (fs::directory_iterator f(shard->path(), ec2); !ec2 && f != end; f.increment(ec2)) {
      std::string fname = f->path().filename().string();
      if (!fname.ends_with(io::kEntrySuffix)) continue;
      std::string key = fname.substr(0, fname.size() - std::strlen(io::kEntrySuffix));
      if (io::is_key(key) && key.starts_with(name)) out.emplace_back(key, f->path());
    }
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Everything but directories: a FIFO or socket moved into quarantine must still be counted and removed.
std::vector<fs::path> files_in(const std::string& dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator f(dir, ec), end; !ec && f != end; f.increment(ec)) {
    std::error_code tec;
    if (!f->is_directory(tec)) out.push_back(f->path());
  }
  return out;
}

// Temp files left by a process that died between mkstemp and rename.
std::vector<fs::path> temp_files(const io::Layout& layout) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (fs::directory_iterator shard(layout.base(), ec), end; !ec && shard != end; shard.increment(ec)) {
    if (shard->path().filename().string().size() != 2) continue;
    for (auto& p : files_in(shard->path().string()))
      if (p.filename().string().find(io::kTempMarker) != std::string::npos) out.push_back(p);
  }
  return out;
}

}  // namespace

std::string serialize_entry(const Entry& e) {
  if (!io::is_key(e.key)) fail(Status::invalid_argument, "cache entry key '{}' is not 64 hex characters", e.key);
  // `replace` keeps a stray non-UTF-8 byte in descriptive metadata from failing a whole compile.
  std::string meta = e.meta.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  std::string out;
  out.reserve(sizeof kMagic + 4 + 4 * 8 + e.key.size() + meta.size() + e.source.size() + e.cubin.size() +
              kChecksumBytes);
  out.append(kMagic, sizeof kMagic);
  put_u32(out, kFormatVersion);
  put_field(out, e.key);
  put_field(out, meta);
  put_field(out, e.source);
  put_field(out, e.cubin);
  Digest d = sha256(out);
  out.append(reinterpret_cast<const char*>(d.data()), d.size());
  return out;
}

Entry parse_entry(const std::string& bytes, const std::string& where) {
  Entry e;
  Reader r{bytes, where};
  parse_head(r, e);
  e.source = r.field("source");
  e.cubin = r.field("cubin");
  size_t rest = bytes.size() - r.pos;
  if (rest < kChecksumBytes)
    damaged(where, fmt::format("truncated: the checksum needs {} bytes, {} remain", kChecksumBytes, rest));
  if (rest > kChecksumBytes) damaged(where, fmt::format("{} unexpected bytes after the checksum", rest - kChecksumBytes));
  Digest d = sha256(std::string_view(bytes).substr(0, r.pos));
  if (std::memcmp(d.data(), bytes.data() + r.pos, kChecksumBytes) != 0)
    damaged(where, "checksum mismatch (the file was modified or corrupted)");
  return e;
}

std::optional<std::string> read_entry_file(const std::string& path, bool owner_check, std::string* refused) {
  std::string why;
  auto bytes = io::read_file(path, owner_check, &why, io::kMaxEntryBytes, check_layout);
  if (!why.empty()) {
    if (!refused) damaged(path, why);
    *refused = std::move(why);
  }
  return bytes;
}

std::string entry_path(const std::string& dir, const std::string& key) { return io::Layout{dir}.entry_path(key); }

std::string dir_problem(const std::string& dir) { return io::unsafe_reason(dir); }

std::vector<EntryInfo> scan_entries(const std::string& dir, bool verify) {
  io::Layout layout{dir};
  std::vector<EntryInfo> out;
  for (auto& [key, path] : entry_files(layout)) {
    EntryInfo info;
    info.key = key;
    info.path = path.string();
    info.bytes = size_of(path);
    io::Usage use = io::read_usage(layout.use_path(key), mtime_ns(path));
    info.hits = use.hits;
    info.last_used_ns = use.last_used_ns;
    try {
      Entry e;
      if (verify) {
        auto bytes = read_entry_file(info.path);
        if (!bytes) continue;  // removed while we listed
        e = parse_entry(*bytes, info.path);
      } else {
        std::string head = read_head_bytes(info.path);
        Reader r{head, info.path};
        parse_head(r, e);
      }
      if (e.key != key) info.problem = fmt::format("{}: holds key {}, not the key its name says", info.path, e.key);
      info.meta = std::move(e.meta);
      info.meta["hits"] = info.hits;
      info.meta["last_used"] = io::iso_time(info.last_used_ns);
    } catch (const Error& err) {
      info.problem = err.what();
    }
    out.push_back(std::move(info));
  }
  return out;
}

std::vector<EntryInfo> list_entries(const std::string& dir) { return scan_entries(dir, true); }

std::optional<Entry> read_entry(const std::string& dir, const std::string& key_or_prefix) {
  std::string prefix = key_or_prefix;
  std::transform(prefix.begin(), prefix.end(), prefix.begin(), [](unsigned char c) { return std::tolower(c); });
  if (prefix.empty() || prefix.size() > 64 || !std::all_of(prefix.begin(), prefix.end(), [](char c) {
        return std::isxdigit(static_cast<unsigned char>(c));
      }))
    fail(Status::invalid_argument, "'{}' is not a cache key or key prefix (hex digits)", key_or_prefix);
  io::Layout layout{dir};
  std::vector<std::pair<std::string, fs::path>> matches;
  for (auto& kp : entry_files(layout))
    if (kp.first.starts_with(prefix)) matches.push_back(kp);
  if (matches.empty()) return std::nullopt;
  if (matches.size() > 1) {
    std::string some;
    for (size_t i = 0; i < matches.size() && i < 5; ++i) some += " " + matches[i].first.substr(0, 16);
    fail(Status::invalid_argument, "key prefix '{}' matches {} entries ({}{}); give more digits", prefix,
         matches.size(), some.substr(1), matches.size() > 5 ? " ..." : "");
  }
  auto& [key, path] = matches.front();
  auto bytes = read_entry_file(path.string());
  if (!bytes) return std::nullopt;
  Entry e = parse_entry(*bytes, path.string());
  io::Usage use = io::read_usage(layout.use_path(key), mtime_ns(path));
  e.meta["hits"] = use.hits;
  e.meta["last_used"] = io::iso_time(use.last_used_ns);
  return e;
}

uint64_t prune(const std::string& dir, uint64_t max_bytes) {
  io::Layout layout{dir};
  struct Item {
    int rank;  // 0: garbage (quarantine, stale temp files) goes first, 1: entries by LRU
    int64_t last_used_ns;
    uint64_t bytes;
    std::string key;  // empty for garbage
    fs::path path;
  };
  std::vector<Item> items;
  uint64_t total = 0;
  for (auto& p : files_in(layout.quarantine_dir())) items.push_back({0, mtime_ns(p), size_of(p), {}, p});
  // A temp file younger than this may belong to a writer that is still running.
  const int64_t stale_before = io::now_ns() - int64_t(3600) * 1000000000;
  for (auto& p : temp_files(layout))
    if (mtime_ns(p) < stale_before) items.push_back({0, mtime_ns(p), size_of(p), {}, p});
  for (auto& [key, path] : entry_files(layout)) {
    io::Usage use = io::read_usage(layout.use_path(key), mtime_ns(path));
    items.push_back({1, use.last_used_ns, size_of(path) + size_of(layout.use_path(key)), key, path});
  }
  for (auto& it : items) total += it.bytes;
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return std::tie(a.rank, a.last_used_ns, a.key) < std::tie(b.rank, b.last_used_ns, b.key);
  });
  uint64_t removed = 0;
  for (auto& it : items) {
    if (total <= max_bytes) break;
    std::error_code ec;
    if (it.key.empty()) {
      fs::remove(it.path, ec);
    } else {
      // A held lock means some process is compiling or publishing this key right now: skip it.
      io::FileLock lock = io::FileLock::try_acquire(layout.lock_path(it.key));
      if (!lock.held()) continue;
      fs::remove(it.path, ec);
      fs::remove(layout.use_path(it.key), ec);
      lock.unlink_file();
    }
    total -= it.bytes;
    removed += it.bytes;
  }
  return removed;
}

uint64_t clear(const std::string& dir) {
  io::Layout layout{dir};
  uint64_t entries = 0;
  std::error_code ec;
  for (auto& [key, path] : entry_files(layout)) {
    if (fs::remove(path, ec)) ++entries;
    fs::remove(layout.use_path(key), ec);
  }
  for (auto& p : temp_files(layout)) fs::remove(p, ec);
  for (auto& p : files_in(layout.quarantine_dir())) fs::remove(p, ec);
  // Lock files of keys nobody holds; a held one belongs to a live compile and stays.
  for (auto& p : files_in(layout.locks_dir())) {
    io::FileLock lock = io::FileLock::try_acquire(p.string());
    if (lock.held()) lock.unlink_file();
  }
  return entries;
}

uint64_t quarantined_count(const std::string& dir) { return files_in(io::Layout{dir}.quarantine_dir()).size(); }

uint64_t parse_byte_count(const std::string& text, const std::string& what) {
  auto bad = [&]() -> uint64_t {
    fail(Status::invalid_argument,
         "{}='{}' is not a byte count: use a whole number of bytes, optionally with a K, M, G or T suffix "
         "(powers of 1024), e.g. 2G; 0 means unbounded",
         what, text);
  };
  size_t i = 0;
  uint64_t v = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    uint64_t d = uint64_t(text[i] - '0');
    if (v > (std::numeric_limits<uint64_t>::max() - d) / 10) return bad();
    v = v * 10 + d;
    ++i;
  }
  if (i == 0) return bad();
  std::string suffix = text.substr(i);
  for (auto& c : suffix) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  int shift = 0;
  if (!suffix.empty()) {
    static const std::string kUnits = "KMGT";
    auto u = kUnits.find(suffix[0]);
    std::string tail = suffix.substr(1);
    if (suffix == "B") {
      shift = 0;
    } else if (u == std::string::npos || !(tail.empty() || tail == "B" || tail == "IB")) {
      return bad();
    } else {
      shift = 10 * int(u + 1);
    }
  }
  if (shift && v > (std::numeric_limits<uint64_t>::max() >> shift)) return bad();
  return v << shift;
}

}  // namespace jitfuse::cache
