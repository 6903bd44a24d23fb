// SHA-256 through OpenSSL EVP; failures (which only happen when libcrypto is broken) become Error(internal).
// Kept tiny so the key and checksum code reads as plain calls.
#include "cache/sha256.hpp"

#include <openssl/evp.h>

#include "common/error.hpp"

namespace jitfuse::cache {

Sha256::Sha256() : ctx_(EVP_MD_CTX_new()) {
  if (!ctx_ || EVP_DigestInit_ex(static_cast<EVP_MD_CTX*>(ctx_), EVP_sha256(), nullptr) != 1) {
    EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_));
    fail(Status::internal, "OpenSSL could not initialise SHA-256 (is libcrypto usable?)");
  }
}

Sha256::~Sha256() { EVP_MD_CTX_free(static_cast<EVP_MD_CTX*>(ctx_)); }

Sha256& Sha256::update(std::string_view bytes) {
  if (EVP_DigestUpdate(static_cast<EVP_MD_CTX*>(ctx_), bytes.data(), bytes.size()) != 1)
    fail(Status::internal, "OpenSSL SHA-256 update failed");
  return *this;
}

Digest Sha256::finish() {
  Digest d{};
  unsigned len = 0;
  if (EVP_DigestFinal_ex(static_cast<EVP_MD_CTX*>(ctx_), d.data(), &len) != 1 || len != d.size())
    fail(Status::internal, "OpenSSL SHA-256 finalisation failed");
  return d;
}

Digest sha256(std::string_view bytes) { return Sha256().update(bytes).finish(); }

std::string to_hex(const Digest& d) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(d.size() * 2, '0');
  for (size_t i = 0; i < d.size(); ++i) {
    s[2 * i] = kHex[d[i] >> 4];
    s[2 * i + 1] = kHex[d[i] & 15];
  }
  return s;
}

}  // namespace jitfuse::cache
