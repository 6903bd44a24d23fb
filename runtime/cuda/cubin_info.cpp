#include "cuda/cubin_info.hpp"

#include <cstring>
#include <map>

#include <fmt/format.h>

#include "common/little_endian.hpp"

namespace jitfuse::cuda {

namespace {

// ELF64, little-endian (the only CUBIN layout ptxas writes).
constexpr size_t kEhdrSize = 64, kShdrSize = 64, kSymSize = 24;
// .nv.info attribute records: format byte, attribute byte, then a 2-byte value (formats 1-3) or a 2-byte
// payload size and the payload (format 4, "size-prefixed").
constexpr uint8_t kFmtSized = 4;
constexpr uint8_t kAttrFrameSize = 0x11, kAttrRegCount = 0x2f;

struct Bytes {
  std::string_view b;
  bool has(uint64_t off, uint64_t n) const { return off <= b.size() && n <= b.size() - off; }
  template <typename T>
  T get(uint64_t off) const {  // caller checked has(off, sizeof(T))
    return static_cast<T>(load_le(b, off, sizeof(T)));
  }
  // A NUL-terminated name inside [begin, begin + size); empty when it runs past.
  std::string_view cstr(uint64_t begin, uint64_t size, uint64_t off) const {
    if (off >= size || !has(begin, size)) return {};
    std::string_view s = b.substr(begin + off, size - off);
    const size_t nul = s.find('\0');
    return nul == std::string_view::npos ? std::string_view{} : s.substr(0, nul);
  }
};

struct Section {
  std::string_view name;
  uint32_t type = 0, link = 0;
  uint64_t offset = 0, size = 0;
  bool in_file = false;  // [offset, offset + size) lies in the file: its bytes may be read
};

constexpr uint32_t kShtNobits = 8;  // .nv.shared.*: a size, no bytes in the file

}  // namespace

CubinResources read_cubin_resources(std::string_view elf) {
  CubinResources out;
  auto fail = [&out](std::string why) {
    out.error = std::move(why);
    return out;
  };
  const Bytes f{elf};
  if (!f.has(0, kEhdrSize) || std::memcmp(elf.data(), "\x7f" "ELF", 4) != 0)
    return fail("not an ELF file");
  if (elf[4] != 2 || elf[5] != 1) return fail("not a 64-bit little-endian ELF file");
  const auto shoff = f.get<uint64_t>(0x28);
  const auto shentsize = f.get<uint16_t>(0x3A), shnum = f.get<uint16_t>(0x3C), shstrndx = f.get<uint16_t>(0x3E);
  if (shentsize != kShdrSize || !f.has(shoff, uint64_t{shnum} * kShdrSize) || shstrndx >= shnum)
    return fail("section header table out of bounds");

  std::vector<Section> secs(shnum);
  const uint64_t str_off = f.get<uint64_t>(shoff + uint64_t{shstrndx} * kShdrSize + 0x18);
  const uint64_t str_size = f.get<uint64_t>(shoff + uint64_t{shstrndx} * kShdrSize + 0x20);
  if (!f.has(str_off, str_size)) return fail("section name table out of bounds");
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint64_t h = shoff + uint64_t{i} * kShdrSize;
    Section& s = secs[i];
    s.name = f.cstr(str_off, str_size, f.get<uint32_t>(h));
    s.type = f.get<uint32_t>(h + 4);
    s.offset = f.get<uint64_t>(h + 0x18);
    s.size = f.get<uint64_t>(h + 0x20);
    s.link = f.get<uint32_t>(h + 0x28);
    s.in_file = f.has(s.offset, s.size);
    if (s.type != kShtNobits && !s.in_file) return fail(fmt::format("section {} out of bounds", i));
  }

  // Entry points, and the symbol names the attributes refer to by index.
  std::map<std::string, size_t, std::less<>> by_name;
  for (const Section& s : secs)
    if (s.name.substr(0, 6) == ".text." && s.name.size() > 6) {
      by_name.emplace(std::string(s.name.substr(6)), out.kernels.size());
      out.kernels.push_back({std::string(s.name.substr(6))});
    }
  std::vector<std::string_view> syms;
  for (const Section& s : secs) {
    if (s.name != ".symtab") continue;
    if (!s.in_file) return fail("the symbol table has no bytes in the file");
    if (s.link >= secs.size()) return fail("symbol table's string table out of range");
    const Section& strs = secs[s.link];
    for (uint64_t o = 0; o + kSymSize <= s.size; o += kSymSize)
      syms.push_back(f.cstr(strs.offset, strs.size, f.get<uint32_t>(s.offset + o)));
  }
  auto kernel = [&](uint32_t sym) -> KernelResources* {
    if (sym >= syms.size()) return nullptr;
    auto it = by_name.find(syms[sym]);
    return it == by_name.end() ? nullptr : &out.kernels[it->second];
  };

  for (const Section& s : secs) {
    if (s.name.substr(0, 11) == ".nv.shared." && s.name.size() > 11)
      if (auto it = by_name.find(s.name.substr(11)); it != by_name.end())
        out.kernels[it->second].static_shared_bytes = static_cast<int64_t>(s.size);
    if (s.name.substr(0, 8) != ".nv.info") continue;
    if (!s.in_file) return fail(fmt::format("{} has no bytes in the file", s.name));
    // Each record is at least 4 bytes, so this walk ends within size / 4 steps.
    for (uint64_t p = 0; p + 4 <= s.size;) {
      const uint64_t at = s.offset + p;
      const auto format = static_cast<uint8_t>(elf[at]), attr = static_cast<uint8_t>(elf[at + 1]);
      if (format == 0 || format > kFmtSized)
        return fail(fmt::format("{}: unknown attribute format {} at byte {}", s.name, format, p));
      const uint64_t payload = format == kFmtSized ? f.get<uint16_t>(at + 2) : 0;
      if (p + 4 + payload > s.size) return fail(fmt::format("{}: attribute runs past its section", s.name));
      if (payload >= 8 && (attr == kAttrRegCount || attr == kAttrFrameSize))
        if (KernelResources* k = kernel(f.get<uint32_t>(at + 4))) {
          const uint32_t v = f.get<uint32_t>(at + 8);
          if (attr == kAttrRegCount) k->registers = static_cast<int>(v);
          else k->frame_bytes = v;
        }
      p += 4 + payload;
    }
  }
  return out;
}

}  // namespace jitfuse::cuda
