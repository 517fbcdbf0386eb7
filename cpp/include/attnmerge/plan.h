// The launch plan: every decision of how a GPU merge (and its backward: plan_backward) runs,
// taken in one place from the call's sizes, the sources and the GPU: index width, row order
// (tiles), source kind, evict-first accesses, strategy, grid, block, shared memory, programmatic
// dependent launch and the number of launches.  Host code only, no CUDA: the C ABI, the header
// launchers (merge_kernels.cuh) and the native benchmarks all plan through plan_merge, so a
// header-only caller gets the library's kernel.
//
// Strategies:
//   kRows    one thread per pack of one row walks the row's states, a chunk of them in flight
//            (merge_kernel; a state's share: merge_share_kernel, one O load per thread): every
//            two-way merge and share, and N-way or variable-length merges with enough rows to fill
//            the GPU or few states per row;
//   kStates  a row's states shared by `groups` groups of threads, each taking its own states a
//            chunk of loads at a time, their partial (max, total) and accumulators combined
//            through shared memory (merge_states_kernel): split-KV decode, few rows and many
//            states, where kRows would leave most of the GPU idle (state_groups says when).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "attnmerge/sources.h"
#include "attnmerge/views.h"

namespace attnmerge {

#ifndef ATTNMERGE_BLOCK_THREADS
#define ATTNMERGE_BLOCK_THREADS 256
#endif
#ifndef ATTNMERGE_PAIR_BLOCK_THREADS
#define ATTNMERGE_PAIR_BLOCK_THREADS 256
#endif
#ifndef ATTNMERGE_STATE_CHUNK
#define ATTNMERGE_STATE_CHUNK 8
#endif
// kRows: the widest block of the N-way kernels (their register cap leaves room for 3 or 4 of them
// per SM) and of the two-state kernels under 32 MB and in place (wider blocks only measured faster
// for larger two-way merges: pair_block_threads, benchmarks/NOTES.md#pair-block-width).
constexpr int kBlockThreads = ATTNMERGE_BLOCK_THREADS;
constexpr int kPairBlockThreads = ATTNMERGE_PAIR_BLOCK_THREADS;
// The widest block a two-state kernel is compiled for (its launch bound; at 32 registers it
// costs them nothing): the plan's widths go up to it.
constexpr int kPairMaxBlockThreads = 1024;
// States of the N-way and variable-length merges whose LSE and O loads a thread keeps in flight:
// 8 moves a row of up to 8 states in one memory round trip; rows of at most kSmallChunk states per
// thread take a kernel that keeps 4 (fewer registers, more threads per SM;
// benchmarks/NOTES.md#nway-chunk).
constexpr int kStateChunk = ATTNMERGE_STATE_CHUNK;
constexpr int kSmallChunk = 4;
// A decode-sized merge spreads over more SMs with narrower blocks, down to this width
// (benchmarks/NOTES.md#min-block-width).
constexpr int kMinBlockThreads = 128;
// kStates: the widest block (whole rows, at most one row's packs x groups), the most groups a row
// has, and the threads an SM holds (the kernel's register cap: 4 blocks of 256).  A thread keeps
// kSmallChunk states in flight: fewer registers, so more threads and as many bytes in flight as
// any wider chunk, measured faster at every decode size (benchmarks/NOTES.md#kstates-chunk).
constexpr int kStateBlockThreads = 256;
constexpr int kMaxStateGroups = 16;
constexpr int kStateThreadsPerSM = 1024;
// CUDA's limit on a block's z extent (kStates' rows per block).
constexpr int64_t kMaxBlockZ = 64;

enum class Strategy : int32_t { kRows = 0, kStates = 1 };

// The storage type of an O, as the plan tells them apart (kUnknown: not told).
enum class Dtype : int8_t { kUnknown, kFloat32, kFloat16, kBFloat16, kFloat8E4M3 };

template <typename T>
constexpr Dtype dtype_of() {
  if constexpr (std::is_same<T, float>::value) return Dtype::kFloat32;
  if constexpr (std::is_same<T, half_t>::value) return Dtype::kFloat16;
  if constexpr (std::is_same<T, bfloat16_t>::value) return Dtype::kBFloat16;
  if constexpr (std::is_same<T, float8_e4m3_t>::value) return Dtype::kFloat8E4M3;
  return Dtype::kUnknown;
}

struct DtypePair {
  Dtype in, out;
};

// The (input, output) dtype pairs whose two-way merges take the plain kernels (PlainPairSource):
// every other pair takes the general one (PairSource).  Each pair here costs 32 kernels per
// architecture, under the budget tests/packaging/test_cuda_builds.py holds: the plain kernel pays at
// decode sizes for every pair, so the list keeps the pairs engines merge most, float32 partials
// into bfloat16 (FlashAttention-3's combine) among them (benchmarks/NOTES.md#plain-pair-kernel).
constexpr DtypePair kPlainPairs[] = {
    {Dtype::kFloat32, Dtype::kFloat32},     {Dtype::kFloat16, Dtype::kFloat16},
    {Dtype::kBFloat16, Dtype::kBFloat16},   {Dtype::kFloat16, Dtype::kFloat8E4M3},
    {Dtype::kBFloat16, Dtype::kFloat8E4M3}, {Dtype::kFloat32, Dtype::kBFloat16},
};

constexpr bool plain_pair(Dtype in, Dtype out) {
  for (const DtypePair& p : kPlainPairs)
    if (p.in == in && p.out == out) return true;
  return false;
}

// One known dtype in and out: the in-place merge's (its output is its input), the only calls
// whose merged LSE overwrites an input's in the merge's own launch.
constexpr bool one_dtype(Dtype in, Dtype out) { return in == out && in != Dtype::kUnknown; }

// The GPU a call runs on; 0: not known (blocks of kBlockThreads, no PDL).  major: the compute
// capability of the code the GPU runs (its own, or lower where the driver JIT-compiles older PTX):
// PDL only from 9, where the kernels wait for the kernel before them.
struct DeviceInfo {
  int sms = 0;
  int major = 0;
};

// What the caller knows of a call beyond its sources: the C ABI reads these off the validated
// tensors.
struct CallFacts {
  Dtype in = Dtype::kUnknown;     // the storage types of the inputs' O and the output's: the plain and
  Dtype out = Dtype::kUnknown;    // in-place kernels only for the pairs that have them (general otherwise)
  int vec = 1;                    // elements per vector access that every O pointer and stride allow
  int access_bytes = 0;           // bytes of that access for the widest O dtype (vec x its size); 0: not known
  int64_t max_offset = 0;         // the largest element offset into any array of the call
  int64_t bytes = 0;              // bytes the call moves, about
  bool lse_tokens_inner = false;  // an LSE has tokens as its faster axis (vLLM's [heads, tokens])
  bool pdl = false;               // the caller allows programmatic dependent launch
  bool batch_invariant = false;   // ATTNMERGE_BATCH_INVARIANT: one strategy and chunk, whatever the rows
  int groups = 0;                 // N-way and varlen: 0 the plan's strategy; 1 kRows; G > 1 kStates with G
                                  // groups (where 32-bit offsets allow it): for benchmarks that compare them
};

struct LaunchDims {
  uint32_t grid[3] = {0, 0, 0};
  uint32_t block[3] = {0, 0, 0};
  uint32_t smem = 0;  // dynamic shared memory, bytes
};

// The kernel a GPU call runs, with the choices of its source that are fixed when it is compiled:
// launch_merge is a switch over it, each case compiled only where plan_merge may give it
// (may_plan), so that every kernel the library compiles can be launched.
enum class Variant : int32_t {
  kNone = 0,          // no rows: nothing launched
  kRows,              // kRows, merge_kernel over the call's own source (two-way merges but the plain
                      // and in-place ones, N-way and variable-length merges)
  kRowsLseAfter,      // PairSource whose LSE is an input's, rows over several blocks: kRows without
                      // the LSE, then the LSEs alone (merge_lse_kernel), two launches
  kRowsPlain,         // PlainPairSource, rows split into token and head
  kRowsPlainFlat,     // PlainPairSource, rows flat on one grid axis (32-bit offsets)
  kInPlaceWarp,       // InPlaceSource<PairSource>, each row in one warp: a warp barrier before the LSE store
  kInPlaceBlock,      // InPlaceSource<PairSource>, each row in one block: a block barrier before it
  kInPlacePlainFlat,  // InPlaceSource<PlainPairSource with flat rows>, each row in one warp (32-bit offsets)
  kStates,            // kStates, merge_states_kernel with `groups` groups per row
  kShare,             // a state's share, merge_share_kernel
  kExchange,          // every rank's state read where it lies, merge_exchange_kernel (exchange_kernels.cuh)
};

// The variant's name, as the plan's tests and benchmarks print it.
constexpr const char* variant_name(Variant v) {
  switch (v) {
    case Variant::kNone: return "none";
    case Variant::kRows: return "rows";
    case Variant::kRowsLseAfter: return "rows_lse_after";
    case Variant::kRowsPlain: return "rows_plain";
    case Variant::kRowsPlainFlat: return "rows_plain_flat";
    case Variant::kInPlaceWarp: return "inplace_warp";
    case Variant::kInPlaceBlock: return "inplace_block";
    case Variant::kInPlacePlainFlat: return "inplace_plain_flat";
    case Variant::kStates: return "states";
    case Variant::kShare: return "share";
    case Variant::kExchange: return "exchange";
  }
  return "unknown";
}

struct LaunchPlan {
  MergeShape shape;  // packs, evict_first and row order filled in
  Variant variant = Variant::kNone;
  int vec = 1;           // elements a thread takes of a row: one access, or two (two-state kernels)
  int chunk = 2;         // states a thread keeps in flight: kRows 2 for two-state sources, else 4 or 8;
                         // kStates kSmallChunk
  int groups = 1;        // kStates: groups of threads sharing a row's states (a power of two)
  bool index32 = false;  // 32-bit offsets: every element offset of the call fits in 30 bits
  bool pdl = false;
  LaunchDims main;    // the merge
  LaunchDims lse;     // the second launch of kRowsLseAfter (merge_lse_kernel)

