// SHA-256 over byte strings, through OpenSSL's EVP API (libcrypto is jitfuse's only hash provider).
// Used for cache keys and entry checksums; both must stay stable across builds and machines.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>

namespace jitfuse::cache {

using Digest = std::array<uint8_t, 32>;

// Incremental hasher, so keys can be built field by field without concatenating copies of the source.
class Sha256 {
 public:
  Sha256();
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;

  Sha256& update(std::string_view bytes);
  Digest finish();  // the hasher may not be updated afterwards

 private:
  void* ctx_;  // EVP_MD_CTX*, kept opaque so OpenSSL headers stay out of includers
};

Digest sha256(std::string_view bytes);
std::string to_hex(const Digest& d);

}  // namespace jitfuse::cache
