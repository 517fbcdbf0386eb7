// The launch-level description of a merge: its shape (MergeShape), where results go (OutView) and
// one state's layout (StateView).  Plain data, 64-bit sizes and strides (counting elements).
// Offsets are computed in the index type I of the launch: int32_t when every offset of every array
// of the call fits in 31 bits (the common case, and half the address arithmetic), int64_t
// otherwise.  Which index type, source and kernel a GPU call gets is the launch plan's decision
// (plan.h).
#pragma once

#include <cstdint>

#include "attnmerge/numeric.h"

namespace attnmerge {

// The high 32 bits of a * b.
ATTNMERGE_HD uint32_t mul_hi(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((uint64_t{a} * b) >> 32);
#endif
}

// A count read by the kernels from the call's memory (num_tokens, a device a_tokens): one int32,
// or int64 where `wide`, at `at`, clamped to [0, most].
ATTNMERGE_HD int64_t read_count(const void* at, bool wide, int64_t most) {
  const int64_t n = wide ? *static_cast<const int64_t*>(at) : *static_cast<const int32_t*>(at);
  return n < 0 ? 0 : n > most ? most : n;
}

// Whether a launch's rows may be in tiles (MergeShape::tile), or are known to be untiled.
enum class Tiles : int8_t { kMaybe, kNone };

struct MergeShape {
  int64_t tokens, heads, head_size;
  int64_t rows;  // rows the launch covers: tokens * heads, rounded up to whole tiles when tiled
  int64_t packs;  // vector accesses per row (head_size / the launch's vector width): the plan's
  bool evict_first;  // evict-first O loads and stores: the plan's
  bool base2;
  // Row order.  Untiled (tile_shift < 0): row = token * heads + head.  Tiled: tokens taken
  // 2^tile_shift at a time, and a tile's rows head-major (row = (tile * heads + head) * 2^tile_shift
  // + token in the tile), so that a warp's rows are consecutive tokens of one head: with LSEs laid
  // out [heads, tokens] they share one 32-byte sector instead of one each, while a block's O stays
  // in runs of whole rows.  Rows past the last token of the last tile do nothing.
  int tile_shift;
  // row / group (group: heads, or heads << tile_shift) as (umulhi(row, magic) + row) >> shift for
  // rows below 2^31: a division takes some twenty instructions, as many as the rest of a row's
  // index math.
  uint32_t magic;
  int shift;
  // The live tokens (num_tokens): null, every token; else one int32 (int64 where live_wide) in the
  // call's memory, read by the kernels themselves, so that a launch sized for `tokens` (a captured
  // graph's capacity) serves any count without a host round trip.  A row of a token at or past
  // the count reads nothing and writes nothing.
  const void* live_tokens = nullptr;
  bool live_wide = false;

  ATTNMERGE_HD MergeShape(int64_t tokens_, int64_t heads_, int64_t head_size_, bool base2_)
      : tokens(tokens_), heads(heads_), head_size(head_size_), rows(tokens_ * heads_), packs(head_size_), evict_first(false), base2(base2_),
        tile_shift(-1), magic(0), shift(0) {
    set_divisor(heads);
  }

  // The tokens whose rows run: the count live_tokens holds, clamped to [0, tokens] (tokens without one).
  ATTNMERGE_HD int64_t live() const {
    return live_tokens == nullptr ? tokens : read_count(live_tokens, live_wide, tokens);
  }
  // Whether the row of `token` (< tokens) lies at or past the live count: it exits unread.
  template <typename I>
  ATTNMERGE_HD bool past_live(I token) const {
    return live_tokens != nullptr && static_cast<int64_t>(token) >= live();
  }

  // Tiles of 2^tile_shift_ tokens (see tile_shift); rows rounded up to whole tiles.
  ATTNMERGE_HD void tile(int tile_shift_) {
    tile_shift = tile_shift_;
    const int64_t per_tile = int64_t{1} << tile_shift;
    rows = (tokens + per_tile - 1) / per_tile * per_tile * heads;
    set_divisor(heads << tile_shift);
  }

