// The GPU merges (attnmerge/merge_kernels.cuh) run on the CPU, for the tests: the library's plan
// (plan_merge) and launcher (launch_merge) with the kernels' own code compiled as host C++ against
// emulated_cuda/cuda_runtime.h, whose launch runs each block's threads as fibers that meet at its
// barriers (__syncthreads, __syncwarp) in the order the test sets.  Loads and stores take the host
// path of the same helpers (a load the GPU predicates off is a branch here), and exp2 the host's:
// what is checked is the kernels' logic on every strategy the plan has (kRows and its flat,
// plain, tiled, in-place and masked sources, 32- and 64-bit offsets, kStates of each group
// count, the two-launch in-place merge), not the device's instructions.  One C function per
// source, called through ctypes (tests/semantics/test_forward_kernel_emulated.py); each returns
// the launch's cudaError_t (emulate_error: why) and leaves its plan for emulate_plan.  Softmax sums
// and valid states (emulate_extras), the two-way merge's sink (emulate_pair_sink) and the live count
// (emulate_num_tokens) and a_tokens in memory (emulate_a_tokens) are set for the calls that follow.
//
// The call's facts (plan.h's CallFacts) are the test's to give, as the C ABI would read them off
// its tensors or otherwise: a plan for any facts must merge right.
#include <attnmerge/attnmerge.h>
#include <attnmerge/merge_kernels.cuh>

#include "emulator.h"

namespace attnmerge {
// The dynamic shared memory of merge_states_kernel's `extern __shared__` declaration.
alignas(16) float4 shared[emulated::kSharedBytes / sizeof(float4)];
}  // namespace attnmerge

using namespace attnmerge;
using emu::state;
using emu::Types;

