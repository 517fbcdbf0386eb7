/* attnmerge: merge partial attention states (O, LSE).  The C ABI of libattnmerge.
 *
 * A partial state is an output O [tokens, heads, head_size] and its log-sum-exp LSE [tokens, heads]
 * over one part of the keys; merging states gives the attention over all of them (section 2.2 of
 * arXiv 2501.01005).  Per (token, head) row, over its states i:
 *
 *   m = max_i lse_i,  w_i = exp(lse_i - m),  W = sum_i w_i,
 *   O = sum_i (w_i / W) * O_i,  LSE = m + log W        (exp/log in base e, or base 2 on request)
 *
 * An LSE of +inf counts as -inf (an empty part); all parts empty give O = 0 and LSE = -inf; a part
 * of zero weight is never read; a NaN LSE makes its row NaN; arithmetic is float32, each output
 * rounded once.  docs/semantics.md has the whole of it (sinks, per-group FP8, the backward).
 *
 * Every entry point returns ATTNMERGE_SUCCESS or an error status, after which attnmerge_last_error()
 * names the argument at fault, the expected and the actual value; validates every argument before
 * it writes anything; never allocates device memory, synchronizes the host, throws or prints; runs
 * on the device the tensors live on (the caller's current device restored), GPU work enqueued on
 * the caller's stream (so that it can be captured in a CUDA graph), host tensors
 * (ATTNMERGE_HOST) on the CPU, synchronously, on up to ATTNMERGE_NUM_THREADS threads.
 */
#ifndef ATTNMERGE_ATTNMERGE_H_
#define ATTNMERGE_ATTNMERGE_H_

#include <stdint.h>

#define ATTNMERGE_VERSION_MAJOR 0
#define ATTNMERGE_VERSION_MINOR 2
#define ATTNMERGE_VERSION_PATCH 0
#define ATTNMERGE_VERSION_STRING "0.2.0"
#define ATTNMERGE_VERSION_NUMBER \
  (ATTNMERGE_VERSION_MAJOR * 10000 + ATTNMERGE_VERSION_MINOR * 100 + ATTNMERGE_VERSION_PATCH)

/* The entry points' linkage: exported where the library itself is compiled
 * (ATTNMERGE_BUILDING_LIBRARY, defined for its sources alone), imported by every includer.  On ELF
 * both are default visibility, so that a program that hides its own symbols (a hidden visibility
 * pragma around the #include) still binds these to the library. */
#if defined(_WIN32)
#if defined(ATTNMERGE_BUILDING_LIBRARY)
#define ATTNMERGE_API __declspec(dllexport)
#else
#define ATTNMERGE_API __declspec(dllimport)
#endif
#else
#define ATTNMERGE_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

typedef enum attnmerge_status {
  ATTNMERGE_SUCCESS = 0,
  ATTNMERGE_ERROR_VALUE = 1,       /* a bad shape, stride, size, alignment, device or option */
  ATTNMERGE_ERROR_TYPE = 2,        /* a bad dtype, or a null pointer where a tensor is needed */
  ATTNMERGE_ERROR_NO_DEVICE = 3,   /* GPU tensors, but no usable CUDA driver or device */
  ATTNMERGE_ERROR_CUDA = 4         /* the CUDA runtime failed (possibly an earlier, sticky error) */
} attnmerge_status;

typedef enum attnmerge_dtype {
  ATTNMERGE_FLOAT32 = 0,
  ATTNMERGE_FLOAT16 = 1,
  ATTNMERGE_BFLOAT16 = 2,
  ATTNMERGE_FLOAT8_E4M3 = 3, /* OCP E4M3 ("e4m3fn"), outputs only: stored = value / output_scale, saturating */
  ATTNMERGE_UINT8 = 4,       /* masks */
  ATTNMERGE_BOOL = 5,        /* masks, one byte each */
  ATTNMERGE_INT32 = 6,       /* indptr */
  ATTNMERGE_INT64 = 7        /* indptr */
} attnmerge_dtype;