  ATTNMERGE_HD int64_t group() const { return tile_shift < 0 ? heads : heads << tile_shift; }

  // (token, head) of a row; token may be >= tokens in the last tile (a row to skip).  With
  // I = int32_t the caller guarantees rows < 2^31.
  // Tiles::kNone: the caller knows the launch is untiled (no tile step compiled in).
  // The same arithmetic on the host (the CPU path, the tests' emulated kernels) as on the device.
  template <Tiles kTiles = Tiles::kMaybe, typename I>
  ATTNMERGE_HD void split_row(I row, I& token, I& head) const {
    constexpr bool kMayTile = kTiles == Tiles::kMaybe;
    const I g = static_cast<I>(kMayTile ? group() : heads);
    I q;
    if (sizeof(I) == 4 || (rows >> 31) == 0) {
      const uint32_t r = static_cast<uint32_t>(row);
      q = static_cast<I>((mul_hi(r, magic) + r) >> shift);
    } else {
      q = row / g;
    }
    const I rem = row - q * g;
    if (!kMayTile || tile_shift < 0) {
      token = q;
      head = rem;
    } else {
      head = rem >> tile_shift;
      token = (q << tile_shift) + (rem & ((I{1} << tile_shift) - 1));
    }
  }

 private:
  ATTNMERGE_HD void set_divisor(int64_t d) {
    magic = 0;
    shift = 0;
    if (d > 0 && d < (int64_t{1} << 31)) {
      while ((int64_t{1} << shift) < d) ++shift;
      magic = static_cast<uint32_t>(((uint64_t{1} << 32) * ((uint64_t{1} << shift) - static_cast<uint64_t>(d))) /
                                        static_cast<uint64_t>(d) + 1);
    }
  }
};

// Where results go: O at o + token * o_st + head * o_sh, and the merged LSE unless lse is null.
// O is scaled by 1 / the output scale before its one rounding (FP8 outputs).  Real: the LSE's type
// and the one the merge computes in, float (OutView) or, for float64 calls on the CPU path, double.
template <typename Real>
struct BasicOutView {
  void* o;
  int64_t o_st, o_sh;
  Real* lse;
  int64_t lse_st, lse_sh;
  float inv_scale;
  const float* scale;  // when set, the scale is read from memory instead (no host round trip)
  // lse is also an input's LSE (an in-place merge).  Every thread of a row reads the row's LSEs
  // and one writes the merged LSE: on the GPU after a block barrier, or in a second launch where a
  // row spans blocks (the launch plan's choice, plan.h).
  bool lse_in_place;
  // The merged LSE's base from the inputs' (base_change): 1 but for ATTNMERGE_OUT_LSE_*, which the
  // in-place merge does not take (its LSE stays lse's), nor do the plain kernels (the plan's).
  Real lse_scale = 1;
  // Per-group FP8 (group > 0: elements per group, a power of two dividing head_size): the scale of
  // group j of row (token, head) at group_scales + token * gs_st + head * gs_sh + j * gs_sg
  // (group_scale, numeric.h), and the row's O multiplied by its inverse.  Only the general kRows
  // kernels, kStates and the share's take it (the plan's condition), each group in one warp's lanes.
  // The block-scaled formats (`block`, numeric.h) are run-time modes of the same kernels, which
  // are compiled for FP8 outputs: MXFP8 writes FP8 and a scale byte per block, NVFP4 a byte per
  // two values (o then holds bytes, o_st and o_sh counting them) and an E4M3 scale byte per block,
  // g = *global_ptr or global its global scale.  Byte scales lie at the same strides, or
  // (swizzled) in the 128 x 4 tiles the block-scaled GEMMs read (swizzled_at).
  void* group_scales = nullptr;
  int64_t gs_st = 0, gs_sh = 0, gs_sg = 0;
  int32_t group = 0;
  bool ue8m0 = false;
  BlockScales block = BlockScales::kFloat;
  bool swizzled = false;
  int32_t head_groups = 0;  // swizzled: a row's scales per head (head_size / group)
  float global = 1.0f;
  const float* global_ptr = nullptr;