namespace {

thread_local LaunchPlan t_plan{MergeShape{0, 0, 0, false}};

// The storage types compiled (emulate_types): each width of element in and out, a wider input
// into a narrower output and the reverse, and FP8 outputs.
using Compiled = emu::TypeList<Types<float, float>, Types<half_t, half_t>, Types<bfloat16_t, bfloat16_t>,
                               Types<float, bfloat16_t>, Types<bfloat16_t, float>, Types<bfloat16_t, float8_e4m3_t>>;

template <typename Source>
cudaError_t run(int in_dtype, int out_dtype, const LaunchPlan& plan, const Source& src, const OutView& out) {
  emulated::state().shared = shared;
  t_plan = plan;
  constexpr int kMost = std::is_same<Source, PairSource>::value ? 32 : 16;  // as the library instantiates them
  return emu::with_types<kMost>(Compiled{}, in_dtype, out_dtype, plan.vec, [&](auto types, auto vec) {
    using T = decltype(types);
    return launch_merge<typename T::TIn, typename T::TOut, decltype(vec)::value>(plan, src, out, nullptr);
  });
}

// The facts of a call (CallFacts): the dtypes in and out (codes), vec elements an access and its
// bytes, the largest element offset, the bytes moved, LSEs laid out [heads, tokens], PDL, forced
// groups (0: the plan's).
CallFacts facts(int in_dtype, int out_dtype, int vec, int access_bytes, int64_t max_offset, int64_t bytes,
                int tokens_inner, int pdl, int groups) {
  CallFacts f;
  f.in = emu::dtype_of_code(in_dtype);
  f.out = emu::dtype_of_code(out_dtype);
  f.vec = vec;
  f.access_bytes = access_bytes;
  f.max_offset = max_offset;
  f.bytes = bytes;
  f.lse_tokens_inner = tokens_inner != 0;
  f.pdl = pdl != 0;
  f.groups = groups;
  return f;
}

// `bases`: the C ABI's base flags (ATTNMERGE_LSE_BASE2, ATTNMERGE_LSE_B_*, ATTNMERGE_OUT_LSE_*), read
// as libattnmerge reads them: the inputs' base, and an argument's own where its flag says.
bool base2_of(int bases, unsigned to_base2, unsigned to_base_e) {
  return (bases & to_base2) ? true : (bases & to_base_e) ? false : (bases & ATTNMERGE_LSE_BASE2) != 0;
}
bool inputs_base2(int bases) { return (bases & ATTNMERGE_LSE_BASE2) != 0; }

// The per-group FP8 scales of the calls that follow (emulate_group_scales): where they go, their
// strides [tokens, heads, groups], the group size (0: none) and UE8M0.
struct GroupScales {
  void* scales = nullptr;
  int64_t strides[3] = {0, 0, 0};
  int group = 0;
  bool ue8m0 = false;
  BlockScales block = BlockScales::kFloat;  // emulate_block_scales
  bool swizzled = false;
  int head_groups = 0;
  float global = 1.0f;
};
thread_local GroupScales t_groups;

// The sink of the two-way merges that follow (emulate_pair_sink; lse null: none).
thread_local SinkView t_pair_sink;

// The softmax sums and valid states of the calls that follow (emulate_extras; on false: none).
thread_local StateExtras t_extras;

// The live count of the calls that follow (emulate_num_tokens; null: every token).
thread_local const void* t_live = nullptr;
thread_local bool t_live_wide = false;

// The two-way merges' a_tokens in memory of the calls that follow (emulate_a_tokens; null: the int).
thread_local const void* t_a_tokens = nullptr;
thread_local bool t_a_tokens_wide = false;

// The shape of a call as the C ABI makes it: `tokens` its capacity, the live count as set.
MergeShape shape_of(int64_t tokens, int64_t heads, int64_t head_size, int bases) {
  MergeShape shape(tokens, heads, head_size, inputs_base2(bases));
  shape.live_tokens = t_live;
  shape.live_wide = t_live_wide;
  return shape;
}

OutView out_view(void* o, const int64_t* os, float* l, const int64_t* ls, float inv_scale, const float* scale,
                 int bases) {
  OutView v{o, os[0], os[1], l, l ? ls[0] : 0, l ? ls[1] : 0, inv_scale, scale, false};
  v.lse_scale = base_change(inputs_base2(bases), base2_of(bases, ATTNMERGE_OUT_LSE_BASE2, ATTNMERGE_OUT_LSE_BASE_E));
  const GroupScales& g = t_groups;
  v.group_scales = g.scales, v.gs_st = g.strides[0], v.gs_sh = g.strides[1], v.gs_sg = g.strides[2];
  v.group = g.group, v.ue8m0 = g.ue8m0;
  v.block = g.block, v.swizzled = g.swizzled, v.head_groups = g.head_groups, v.global = g.global;
  return v;
}

// The runtime's own check (emulate_runtime_check): each of a block's 64 threads posts its index,
// meets the others (or not: `barrier` 0) and reads its neighbour's; or (`barrier` 2) half of the
// first warp waits at a warp barrier for the other half, which waits at __syncthreads: never met;
// or (3) the first thread leaves before the others' __syncthreads.
float posted[64];
void neighbours(float* out, int barrier) {
  const unsigned i = threadIdx.x;
  posted[i] = static_cast<float>(i);
  if (barrier == 3) {
    if (i == 0) return;
    __syncthreads();
  }
  if (barrier == 1) __syncthreads();
  if (barrier == 2) {
    if (i >= 16 && i < 32) {
      __syncwarp();
    } else {
      __syncthreads();
    }
  }
  out[i] = posted[(i + 1) % 64];
}

}  // namespace