  explicit LaunchPlan(const MergeShape& s) : shape(s) {}

  Strategy strategy() const { return variant == Variant::kStates ? Strategy::kStates : Strategy::kRows; }
  int launches() const { return variant == Variant::kNone ? 0 : variant == Variant::kRowsLseAfter ? 2 : 1; }
};

namespace plan_detail {
inline uint32_t div_up(int64_t a, int64_t b) { return static_cast<uint32_t>((a + b - 1) / b); }
}  // namespace plan_detail

// Grid and block for `packs` vector accesses per row over `rows` rows, one thread each.  Blocks
// are `max_threads` wide unless that leaves SMs idle (`sms`, 0: unknown): a decode-sized merge is
// spread over more SMs, down to blocks of kMinBlockThreads (or of `min_threads`, more).  Rows go
// over the x (and, past 2^31 blocks, z) grid axes, a row's packs over the block's x axis and the y
// grid axis where a row has more packs than a block has threads.
// `lanes` (0: packs): the threads a row takes along the block's x axis, at least its packs (a row
// padded to a power of two so that it lies in one warp at aligned lanes; those past its packs idle).
inline LaunchDims row_dims(int64_t packs, int64_t rows, int sms, int max_threads = kBlockThreads,
                           int64_t min_threads = kMinBlockThreads, int64_t lanes = 0) {
  int threads = max_threads;
  const int64_t width = std::max(packs, lanes);
  const int64_t total = width * rows;
  const int64_t floor = std::max<int64_t>(kMinBlockThreads, min_threads);
  while (threads / 2 >= floor && (total + threads - 1) / threads < sms) threads /= 2;
  const int bx = static_cast<int>(std::min<int64_t>(width, threads));
  const int by = std::max(1, threads / bx);
  const int64_t row_blocks = (rows + by - 1) / by;
  const int64_t gx = std::min(row_blocks, (int64_t{1} << 31) - 1);
  LaunchDims d;
  d.block[0] = static_cast<uint32_t>(bx), d.block[1] = static_cast<uint32_t>(by), d.block[2] = 1;
  d.grid[0] = static_cast<uint32_t>(gx), d.grid[1] = plan_detail::div_up(packs, bx);
  d.grid[2] = plan_detail::div_up(row_blocks, gx);
  return d;
}

// Whether a kRows kernel of Source with kChunk states in flight has code for calls with StateExtras
// (softmax sums, valid states): a general source's kernels of at most kSmallChunk states in flight,
// as a call with extras takes a row's states one at a time whatever the chunk (merge_body), so that
// the plan gives such calls those (kChunk no more) and the others carry none of it.
template <typename Source, int kChunk>
ATTNMERGE_HD constexpr bool takes_extras() {
  return Source::Traits::kExtras && kChunk <= kSmallChunk;
}

// Whether a source's rows may be shared by groups of threads (kStates): those of the N-way and
// variable-length merges.  A share reads one O a row, which kRows' threads read once each.
template <typename Source>
constexpr bool takes_states() {
  return std::is_same<Source, StackSource>::value || std::is_same<Source, RangeSource>::value;
}

// Whether plan_merge may give a call of Source variant v with O of storage types (in, out),
// threads that each take `access` bytes of the wider O dtype (the plan's vec x its size), O's
// cache policy `cache` and rows masked or not (each fixed when compiled in the plain variants;
// kAsShape and kByToken: either, at run time): the kernels launch_merge compiles, so that each
// can be launched.  The plain variants for kPlainPairs; in place in one launch and two 16-byte
// accesses per thread only for one dtype (one_dtype); two accesses only in a masked in-place merge
// of 16 MB or more, never evict-first (plan_merge); a mask only in place; kStates with 16-byte
// accesses alone.
template <typename Source>
constexpr bool may_plan(Variant v, Dtype in, Dtype out, int access, Cache cache = Cache::kAsShape,
                        Mask mask = Mask::kByToken) {
  constexpr bool kPair = std::is_same<Source, PairSource>::value;
  if (v == Variant::kNone) return true;
  const bool in_place = v == Variant::kInPlaceWarp || v == Variant::kInPlaceBlock ||
                        v == Variant::kInPlacePlainFlat || v == Variant::kRowsLseAfter;
  if (access > 16 && !(kPair && in_place && one_dtype(in, out) && mask == Mask::kByToken &&
                       cache != Cache::kEvictFirst))
    return false;
  switch (v) {
    case Variant::kNone: return true;  // (no kernel)
    case Variant::kRows: return !std::is_same<Source, ShareSource>::value;
    case Variant::kRowsLseAfter: return kPair;
    case Variant::kRowsPlain:
    case Variant::kRowsPlainFlat: return kPair && plain_pair(in, out) && mask == Mask::kNone;
    case Variant::kInPlaceWarp:
    case Variant::kInPlaceBlock: return kPair && one_dtype(in, out);
    case Variant::kInPlacePlainFlat: return kPair && one_dtype(in, out) && plain_pair(in, out);
    case Variant::kStates: return takes_states<Source>() && access == 16;
    case Variant::kShare: return std::is_same<Source, ShareSource>::value;
    case Variant::kExchange: return std::is_same<Source, ExchangeSource>::value;
  }
  return false;
}

namespace plan_detail {

// States a row has, for the strategy: S of the N-way merge (and of a share of one), the mean of
// the variable-length one.
template <typename Source>
int64_t states_per_row(const Source& src, const MergeShape& shape) {
  if constexpr (std::is_same<Source, StackSource>::value || std::is_same<Source, ShareSource>::value) {
    return src.states;
  } else if constexpr (std::is_same<Source, RangeSource>::value) {
    const int64_t rows = shape.tokens;
    return rows > 0 ? (src.total + rows - 1) / rows : 0;
  } else {
    return 2;
  }
}

// Evict-first O accesses where they were measured faster than plain ones: two-way merges, in
// place or not, of rows taken in order (`pair_in_order`) moving under 8 MB, other calls under
// 16 MB (the tiled rows of vLLM's layout among them), N-way merges of more states than a chunk
// under 512 MB, variable-length merges (benchmarks/NOTES.md#evict-first-threshold).
template <typename Source>
bool evict_first_o(const Source& src, int64_t bytes, bool pair_in_order) {
  if constexpr (std::is_same<Source, RangeSource>::value) {
    return true;
  } else if constexpr (std::is_same<Source, StackSource>::value) {
    if (src.states > kStateChunk && bytes < (int64_t{512} << 20)) return true;
  } else {
    if (pair_in_order) return bytes < (int64_t{8} << 20);
  }
  return bytes < (int64_t{16} << 20);
}

}  // namespace plan_detail

// The widest block of a two-way merge moving `bytes`: kPairBlockThreads, or wider for calls of
// 32 MB (512 threads) and 128 MB (1024) or more, where fewer, wider blocks were measured faster;
// in place 512 at every size (a token's rows per block at 32 x 128; narrower at decode sizes
// through row_dims), and masked kPairBlockThreads (benchmarks/NOTES.md#pair-block-width).
inline int pair_block_threads(int64_t bytes, bool in_place = false, bool masked = false) {
  if (in_place) return masked ? kPairBlockThreads : 512;
  return bytes >= (int64_t{128} << 20) ? 1024 : bytes >= (int64_t{32} << 20) ? 512 : kPairBlockThreads;
}

// Groups of threads a row's `states` are split into under kStates; 1 means kRows.  Only where a
// row has more states than one kRows thread keeps in flight, and one kStates thread per pack
// (`rows` x `packs`) fits the GPU at once (`sms` x kStateThreadsPerSM), or two where a row has
// at most twice kStateChunk states (kRows takes those in two chunks, as fast as kStates on a
// GPU filled twice over: benchmarks/NOTES.md#kstates-groups).  Then the fewest groups, from 2, that leave each
// a chunk (kSmallChunk) of states, while the row's threads fit one block and the launch fits the
// GPU at once, up to kMaxStateGroups: a decode-sized merge fills the GPU with threads of few
// registers, each with its loads in flight together.  Groups of one chunk that would fill more
// than half the GPU are halved (two chunks each): fewer partials to combine, measured faster
// (benchmarks/NOTES.md#kstates-groups).
inline int state_groups(int64_t states, int64_t packs, int64_t rows, int sms) {
  const int64_t capacity = int64_t{sms > 0 ? sms : 1} * kStateThreadsPerSM;
  const int64_t threads = rows * packs * (states <= 2 * kStateChunk ? 2 : 1);
  if (states <= kStateChunk || threads > capacity || packs * 2 > kStateBlockThreads) return 1;
  int g = 2;
  while (2 * g <= kMaxStateGroups && int64_t{g} * kSmallChunk < states && packs * 2 * g <= kStateBlockThreads &&
         rows * packs * 2 * g <= capacity)
    g *= 2;
  if (g > 2 && int64_t{g} * kSmallChunk >= states && 2 * rows * packs * g > capacity) g /= 2;
  return g;
}

// The launch of kStates with `groups` groups over `rows` rows of `packs` packs: blocks of whole
// rows (packs x groups x rows per block), up to kStateBlockThreads and kMaxBlockZ rows, as few
// rows per block as it takes to give every SM a block (`sms`, 0: unknown); shared memory for each
// group's (max, total) and each pack's accumulator of `vec` floats, and with per-group FP8
// (`quantized`) an amax slot per pack (a row has at most one FP8 group per pack).
inline LaunchDims state_dims(int64_t packs, int64_t rows, int groups, int vec, int sms, bool quantized = false) {
  const int64_t per_row = packs * groups;
  int64_t threads = kStateBlockThreads;
  while (threads > kMinBlockThreads && (rows * per_row + threads - 1) / threads < sms) threads /= 2;
  const int64_t rows_per_block = std::max<int64_t>(1, std::min({threads / per_row, rows, kMaxBlockZ}));
  LaunchDims d;
  d.block[0] = static_cast<uint32_t>(packs), d.block[1] = static_cast<uint32_t>(groups);
  d.block[2] = static_cast<uint32_t>(rows_per_block);
  d.grid[0] = plan_detail::div_up(rows, rows_per_block), d.grid[1] = 1, d.grid[2] = 1;
  d.smem = static_cast<uint32_t>(rows_per_block * (groups * (2 + packs * vec) + (quantized ? packs : 0)) *
                                 sizeof(float));
  return d;
}

// The plan of one GPU call.  `out.lse_in_place`: out.lse is also an input's LSE.
template <typename Source>
LaunchPlan plan_merge(const MergeShape& shape, const Source& src, const OutView& out, const CallFacts& facts,
                      DeviceInfo device) {
  LaunchPlan plan(shape);
  MergeShape& s = plan.shape;
  plan.vec = facts.vec;
  // An in-place merge: out.lse is an input's LSE, which its rows' threads weigh by.
  [[maybe_unused]] const bool lse_in_place = out.lse_in_place && out.lse != nullptr;
  if constexpr (std::is_same<Source, PairSource>::value) {
    // Two 16-byte accesses per thread for a masked in-place merge of 16 MB or more, where every O
    // allows them and a row has an even number: half the threads, so half the masked-out ones,
    // whose launch and mask byte are most of such a call's cost (measured faster there only;
    // slower for smaller and unmasked calls: benchmarks/NOTES.md#wide-inplace-accesses).
    if (src.mask != nullptr && lse_in_place && one_dtype(facts.in, facts.out) &&
        !plan_detail::evict_first_o(src, facts.bytes, false) && facts.access_bytes == 16 &&
        shape.head_size % (2 * facts.vec) == 0)
      plan.vec = 2 * facts.vec;
  }
  s.packs = shape.head_size / plan.vec;
  // With room for the grid's last block and the one-past-the-end start of an empty varlen row.
  plan.index32 = facts.max_offset < (int64_t{1} << 30);
  plan.pdl = facts.pdl && device.major >= 9;
  if (s.rows == 0) return plan;
  if constexpr (is_pair_source<Source>()) {
    // LSEs whose tokens are the faster axis (vLLM's [heads, tokens]): rows in tiles of 8 tokens,
    // so that a warp's rows share their LSE sectors (MergeShape::tile); not at decode sizes, where
    // a tile would mostly be padding (benchmarks/NOTES.md#lse-tiles).
    if (facts.lse_tokens_inner && s.tokens >= 64) s.tile(3);
    s.evict_first = plan_detail::evict_first_o(src, facts.bytes, s.tile_shift < 0);
    const bool plain = !Source::Traits::kSink && src.a_tokens >= s.tokens && src.a_tokens_at == nullptr &&
                       s.tile_shift < 0 && out.scale == nullptr &&
                       src.b_scale == 1.0f && out.lse_scale == 1.0f && out.group == 0 && !src.extras.on &&
                       plain_pair(facts.in, facts.out);  // PlainPairSource: one base, no groups, sink or extras
    // Flat rows: dense heads and the same row strides in every view (PlainPairSource's kFlatRows).
    const bool dense = plan.index32 && flattens(src.a, s.heads) && flattens(src.b, s.heads) && flattens(out, s.heads) &&
                       same_rows(src.a, src.b) && same_rows(src.a, out);
    // An in-place merge overwrites the LSE its row's threads weigh by.  Rows of at most a warp's
    // packs: each padded to a power of two lanes, so that it lies in one warp, whose lanes meet
    // at a warp barrier before the store (a masked row's threads leave at once); the plain source
    // there where its rows are flat.  Wider rows in one block: a block barrier before the store
    // (blocks not narrowed below a row).  Rows over several blocks, and an output of another
    // dtype than the inputs' (whose in-place kernels are not compiled: may_plan): the LSEs in a
    // second launch (benchmarks/NOTES.md#inplace-lanes).
    const bool one_launch = one_dtype(facts.in, facts.out);
    if (lse_in_place && one_launch && s.packs <= 32) {
      int64_t lanes = 1;
      while (lanes < s.packs) lanes *= 2;
      plan.main = row_dims(s.packs, s.rows, device.sms, pair_block_threads(facts.bytes, true, src.mask != nullptr), 0,
                           lanes);
      plan.variant = plain && dense ? Variant::kInPlacePlainFlat : Variant::kInPlaceWarp;
    } else if (lse_in_place) {
      plan.main = row_dims(s.packs, s.rows, device.sms, kPairBlockThreads, s.packs);
      plan.variant = one_launch && plan.main.grid[1] == 1 ? Variant::kInPlaceBlock : Variant::kRowsLseAfter;
      if (plan.variant == Variant::kRowsLseAfter) plan.lse = row_dims(1, s.rows, device.sms, kPairBlockThreads);
    } else {
      plan.main = row_dims(s.packs, s.rows, device.sms, pair_block_threads(facts.bytes));
      // The plain source: rows flat where every view is dense and the grid has one axis (a mask
      // only in place: the two-way merge takes none).
      const bool flat = dense && plan.main.grid[1] == 1 && plan.main.grid[2] == 1;
      plan.variant = !plain || src.mask != nullptr ? Variant::kRows
                     : flat                         ? Variant::kRowsPlainFlat
                                                    : Variant::kRowsPlain;
    }
    return plan;
  } else {
    s.evict_first = plan_detail::evict_first_o(src, facts.bytes, false);
    const int64_t states = plan_detail::states_per_row(src, s);
    // kStates: 32-bit offsets and 16-byte accesses (whole float4s of accumulator per thread).
    int groups = 1;
    if (takes_states<Source>() && !facts.batch_invariant && plan.index32 && facts.access_bytes == 16 &&
        facts.vec % 4 == 0) {
      if (facts.groups > 0) {
        const int64_t most = std::min<int64_t>(kMaxStateGroups, kStateBlockThreads / std::max<int64_t>(s.packs, 1));
        while (2 * groups <= std::min<int64_t>(facts.groups, most)) groups *= 2;
      } else {
        groups = state_groups(states, s.packs, s.rows, device.sms);
      }
    }
    // NVFP4 stores two values per byte: each kStates finishing thread takes two or more of its pack
    // (at most vec / 2 groups), as no two finishers of a pack share a warp to pair theirs in.
    if (out.group > 0 && out.block == BlockScales::kNvfp4)
      while (groups > 1 && groups > facts.vec / 2) groups /= 2;
    if (groups > 1) {
      plan.variant = Variant::kStates;
      plan.groups = groups;
      plan.chunk = kSmallChunk;
      s.evict_first = true;  // the kernel's accesses are evict-first
      plan.main = state_dims(s.packs, s.rows, groups, facts.vec, device.sms, out.group > 0);
    } else {
      plan.variant = std::is_same<Source, ShareSource>::value ? Variant::kShare : Variant::kRows;
      // A variable-length merge's mean states per row is the batch's: invariant calls fix the chunk.
      // A call with StateExtras: kSmallChunk, whose kernels alone take them (takes_extras).
      const bool fixed = facts.batch_invariant && std::is_same<Source, RangeSource>::value;
      plan.chunk = (!fixed && states <= kSmallChunk) || src.extras.on ? kSmallChunk : kStateChunk;
      plan.main = row_dims(s.packs, s.rows, device.sms);
    }
    return plan;
  }
}

// The plan of an exchange (attnmerge_merge_exchange: every rank's state read where it lies,
// exchange_kernels.cuh).  Laid out as kRows, one thread per pack of a row, the ranks' states
// kStateChunk at a time: an exchange is a decode-sized call whose rows have few states each.
// 64-bit offsets (the ranks' arrays lie apart, so no one span bounds them), cached accesses (the
// states were written just before, the output is read by the next layer).  A rank with no rows
// still launches one block: its peers wait for its signals.
inline LaunchPlan plan_exchange(const MergeShape& shape, const CallFacts& facts, DeviceInfo device) {
  LaunchPlan plan(shape);
  MergeShape& s = plan.shape;
  plan.vec = facts.vec;
  s.packs = shape.head_size / plan.vec;
  s.evict_first = false;
  plan.pdl = facts.pdl && device.major >= 9;
  plan.variant = Variant::kExchange;
  plan.chunk = kStateChunk;
  plan.main = s.rows > 0 ? row_dims(s.packs, s.rows, device.sms) : row_dims(1, 1, 0);
  return plan;
}

// ---- the backward (merge_backward_kernels.cuh) ------------------------------------------------

constexpr int kBackwardBlockThreads = 256;

// How a backward runs.  A row is taken by `lanes` consecutive, aligned lanes of one warp (a
// power of two, the row's packs rounded up, at most 32), each lane one pack of VEC elements at a
// time (packs lane, lane + lanes, ...): the dot <dO, O_i - O> is summed over the lanes by
// shuffles, then lane c of the row writes dlse of the chunk's state c.  A row's states come
// `chunk` at a time, their LSEs and O packs loaded together: 2 for rows of at most two states and
// wherever the forward's O is given, else the forward's kSmallChunk.  Where the forward's O is
// given, a row's states are independent, and `groups` (a power of two) sets of `lanes` threads
// take `span` states each (group g states g span .. (g + 1) span), consecutive in the block, so
// that a row's groups read its dO and O from HBM once.
struct BackwardPlan {
  MergeShape shape;  // packs filled in
  int vec = 1;
  int lanes = 1;
  int chunk = 2;
  int groups = 1;
  int group_shift = 0;  // log2(groups)
  int span = 0;         // states a group takes, a multiple of chunk (groups == 1: the whole row)
  bool pdl = false;
  int launches = 0;
  LaunchDims dims;
  explicit BackwardPlan(const MergeShape& s) : shape(s) {}
};

// What the caller knows of a backward call beyond its shape.
struct BackwardFacts {
  int vec = 1;             // elements per vector access that every O pointer and stride allow
  int64_t max_states = 0;  // the most states a row has (max_states() of the source,
                           // backward_params.h: 2 two-way, S N-way, 0 not known: variable length)
  bool saved_o = false;    // the forward's O is given (without it a row's dlse need all its dots)
  bool pdl = false;        // the caller allows programmatic dependent launch
  int groups = 0;          // 0: the plan's choice; else (rounded down to a power of two) for
                           // benchmarks that compare them
  int chunk = 0;           // 0: the plan's choice; else 2 or kSmallChunk, likewise
};

// Blocks of kBackwardBlockThreads an SM holds of the N-way kernel of 2 states in flight (its
// register cap: 85, no spills; at 4 blocks it spills: benchmarks/NOTES.md#backward-chunk).
constexpr int kBackwardTwoChunkBlocks = 3;

// Whether a call's rows may take the backward kernel of 2 states in flight, which has no second
// pass: rows of at most 2 states, or any rows where the forward's O is given.
inline bool two_states_in_flight(const BackwardFacts& facts) {
  return facts.saved_o || (facts.max_states > 0 && facts.max_states <= 2);
}

// Rows of at most 2 states, and every N-way or variable-length row where the forward's O is
// given, take the kernel of 2 states in flight: fewer registers, so more threads per SM (measured
// faster than 4 in flight at every size, benchmarks/NOTES.md#backward-chunk); without the forward's O longer
// rows keep kSmallChunk.  With the forward's O a row's states are independent: they are split
// into groups (a power of two) while each group keeps 2 or more, the row's groups fit a block and
// the launch still fits the GPU at once, so that a decode-sized backward fills the GPU.
inline BackwardPlan plan_backward(const MergeShape& shape, const BackwardFacts& facts, DeviceInfo device) {
  BackwardPlan plan(shape);
  plan.vec = facts.vec;
  plan.shape.packs = shape.head_size / facts.vec;
  plan.pdl = facts.pdl && device.major >= 9;
  while (plan.lanes < 32 && plan.lanes < plan.shape.packs) plan.lanes *= 2;
  const int64_t states = facts.max_states;  // 0: not known
  int groups = 1;
  if (facts.saved_o && states > 2) {
    const int64_t capacity = int64_t{device.sms > 0 ? device.sms : 1} * kBackwardBlockThreads * kBackwardTwoChunkBlocks;
    const auto fits = [&](int64_t g) {
      return plan.lanes * g <= kBackwardBlockThreads &&
             (facts.groups > 0 ? g <= facts.groups : 2 * g <= states && shape.rows * plan.lanes * g <= capacity);
    };
    while (fits(2 * groups)) groups *= 2;
  }
  plan.chunk = facts.chunk > 0 ? facts.chunk : two_states_in_flight(facts) ? 2 : kSmallChunk;
  plan.groups = groups;
  while ((1 << plan.group_shift) < groups) ++plan.group_shift;
  const int64_t per_group = (states + groups - 1) / groups;
  plan.span = groups > 1 ? static_cast<int>((per_group + plan.chunk - 1) / plan.chunk * plan.chunk) : 0;
  if (shape.rows == 0) return plan;
  plan.launches = 1;
  // Rows (each `groups` sets of `lanes` threads) over the grid as the forward's kRows lays them out.
  plan.dims = row_dims(plan.lanes, shape.rows * groups, device.sms, kBackwardBlockThreads);
  return plan;
}

}  // namespace attnmerge
