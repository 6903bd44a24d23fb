// Text from untrusted input, made safe to put in an error message: valid UTF-8, control bytes escaped,
// and never the whole of a long value (a 1 MB op name must not become a 1 MB message).
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace jitfuse::text {

// Whether `s` is well-formed UTF-8 (no overlongs, no surrogates, nothing above U+10FFFF).
bool valid_utf8(std::string_view s);

// For quoting a value inside a message: invalid UTF-8 and control bytes as \xNN, and past `max_bytes`
// the rest replaced by "... (N bytes in all)". Valid non-ASCII characters are kept.
std::string shorten(std::string_view s, size_t max_bytes = 80);

// For a whole message: invalid UTF-8 replaced by U+FFFD (newlines and tabs kept), cut at `max_bytes`
// with a note saying so.
std::string sanitize_message(std::string_view s, size_t max_bytes = 64 * 1024);

}  // namespace jitfuse::text