/* The arguments a dtype may be (attnmerge_dtype_info.roles): ROLE_O_IN an O a merge reads, the
 * in-place merge's O and every O of a backward; ROLE_O_OUT the O a two-way, N-way or variable-length
 * merge writes; ROLE_LSE every LSE and LSE gradient; ROLE_MASK the in-place merge's mask;
 * ROLE_INDPTR the variable-length merges' indptr. */
#define ATTNMERGE_ROLE_O_IN 1u
#define ATTNMERGE_ROLE_O_OUT 2u
#define ATTNMERGE_ROLE_LSE 4u
#define ATTNMERGE_ROLE_MASK 8u
#define ATTNMERGE_ROLE_INDPTR 16u

/* What a dtype code is called, how large its elements are and which arguments take it: the
 * library's one table of dtypes, for callers that describe arrays by name (the Python binding,
 * tools), so that none of them restates it.  `name` is this library's spelling, in its messages
 * ("float8_e4m3"); `array_name` that of NumPy, ml_dtypes, PyTorch and JAX ("float8_e4m3fn");
 * `size` the bytes of an element; `roles` ATTNMERGE_ROLE_* bits. */
typedef struct attnmerge_dtype_info {
  const char* name;
  const char* array_name;
  uint32_t size;
  uint32_t roles;
} attnmerge_dtype_info;

/* The device of host memory. */
#define ATTNMERGE_HOST (-1)

/* attnmerge_tensor.flags */
#define ATTNMERGE_READ_ONLY 1u /* refused where the tensor is an output */
/* The caller vouches that `device` is where `data` lives (a framework's own DLPack device, say),
 * so the library does not ask CUDA (a pointer query costs a few hundred nanoseconds).  Without
 * it every pointer is checked: device memory of `device`, managed or pinned memory for a GPU
 * launch, and no device memory handed to the CPU path. */
#define ATTNMERGE_DEVICE_KNOWN 2u

/* A strided view of up to ATTNMERGE_MAX_NDIM dimensions, in the logical axis order each op names
 * (O [tokens, heads, head_size] with head_size unit-stride, LSE [tokens, heads] float32, or
 * [heads, tokens] with ATTNMERGE_LSE_HEADS_FIRST).  Strides count elements, not bytes, and must be
 * >= 0; any other layout is a permutation of the strides, not a copy. */
#define ATTNMERGE_MAX_NDIM 4
typedef struct attnmerge_tensor {
  void* data;
  int64_t shape[ATTNMERGE_MAX_NDIM];
  int64_t strides[ATTNMERGE_MAX_NDIM];
  int32_t ndim;
  int32_t dtype;  /* attnmerge_dtype */
  int32_t device; /* ATTNMERGE_HOST or a CUDA device ordinal */
  uint32_t flags; /* ATTNMERGE_READ_ONLY, ATTNMERGE_DEVICE_KNOWN */
} attnmerge_tensor;

/* attnmerge_options.flags */
#define ATTNMERGE_LSE_BASE2 1u        /* LSEs are log2-sum-exp2 (FlashInfer); default base e */
#define ATTNMERGE_LSE_HEADS_FIRST 2u  /* two-way and in-place merges: LSEs laid out [heads, tokens] (vLLM) */
#define ATTNMERGE_A_TOKENS 4u         /* two-way merge: options.a_tokens applies */
/* Programmatic dependent launch (sm_90 and newer; ignored on older GPUs and on the CPU): the
 * kernel may be scheduled while the previous kernel on the stream is still running, and waits for
 * it to finish before it reads anything, so that its launch latency overlaps that kernel's tail.
 * The results are those of a plain launch. */