  ATTNMERGE_HD float inverse_scale() const { return scale != nullptr ? 1.0f / *scale : inv_scale; }

  // `at`: an element offset within the row, added in I with the rest (one address computation).
  template <typename T, typename I>
  ATTNMERGE_HD T* o_at(I token, I head, I at = I{0}) const {
    return static_cast<T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh) + at);
  }
  // Where the row's merged LSE goes: null when none is written (lse_at), or, for an output known
  // to have one (lse set), without the check (lse_row).
  template <typename I>
  ATTNMERGE_HD float* group_scale_at(I token, I head, I j) const {
    return static_cast<float*>(group_scales) +
           (token * static_cast<I>(gs_st) + head * static_cast<I>(gs_sh) + j * static_cast<I>(gs_sg));
  }
  // A block format's scale byte of block j of row (token, head): at the strides, or swizzled.
  template <typename I>
  ATTNMERGE_HD uint8_t* scale_byte_at(I token, I head, I j) const {
    if (swizzled) return swizzled_at(token, head * static_cast<I>(head_groups) + j);
    return static_cast<uint8_t*>(group_scales) +
           (token * static_cast<I>(gs_st) + head * static_cast<I>(gs_sh) + j * static_cast<I>(gs_sg));
  }
  // The 128 x 4 tiles (cuBLASLt's and CUTLASS's block-scaled layout) of a matrix of scales whose
  // row is a token (an output row) and whose column a block of it (head * head_groups + j): tile
  // (row / 128, col / 4) at gs_st * (row / 128) + gs_sh * (col / 4), 512 bytes, in which the
  // scale of (row, col) is byte (row % 32) * 16 + (row / 32 % 4) * 4 + col % 4.
  template <typename I>
  ATTNMERGE_HD uint8_t* swizzled_at(I row, I col) const {
    return static_cast<uint8_t*>(group_scales) + ((row >> 7) * static_cast<I>(gs_st) + (col >> 2) * static_cast<I>(gs_sh) +
                                                  ((row & 31) << 4) + (((row >> 5) & 3) << 2) + (col & 3));
  }
  // Zeroes the share `lane` of `lanes` that the scale of (row, col) owns of the swizzled tiles'
  // padding, for a matrix of `rows` x `cols` scales: the last column's scale the bytes past it in
  // its row, and the last row's scales their column (and the last one every column past the
  // matrix's) in each row past `rows` up to the last tile's end.  Every padding byte is so written
  // once, by the writers of the matrix's last row and column.
  template <typename I>
  ATTNMERGE_HD void zero_padding(I row, I col, I rows, I cols, I lane, I lanes) const {
    const I cols_end = (cols + 3) & ~I{3};
    const bool last_col = col == cols - 1;
    if (last_col && lane == 0)
      for (I c = cols; c < cols_end; ++c) *swizzled_at(row, c) = 0;
    if (row != rows - 1) return;
    for (I r = rows + lane; r < ((rows + 127) & ~I{127}); r += lanes) {
      *swizzled_at(r, col) = 0;
      if (last_col)
        for (I c = cols; c < cols_end; ++c) *swizzled_at(r, c) = 0;
    }
  }
  // NVFP4's global scale.
  ATTNMERGE_HD float global_scale() const { return global_ptr != nullptr ? *global_ptr : global; }

  // The scale of a block whose largest magnitude has the bits `amax` (magnitude_bits), as this
  // output stores it (a float32, or a byte), and what its values are multiplied by.
  struct Scale {
    float value;
    uint32_t byte;
    float multiplier;
  };
  ATTNMERGE_HD Scale block_scale(uint32_t amax) const {
    switch (block) {
      case BlockScales::kFloat: {
        const float scale = group_scale(detail::bits_to_float(amax), ue8m0);
        return Scale{scale, 0u, 1.0f / scale};
      }
      case BlockScales::kNvfp4: {
        const float g = global_scale();
        const Nvfp4Scale s = nvfp4_scale(detail::bits_to_float(amax), g, 1.0f / g);
        return Scale{0.0f, s.bits, s.multiplier};
      }
      default: {
        const uint32_t byte = mx_scale_byte(amax, block == BlockScales::kMxRceil);
        return Scale{0.0f, byte, mx_reciprocal(byte)};
      }
    }
  }
  // Stores the scale of block j of row (token, head).
  template <typename I>
  ATTNMERGE_HD void store_scale(I token, I head, I j, const Scale& s) const {
    if (block == BlockScales::kFloat) {
      *group_scale_at(token, head, j) = s.value;
    } else {
      *scale_byte_at(token, head, j) = static_cast<uint8_t>(s.byte);
    }
  }
  template <typename I>
  ATTNMERGE_HD Real* lse_row(I token, I head) const {
    return lse + (token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh));
  }
  template <typename I>
  ATTNMERGE_HD Real* lse_at(I token, I head) const {
    return lse != nullptr ? lse_row(token, head) : nullptr;
  }
  // The merged LSE `v`, in the inputs' base, as the output takes it.
  ATTNMERGE_HD Real lse_value(Real v) const { return v * lse_scale; }
  template <typename I>
  ATTNMERGE_HD void store_lse(I token, I head, Real v) const {
    if (Real* p = lse_at(token, head)) *p = lse_value(v);
  }
};
using OutView = BasicOutView<float>;

