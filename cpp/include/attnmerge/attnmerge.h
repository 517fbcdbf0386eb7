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
 * float64: on host tensors (the CPU path) every O and LSE named float32 or 16-bit below may
 * instead be float64, all of a call's or none of them, and such a call computes in float64
 * (gradients checked against finite differences in float64, say).  On a GPU, float64 is refused
 * (ATTNMERGE_ERROR_TYPE) before anything is written.
 *
 * Every entry point returns ATTNMERGE_SUCCESS or an error status, after which attnmerge_last_error()
 * names the argument at fault, the expected and the actual value; validates every argument before
 * it writes anything; never allocates device memory, synchronizes the host, throws or prints; runs
 * on the device the tensors live on (the caller's current device restored), GPU work enqueued on
 * the caller's stream (so that it can be captured in a CUDA graph), host tensors
 * (ATTNMERGE_HOST) on the CPU, synchronously, multi-threaded for large inputs.  The environment
 * variable ATTNMERGE_NUM_THREADS, read at the first CPU call, caps the threads: a whole number
 * from 1 to 1024, or unset (the hardware's); any other value makes every CPU call fail, naming it.
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
  ATTNMERGE_ERROR_CUDA = 4,        /* the CUDA runtime failed (possibly an earlier, sticky error) */
  ATTNMERGE_ERROR_TIMEOUT = 5      /* an exchange waited longer than its timeout for a peer's signal */
} attnmerge_status;

typedef enum attnmerge_dtype {
  ATTNMERGE_FLOAT32 = 0,
  ATTNMERGE_FLOAT16 = 1,
  ATTNMERGE_BFLOAT16 = 2,
  ATTNMERGE_FLOAT8_E4M3 = 3, /* OCP E4M3 ("e4m3fn"), outputs only: stored = value / output_scale, saturating */
  ATTNMERGE_UINT8 = 4,       /* masks */
  ATTNMERGE_BOOL = 5,        /* masks, one byte each */
  ATTNMERGE_INT32 = 6,       /* indptr */
  ATTNMERGE_INT64 = 7,       /* indptr */
  ATTNMERGE_FLOAT64 = 8      /* host arrays only (the CPU path, which computes in float64): every O and
                                LSE of a call float64, or none */
} attnmerge_dtype;

/* The arguments a dtype may be (attnmerge_dtype_info.roles): ROLE_O_IN an O a merge reads, the
 * in-place merge's O and every O of a backward; ROLE_O_OUT the O a two-way, N-way or variable-length
 * merge writes; ROLE_LSE every LSE, softmax sum and LSE gradient, and the sink; ROLE_MASK the
 * in-place merge's mask; ROLE_INDPTR the variable-length merges' indptr; ROLE_SCALE the FP8
 * output's scales (options.group_scales, options.output_scale_ptr; the block-scaled formats' byte
 * scales and NVFP4's uint8 out are read by their flags, ATTNMERGE_BLOCK_*); options.valid takes
 * the dtypes of ROLE_MASK and ROLE_INDPTR. */
#define ATTNMERGE_ROLE_O_IN 1u
#define ATTNMERGE_ROLE_O_OUT 2u
#define ATTNMERGE_ROLE_LSE 4u
#define ATTNMERGE_ROLE_MASK 8u
#define ATTNMERGE_ROLE_INDPTR 16u
#define ATTNMERGE_ROLE_SCALE 32u

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

/** A descriptor of a contiguous array (row-major: the last axis unit-stride), flags 0.
 *
 * \param[in] data    the array's first element
 * \param[in] dtype   an attnmerge_dtype
 * \param[in] device  ATTNMERGE_HOST or a CUDA device ordinal
 * \param[in] ndim    0 to ATTNMERGE_MAX_NDIM (another value is kept, with no shape, for the ops to refuse)
 * \param[in] shape   ndim sizes
 * \return the descriptor, its strides those of a contiguous array of that shape
 */
static inline attnmerge_tensor attnmerge_contiguous_tensor(void* data, int32_t dtype, int32_t device, int32_t ndim,
                                                           const int64_t* shape) {
  attnmerge_tensor t;
  uint64_t stride = 1; /* unsigned: a product past 2^63 wraps, and the ops refuse the span */
  int32_t i;
  for (i = 0; i < ATTNMERGE_MAX_NDIM; ++i) t.shape[i] = t.strides[i] = 0;
  t.data = data;
  t.ndim = ndim;
  t.dtype = dtype;
  t.device = device;
  t.flags = 0;
  if (ndim < 0 || ndim > ATTNMERGE_MAX_NDIM) return t;
  for (i = ndim - 1; i >= 0; --i) {
    t.shape[i] = shape[i];
    t.strides[i] = (int64_t)stride;
    stride *= (uint64_t)shape[i];
  }
  return t;
}

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
/* Per-group FP8 outputs (options.group_scales): each group's float32 scale rounded up to a power of
 * two (UE8M0, as DeepGEMM's Blackwell kernels take them). */
#define ATTNMERGE_GROUP_SCALE_UE8M0 256u
/* Block-scaled outputs: the formats the block-scaled GEMMs of Blackwell GPUs read, quantized in the
 * merge (docs/semantics.md gives the rules, which are the reference quantizers' bit for bit).
 * options.group_scales receives the blocks' scales and options.group_size is the format's block (0
 * takes it); the two-way, N-way and variable-length merges and the share take them.
 *   ATTNMERGE_BLOCK_MXFP8: out FP8 E4M3, one UE8M0 scale (uint8: 2^(byte - 127), 255 NaN) per 32
 *     elements of a row: 2^(floor(log2 amax) - 8) (the OCP MX rule), or amax / 448 rounded up to a
 *     power of two with ATTNMERGE_SCALE_RCEIL (cuBLAS's); the values value / scale, saturating.
 *   ATTNMERGE_BLOCK_NVFP4: out uint8 [..., head_size / 2], two E2M1 values per byte (the even
 *     element in the low nibble), one FP8 E4M3 scale per 16 elements: amax / 6 in units of the
 *     global scale g, clamped to [2^-6, 448] and rounded to E4M3; the values value / (g * scale),
 *     rounded to E2M1, saturating at 6.  g: output_scale or output_scale_ptr (a value > 0 and
 *     finite; 1 when neither is given), so that value ~ e2m1 * scale * g.
 * The scales are laid out [rows, heads, head_size / block] (any strides), or with
 * ATTNMERGE_SCALE_SWIZZLED in the 128 x 4 tiles of cuBLASLt and CUTLASS: a tensor [ceil(rows / 128),
 * ceil(heads * head_size / block / 4), 512] (rows: out's first axis; the last axis unit-stride,
 * the pointer and the other strides multiples of 16 bytes), tile (r, c) holding the scales of rows
 * 128 r .. 128 r + 127 and of the scale columns 4 c .. 4 c + 3 of the matrix [rows, heads *
 * head_size / block], that of (row, column) at byte (row % 32) * 16 + (row / 32 % 4) * 4 +
 * column % 4.  The tiles' padding (rows past the last, columns past a row's last) is written
 * with zeros. */
#define ATTNMERGE_BLOCK_MXFP8 1024u
#define ATTNMERGE_BLOCK_NVFP4 2048u
#define ATTNMERGE_SCALE_RCEIL 4096u
#define ATTNMERGE_SCALE_SWIZZLED 8192u
/* Batch invariance: each row's results depend on that row's inputs and the call's options alone,
 * never on the other rows of the call, the strategy the launch plan would pick for their number or
 * the GPU's size (a row merged alone gives the same bits).  The forwards take it; the N-way and
 * variable-length merges then keep one strategy and one chunk of states for every call (without it
 * a decode-sized call shares each row's states among groups of threads, which sum them in another
 * order), and the other forwards are invariant already.  The GPU's and the CPU's bits differ (the
 * GPU takes the hardware's exp2 and log2). */
#define ATTNMERGE_BATCH_INVARIANT 512u

/* The caller's name for one argument (attnmerge_options.arg_names): `arg` is its name in this
 * header ("o_a", "lse_b", "mask", "grad_out", ...; or "a_tokens" and "output_scale", the options
 * the messages name), `name` what the caller calls it ("prefix_output"), which every message of
 * the call then gives instead.  The arg "NULL" names a missing tensor in the caller's language
 * ("None" from Python): "lse_b: expected an array, got None". */
typedef struct attnmerge_arg_name {
  const char* arg;
  const char* name;
} attnmerge_arg_name;

/* The options of a call; NULL options are the defaults, and so are zero-initialized ones: base e,
 * LSEs [tokens, heads], every token of a merged, no output scale, the arguments named as in this
 * header, no sink, no group scales.  docs/semantics.md gives the semantics of each. */
typedef struct attnmerge_options {
  /* ATTNMERGE_LSE_BASE2, ATTNMERGE_LSE_HEADS_FIRST, ...: those the op takes (the others are
   * refused).  Default 0. */
  uint32_t flags;
  /* With ATTNMERGE_A_TOKENS (the two-way merge and its backward): the rows of the first a_tokens
   * tokens merge a with b, the others take b alone and never read a, which then needs only
   * a_tokens tokens (vLLM's prefill_tokens_with_context).  0 to tokens. */
  int64_t a_tokens;
  /* FP8 outputs store value / output_scale (vLLM's output_scale), a finite scale > 0; 0 (default):
   * none; NVFP4 outputs take it as their global scale.  Other outputs take none (1 is accepted: it
   * changes nothing). */
  float output_scale;
  /* Or the scale as one float32 in the memory of the op's device (host memory for host tensors),
   * read by the kernel itself, so that no host synchronization is needed.  NULL (default): none. */
  const float* output_scale_ptr;
  /* The layout the caller was built against: 0, or sizeof(attnmerge_options) of a released
   * attnmerge.h; any other size is refused.  This layout, 0.2.0's (120 bytes on 64-bit platforms),
   * is the baseline: 0 names it, so that zero-initialized options are the defaults.  A later
   * release adds fields at the end only, and reads them only where struct_size is the size of a
   * layout that has them: a caller built against an older attnmerge.h keeps working. */
  uint32_t struct_size;
  /* The caller's names for the op's arguments, num_arg_names entries, each arg and name a
   * non-empty string that need only live for the call: every message of the call names an
   * argument by the first entry for it.  An arg the op does not have is ignored (one table may
   * serve several ops).  NULL and 0 (default): the names of this header. */
  const attnmerge_arg_name* arg_names;
  int32_t num_arg_names;
  /* Attention sinks (gpt-oss, StreamingLLM): a float32 tensor [heads] (any stride >= 0), each
   * head's sink logit in the LSE's base, merged into every row of its head as one more state
   * whose output is 0.  The two-way, N-way and variable-length merges and the share take one.
   * NULL (default): none. */
  const attnmerge_tensor* sink;
  /* Per-group FP8 outputs (DeepSeek-V3's 1 x 128 blocks): a float32 tensor [tokens, heads,
   * head_size / group_size] (any strides >= 0) that receives the scale of each group of group_size
   * consecutive elements of a row, out being FP8 E4M3 without output_scale.  With
   * ATTNMERGE_BLOCK_MXFP8 (NVFP4) the blocks' scales instead, uint8 (float8_e4m3), in either layout
   * of the block-scaled formats.  The two-way, N-way and variable-length merges and the share take
   * them.  NULL (default): none. */
  const attnmerge_tensor* group_scales;
  /* The elements of a group: a power of two from 8 up that divides head_size and is at most 32
   * times the elements a vector access takes of every O array (its pointer's and strides'
   * alignment, within 16 bytes); the block-scaled formats': their block, 32 or 16 (0 takes it),
   * NVFP4's vector access at least two elements.  0 (default) without group_scales. */
  int32_t group_size;
  /* Softmax statistics in place of LSEs (TensorRT-LLM's Helix, a flash-decoding kernel before it
   * takes the log).  Where sum_a (sum_b) is given, the op's first (second) LSE argument holds each
   * row's running max m of its part's scores, and this float32 tensor, of that argument's shape
   * and layout (strides of its own >= 0; ATTNMERGE_LSE_HEADS_FIRST applies to it too), the sum s
   * of exp(score - m) (exp2 with base 2) over the part's keys: the state's LSE is m + log(s)
   * (log2 with base 2), taken in float32 as the merge reads it, and s = 0 is an empty part
   * whatever m holds (the max of no scores); then the LSE's rules apply (+inf or -inf: empty; NaN:
   * the row NaN).  sum_a: of lse_a (two-way merge), of lse (N-way and variable-length merges,
   * share; the exchange's ranks' are attnmerge_exchange.sum); sum_b: of lse_b (two-way merge), of
   * lse_other (in-place merge).  The in-place merge refuses sum_a (its merged LSE is written over
   * lse), and an out_lse that is the LSE argument of a sum is refused (the merged LSE would
   * overwrite the maxima).  The merged LSE is an LSE (m = LSE,
   * s = 1 as statistics).  The backwards take none: their LSEs are m + log(s), whose gradients are
   * dm = dlse and ds = dlse / (s ln b).  NULL (default): LSEs. */
  const attnmerge_tensor* sum_a;
  const attnmerge_tensor* sum_b;
  /* Which states hold keys (vLLM's interleaved context-parallel KV sharding, where a rank may hold
   * none of a sequence's keys), read by the kernel from the op's device: never synchronized with
   * the host, so that one captured CUDA graph serves every batch.  uint8 or bool (a mask), or
   * int32 or int64 (a count of keys, such as per-rank KV lengths), any strides >= 0, 0 where the
   * state holds no key for the token: [tokens, S] for the N-way merge and the share, [tokens, 2]
   * for the two-way merge (a, b) and the in-place merge (o's state, o_other's), [total] for the
   * variable-length merge (each state of o), [tokens of out, world_size] for the exchange's merge
   * (each rank's state of the slice's tokens).  A state whose entry is 0 weighs nothing, whatever its
   * O and LSE hold (NaN or garbage never reach the result); a row with no state left gets O = 0 and
   * LSE = -inf (the sink's LSE, with one).  The backwards take none.  NULL (default): every state
   * holds keys. */
  const attnmerge_tensor* valid;
  /* The live number of tokens (rows of the variable-length merge), read by the kernel from the
   * op's device: an int32 or int64 tensor of one element (host memory for host tensors), so that a
   * CUDA graph captured at a capacity serves every batch up to it without a host round trip.  The
   * arrays are sized for the capacity (their tokens), and the launch too; the rows of tokens at or
   * past the count read nothing and write nothing (every output there keeps what it held).  A
   * count above the capacity is taken as the capacity, one below 0 as 0.  The forward merges and
   * the share take it.  NULL (default): every token. */
  const attnmerge_tensor* num_tokens;
  /* The two-way merge's a_tokens read by the kernel from the op's device instead (an int32 or int64
   * tensor of one element; host memory for host tensors), so that a captured CUDA graph takes a
   * new one at each replay: the rows of the first a_tokens tokens merge a with b, the others take b
   * alone and never read a.  o_a and lse_a then have every token (the count is not known on the
   * host); a count above the tokens is taken as the tokens, one below 0 as 0.  Not with
   * ATTNMERGE_A_TOKENS.  NULL (default): options.a_tokens. */
  const attnmerge_tensor* a_tokens_tensor;
} attnmerge_options;

/** Two-way merge: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)), and options->sink where given.
 *
 * \param[out] out      O [tokens, heads, head_size]: float32, float16, bfloat16 or FP8 E4M3; may be
 *                      o_a or o_b itself (the same view), never a partial overlap of them
 * \param[out] out_lse  LSE [tokens, heads], float32; may be lse_a or lse_b itself (not with a
 *                      sink); NULL: not written
 * \param[in]  o_a      O [tokens, heads, head_size] (with ATTNMERGE_A_TOKENS: at least a_tokens
 *                      tokens): float32, float16 or bfloat16
 * \param[in]  lse_a    LSE of o_a, float32 [tokens, heads] (at least a_tokens tokens)
 * \param[in]  o_b      O [tokens, heads, head_size], the dtype of o_a
 * \param[in]  lse_b    LSE of o_b, float32 [tokens, heads]
 * \param[in]  options  NULL: the defaults
 * \param[in]  stream   a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                               const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                               const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                               const attnmerge_options* options, void* stream);

/** In-place merge: (o, lse) <- merge((o, lse), (o_other, lse_other)) on the rows of tokens whose
 * mask is not 0.  It takes no sink and no group scales.
 *
 * \param[in,out] o          O [tokens, heads, head_size]: float32, float16 or bfloat16
 * \param[in,out] lse        LSE of o, float32 [tokens, heads]
 * \param[in]     o_other    O [tokens, heads, head_size], the dtype of o
 * \param[in]     lse_other  LSE of o_other, float32 [tokens, heads]
 * \param[in]     mask       uint8 or bool [tokens]: rows of tokens whose mask is 0 are left
 *                           untouched; NULL: every row merges
 * \param[in]     options    NULL: the defaults
 * \param[in]     stream     a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_inplace(const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                       const attnmerge_tensor* o_other,
                                                       const attnmerge_tensor* lse_other,
                                                       const attnmerge_tensor* mask,
                                                       const attnmerge_options* options, void* stream);

/** N-way merge in one pass (each input read once) of the S states of every row, and options->sink
 * where given.  S >= 0; S = 0 gives O = 0 and LSE = -inf.
 *
 * \param[out] out      O [tokens, heads, head_size]: float32, float16, bfloat16 or FP8 E4M3
 * \param[out] out_lse  LSE [tokens, heads], float32; NULL: not written
 * \param[in]  o        O [tokens, S, heads, head_size], any strides (FlashInfer's [tokens, S, ...],
 *                      or an all-gather's [S, tokens, ...] passed as its permutation): float32,
 *                      float16 or bfloat16
 * \param[in]  lse      LSE of o, float32 [tokens, S, heads], any strides
 * \param[in]  options  NULL: the defaults
 * \param[in]  stream   a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_states(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                      const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                      const attnmerge_options* options, void* stream);

/** Variable-length merge: row r of out merges states indptr[r] to indptr[r + 1] - 1 of o, and
 * options->sink where given; a row with no states gets O = 0, LSE = -inf.
 *
 * \param[out] out      O [rows, heads, head_size]: float32, float16, bfloat16 or FP8 E4M3
 * \param[out] out_lse  LSE [rows, heads], float32; NULL: not written
 * \param[in]  o        O [total, heads, head_size]: float32, float16 or bfloat16
 * \param[in]  lse      LSE of o, float32 [total, heads]
 * \param[in]  indptr   int32 or int64 [rows + 1].  On host tensors a bad indptr (below 0,
 *                      decreasing, past total) is refused; on the GPU it is not read back (that
 *                      would synchronize): each row takes states [clamp(indptr[r], 0, total),
 *                      clamp(indptr[r + 1], that, total)), never an access out of bounds
 * \param[in]  options  NULL: the defaults
 * \param[in]  stream   a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_varlen(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                      const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                      const attnmerge_tensor* indptr,
                                                      const attnmerge_options* options, void* stream);

/** The share of state `index` in the N-way merge of the S states whose LSEs are given, for context
 * parallelism's combine by reduce-scatter (every rank gathers the LSEs of all, scales its own
 * output by its share, and a reduce-scatter sums the shares):
 *
 *   m = max_i lse_i,  W = sum_i exp(lse_i - m),
 *   out = (exp(lse_index - m) / W) * o,  out_lse = m + log W      (the merged LSE of the S states)
 *
 * so that the shares summed are the N-way merge (each rounded once to out's dtype), with its
 * semantics (a state of zero weight gives a share of 0 without its O being read).  options->sink
 * weighs every rank's share alike and adds to none.
 *
 * \param[out] out      O [tokens, heads, head_size]: float32, float16, bfloat16 or FP8 E4M3; may
 *                      be o itself (the same view)
 * \param[out] out_lse  LSE [tokens, heads], float32; NULL: not written
 * \param[in]  o        O [tokens, heads, head_size] of state `index`: float32, float16 or bfloat16
 * \param[in]  lse      every state's LSE, float32 [tokens, S, heads], any strides (an
 *                      all-gather's [S, tokens, heads] passed as its permutation)
 * \param[in]  index    the state whose share is asked: 0 <= index < S
 * \param[in]  options  NULL: the defaults
 * \param[in]  stream   a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_share(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                     const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                     int64_t index, const attnmerge_options* options, void* stream);

/* The backwards: the gradients of a merge's inputs from those of its outputs, in one pass over the
 * data.  Per row, with the forward's output O and LSE, their gradients dO and dLSE, and the row's
 * states i:
 *
 *   p_i = b^(lse_i - LSE)      (b = e, or 2 with ATTNMERGE_LSE_BASE2: the forward's base)
 *   dO_i = p_i dO,   dlse_i = p_i (dLSE + ln(b) <dO, O_i - O>)      (<,> over head_size)
 *
 * out and out_lse are the forward's results, saved and passed in; the other inputs the forward's
 * inputs, as it took them (layouts, strides, options).  An empty part (lse_i -inf or +inf), a part
 * of zero weight and every part of an all-empty row get zero gradients; NaN in an input gives NaN
 * where the formula does.  Each gradient output may be NULL (not written); without the LSE
 * gradients no O_i or O is read.  The O inputs and their gradients share one of float32, float16
 * or bfloat16, out and grad_out one (which may differ); every LSE is float32; outputs may not
 * overlap each other or any input.  options.flags: ATTNMERGE_LSE_BASE2 and ATTNMERGE_PDL, for the
 * two-way merge also ATTNMERGE_LSE_HEADS_FIRST (every LSE of the call [heads, tokens]) and
 * ATTNMERGE_A_TOKENS; no sink, no output scale, no group scales (FP8 outputs have no gradient).
 * The in-place merge has none: it overwrites the O_a it needs. */

/** Two-way merge backward.
 *
 * \param[out] grad_o_a      dO_a [tokens, heads, head_size] (with ATTNMERGE_A_TOKENS: [a_tokens,
 *                           ...]; a's later tokens, if any, have a zero gradient the caller writes),
 *                           the dtype of o_a; NULL: not written
 * \param[out] grad_lse_a    dlse_a, float32 [tokens, heads] ([a_tokens, heads]); NULL: not written
 * \param[out] grad_o_b      dO_b [tokens, heads, head_size], the dtype of o_a; NULL: not written
 * \param[out] grad_lse_b    dlse_b, float32 [tokens, heads]; NULL: not written
 * \param[in]  grad_out      dO [tokens, heads, head_size], the dtype of out
 * \param[in]  grad_out_lse  dLSE, float32 [tokens, heads]; NULL: 0 (the forward's LSE unused)
 * \param[in]  out           the forward's O [tokens, heads, head_size]; NULL: <dO, O_i - O> is
 *                           computed as <dO, O_i> - sum_j p_j <dO, O_j>, O not read
 * \param[in]  out_lse       the forward's LSE, float32 [tokens, heads]
 * \param[in]  o_a           the forward's o_a
 * \param[in]  lse_a         the forward's lse_a
 * \param[in]  o_b           the forward's o_b
 * \param[in]  lse_b         the forward's lse_b
 * \param[in]  options       NULL: the defaults
 * \param[in]  stream        a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_backward(
    const attnmerge_tensor* grad_o_a, const attnmerge_tensor* grad_lse_a, const attnmerge_tensor* grad_o_b,
    const attnmerge_tensor* grad_lse_b, const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
    const attnmerge_tensor* out, const attnmerge_tensor* out_lse, const attnmerge_tensor* o_a,
    const attnmerge_tensor* lse_a, const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
    const attnmerge_options* options, void* stream);

/** N-way merge backward.
 *
 * \param[out] grad_o        dO_i [tokens, S, heads, head_size], any strides (which need not be
 *                           o's), the dtype of o; NULL: not written
 * \param[out] grad_lse      dlse_i, float32 [tokens, S, heads], any strides; NULL: not written
 * \param[in]  grad_out      dO [tokens, heads, head_size], the dtype of out
 * \param[in]  grad_out_lse  dLSE, float32 [tokens, heads]; NULL: 0
 * \param[in]  out           the forward's O [tokens, heads, head_size]; NULL: not read
 * \param[in]  out_lse       the forward's LSE, float32 [tokens, heads]
 * \param[in]  o             the forward's o [tokens, S, heads, head_size]
 * \param[in]  lse           the forward's lse [tokens, S, heads]
 * \param[in]  options       NULL: the defaults
 * \param[in]  stream        a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_states_backward(
    const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse, const attnmerge_tensor* grad_out,
    const attnmerge_tensor* grad_out_lse, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
    const attnmerge_tensor* o, const attnmerge_tensor* lse, const attnmerge_options* options, void* stream);

/** Variable-length merge backward.  Every state's gradient is written: states no row takes
 * (before indptr[0], from indptr[rows] on, all of them when rows = 0) get zeros.
 *
 * \param[out] grad_o        dO_i [total, heads, head_size], the dtype of o; NULL: not written
 * \param[out] grad_lse      dlse_i, float32 [total, heads]; NULL: not written
 * \param[in]  grad_out      dO [rows, heads, head_size], the dtype of out
 * \param[in]  grad_out_lse  dLSE, float32 [rows, heads]; NULL: 0
 * \param[in]  out           the forward's O [rows, heads, head_size]; NULL: not read
 * \param[in]  out_lse       the forward's LSE, float32 [rows, heads]
 * \param[in]  o             the forward's o [total, heads, head_size]
 * \param[in]  lse           the forward's lse [total, heads]
 * \param[in]  indptr        the forward's indptr, checked on the host as there; on the GPU each
 *                           row takes the forward's clamped states (a state in two rows' clamped
 *                           ranges then gets one of their gradients)
 * \param[in]  options       NULL: the defaults
 * \param[in]  stream        a cudaStream_t (NULL: the legacy default stream); ignored for host tensors
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_varlen_backward(
    const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse, const attnmerge_tensor* grad_out,
    const attnmerge_tensor* grad_out_lse, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
    const attnmerge_tensor* o, const attnmerge_tensor* lse, const attnmerge_tensor* indptr,
    const attnmerge_options* options, void* stream);

/* ---- Context parallelism on one node: the exchange fused with the merge ------------------------
 *
 * The ranks of a context-parallel group (the GPUs of one NVLink domain, or threads of one process
 * on host memory) hold the same queries and one shard of the keys each: rank p's partial state is
 * O_p [tokens, heads, head_size] and LSE_p [tokens, heads], in memory every rank addresses
 * (symmetric memory: PyTorch's, NVSHMEM's, an NCCL window, CUDA IPC), every rank's laid out alike.
 * attnmerge_merge_exchange on rank r reads r's slice (a range of tokens or of heads) of every
 * rank's state where it lies and writes the merge of the states into r's own output: the all-to-all
 * and the merge in one kernel, with merge_states' semantics.  The ranks meet at signal pads, one
 * per rank (attnmerge_exchange_pad_bytes each, zeroed before first use), step by step, each step
 * an epoch (1 first, then each newer than the last; 64-bit, so never reused):
 *
 *   publish  attnmerge_exchange_publish(x, e) on rank r, after r's state of step e is written (on
 *            its stream): stores e, with release semantics at system scope, into the ready slot of
 *            r in every rank's pad, and keeps e in r's pad as the last epoch r published.
 *   merge    attnmerge_merge_exchange(..., e, ...) on rank r: every block of it waits (acquire,
 *            system scope) until every rank's ready slot in r's pad holds e or newer, then reads
 *            its rows of every rank's state and writes their merge.  A slot holds the newest epoch
 *            its rank signalled, so that no step's signal satisfies a later step's wait.
 *   reuse    how a rank knows that its buffer may be written again (attnmerge_exchange.reuse):
 *            ATTNMERGE_EXCHANGE_WAIT_READERS: once every block of r's merge has read its rows, the
 *            last of them (a count in r's pad) stores e into the done slot of r in every rank's pad,
 *            and waits until every rank's done slot in r's pad holds e: when r's merge has ended,
 *            every rank has read r's state, and r may write it again (the next step's producer,
 *            after the merge on r's stream).
 *            ATTNMERGE_EXCHANGE_ALTERNATE: nothing is signalled or waited for after the merge.  Every
 *            rank keeps two buffers and writes its state of epoch e into buffer e % 2 (the pointers
 *            of the call are those of that buffer): buffer e % 2 is written again at epoch e + 2,
 *            when every rank has published e + 1, which it does only after its merge of e (each
 *            rank enqueues its merge of e before its publish of e + 1): the merge is then its read
 *            alone, the fastest form.
 *
 * Epochs from device memory: epoch 0 takes the epoch from r's pad (a publish the last one + 1, a
 * merge the last one published), so that a CUDA graph captured once replays step after step.  A
 * publish of an epoch not newer than the last one r published, and a merge of another epoch than
 * it, are stale.
 *
 * Waiting: every wait gives up after the exchange's timeout_ns nanoseconds (the GPU's
 * %globaltimer, the host's steady clock), never traps and never hangs, and records why in r's pad:
 * the rank waited for, the epoch, the value its slot held.  While r's pad records a failure, r's
 * exchange calls do nothing (they neither wait nor write nor signal), so that the peers of a rank
 * that failed give up in turn, each naming it.  attnmerge_exchange_status returns the record (a
 * timeout as ATTNMERGE_ERROR_TIMEOUT, a stale epoch as ATTNMERGE_ERROR_VALUE, with a message naming
 * the rank and the epoch) and clears it.  On the host a call returns its failure itself, and a
 * stale epoch is refused before anything is done.  On the GPU the pad is not read by the host
 * (that would synchronize), so a stale epoch, like a timeout, is found by the kernel: the merge
 * then writes nothing (after a timeout, some of its rows may have been written).
 *
 * Several ranks on one GPU (tests, benchmarks): a waiting merge keeps its blocks on the GPU, so a
 * publish enqueued after a merge it would satisfy needs an SM to spare; publish the ranks' states
 * before their merges. */

/* The most ranks an exchange has: every GPU of an NVLink domain. */
#define ATTNMERGE_EXCHANGE_MAX_WORLD 72

/* How a rank's buffer may be written again (attnmerge_exchange.reuse; see above). */
typedef enum attnmerge_exchange_reuse {
  ATTNMERGE_EXCHANGE_WAIT_READERS = 0, /* the merge returns once every rank has read this rank's state */
  ATTNMERGE_EXCHANGE_ALTERNATE = 1     /* two buffers per rank, the state of epoch e in buffer e % 2 */
} attnmerge_exchange_reuse;

/* Which rows of the states a rank merges (attnmerge_merge_exchange's slice). */
typedef enum attnmerge_slice {
  ATTNMERGE_SLICE_TOKENS = 0, /* a range of tokens, every head */
  ATTNMERGE_SLICE_HEADS = 1   /* a range of heads, every token */
} attnmerge_slice;

/* The ranks of an exchange, as one rank addresses them. */
typedef struct attnmerge_exchange {
  /* The layout the caller was built against: 0, or sizeof(attnmerge_exchange) of a released
   * attnmerge.h (this one's: 0.2.0's); another size is refused. */
  uint32_t struct_size;
  int32_t rank;       /* this rank: 0 <= rank < world_size */
  int32_t world_size; /* 1 to ATTNMERGE_EXCHANGE_MAX_WORLD */
  int32_t reuse;      /* attnmerge_exchange_reuse: the same for every rank */
  int64_t timeout_ns; /* > 0: the longest any wait of the exchange lasts before it gives up */
  /* world_size pointers each, entry p rank p's as this rank addresses it (its own, or a peer's
   * mapped into this rank's address space): its O and LSE, laid out as o_layout and lse_layout
   * say, and its signal pad.  On a GPU each is memory of this rank's device or of a device it can
   * access as a peer; on the host, host memory. */
  const void* const* o;
  const void* const* lse;
  void* const* pads;
  /* The layout every rank's O shares: shape [tokens, heads, head_size], strides, dtype (float32,
   * float16 or bfloat16), device (this rank's: where its output lives) and flags (with
   * ATTNMERGE_DEVICE_KNOWN no pointer of the exchange is asked of CUDA); data is not read (each
   * rank's is o[p]).  lse_layout: every rank's LSE, float32 [tokens, heads], likewise. */
  attnmerge_tensor o_layout;
  attnmerge_tensor lse_layout;
  /* Softmax statistics in place of LSEs (as attnmerge_options.sum_a for the merges): NULL (default),
   * the ranks' lse hold LSEs; else world_size pointers, entry p rank p's sums (float32, laid out as
   * lse_layout says, addressed as lse[p] is), each rank's lse[p] then holding its running maxima:
   * rank p's state's LSE is lse + log(sum) (log2 with ATTNMERGE_LSE_BASE2), and a sum of 0 an
   * empty part, whatever the maximum holds. */
  const void* const* sum;
} attnmerge_exchange;

/** The bytes of one rank's signal pad.
 *
 * \param[in] world_size  the ranks of the exchange
 * \return the pad's size, or 0 where world_size is not from 1 to ATTNMERGE_EXCHANGE_MAX_WORLD
 */
ATTNMERGE_API int64_t attnmerge_exchange_pad_bytes(int32_t world_size);

/** Publishes this rank's state of an epoch: stores the epoch in the ready slot of this rank in
 * every rank's pad (release semantics, system scope), once the work before it on `stream` is done.
 *
 * \param[in] exchange  the ranks (its pads, rank and world_size are read; o and lse may be NULL)
 * \param[in] epoch     > 0: the epoch, newer than the last this rank published; 0: that one + 1,
 *                      read from the pad by the kernel (CUDA graphs)
 * \param[in] stream    a cudaStream_t (NULL: the legacy default stream); ignored on the host
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_exchange_publish(const attnmerge_exchange* exchange, int64_t epoch,
                                                          void* stream);

/** The exchange fused with the merge: (out, out_lse) = the merge of every rank's rows of this
 * rank's slice, each read where it lies, once every rank has published the epoch; then, with
 * ATTNMERGE_EXCHANGE_WAIT_READERS, this rank waits until every rank has read its state.  Row
 * (t, h) of out is the merge of row (t, h) + the slice's start of every rank's state, in rank
 * order, and options->sink [heads of out] where given; bit for bit on the host what
 * attnmerge_merge_states gives over the states gathered (with the same sums and valid).
 * options.flags: ATTNMERGE_LSE_BASE2, ATTNMERGE_OUT_LSE_BASE2 / _BASE_E and ATTNMERGE_PDL; an
 * output scale (FP8 out), a sink and options.valid [tokens of out, world_size] (on this rank's
 * device: which ranks hold keys for each token of the slice, as the N-way merge's [tokens, S]); no
 * group scales, and the ranks' softmax sums in exchange->sum, not options.sum_a.
 *
 * \param[out] out          O [tokens of the slice, heads of the slice, head_size]: float32, float16,
 *                          bfloat16 or FP8 E4M3, on this rank's device, apart from every rank's state
 * \param[out] out_lse      LSE [tokens of the slice, heads of the slice], float32; NULL: not written
 * \param[in]  exchange     the ranks, their states and pads
 * \param[in]  slice        attnmerge_slice: the axis out takes a range of (its other axis is whole)
 * \param[in]  slice_begin  the range's first token or head: 0 <= slice_begin, and slice_begin + out's
 *                          size on that axis <= the states' size on it
 * \param[in]  epoch        > 0: the epoch, the last this rank published; 0: that one, read from the
 *                          pad by the kernel (CUDA graphs)
 * \param[in]  options      NULL: the defaults
 * \param[in]  stream       a cudaStream_t (NULL: the legacy default stream); ignored on the host
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why); on the GPU a
 *         timeout or a stale epoch is found by the kernel, and attnmerge_exchange_status returns it
 */
ATTNMERGE_API attnmerge_status attnmerge_merge_exchange(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                        const attnmerge_exchange* exchange, int32_t slice,
                                                        int64_t slice_begin, int64_t epoch,
                                                        const attnmerge_options* options, void* stream);

/** What this rank's exchange calls recorded when they gave up, and clears it: ATTNMERGE_SUCCESS
 * where nothing is recorded; ATTNMERGE_ERROR_TIMEOUT (a wait) or ATTNMERGE_ERROR_VALUE (a stale
 * epoch), with attnmerge_last_error() naming this rank, the rank it waited for and the epoch.  On
 * the GPU it waits for `stream` (the work before it), reading the pad: the one exchange call
 * that synchronizes the host.
 *
 * \param[in] exchange  the ranks (its pads, rank and world_size are read)
 * \param[in] stream    a cudaStream_t (NULL: the legacy default stream); ignored on the host
 * \return the recorded failure's status, ATTNMERGE_SUCCESS, or an error status of the call itself
 */
ATTNMERGE_API attnmerge_status attnmerge_exchange_status(const attnmerge_exchange* exchange, void* stream);

/* What the calling thread's last op enqueued on the GPU, for tests, benchmarks and tools that
 * check which kernel a shape gets (the launch plan, cpp/include/attnmerge/plan.h).  Host calls,
 * empty calls and refused calls enqueue nothing: launches = 0. */
#define ATTNMERGE_KERNEL_NONE 0
#define ATTNMERGE_KERNEL_ROWS 1          /* one thread per pack of a row walks its states */
#define ATTNMERGE_KERNEL_ROWS_PLAIN 2    /* the same, two states, no mask, a_tokens, tiles or scale pointer */
#define ATTNMERGE_KERNEL_ROWS_INPLACE 3  /* the same, the merged LSE written over an input's in the same launch */
#define ATTNMERGE_KERNEL_STATES 4        /* a row's states shared by groups of threads, combined in shared memory */
#define ATTNMERGE_KERNEL_BACKWARD 5      /* the backward: lanes of a warp per row, the dots summed by shuffles */
#define ATTNMERGE_KERNEL_EXCHANGE 6      /* the exchange: one thread per pack of a row reads every rank's state */
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

/** What the calling thread's last op enqueued on the GPU.
 *
 * \param[out] info  filled in; NULL: nothing is written
 */
ATTNMERGE_API void attnmerge_last_launch(attnmerge_launch_info* info);

/** The row of the library's dtype table for one code.
 *
 * \param[in] dtype  an attnmerge_dtype: the codes run from 0 up to the first that gives NULL
 * \return the row, which lives as long as the library, or NULL where `dtype` names none
 */
ATTNMERGE_API const attnmerge_dtype_info* attnmerge_dtype_info_of(int32_t dtype);

/* The error message of the calling thread's last call ("" after a success), valid until its next call. */
ATTNMERGE_API const char* attnmerge_last_error(void);

/** The name of a status ("invalid value").
 *
 * \param[in] status  an attnmerge_status (another value gives "unknown status")
 */
ATTNMERGE_API const char* attnmerge_status_string(attnmerge_status status);

/* Version: ATTNMERGE_VERSION_NUMBER and ATTNMERGE_VERSION_STRING of the library actually loaded. */
ATTNMERGE_API int attnmerge_version(void);
ATTNMERGE_API const char* attnmerge_version_string(void);

/* The GPU code compiled in.  attnmerge_cuda_architectures(): the SMs with SASS, as
 * "75;80;86;89;90;100;120" (the release list; "" for a build of PTX alone).
 * attnmerge_cuda_ptx_architectures(): the virtual architectures whose PTX is embedded ("120" in the
 * release list, sm_90's in a CUDA 12 build compiled by clang), which the driver JIT-compiles, once
 * and into its cache, for a GPU with no SASS of its own: the newest PTX not above the GPU's SM; a GPU
 * older than every SASS and PTX runs none.  attnmerge_cuda_architectures_choice(): how the build
 * chose them: "detected" (the GPUs of the build machine), "no-gpu" (none found there: PTX alone),
 * "release" or "requested" (a list given).  And the CUDA toolkit version the library was built with
 * (e.g. 13000; 12090 for the CUDA 12 build, attnmerge-cu12). */
ATTNMERGE_API const char* attnmerge_cuda_architectures(void);
ATTNMERGE_API const char* attnmerge_cuda_ptx_architectures(void);
ATTNMERGE_API const char* attnmerge_cuda_architectures_choice(void);
ATTNMERGE_API int attnmerge_cuda_build_version(void);

/* The installed driver's CUDA version (0 if there is no driver) and the number of usable devices
 * (0 without a driver or device).  Neither fails. */
ATTNMERGE_API int attnmerge_cuda_driver_version(void);
ATTNMERGE_API int attnmerge_device_count(void);

/** The CUDA device whose device memory a pointer points into, for callers that hold bare pointers
 * (__cuda_array_interface__).
 *
 * \param[in] ptr  any pointer
 * \return a CUDA device ordinal, or ATTNMERGE_HOST for anything the host can address (ordinary,
 *         pinned or managed memory) and when there is no driver
 */
ATTNMERGE_API int attnmerge_pointer_device(const void* ptr);

/** Blocks the host until a stream has finished its work.  Never called by the ops themselves; for
 * callers that must hand results to a framework that cannot wait on a stream.
 *
 * \param[in] device  the CUDA device of the stream
 * \param[in] stream  a cudaStream_t (NULL: the legacy default stream)
 * \return ATTNMERGE_SUCCESS or an error status (attnmerge_last_error() says why)
 */
ATTNMERGE_API attnmerge_status attnmerge_stream_synchronize(int32_t device, void* stream);

#ifdef __cplusplus
}
#endif

#endif /* ATTNMERGE_ATTNMERGE_H_ */