#define ATTNMERGE_PDL 8u
/* Mixed LSE bases: the base of one LSE argument, whatever ATTNMERGE_LSE_BASE2 says of the others
 * (a flag that names the base the call has anyway changes nothing; both of a pair are refused).
 * Engines differ (FlashInfer writes base-2 LSEs, FlashAttention natural ones), and converting an
 * LSE is a launch of its own at decode sizes.  The merge converts in float32: the second state's
 * LSE into the first's base before the merge (one multiplication by ln 2 or log2 e, one rounding),
 * the merged LSE into its base after it.
 *   LSE_B_*: lse_b of the two-way merge, lse_other of the in-place merge (the in-place merge's
 *            merged LSE replaces lse, in lse's base);
 *   OUT_LSE_*: out_lse of the two-way, N-way and variable-length merges and of the share (the
 *            sink is in the inputs' base; the merged LSE counts it, then is converted).
 * The backwards take one base for every LSE (ATTNMERGE_LSE_BASE2 or not) and refuse these flags:
 * convert the forward's LSEs first (a gradient through lse' = c lse is c dlse'). */
#define ATTNMERGE_LSE_B_BASE2 16u
#define ATTNMERGE_LSE_B_BASE_E 32u
#define ATTNMERGE_OUT_LSE_BASE2 64u
#define ATTNMERGE_OUT_LSE_BASE_E 128u
/* Per-group FP8 outputs (options.group_scales): each group's scale rounded up to a power of two
 * (UE8M0, as DeepGEMM's Blackwell kernels take them). */
#define ATTNMERGE_GROUP_SCALE_UE8M0 256u

/* The caller's name for one argument (attnmerge_options.arg_names): `arg` is its name in this
 * header ("o_a", "lse_b", "mask", "grad_out", ...; or "a_tokens" and "output_scale", the options
 * the messages name), `name` what the caller calls it ("prefix_output"), which every message of
 * the call then gives instead. */
typedef struct attnmerge_arg_name {
  const char* arg;
  const char* name;
} attnmerge_arg_name;

/* Zero-initialized options are the defaults: base e, LSE [tokens, heads], no limit, no scale,
 * the arguments named as in this header. */
