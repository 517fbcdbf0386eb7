// The element steps every path shares: a pack of N elements moved as one vector access, its
// loads and stores (evict-first where the launch chose so) and the weighted accumulation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "attnmerge/numeric.h"

namespace attnmerge {

// N elements of T, moved as one access of N * sizeof(T) bytes (or, past 16, as 16-byte accesses
// side by side) and held as 32-bit words (a pack narrower than a word sits in the low bits of w[0]).
template <typename T, int N>
struct Pack {
  static constexpr int kBytes = N * static_cast<int>(sizeof(T));
  static constexpr int kWords = kBytes >= 4 ? kBytes / 4 : 1;
  uint32_t w[kWords];

  ATTNMERGE_HD float get(int i) const { return Word<T>::get(w[i / Word<T>::kCount], i % Word<T>::kCount); }
};

// The kernels' accesses are vector loads and stores of the pack's width, spelled with CUDA's
// vector types (the compiler would otherwise split a 16-byte store into 4-byte pieces);
// `evict_first` marks them evict-first where the launch chose so (MergeShape::evict_first).
#if defined(__CUDA_ARCH__) && !defined(__NVCC__)
// clang's CUDA headers have no __ldcs / __stcs (the CUDA 12 build is compiled by clang): the same
// evict-first accesses, in PTX, as CUDA's headers spell them for nvcc.  volatile keeps a streaming
// load before a later store to the same address (the in-place merge); the stores clobber memory.
__device__ __forceinline__ uint4 load_evict_first(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ uint2 load_evict_first(const uint2* p) {
  uint2 v;
  asm volatile("ld.global.cs.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned int load_evict_first(const unsigned int* p) {
  unsigned int v;
  asm volatile("ld.global.cs.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned short load_evict_first(const unsigned short* p) {
  unsigned short v;
  asm volatile("ld.global.cs.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ unsigned char load_evict_first(const unsigned char* p) {
  unsigned short v;
  asm volatile("ld.global.cs.u8 %0, [%1];" : "=h"(v) : "l"(p));
  return static_cast<unsigned char>(v);
}
__device__ __forceinline__ void store_evict_first(uint4* p, uint4 v) {
  asm volatile("st.global.cs.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void store_evict_first(uint2* p, uint2 v) {
  asm volatile("st.global.cs.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
__device__ __forceinline__ void store_evict_first(unsigned int* p, unsigned int v) {
  asm volatile("st.global.cs.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void store_evict_first(unsigned short* p, unsigned short v) {
  asm volatile("st.global.cs.u16 [%0], %1;" ::"l"(p), "h"(v) : "memory");
}
__device__ __forceinline__ void store_evict_first(unsigned char* p, unsigned char v) {
  asm volatile("st.global.cs.u8 [%0], %1;" ::"l"(p), "h"(static_cast<unsigned short>(v)) : "memory");
}
#elif defined(__CUDA_ARCH__)
template <typename V>
__device__ __forceinline__ V load_evict_first(const V* p) {
  return __ldcs(p);
}
template <typename V>
__device__ __forceinline__ void store_evict_first(V* p, V v) {
  __stcs(p, v);
}
#endif

#if defined(__CUDA_ARCH__)
// A plain store of a vector, in PTX: `*p = v` of a uint4 was compiled as four 4-byte stores where
// the compiler lost track of the pointer's alignment (the backward's), and CUDA's __stwb adds
// ordering (STG.STRONG) a plain store does not need.
__device__ __forceinline__ void store_cached(uint4* p, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}
__device__ __forceinline__ void store_cached(uint2* p, uint2 v) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(v.x), "r"(v.y) : "memory");
}
template <typename V>
__device__ __forceinline__ void store_cached(V* p, V v) {
  *p = v;  // one word or less: nothing to split
}
#endif

#if defined(__CUDA_ARCH__)
// A load or store of one vector, streaming (evict first) or cached as usual.
template <typename V>
__device__ __forceinline__ V load_bits(const V* p, bool evict_first) {
  return evict_first ? load_evict_first(p) : *p;
}
template <typename V>
__device__ __forceinline__ void store_bits(V* p, V v, bool evict_first) {
  if (evict_first) {
    store_evict_first(p, v);
  } else {
    store_cached(p, v);
  }
}
#endif

#if defined(__CUDA_ARCH__)
// A 16-byte load where `take`; elsewhere nothing is read (p need not be readable) and the bits
// are unspecified: only a part of weight 0 may take them, whose words accumulate clears.  One
// predicated instruction, no branch, so that a chunk's loads go out back to back whatever the
// row's count: a branch around each load had the compiler compute each address inside it.
__device__ __forceinline__ uint4 load_bits_if(const uint4* p, bool take, bool evict_first) {
  uint4 v;
  if (evict_first) {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t@q ld.global.cs.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(static_cast<int>(take)));
  } else {
    asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %5, 0;\n\t@q ld.global.v4.u32 {%0, %1, %2, %3}, [%4];\n\t}"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p), "r"(static_cast<int>(take)));
  }
  return v;
}
#endif

// Asks L2 for the line holding `p`, neither waiting nor taking a register: a later load of it
// then meets L2 rather than HBM.  Kernels that keep few bytes in flight (few threads per SM, or a
// chunk at a time) issue their next chunk's so, before using the current one.
ATTNMERGE_HD void prefetch_l2(const void* p) {
#if defined(__CUDA_ARCH__)
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
#else
  (void)p;
#endif
}

template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_pack(const T* src, bool evict_first) {
  Pack<T, N> p;
  constexpr int kBytes = Pack<T, N>::kBytes;
#if defined(__CUDA_ARCH__)
  if constexpr (kBytes >= 16) {
    static_assert(kBytes % 16 == 0, "packs past 16 bytes are whole 16-byte accesses");
    ATTNMERGE_UNROLL
    for (int a = 0; a < kBytes / 16; ++a) {
      const uint4 v = load_bits(reinterpret_cast<const uint4*>(src) + a, evict_first);
      p.w[4 * a] = v.x, p.w[4 * a + 1] = v.y, p.w[4 * a + 2] = v.z, p.w[4 * a + 3] = v.w;
    }
  } else if constexpr (kBytes == 8) {
    const uint2 v = load_bits(reinterpret_cast<const uint2*>(src), evict_first);
    p.w[0] = v.x, p.w[1] = v.y;
  } else if constexpr (kBytes == 4) {
    p.w[0] = load_bits(reinterpret_cast<const unsigned int*>(src), evict_first);
  } else if constexpr (kBytes == 2) {
    p.w[0] = load_bits(reinterpret_cast<const unsigned short*>(src), evict_first);
  } else {
    p.w[0] = load_bits(reinterpret_cast<const unsigned char*>(src), evict_first);
  }
#else
  (void)evict_first;
  p.w[0] = 0;
  std::memcpy(p.w, src, kBytes);
#endif
  return p;
}

// load_pack where `take`; elsewhere src is never read and the pack's bits are unspecified (for
// a part of weight 0 only: accumulate clears its words).  Predicated where the pack is whole
// 16-byte accesses (load_bits_if), a branch otherwise.
template <typename T, int N>
ATTNMERGE_HD Pack<T, N> load_pack_if(const T* src, bool take, bool evict_first) {
#if defined(__CUDA_ARCH__)
  constexpr int kBytes = Pack<T, N>::kBytes;
  if constexpr (kBytes % 16 == 0) {
    Pack<T, N> p;
    ATTNMERGE_UNROLL
    for (int a = 0; a < kBytes / 16; ++a) {
      const uint4 v = load_bits_if(reinterpret_cast<const uint4*>(src) + a, take, evict_first);
      p.w[4 * a] = v.x, p.w[4 * a + 1] = v.y, p.w[4 * a + 2] = v.z, p.w[4 * a + 3] = v.w;
    }
    return p;
  }
#endif
  Pack<T, N> p{};
#if !defined(__CUDA_ARCH__)
  // On the host (the kernels emulated on the CPU, tests/native) the bits of a pack not taken are
  // all ones, NaN in every storage type: a kernel that used them would show it.
  for (uint32_t& w : p.w) w = ~0u;
#endif
  if (take) p = load_pack<T, N>(src, evict_first);
  return p;
}

// A float where `take`, else `otherwise` and nothing read: one predicated load on the GPU.
ATTNMERGE_HD float load_float_if(const float* p, bool take, float otherwise) {
#if defined(__CUDA_ARCH__)
  float v = otherwise;
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %2, 0;\n\t@q ld.global.f32 %0, [%1];\n\t}"
               : "+f"(v)
               : "l"(p), "r"(static_cast<int>(take)));
  return v;
#else
  return take ? *p : otherwise;
#endif
}

// A prefetch of the line of `p` into L1 where `take` (nothing on the host): no register held.
ATTNMERGE_HD void prefetch_if(const void* p, bool take) {
#if defined(__CUDA_ARCH__)
  asm volatile("{\n\t.reg .pred q;\n\tsetp.ne.b32 q, %1, 0;\n\t@q prefetch.global.L1 [%0];\n\t}" ::"l"(p),
               "r"(static_cast<int>(take)));
#else
  (void)p, (void)take;
#endif
}


// An LSE where `take`, else -inf and nothing read.
ATTNMERGE_HD float load_lse_if(const float* p, bool take) { return load_float_if(p, take, -INFINITY); }

// Whether an integer of `bytes` bytes (1, 4 or 8) is not 0, read where `take`, else true and
// nothing read: on the GPU one address and one predicated load whatever the width (an 8-byte
// entry's words ORed), no branch, so that a chunk's loads go out together.
ATTNMERGE_HD bool load_nonzero_if(const void* p, int bytes, bool take) {
#if defined(__CUDA_ARCH__)
  uint32_t v = 1, hi = 0;
  asm volatile(
      "{\n\t.reg .pred q, q1, q4, q8;\n\tsetp.ne.b32 q, %4, 0;\n\tsetp.eq.and.s32 q1, %3, 1, q;\n\t"
      "setp.eq.and.s32 q4, %3, 4, q;\n\tsetp.eq.and.s32 q8, %3, 8, q;\n\t@q1 ld.global.u8 %0, [%2];\n\t"
      "@q4 ld.global.u32 %0, [%2];\n\t@q8 ld.global.v2.u32 {%0, %1}, [%2];\n\t}"
      : "+r"(v), "+r"(hi)
      : "l"(p), "r"(bytes), "r"(static_cast<int>(take)));
  return (v | hi) != 0;
#else
  if (!take) return true;
  return bytes == 1 ? *static_cast<const uint8_t*>(p) != 0
         : bytes == 4 ? *static_cast<const int32_t*>(p) != 0
                      : *static_cast<const int64_t*>(p) != 0;
#endif
}

// acc += scale * p, where a part of zero `weight` adds zeros: its words are cleared first, so NaN
// or garbage in it cannot reach the result even when it was fetched.  A select per word rather
// than a branch, and on the weight, known before the scale: at decode sizes the instructions after
// the loads are the merge's latency.
template <typename T, int N>
ATTNMERGE_HD void accumulate(float (&acc)[N], Pack<T, N> p, float scale, float weight) {
  const uint32_t keep = weight != 0.0f ? ~0u : 0u;
  ATTNMERGE_UNROLL
  for (int j = 0; j < Pack<T, N>::kWords; ++j) p.w[j] &= keep;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) acc[i] += scale * p.get(i);
}

// dst[0:N] = acc, each rounded once to T.
template <typename T, int N>
ATTNMERGE_HD void store_pack(T* dst, const float (&acc)[N], bool evict_first) {
  using P = Pack<T, N>;
  constexpr int kPer = Word<T>::kCount;
  uint32_t w[P::kWords];
  if constexpr (N >= kPer) {
    ATTNMERGE_UNROLL
    for (int j = 0; j < P::kWords; ++j) w[j] = Word<T>::put(acc + j * kPer);
  } else {
    float x[kPer] = {};
    for (int i = 0; i < N; ++i) x[i] = acc[i];
    w[0] = Word<T>::put(x);
  }
#if defined(__CUDA_ARCH__)
  if constexpr (P::kBytes >= 16) {
    static_assert(P::kBytes % 16 == 0, "packs past 16 bytes are whole 16-byte accesses");
    ATTNMERGE_UNROLL
    for (int a = 0; a < P::kBytes / 16; ++a)
      store_bits(reinterpret_cast<uint4*>(dst) + a, make_uint4(w[4 * a], w[4 * a + 1], w[4 * a + 2], w[4 * a + 3]),
                 evict_first);
  } else if constexpr (P::kBytes == 8) {
    store_bits(reinterpret_cast<uint2*>(dst), make_uint2(w[0], w[1]), evict_first);
  } else if constexpr (P::kBytes == 4) {
    store_bits(reinterpret_cast<unsigned int*>(dst), w[0], evict_first);
  } else if constexpr (P::kBytes == 2) {
    store_bits(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(w[0]), evict_first);
  } else {
    store_bits(reinterpret_cast<unsigned char*>(dst), static_cast<unsigned char>(w[0]), evict_first);
  }
#else
  (void)evict_first;
  std::memcpy(dst, w, P::kBytes);
#endif
}

// N values, each multiplied by `multiplier`, as E2M1 codes (NVFP4, e2m1_code): two per byte, the
// even element in the low nibble, stored as one access of N / 2 bytes.
template <int N>
ATTNMERGE_HD void store_e2m1(uint8_t* dst, const float* x, float multiplier, bool evict_first) {
  static_assert(N % 2 == 0 && N <= 8, "whole bytes, at most a word");
  uint32_t w = 0;
  ATTNMERGE_UNROLL
  for (int i = 0; i < N; ++i) w |= e2m1_code(x[i] * multiplier) << (4 * i);
#if defined(__CUDA_ARCH__)
  if constexpr (N == 8) {
    store_bits(reinterpret_cast<unsigned int*>(dst), w, evict_first);
  } else if constexpr (N == 4) {
    store_bits(reinterpret_cast<unsigned short*>(dst), static_cast<unsigned short>(w), evict_first);
  } else {
    store_bits(reinterpret_cast<unsigned char*>(dst), static_cast<unsigned char>(w), evict_first);
  }
#else
  (void)evict_first;
  for (int b = 0; b < N / 2; ++b) dst[b] = static_cast<uint8_t>(w >> (8 * b));
#endif
}

}  // namespace attnmerge
