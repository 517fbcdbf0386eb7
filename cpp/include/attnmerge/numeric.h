// Storage types and their conversions to the type a merge computes in (float32; float64 for
// float64 storage, which the CPU path alone takes), usable from host C++ and CUDA device code
// alike, so the CPU path and the kernels share one definition of every dtype.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define ATTNMERGE_HD __host__ __device__ __forceinline__
#define ATTNMERGE_UNROLL _Pragma("unroll")
#else
#define ATTNMERGE_HD inline
#define ATTNMERGE_UNROLL _Pragma("GCC unroll 8")
#endif

namespace attnmerge {

// 16-bit storage types are plain bit containers: host code needs no CUDA headers, and device
// code converts through the hardware instructions.
struct half_t { uint16_t bits; };
struct bfloat16_t { uint16_t bits; };
struct float8_e4m3_t { uint8_t bits; };  // OCP E4M3 ("e4m3fn"): max 448, no infinities

namespace detail {

ATTNMERGE_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

ATTNMERGE_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// round(x) to nearest, ties to even, for 0 <= x < 2^23 (the float adder's own rounding mode).
inline uint32_t round_half_even(float x) {
  const uint32_t r = static_cast<uint32_t>(x);
  const float rem = x - static_cast<float>(r);
  return r + ((rem > 0.5f || (rem == 0.5f && (r & 1u))) ? 1u : 0u);
}

// c ? a : b as bit operations: a select the compiler keeps as one (a ?: between values computed
// with float arithmetic becomes a branch, as the float operation may not be speculated).
inline uint32_t select_bits(bool c, uint32_t a, uint32_t b) {
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return (a & m) | (b & ~m);
}

// IEEE binary16 from float32, round to nearest even, overflow to inf, NaN kept quiet.  Branch-free
// (every case computed, one selected), so that the CPU path's loops over it vectorize.
inline uint16_t host_float_to_half(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7fffffffu;
  // |f| < 2^-14, a subnormal or zero half: adding 0.5 puts its 10 bits at the bottom of the
  // mantissa, rounded to nearest even by the float adder itself.
  const uint32_t subnormal = float_to_bits(bits_to_float(ax) + 0.5f) - 0x3f000000u;
  // Normal: rebias the exponent, round the 13 dropped bits to nearest even (a carry past 65504
  // gives the inf pattern).
  const uint32_t normal = (ax - 0x38000000u + 0xfffu + ((ax >> 13) & 1u)) >> 13;
  const uint32_t special = ax > 0x7f800000u ? 0x7e00u : 0x7c00u;  // NaN (quiet) or inf
  const uint32_t magnitude = select_bits(ax >= 0x47800000u, special, select_bits(ax < 0x38800000u, subnormal, normal));
  return static_cast<uint16_t>(sign | magnitude);
}

// float32 from IEEE binary16, exactly; branch-free like the above.
inline float host_half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  const float subnormal = static_cast<float>(static_cast<int32_t>(em)) * 5.9604644775390625e-08f;  // em * 2^-24
  // Rebias the exponent by 112, and inf / NaN (exponent 31) by 112 more to reach 255.
  const uint32_t normal = (em << 13) + 0x38000000u + (em >= 0x7c00u ? 0x38000000u : 0u);
  return bits_to_float(sign | select_bits(em < 0x400u, float_to_bits(subnormal), normal));
}

// Branch-free, so that the CPU path's loops over it vectorize.
inline uint16_t host_float_to_bfloat16(float f) {
  const uint32_t x = float_to_bits(f);
  const uint32_t rounded = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (x >> 16) | 0x40u;
  return static_cast<uint16_t>((x & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

// FP8 E4M3 from float32, round to nearest even, saturating to +-448; NaN stays NaN.
inline uint8_t host_float_to_e4m3(float f) {
  const uint32_t x = float_to_bits(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return sign | 0x7fu;
  if (ax >= 0x43e00000u) return sign | 0x7eu;  // |f| >= 448
  if (ax < 0x3c800000u)  // below 2^-6: in units of the smallest subnormal, 2^-9
    return static_cast<uint8_t>(sign | round_half_even(bits_to_float(ax) * 512.0f));
  const uint32_t rounded = ax + 0x7ffffu + ((ax >> 20) & 1u);
  const uint32_t q = (rounded >> 20) - (120u << 3);
  return static_cast<uint8_t>(sign | (q > 0x7eu ? 0x7eu : q));
}

inline float host_e4m3_to_float(uint8_t v) {
  const uint32_t sign = static_cast<uint32_t>(v & 0x80u) << 24;
  const uint32_t exp = (v >> 3) & 0xfu;
  const uint32_t mant = v & 0x7u;
  if (exp == 0xfu && mant == 0x7u) return bits_to_float(sign | 0x7fc00000u);
  if (exp == 0) {
    const float m = static_cast<float>(mant) * 0.001953125f;  // mant * 2^-9
    return sign ? -m : m;
  }
  return bits_to_float(sign | ((exp + 120u) << 23) | (mant << 20));
}

}  // namespace detail

// load<T>(p) -> float and store<T>(p, float), double for T = double: the only places a storage
// type is interpreted.
template <typename T> struct Convert;

template <> struct Convert<float> {
  static ATTNMERGE_HD float load(float v) { return v; }
  static ATTNMERGE_HD float store(float f) { return f; }
};

// float64 (the CPU path only): computed in float64, so never rounded to float32 on the way.
template <> struct Convert<double> {
  static ATTNMERGE_HD double load(double v) { return v; }
  static ATTNMERGE_HD double store(double f) { return f; }
};

template <> struct Convert<half_t> {
  static ATTNMERGE_HD float load(half_t v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(v.bits));
#else
    return detail::host_half_to_float(v.bits);
#endif
  }
  static ATTNMERGE_HD half_t store(float f) {
#if defined(__CUDA_ARCH__)
    return half_t{__half_as_ushort(__float2half_rn(f))};
#else
    return half_t{detail::host_float_to_half(f)};
#endif
  }
};

template <> struct Convert<bfloat16_t> {
  static ATTNMERGE_HD float load(bfloat16_t v) { return detail::bits_to_float(static_cast<uint32_t>(v.bits) << 16); }
  static ATTNMERGE_HD bfloat16_t store(float f) {
#if defined(__CUDA_ARCH__)
    return bfloat16_t{__bfloat16_as_ushort(__float2bfloat16_rn(f))};
#else
    return bfloat16_t{detail::host_float_to_bfloat16(f)};
#endif
  }
};

template <> struct Convert<float8_e4m3_t> {
  static ATTNMERGE_HD float load(float8_e4m3_t v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__half(__nv_cvt_fp8_to_halfraw(v.bits, __NV_E4M3)));
#else
    return detail::host_e4m3_to_float(v.bits);
#endif
  }
  static ATTNMERGE_HD float8_e4m3_t store(float f) {
#if defined(__CUDA_ARCH__)
    return float8_e4m3_t{static_cast<uint8_t>(__nv_cvt_float_to_fp8(f, __NV_SATFINITE, __NV_E4M3))};
#else
    return float8_e4m3_t{detail::host_float_to_e4m3(f)};
#endif
  }
};

// The bits of a storage value and back (the low sizeof(T) bytes of a word).
template <typename T>
ATTNMERGE_HD uint32_t to_bits(T v) {
  if constexpr (sizeof(T) == 4) {
    return detail::float_to_bits(v);
  } else {
    return v.bits;
  }
}

template <typename T>
ATTNMERGE_HD T from_bits(uint32_t u) {
  if constexpr (sizeof(T) == 4) {
    return detail::bits_to_float(u);
  } else {
    return T{static_cast<decltype(T::bits)>(u)};
  }
}

// The 4 / sizeof(T) elements of T packed in one 32-bit word, element 0 in the low bits, as
// floats and back: the kernels move O as words, and convert pairs where the hardware does
// (one instruction rounds two floats to two bfloat16, float16 or FP8 values).
template <typename T>
struct Word {
  static constexpr int kCount = 4 / static_cast<int>(sizeof(T));
  static constexpr int kBits = 8 * static_cast<int>(sizeof(T));

  static ATTNMERGE_HD float get(uint32_t w, int i) {
    if constexpr (kCount == 1) {
      return Convert<T>::load(from_bits<T>(w));
    } else if constexpr (std::is_same<T, bfloat16_t>::value) {
      return detail::bits_to_float(i == 1 ? w & 0xffff0000u : w << 16);  // no shift down and up
    } else {
      return Convert<T>::load(from_bits<T>((w >> (kBits * i)) & ((1u << kBits) - 1u)));
    }
  }

  static ATTNMERGE_HD uint32_t put(const float* x) {
#if defined(__CUDA_ARCH__)
    if constexpr (std::is_same<T, bfloat16_t>::value) {
      const __nv_bfloat162 v = __floats2bfloat162_rn(x[0], x[1]);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else if constexpr (std::is_same<T, half_t>::value) {
      const __half2 v = __floats2half2_rn(x[0], x[1]);
      return *reinterpret_cast<const uint32_t*>(&v);
    } else if constexpr (std::is_same<T, float8_e4m3_t>::value) {
      const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(x[0], x[1]), __NV_SATFINITE, __NV_E4M3);
      const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(x[2], x[3]), __NV_SATFINITE, __NV_E4M3);
      return lo | (hi << 16);
    }
#endif
    uint32_t w = 0;
    for (int i = 0; i < kCount; ++i) w |= to_bits(Convert<T>::store(x[i])) << (kBits * i);
    return w;
  }
};

// Per-group FP8 (attnmerge.h's group_scales): the scale of a group whose largest magnitude is
// `amax` (NaN elements left out by the caller's fmaxf), max(amax, 1e-10) / 448, or that rounded
// up to a power of two (UE8M0).  The floor keeps an all-zero group's scale finite and nonzero, as
// vLLM's per_token_group_quant_fp8 does; the one owner of the formula, for the kernels and the
// CPU path.
constexpr float kFp8Max = 448.0f;
constexpr float kGroupAmaxFloor = 1e-10f;
ATTNMERGE_HD float group_scale(float amax, bool ue8m0) {
  const float scale = (amax > kGroupAmaxFloor ? amax : kGroupAmaxFloor) / kFp8Max;  // amax >= +0, or +inf
  if (!ue8m0) return scale;
  // A positive normal float (or +inf) up to the next power of two: a carry out of the mantissa.
  return detail::bits_to_float((detail::float_to_bits(scale) + 0x7fffffu) & 0xff800000u);
}

// ---- block-scaled formats (attnmerge.h's ATTNMERGE_BLOCK_MXFP8, ATTNMERGE_BLOCK_NVFP4) --------
// The rules of the OCP MX and NVIDIA formats as their reference quantizers define them (torchao's
// to_mx and nvfp4_quantize, TransformerEngine's cast), each value computed in float32 with one
// rounding per step, so that the kernels and the CPU path give the references' bits.

// How a quantized output's blocks are scaled (OutView::block): per-group FP8's float32 scales, or
// a block-scaled format's byte scales.
enum class BlockScales : uint8_t {
  kFloat,    // per-group FP8: group_scale
  kMxFloor,  // MXFP8, the OCP MX rule: 2^(floor(log2 amax) - 8)
  kMxRceil,  // MXFP8, amax / 448 rounded up to a power of two (cuBLAS's, TransformerEngine's)
  kNvfp4,    // NVFP4: an E4M3 scale per 16 values, E2M1 values
};

// A value's magnitude as bits, for a block's largest magnitude taken as the largest bits (a
// non-negative float orders as its bits): NaN, larger than +inf, wins where `keep_nan` (the block
// formats, whose references' amax is NaN then), and is left out otherwise (per-group FP8, whose
// amax skips NaN elements).
ATTNMERGE_HD uint32_t magnitude_bits(float x, bool keep_nan) {
  const uint32_t b = detail::float_to_bits(x) & 0x7fffffffu;
  return keep_nan || b <= 0x7f800000u ? b : 0u;
}

// The larger of two magnitudes' bits (one integer max on the GPU, as on the host).
ATTNMERGE_HD uint32_t max_bits(uint32_t a, uint32_t b) { return a > b ? a : b; }

// MXFP8's UE8M0 scale byte of a block whose largest magnitude has the bits `amax` (a power of two
// 2^(byte - 127); 255: NaN, the scale of a block holding a NaN or an infinity).
ATTNMERGE_HD uint32_t mx_scale_byte(uint32_t amax, bool rceil) {
  if (!rceil) {  // floor(log2 amax) - 8 (E4M3's largest power of two, 2^8), from 2^-127 up
    if (amax >= 0x7f800000u) return 255u;
    const uint32_t e = amax >> 23;
    return e < 8u ? 0u : e - 8u;
  }
  // amax * (1 / 448) rounded up to a power of two: a carry out of the mantissa; a float32
  // subnormal is above 2^-127 (byte 0) only past half of it.
  const uint32_t d = detail::float_to_bits(detail::bits_to_float(amax) * (1.0f / kFp8Max));
  if (d >= 0x7f800000u) return 255u;
  const uint32_t e = d >> 23, m = d & 0x7fffffu;
  return e + ((e == 0u ? m > 0x400000u : m != 0u) ? 1u : 0u);
}

// 1 / 2^(byte - 127), exactly (2^-127 a float32 subnormal), NaN for 255: what MXFP8's values are
// multiplied by.
ATTNMERGE_HD float mx_reciprocal(uint32_t byte) {
  if (byte == 255u) return detail::bits_to_float(0x7fc00000u);
  const uint32_t e = 254u - byte;
  return detail::bits_to_float(e == 0u ? 0x00400000u : e << 23);
}

// NVFP4: the largest E2M1 value, and the smallest normal E4M3 value, the least a block scale is
// (the reference's floor: a block of zeros gets 2^-6).
constexpr float kFp4Max = 6.0f;
constexpr float kNvfp4ScaleFloor = 0.015625f;

// A block's E4M3 scale (`bits`) and what its values are multiplied by, for a block whose largest
// magnitude is `amax` and the global scale g (`inv_g` = 1 / g, rounded): the scale amax / 6 / g
// (two roundings), clamped to [2^-6, 448] (NaN kept) and rounded to E4M3; the multiplier
// (1 / g) / that scale.  Dequantized, value ~ e2m1 * scale * g.
struct Nvfp4Scale {
  uint32_t bits;
  float multiplier;
};
ATTNMERGE_HD Nvfp4Scale nvfp4_scale(float amax, float g, float inv_g) {
  const float s = amax / kFp4Max / g;
  const float clamped = s != s ? s : s < kNvfp4ScaleFloor ? kNvfp4ScaleFloor : s > kFp8Max ? kFp8Max : s;
  const float8_e4m3_t e = Convert<float8_e4m3_t>::store(clamped);
  return Nvfp4Scale{e.bits, inv_g / Convert<float8_e4m3_t>::load(e)};
}

// The E2M1 code (4 bits: sign, 2 of exponent, 1 of mantissa) of a scaled value q: |q| clamped to
// 6 and rounded to nearest even (0, 0.5, 1, 1.5, 2, 3, 4, 6), the sign kept (-0 too).  E2M1 has
// no NaN: a NaN is 0x3 (+1.5, what the reference gives a quiet NaN), in a block whose NaN scale
// says so.
ATTNMERGE_HD uint32_t e2m1_code(float q) {
  const uint32_t bits = detail::float_to_bits(q);
  const float a = fminf(fabsf(q), kFp4Max);
  const uint32_t ab = detail::float_to_bits(a);
  // Below 1: the float adder rounds a to halves at 2^22 (0, 1 or 2: 1.0's code).  From 1 on: the
  // exponent rebased and one mantissa bit kept, rounded to nearest even.
  const uint32_t sub = detail::float_to_bits(a + 4194304.0f) - 0x4a800000u;
  const uint32_t normal = (ab - 0x3f000000u + 0x1fffffu + ((ab >> 22) & 1u)) >> 22;
  const uint32_t code = a < 1.0f ? sub : normal;
  return q != q ? 0x3u : code | ((bits >> 28) & 0x8u);
}

}  // namespace attnmerge