extern "C" {

// The per-group FP8 scales of the calls that follow (OutView::group_scales): `scales` [tokens,
// heads, head_size / group] with strides `strides` (elements), groups of `group` elements (0:
// none, as before any call of this), rounded up to powers of two where ue8m0.
void emulate_group_scales(void* scales, const int64_t* strides, int group, int ue8m0) {
  t_groups = GroupScales{};
  if (group == 0) return;
  t_groups.scales = scales;
  std::copy(strides, strides + 3, t_groups.strides);
  t_groups.group = group;
  t_groups.ue8m0 = ue8m0 != 0;
}

// The block-scaled format of the calls that follow, their scale bytes at `scales` with strides
// `strides` (rows, heads, blocks; swizzled: row tiles, column tiles, 1): `block` a BlockScales
// (1 MXFP8 floor, 2 MXFP8 RCEIL, 3 NVFP4: blocks of 32 or 16, the output FP8 or bytes of two
// values), `swizzled` the 128 x 4 tiles of `head_groups` blocks per head, NVFP4's global scale.
void emulate_block_scales(void* scales, const int64_t* strides, int block, int swizzled, int head_groups,
                          float global) {
  t_groups = GroupScales{};
  t_groups.scales = scales;
  std::copy(strides, strides + 3, t_groups.strides);
  t_groups.block = static_cast<BlockScales>(block);
  t_groups.group = t_groups.block == BlockScales::kNvfp4 ? 16 : 32;
  t_groups.swizzled = swizzled != 0;
  t_groups.head_groups = head_groups;
  t_groups.global = global;
}

// The sink [heads] of the two-way merges that follow (SinkPairSource), `stride` apart (null: none,
// as before any call of this).
void emulate_pair_sink(const float* sink, int64_t stride) { t_pair_sink = SinkView{sink, stride}; }

// The softmax sums and valid states of the calls that follow (a source's StateExtras), as the C ABI
// makes them: sum_a and sum_b (null: none) with strides (token, state, head) in elements, valid
// (null: none) with strides (token, state) and `valid_bytes` an entry (1, 4 or 8).  Nothing given:
// none, as before any call of this.
void emulate_extras(const float* sum_a, const int64_t* sa, const float* sum_b, const int64_t* sb, const void* valid,
                    const int64_t* vs, int valid_bytes) {
  t_extras = StateExtras{};
  if (sum_a != nullptr) t_extras.sum_a = SumView{sum_a, sa[0], sa[1], sa[2]};
  if (sum_b != nullptr) t_extras.sum_b = SumView{sum_b, sb[0], sb[1], sb[2]};
  if (valid != nullptr) t_extras.valid = ValidView{valid, vs[0], vs[1], valid_bytes};
  t_extras.on = sum_a != nullptr || sum_b != nullptr || valid != nullptr;
}

// The live count of the calls that follow (MergeShape::live_tokens): one int32 (int64 where
// `wide`) at `count`; null: every token, as before any call of this.
void emulate_num_tokens(const void* count, int wide) {
  t_live = count;
  t_live_wide = wide != 0;
}

// The two-way merges' a_tokens of the calls that follow read from memory (PairSource::a_tokens_at):
// one int32 (int64 where `wide`) at `count`; null: their a_tokens argument, as before any call of this.
void emulate_a_tokens(const void* count, int wide) {
  t_a_tokens = count;
  t_a_tokens_wide = wide != 0;
}

// The (input, output) storage types compiled, as dtype codes at codes[2 i], codes[2 i + 1]; how many.
int emulate_types(int* codes, int most) { return emu::codes_of(Compiled{}, codes, most); }

// neighbours() over one block of 64 threads in the order set (emulate_order), `out` its reads.
int emulate_runtime_check(float* out, int barrier) {
  std::fill(posted, posted + 64, -1.0f);
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1), config.blockDim = dim3(64);
  return cudaLaunchKernelEx(&config, neighbours, out, barrier);
}