typedef struct attnmerge_options {
  uint32_t flags;
  /* With ATTNMERGE_A_TOKENS (two-way merge only): only rows of the first a_tokens tokens merge a
   * with b; the others take b alone (its state unchanged; an empty b gives O = 0, LSE = -inf) and
   * never read a, which then needs only a_tokens tokens (vLLM's prefill_tokens_with_context). */
  int64_t a_tokens;
  /* FP8 outputs store value / output_scale (vLLM's output_scale), a finite scale > 0; 0 (the
   * zero-initialized default) means none.  Other output dtypes take none (1 is accepted: it
   * changes nothing). */
  float output_scale;
  /* Or the scale as one float32 in the memory of the op's device (host memory for host tensors),
   * read by the kernel itself, so that no host synchronization is needed.  NULL: unused. */
  const float* output_scale_ptr;
  /* The layout the caller was built against: 0, or sizeof(attnmerge_options) of a released
   * attnmerge.h; any other size is refused.  This layout, 0.2.0's (80 bytes on 64-bit platforms),
   * is the baseline: 0 names it, so that zero-initialized options are the defaults.  A later
   * release adds fields at the end only, and reads them only where struct_size is the size of a
   * layout that has them: a caller built against an older attnmerge.h keeps working. */
  uint32_t struct_size;
  /* The caller's names for the op's arguments: num_arg_names entries (0: none; arg_names may then be NULL), each arg and name a
   * non-empty string (a NULL or empty one is refused, before any other check), which need only
   * live for the call.  Every message of the call names an argument by the first entry for it,
   * and an argument with no entry by its name here; the names change the messages only.  An arg
   * the op does not have is ignored, not refused: one table may then serve several ops (a layer
   * that keeps another library's names for all of them), and a call that fails nothing never
   * reads the table beyond those checks. */
  const attnmerge_arg_name* arg_names;
  int32_t num_arg_names;
  /* Attention sinks (gpt-oss,
   * StreamingLLM): NULL for none, or a float32 tensor of shape [heads] (any stride >= 0), each
   * head's sink logit in the LSE's base, merged into every row of its head as one more state whose
   * output is 0 (its weight takes a share of the softmax, its output adds nothing):
   *
   *   m = max(sink, max_i lse_i),  W = exp(sink - m) + sum_i exp(lse_i - m),
   *   O = sum_i (exp(lse_i - m) / W) * O_i,  LSE = m + log W    (the merged LSE counts the sink)
   *
   * with the semantics of any state (+inf counts as -inf, a NaN sink makes its rows NaN); a row
   * with no states gets O = 0 and LSE = sink.  Put a head's sink into one merge of the states of
   * a row, not into several (the shares of one merge, attnmerge_merge_share, each take it: they
   * are one merge).  The two-way, N-way and variable-length merges and the share take one (the
   * two-way merge's in lse_a's base: cascade attention's prefix and suffix, the sink added
   * once; not where out_lse is lse_a or lse_b); the in-place merge refuses it, and so do the
   * backwards: given the forward's out and out_lse, which count the sink, the
   * states' gradients are those without one, and the sink's own gradient is, per head, the sum
   * over the rows of that head of  b^(sink - LSE) * (dLSE - ln(b) <dO, O>)  (b = e, or 2). */
  const attnmerge_tensor* sink;
  /* Per-group FP8
   * outputs (DeepSeek-V3's 1 x 128 blocks; vLLM's per_token_group_quant_fp8), for a GEMM that
   * takes block-scaled FP8 next (the output projection): NULL for none, or a float32 tensor
   * [tokens, heads, head_size / group_size] (any strides >= 0: a [tokens, heads x head_size /
   * group_size] buffer, or DeepGEMM's column-major one passed as a permutation) that receives one
   * scale per group of group_size consecutive elements of a row.  For the merged values x of a
   * group:
   *
   *   amax = max |x_e| (NaN elements left out),  scale = max(amax, 1e-10) / 448
   *          (with ATTNMERGE_GROUP_SCALE_UE8M0 rounded up to a power of two),
   *   out_e = x_e * (1 / scale), rounded once to nearest even, saturating to +-448 (NaN stays NaN)
   *
   * out must be FP8 E4M3 and no output_scale given; group_size a power of two from 8 up that
   * divides head_size and is at most 32 times the elements a vector access takes of every O array
   * (its pointer's and strides' alignment, within 16 bytes: at most 128 for aligned float32
   * inputs, 256 for 16-bit ones; any up to 32), as one warp's lanes share a group.  The two-way,
   * N-way and variable-length merges and the share take them; an all-empty row's groups get
   * O = 0 and scale 1e-10 / 448.  The rest of the call's semantics are unchanged. */
  const attnmerge_tensor* group_scales;
  int32_t group_size;
} attnmerge_options;

/* Two-way merge: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)), and options->sink where given.
 * out_lse may be NULL: no LSE is written.  options may be NULL (the defaults).  stream is a
 * cudaStream_t (NULL: the legacy default stream), ignored for host tensors.  out may be o_a or o_b itself (the same view), never a
 * partial overlap of them.  dtypes: o_a and o_b share one of float32, float16 or bfloat16; out
 * has any of them or FP8 E4M3.  The other ops follow the same conventions. */
ATTNMERGE_API attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                               const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                               const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                               const attnmerge_options* options, void* stream);

/* In-place merge: (o, lse) <- merge((o, lse), (o_other, lse_other)).  mask (may be NULL): uint8 or
 * bool [tokens]; rows of tokens whose mask is 0 are left untouched. */
ATTNMERGE_API attnmerge_status attnmerge_merge_inplace(const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                       const attnmerge_tensor* o_other,
                                                       const attnmerge_tensor* lse_other,
                                                       const attnmerge_tensor* mask,
                                                       const attnmerge_options* options, void* stream);

/* N-way merge in one pass (each input read once): o [tokens, S, heads, head_size], lse
 * [tokens, S, heads], any strides (FlashInfer's [tokens, S, ...] layout, or an all-gather's
 * [S, tokens, ...] passed as its permutation); out [tokens, heads, head_size], out_lse [tokens, heads]
 * (may be NULL).  S >= 0; S = 0 gives O = 0 and LSE = -inf. */
