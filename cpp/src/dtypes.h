// The dtype table: one row per attnmerge_dtype, the only place that says what a code is called, how
// large its elements are, which arguments take it and whether the GPU does.  Validation and its
// messages read it here; the binding and the Python package read it through attnmerge_dtype_info_of
// (info.cpp).
#pragma once

#include <cstddef>
#include <cstdint>

#include "attnmerge/attnmerge.h"
#include "attnmerge/numeric.h"

namespace attnmerge {
namespace detail {

// Where arrays of a dtype may live: anywhere, or host memory alone (no GPU kernel is compiled for
// it: the CPU path runs it).
enum class Where : uint8_t { kAnywhere, kHostOnly };

struct DtypeRow {
  int32_t code;
  attnmerge_dtype_info info;
  Where where = Where::kAnywhere;
};

// Sizes are those of the storage types (numeric.h) the kernels and the CPU path read and write.
constexpr DtypeRow kDtypes[] = {
    {ATTNMERGE_FLOAT32,
     {"float32", "float32", sizeof(float),
      ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT | ATTNMERGE_ROLE_LSE | ATTNMERGE_ROLE_SCALE}},
    {ATTNMERGE_FLOAT16, {"float16", "float16", sizeof(half_t), ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT}},
    {ATTNMERGE_BFLOAT16, {"bfloat16", "bfloat16", sizeof(bfloat16_t), ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT}},
    {ATTNMERGE_FLOAT8_E4M3, {"float8_e4m3", "float8_e4m3fn", sizeof(float8_e4m3_t), ATTNMERGE_ROLE_O_OUT}},
    {ATTNMERGE_UINT8, {"uint8", "uint8", sizeof(uint8_t), ATTNMERGE_ROLE_MASK}},
    {ATTNMERGE_BOOL, {"bool", "bool", sizeof(uint8_t), ATTNMERGE_ROLE_MASK}},  // one byte each, whatever C++'s bool
    {ATTNMERGE_INT32, {"int32", "int32", sizeof(int32_t), ATTNMERGE_ROLE_INDPTR}},
    {ATTNMERGE_INT64, {"int64", "int64", sizeof(int64_t), ATTNMERGE_ROLE_INDPTR}},
    {ATTNMERGE_FLOAT64,
     {"float64", "float64", sizeof(double), ATTNMERGE_ROLE_O_IN | ATTNMERGE_ROLE_O_OUT | ATTNMERGE_ROLE_LSE},
     Where::kHostOnly},
};
constexpr int kDtypeCount = static_cast<int>(sizeof kDtypes / sizeof kDtypes[0]);

constexpr bool rows_follow_the_codes() {
  for (int i = 0; i < kDtypeCount; ++i)
    if (kDtypes[i].code != i) return false;
  return true;
}
static_assert(rows_follow_the_codes(), "kDtypes[code] is the row of `code`");
static_assert(kDtypeCount <= 32, "a set of dtypes is a 32-bit mask of codes");

// The row of `dtype`, or null for a code that names none.
constexpr const attnmerge_dtype_info* dtype_info(int dtype) {
  return dtype >= 0 && dtype < kDtypeCount ? &kDtypes[dtype].info : nullptr;
}

constexpr const char* dtype_name(int dtype) { return dtype_info(dtype) ? dtype_info(dtype)->name : "unknown"; }

// 1 for a code that names none (never addressed: validation refuses it first).
constexpr std::size_t dtype_size(int dtype) { return dtype_info(dtype) ? dtype_info(dtype)->size : 1; }

// The set of dtypes an argument of `role` may have: bit `code` for each.
constexpr uint32_t dtypes_of(uint32_t role) {
  uint32_t set = 0;
  for (int i = 0; i < kDtypeCount; ++i)
    if (kDtypes[i].info.roles & role) set |= 1u << i;
  return set;
}

constexpr bool in_set(uint32_t set, int dtype) { return dtype >= 0 && dtype < kDtypeCount && (set >> dtype & 1u); }

// The dtypes whose arrays live in host memory alone: bit `code` for each.
constexpr uint32_t host_only_dtypes() {
  uint32_t set = 0;
  for (int i = 0; i < kDtypeCount; ++i)
    if (kDtypes[i].where == Where::kHostOnly) set |= 1u << i;
  return set;
}

}  // namespace detail
}  // namespace attnmerge