// One state laid out [tokens, heads, head_size]: O at o + token * o_st + head * o_sh, LSE likewise
// (Real as for BasicOutView).
template <typename Real>
struct BasicStateView {
  const void* o;
  int64_t o_st, o_sh;
  const Real* lse;
  int64_t lse_st, lse_sh;

  template <typename T, typename I>
  ATTNMERGE_HD const T* o_at(I token, I head, I at = I{0}) const {
    return static_cast<const T*>(o) + (token * static_cast<I>(o_st) + head * static_cast<I>(o_sh) + at);
  }
  template <typename I>
  ATTNMERGE_HD Real lse_at(I token, I head) const {
    return lse[token * static_cast<I>(lse_st) + head * static_cast<I>(lse_sh)];
  }
};
using StateView = BasicStateView<float>;

// A view whose heads lie dense within its tokens (token stride = heads x head stride, for O and
// LSE) as one of rows: row r = token * heads + head at r * the head stride.  `heads`: the call's.
inline bool flattens(const StateView& v, int64_t heads) {
  return v.o_st == heads * v.o_sh && v.lse_st == heads * v.lse_sh;
}
inline bool flattens(const OutView& v, int64_t heads) {
  return v.o_st == heads * v.o_sh && (v.lse == nullptr || v.lse_st == heads * v.lse_sh);
}
// Whether two views step alike from head to head (the row stride of a flattened view), O and LSE
// (an output without LSE: O only).
inline bool same_rows(const StateView& x, const StateView& y) { return x.o_sh == y.o_sh && x.lse_sh == y.lse_sh; }
inline bool same_rows(const StateView& x, const OutView& y) {
  return x.o_sh == y.o_sh && (y.lse == nullptr || x.lse_sh == y.lse_sh);
}
inline StateView flat_rows(StateView v) {
  v.o_st = v.o_sh, v.lse_st = v.lse_sh;
  return v;
}
inline OutView flat_rows(OutView v) {
  v.o_st = v.o_sh, v.lse_st = v.lse_sh;
  return v;
}

}  // namespace attnmerge
