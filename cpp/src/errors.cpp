// The calling thread's last error message, the caller's names of arguments, the names of the
// status codes.
#include "errors.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

namespace attnmerge {
namespace detail {

namespace {
thread_local char g_error[1024] = "";
}  // namespace

attnmerge_status fail(attnmerge_status status, const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(g_error, sizeof g_error, fmt, args);
  va_end(args);
  return status;
}

void clear_error() { g_error[0] = '\0'; }

attnmerge_status unknown_dtype(int dtype) {
  return fail(ATTNMERGE_ERROR_TYPE,
              "dtype %d: reached the dispatch of libattnmerge's kernels unvalidated (a bug of the library; please "
              "report it)",
              dtype);
}

const char* ArgNames::of(const char* arg) const {
  for (int i = 0; i < count; ++i)
    if (std::strcmp(entries[i].arg, arg) == 0) return entries[i].name;
  return arg;
}

}  // namespace detail
}  // namespace attnmerge

extern "C" {

const char* attnmerge_last_error(void) { return attnmerge::detail::g_error; }

const char* attnmerge_status_string(attnmerge_status status) {
  switch (status) {
    case ATTNMERGE_SUCCESS: return "success";
    case ATTNMERGE_ERROR_VALUE: return "invalid value";
    case ATTNMERGE_ERROR_TYPE: return "invalid type";
    case ATTNMERGE_ERROR_NO_DEVICE: return "no CUDA device";
    case ATTNMERGE_ERROR_CUDA: return "CUDA runtime error";
    case ATTNMERGE_ERROR_TIMEOUT: return "timed out waiting for a peer";
  }
  return "unknown status";
}

}  // extern "C"
