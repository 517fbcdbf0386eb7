// What the emulators (forward_emulator.cpp, backward_emulator.cpp) share: the GPU kernels run on
// the CPU through the library's own launchers, their launches emulated (emulated_cuda/
// cuda_runtime.h); the storage types they are compiled for, chosen by dtype code; arrays as a
// pointer and strides in elements; and C functions for ctypes that set the threads' order and
// tell why a launch failed and how it ran.
#pragma once

#include <cuda_runtime.h>

#include <attnmerge/attnmerge.h>
#include <attnmerge/numeric.h>
#include <attnmerge/plan.h>
#include <attnmerge/views.h>

#include <cstdint>
#include <type_traits>

namespace emu {

using attnmerge::bfloat16_t;
using attnmerge::float8_e4m3_t;
using attnmerge::half_t;

template <typename T>
constexpr int code_of() {
  if constexpr (std::is_same<T, float>::value) return ATTNMERGE_FLOAT32;
  if constexpr (std::is_same<T, half_t>::value) return ATTNMERGE_FLOAT16;
  if constexpr (std::is_same<T, bfloat16_t>::value) return ATTNMERGE_BFLOAT16;
  if constexpr (std::is_same<T, float8_e4m3_t>::value) return ATTNMERGE_FLOAT8_E4M3;
}

// The plan's Dtype of a C ABI dtype code (kUnknown for one that names no O dtype).
inline attnmerge::Dtype dtype_of_code(int code) {
  attnmerge::Dtype d = attnmerge::Dtype::kUnknown;
  const auto match = [&](auto tag) {
    if (code_of<decltype(tag)>() == code) d = attnmerge::dtype_of<decltype(tag)>();
  };
  match(float{}), match(half_t{}), match(bfloat16_t{}), match(float8_e4m3_t{});
  return d;
}

// An (input, output) pair of storage types an emulator is compiled for.
template <typename In, typename Out>
struct Types {
  using TIn = In;
  using TOut = Out;
};

// The pairs an emulator is compiled for.
template <typename... Pairs>
struct TypeList {};

// Their dtype codes, (input, output) at codes[2 i], codes[2 i + 1] for the first `most`; how many.
template <typename... Pairs>
int codes_of(TypeList<Pairs...>, int* codes, int most) {
  int i = 0;
  const auto put = [&](auto pair) {
    using P = decltype(pair);
    if (i < most) codes[2 * i] = code_of<typename P::TIn>(), codes[2 * i + 1] = code_of<typename P::TOut>();
    ++i;
  };
  (put(Pairs{}), ...);
  return i;
}

// f(Types<TIn, TOut>{}, std::integral_constant<int, VEC>{}) for the pair among `Pairs` whose
// codes are (in, out), and vec: one of 1, 2, 4, 8, 16 whose accesses of either type take at most
// kMostBytes.  cudaErrorInvalidValue for a combination not compiled.
template <int kMostBytes, typename... Pairs, typename F>
cudaError_t with_types(TypeList<Pairs...>, int in, int out, int vec, F&& f) {
  cudaError_t err = cudaErrorInvalidValue;
  const auto try_pair = [&](auto pair) {
    using P = decltype(pair);
    if (in != code_of<typename P::TIn>() || out != code_of<typename P::TOut>()) return;
    const auto try_vec = [&](auto v) {
      constexpr int kVec = decltype(v)::value;
      if constexpr (kVec * sizeof(typename P::TIn) <= kMostBytes && kVec * sizeof(typename P::TOut) <= kMostBytes)
        if (vec == kVec) err = f(pair, v);
    };
    try_vec(std::integral_constant<int, 1>{});
    try_vec(std::integral_constant<int, 2>{});
    try_vec(std::integral_constant<int, 4>{});
    try_vec(std::integral_constant<int, 8>{});
    try_vec(std::integral_constant<int, 16>{});
  };
  (try_pair(Pairs{}), ...);
  return err;
}

// An O of logical shape [tokens, heads, head_size] and its LSE [tokens, heads] (null: absent);
// s: strides in elements, in the logical axis order of each array.
inline attnmerge::StateView state(const void* o, const int64_t* os, const float* l, const int64_t* ls) {
  return attnmerge::StateView{o, o ? os[0] : 0, o ? os[1] : 0, l, l ? ls[0] : 0, l ? ls[1] : 0};
}

}  // namespace emu

// Each emulator's library carries these (the header is included by one source file each).
extern "C" {

// The order of a block's threads between waits in the launches that follow (emulated::Order:
// 0 first to last, 1 last to first, 2 shuffled from `seed`); the record of launches is cleared.
void emulate_order(int order, uint32_t seed) {
  emulated::state().order = static_cast<emulated::Order>(order);
  emulated::state().seed = seed;
  emulated::state().launches.clear();
}

// Why the last launch that failed failed.
const char* emulate_error() { return emulated::error().c_str(); }

// The launches since emulate_order: how many, and for launch i < most, its grid and block
// dimensions, dynamic shared memory and PDL at dims[8 i .. 8 i + 7].
int emulate_launches(int64_t* dims, int most) {
  const auto& l = emulated::state().launches;
  for (int i = 0; i < most && i < static_cast<int>(l.size()); ++i) {
    int64_t* d = dims + 8 * i;
    d[0] = l[i].grid.x, d[1] = l[i].grid.y, d[2] = l[i].grid.z;
    d[3] = l[i].block.x, d[4] = l[i].block.y, d[5] = l[i].block.z;
    d[6] = static_cast<int64_t>(l[i].smem), d[7] = l[i].pdl;
  }
  return static_cast<int>(l.size());
}

}  // extern "C"
