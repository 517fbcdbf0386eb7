// The C ABI's error reporting: the calling thread's last message, set by fail().
#pragma once

#include "attnmerge/attnmerge.h"

namespace attnmerge {
namespace detail {

// Records the calling thread's error message (printf-style) and returns `status`.
attnmerge_status fail(attnmerge_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Empties the calling thread's message: the start of every call that can fail.
void clear_error();

}  // namespace detail
}  // namespace attnmerge