ATTNMERGE_API attnmerge_status attnmerge_merge_states(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                      const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                      const attnmerge_options* options, void* stream);

/* Variable-length merge: row r of out [rows, heads, head_size] merges states indptr[r] to
 * indptr[r + 1] - 1 of o [total, heads, head_size], lse [total, heads]; indptr is int32 or int64
 * [rows + 1].  A row with no states gets O = 0, LSE = -inf.  On host tensors a bad indptr (below 0,
 * decreasing, past total) is refused; on the GPU it is not read back to the host (that would
 * synchronize), so each row takes states [clamp(indptr[r], 0, total), clamp(indptr[r+1], that, total)):
 * never a read or write out of bounds, and a row whose bounds cross is empty. */
ATTNMERGE_API attnmerge_status attnmerge_merge_varlen(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                      const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                      const attnmerge_tensor* indptr,
                                                      const attnmerge_options* options, void* stream);

/* The share of one state in an N-way merge, for context parallelism's combine by reduce-scatter
 * (vLLM's decode context parallelism: every rank gathers the LSEs of all, scales its own output
 * by its share, and a reduce-scatter sums the shares).  For a row whose S states' LSEs are given
 * and whose state `index` has O = o (the others' O are not needed):
 *
 *   m = max_i lse_i,  w_i = exp(lse_i - m),  W = sum_i w_i,
 *   out = (w_index / W) * o,  out_lse = m + log W      (the merged LSE of the S states)
 *
 * so that the S states' shares summed are the N-way merge of them (each share rounded once to
 * out's dtype).  o [tokens, heads, head_size]: state `index`'s O; lse [tokens, S, heads]: every
 * state's LSE, any strides (an all-gather's [S, tokens, heads] passed as its permutation);
 * 0 <= index < S.  out [tokens, heads, head_size] may be o itself (the same view); out_lse
 * [tokens, heads] may be NULL.  The semantics of the N-way merge: a state of zero weight gives a
 * share of 0 without its O being read, an all-empty row O = 0 and LSE -inf, a NaN LSE a NaN row.
 * options.sink as the N-way merge takes it, in every rank's share alike (it weighs each share;
 * having no O, it adds to none).  Gradients (no C entry point; the torch ops and attnmerge.jax
 * compute them): with p_i = b^(lse_i - LSE) and g = ln(b) <dO, out>, do = p_index dO and
 * dlse_i = p_i (dLSE - g), plus g for i = index. */
ATTNMERGE_API attnmerge_status attnmerge_merge_share(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                     const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                     int64_t index, const attnmerge_options* options, void* stream);

/* Backward of the merges: the gradients of a merge's inputs from those of its outputs, in one
 * pass over the data.  For a row (token, head) with the forward's output O and LSE, the gradients
 * dO (grad_out) and dLSE (grad_out_lse) of them, and the row's states i (O_i, lse_i):
 *
 *   p_i = b^(lse_i - LSE)      (b = e, or 2 with ATTNMERGE_LSE_BASE2: the forward's base)
 *   dO_i = p_i dO,   dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>)      (<,> over head_size)
 *
 *   - out and out_lse are the forward's results, saved and passed in, not recomputed; the other
 *     inputs are the forward's inputs, as it took them (the same layouts, strides and options);
 *   - out may be NULL: <dO, O_i - O> is then <dO, O_i> - sum_j p_j <dO, O_j> (equal in exact
 *     arithmetic; O is not read, one vector a row less; the dots of rows of more than 4 states on
 *     the GPU, 64 on the CPU, are stored in the LSE gradients and finished in a second pass over
 *     them, a float a state);
 *   - an empty part (lse_i -inf or +inf) gets zero gradients, never NaN, whatever its O_i or dO
 *     holds; so does a part of zero weight, and every part of an all-empty row (LSE -inf);
 *   - a NaN lse_i, LSE or dLSE, or NaN in dO, O or O_i, gives NaN where the formula does: errors
 *     surface (apart from the zero-weight parts above);
 *   - arithmetic in float32 whatever the storage types (the dot accumulated in float32), each
 *     result rounded once; every O_i is read once, and dO and O once a row where head_size is at
 *     most 256 16-bit or 128 float32 elements (the GPU reads the rest of wider rows again for
 *     each 4 states, the CPU for each 64);
 *   - grad_out_lse may be NULL: dLSE = 0 (the forward's LSE was not used);
 *   - each gradient output may be NULL: not written.  Without the LSE gradients no O_i or O is
 *     read at all (dO_i needs only the LSEs and dO);
 *   - dtypes: the inputs' O and their gradients share one of float32, float16 or bfloat16; out and
 *     grad_out share one (which may differ: a float32 merge of bfloat16 states, say); every LSE
 *     and LSE gradient is float32.  FP8 outputs and an output scale have no gradient (refused);
 *   - outputs may not overlap each other or any input (no in-place backward);
 *   - options.flags: ATTNMERGE_LSE_BASE2 and ATTNMERGE_PDL; for the two-way merge also
 *     ATTNMERGE_LSE_HEADS_FIRST (every LSE and LSE gradient of the call [heads, tokens]) and
 *     ATTNMERGE_A_TOKENS.  The in-place merge has no backward: it overwrites the O_a it needs.
 * Conventions otherwise those of the forward (status codes, the last error, streams, devices). */