// (token, head) of `row` under MergeShape::split_row for `tokens` x `heads` rows in tiles of
// 2^tile_shift tokens (-1: untiled), with 32-bit (index32) or 64-bit indices: the division by a
// multiply-high the kernels use, at out[0], out[1].
void emulate_split_row(int64_t tokens, int64_t heads, int tile_shift, int64_t row, int index32, int64_t* out) {
  MergeShape shape(tokens, heads, 1, false);
  if (tile_shift >= 0) shape.tile(tile_shift);
  if (index32) {
    int32_t token, head;
    shape.split_row(static_cast<int32_t>(row), token, head);
    out[0] = token, out[1] = head;
  } else {
    shape.split_row(row, out[0], out[1]);
  }
}

// The plan of the last call: variant, chunk, groups, launches, index32, vec, evict_first,
// tile_shift, pdl, at fields[0 .. 8].
void emulate_plan(int64_t* fields) {
  const LaunchPlan& p = t_plan;
  const int64_t f[] = {static_cast<int64_t>(p.variant), p.chunk, p.groups, p.launches(), p.index32, p.vec,
                       p.shape.evict_first, p.shape.tile_shift, p.pdl};
  std::copy(std::begin(f), std::end(f), fields);
}

// The name of Variant `v` (plan.h's variant_name), null past the last.
const char* emulate_variant_name(int v) {
  return v >= 0 && v <= static_cast<int>(Variant::kExchange) ? variant_name(static_cast<Variant>(v)) : nullptr;
}

// The two-way merge into out (and out_lse, null: none), or, with in_place, the in-place merge of
// (o_a, lse_a) = (out, out_lse) with b, rows whose token's mask byte is 0 left alone (mask null:
// none).  O [tokens, heads, head_size] (a: a_tokens tokens), LSEs [tokens, heads], any strides.
int emulate_merge(int64_t tokens, int64_t a_tokens, int64_t heads, int64_t head_size, int in_dtype, int out_dtype,
                  int bases, int vec, int access_bytes, int sms, int64_t max_offset, int64_t bytes, int tokens_inner,
                  int pdl, int in_place, float inv_scale, const float* scale, void* out, const int64_t* out_s,
                  float* out_lse, const int64_t* ol_s, const void* o_a, const int64_t* oa_s, const float* lse_a,
                  const int64_t* la_s, const void* o_b, const int64_t* ob_s, const float* lse_b, const int64_t* lb_s,
                  const uint8_t* mask, int64_t mask_stride) {
  const MergeShape shape = shape_of(tokens, heads, head_size, bases);
  PairSource src{state(o_a, oa_s, lse_a, la_s), state(o_b, ob_s, lse_b, lb_s), a_tokens, mask, mask_stride};
  src.b_scale = base_change(base2_of(bases, ATTNMERGE_LSE_B_BASE2, ATTNMERGE_LSE_B_BASE_E), inputs_base2(bases));
  src.extras = t_extras;
  src.a_tokens_at = t_a_tokens;
  src.a_tokens_wide = t_a_tokens_wide;
  OutView dst = out_view(out, out_s, out_lse, ol_s, inv_scale, scale, bases);
  dst.lse_in_place = in_place != 0;
  const CallFacts f = facts(in_dtype, out_dtype, vec, access_bytes, max_offset, bytes, tokens_inner, pdl, 0);
  if (t_pair_sink.lse != nullptr) {  // as the C ABI runs a two-way merge with a sink
    const SinkPairSource sunk{src, t_pair_sink};
    return run(in_dtype, out_dtype, plan_merge(shape, sunk, dst, f, DeviceInfo{sms, 9}), sunk, dst);
  }
  return run(in_dtype, out_dtype, plan_merge(shape, src, dst, f, DeviceInfo{sms, 9}), src, dst);
}

