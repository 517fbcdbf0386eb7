// The C ABI's error reporting: the calling thread's last message, set by fail(), and the names it
// gives the arguments.
#pragma once

#include "attnmerge/attnmerge.h"

namespace attnmerge {
namespace detail {

// Records the calling thread's error message (printf-style) and returns `status`.
attnmerge_status fail(attnmerge_status status, const char* fmt, ...) __attribute__((format(printf, 2, 3)));

// Empties the calling thread's message: the start of every call that can fail.
void clear_error();

// A dtype code that reached a dispatch with no type for it (internal.h): validation refuses every
// such code first, so this is a bug of the library, reported as one (ATTNMERGE_ERROR_TYPE, naming
// the code) rather than run in another type.
attnmerge_status unknown_dtype(int dtype);

// The caller's names of a call's arguments (options.arg_names, checked by validate()): every
// message of the C ABI names an argument through of(), so that it names what the caller wrote.
struct ArgNames {
  const attnmerge_arg_name* entries = nullptr;
  int count = 0;
  // The caller's name of `arg` (an argument's name in attnmerge.h, or "a_tokens", "output_scale"):
  // the first entry for it, else `arg`.  Called only where a message is worded.
  const char* of(const char* arg) const;
};

}  // namespace detail
}  // namespace attnmerge