/* Two-way merge backward.  grad_o_a, grad_lse_a, grad_o_b, grad_lse_b: the gradients of o_a,
 * lse_a, o_b, lse_b, shaped as o_b and lse_b ([tokens, heads, head_size], [tokens, heads]).  With
 * ATTNMERGE_A_TOKENS the forward read only the first a_tokens tokens of a: grad_o_a and grad_lse_a
 * are then [a_tokens, heads, head_size] and [a_tokens, heads] (the gradient of a's later tokens,
 * if it has any, is zero and the caller's to write), and o_a, lse_a need at least a_tokens tokens. */
ATTNMERGE_API attnmerge_status attnmerge_merge_backward(
    const attnmerge_tensor* grad_o_a, const attnmerge_tensor* grad_lse_a, const attnmerge_tensor* grad_o_b,
    const attnmerge_tensor* grad_lse_b, const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
    const attnmerge_tensor* out, const attnmerge_tensor* out_lse, const attnmerge_tensor* o_a,
    const attnmerge_tensor* lse_a, const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
    const attnmerge_options* options, void* stream);

/* N-way merge backward.  grad_o [tokens, S, heads, head_size] and grad_lse [tokens, S, heads]: the
 * gradients of o and lse, any strides (like o and lse, which need not share them); grad_out, out
 * [tokens, heads, head_size]; grad_out_lse, out_lse [tokens, heads]. */
ATTNMERGE_API attnmerge_status attnmerge_merge_states_backward(
    const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse, const attnmerge_tensor* grad_out,
    const attnmerge_tensor* grad_out_lse, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
    const attnmerge_tensor* o, const attnmerge_tensor* lse, const attnmerge_options* options, void* stream);

/* Variable-length merge backward.  grad_o [total, heads, head_size], grad_lse [total, heads]: the
 * gradients of o and lse; grad_out, out [rows, heads, head_size]; grad_out_lse, out_lse [rows,
 * heads]; indptr as the forward took it.  Every state's gradient is written: states that no row
 * takes (before indptr[0], from indptr[rows] on, or all of them when rows = 0) get zeros.  indptr
 * is checked on the host as in the forward; on the GPU each row takes the forward's clamped
 * states, so a bad indptr cannot make an access leave the arrays (a state in two rows' clamped
 * ranges then gets one of their gradients). */
ATTNMERGE_API attnmerge_status attnmerge_merge_varlen_backward(
    const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse, const attnmerge_tensor* grad_out,
    const attnmerge_tensor* grad_out_lse, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
    const attnmerge_tensor* o, const attnmerge_tensor* lse, const attnmerge_tensor* indptr,
    const attnmerge_options* options, void* stream);