// The N-way merge: o [tokens, states, heads, head_size], lse [tokens, states, heads], any strides;
// out [tokens, heads, head_size], out_lse [tokens, heads] (null: none); sink [heads], `sink_stride`
// apart (null: none).  groups: CallFacts::groups.
int emulate_merge_states(int64_t tokens, int64_t states, int64_t heads, int64_t head_size, int in_dtype, int out_dtype,
                         int bases, int vec, int access_bytes, int sms, int64_t max_offset, int64_t bytes, int groups,
                         float inv_scale, void* out, const int64_t* out_s, float* out_lse, const int64_t* ol_s,
                         const void* o, const int64_t* o_s, const float* lse, const int64_t* l_s, const float* sink,
                         int64_t sink_stride) {
  const MergeShape shape = shape_of(tokens, heads, head_size, bases);
  const StackSource src{o,      o_s[0], o_s[1], o_s[2], lse, l_s[0], l_s[1], l_s[2],
                        states, SinkView{sink, sink_stride}, t_extras};
  const OutView dst = out_view(out, out_s, out_lse, ol_s, inv_scale, nullptr, bases);
  const CallFacts f = facts(in_dtype, out_dtype, vec, access_bytes, max_offset, bytes, 0, 0, groups);
  return run(in_dtype, out_dtype, plan_merge(shape, src, dst, f, DeviceInfo{sms, 9}), src, dst);
}

// A state's share of the N-way merge: o [tokens, heads, head_size] (state `index`'s O), lse
// [tokens, states, heads], any strides; out, out_lse and the sink as for the N-way merge.
int emulate_merge_share(int64_t tokens, int64_t states, int64_t heads, int64_t head_size, int in_dtype, int out_dtype,
                        int bases, int vec, int access_bytes, int sms, int64_t max_offset, int64_t bytes, int groups,
                        float inv_scale, void* out, const int64_t* out_s, float* out_lse, const int64_t* ol_s,
                        const void* o, const int64_t* o_s, const float* lse, const int64_t* l_s, int64_t index,
                        const float* sink, int64_t sink_stride) {
  const MergeShape shape = shape_of(tokens, heads, head_size, bases);
  const ShareSource src{
      {o, o_s[0], 0, o_s[1], lse, l_s[0], l_s[1], l_s[2], states, SinkView{sink, sink_stride}, t_extras}, index};
  const OutView dst = out_view(out, out_s, out_lse, ol_s, inv_scale, nullptr, bases);
  const CallFacts f = facts(in_dtype, out_dtype, vec, access_bytes, max_offset, bytes, 0, 0, groups);
  return run(in_dtype, out_dtype, plan_merge(shape, src, dst, f, DeviceInfo{sms, 9}), src, dst);
}

// The variable-length merge: row r of out [rows, heads, head_size] merges states [indptr[r],
// indptr[r + 1]) of o [total, heads, head_size] and lse [total, heads]; indptr int64 or int32
// (indptr64), `indptr_stride` elements apart; the sink as for the N-way merge.
int emulate_merge_varlen(int64_t rows, int64_t total, int64_t heads, int64_t head_size, int in_dtype, int out_dtype,
                         int bases, int vec, int access_bytes, int sms, int64_t max_offset, int64_t bytes, int groups,
                         float inv_scale, void* out, const int64_t* out_s, float* out_lse, const int64_t* ol_s,
                         const void* o, const int64_t* o_s, const float* lse, const int64_t* l_s, const void* indptr,
                         int64_t indptr_stride, int indptr64, const float* sink, int64_t sink_stride) {
  const MergeShape shape = shape_of(rows, heads, head_size, bases);
  const RangeSource src{o,     o_s[0], o_s[1], lse, l_s[0], l_s[1], indptr, indptr_stride, indptr64 != 0,
                        total, SinkView{sink, sink_stride}, t_extras};
  const OutView dst = out_view(out, out_s, out_lse, ol_s, inv_scale, nullptr, bases);
  const CallFacts f = facts(in_dtype, out_dtype, vec, access_bytes, max_offset, bytes, 0, 0, groups);
  return run(in_dtype, out_dtype, plan_merge(shape, src, dst, f, DeviceInfo{sms, 9}), src, dst);
}

}  // extern "C"
