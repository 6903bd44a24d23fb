// Little-endian unsigned integers of 1 to 8 bytes at a byte offset, independent of the host's byte order:
// the file formats jitfuse reads (kernel cache entries, CUBINs' ELF structures). The caller checks that
// [at, at + bytes) lies inside `b`.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>

namespace jitfuse {

inline uint64_t load_le(std::string_view b, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(b[at + i])) << (8 * i);
  return v;
}

}  // namespace jitfuse