/* What the calling thread's last op enqueued on the GPU, for tests, benchmarks and tools that
 * check which kernel a shape gets (the launch plan, cpp/include/attnmerge/plan.h).  Host calls,
 * empty calls and refused calls enqueue nothing: launches = 0. */
#define ATTNMERGE_KERNEL_NONE 0
#define ATTNMERGE_KERNEL_ROWS 1          /* one thread per pack of a row walks its states */
#define ATTNMERGE_KERNEL_ROWS_PLAIN 2    /* the same, two states, no mask, a_tokens, tiles or scale pointer */
#define ATTNMERGE_KERNEL_ROWS_INPLACE 3  /* the same, the merged LSE written over an input's in the same launch */
#define ATTNMERGE_KERNEL_STATES 4        /* a row's states shared by groups of threads, combined in shared memory */
#define ATTNMERGE_KERNEL_BACKWARD 5      /* the backward: lanes of a warp per row, the dots summed by shuffles */
typedef struct attnmerge_launch_info {
  int32_t kernel;       /* ATTNMERGE_KERNEL_* of the first launch */
  int32_t launches;     /* kernels enqueued: 0, 1, or 2 (an in-place merge whose rows span blocks) */
  int32_t state_groups; /* ATTNMERGE_KERNEL_STATES, _BACKWARD: groups of threads a row's states are split
                           into; else 1 */
  int32_t index_bits;   /* 32 or 64: the offsets' width */
  int32_t vec;          /* elements a thread takes of a row: one vector access, or two side by side
                           (masked in-place merges of 16 MB or more, of 16-byte accesses) */
  int32_t pdl;          /* launched with programmatic dependent launch */
  uint32_t grid[3];
  uint32_t block[3];
} attnmerge_launch_info;
ATTNMERGE_API void attnmerge_last_launch(attnmerge_launch_info* info);

/* The dtype of code `dtype` (an attnmerge_dtype), or NULL where `dtype` is none: the codes run from
 * 0 up to the first that gives NULL.  The table lives as long as the library. */
ATTNMERGE_API const attnmerge_dtype_info* attnmerge_dtype_info_of(int32_t dtype);

/* The error message of the calling thread's last call ("" after a success), valid until its next call. */
ATTNMERGE_API const char* attnmerge_last_error(void);
ATTNMERGE_API const char* attnmerge_status_string(attnmerge_status status);

/* Version: ATTNMERGE_VERSION_NUMBER and ATTNMERGE_VERSION_STRING of the library actually loaded. */
ATTNMERGE_API int attnmerge_version(void);
ATTNMERGE_API const char* attnmerge_version_string(void);

/* The GPU architectures compiled in, as "75;80;86;89;90;100;120" (SASS for each, PTX for the last;
 * a CUDA 12 build compiled by clang carries sm_90's PTX instead), and the CUDA toolkit version the
 * library was built with (e.g. 13000; 12090 for the CUDA 12 build, attnmerge-cu12). */
ATTNMERGE_API const char* attnmerge_cuda_architectures(void);
ATTNMERGE_API int attnmerge_cuda_build_version(void);

/* The installed driver's CUDA version (0 if there is no driver) and the number of usable devices
 * (0 without a driver or device).  Neither fails. */
ATTNMERGE_API int attnmerge_cuda_driver_version(void);
ATTNMERGE_API int attnmerge_device_count(void);

/* The CUDA device whose device memory `ptr` points into; ATTNMERGE_HOST for anything the host can
 * address (ordinary, pinned or managed memory) or when there is no driver.  For callers that hold
 * bare pointers, such as __cuda_array_interface__. */
ATTNMERGE_API int attnmerge_pointer_device(const void* ptr);

/* Blocks the host until `stream` on `device` has finished its work.  Never called by the ops
 * themselves; for callers that must hand results to a framework that cannot wait on a stream. */
ATTNMERGE_API attnmerge_status attnmerge_stream_synchronize(int32_t device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* ATTNMERGE_ATTNMERGE_H_ */
