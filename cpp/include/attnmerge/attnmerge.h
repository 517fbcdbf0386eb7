/* attnmerge: merge partial attention states (O, LSE).  The C ABI of libattnmerge.
 *
 * A partial state is an output O of logical shape [tokens, heads, head_size] and its log-sum-exp
 * LSE of logical shape [tokens, heads].  Merging states gives the attention over the union of
 * their key sets (section 2.2 of arXiv 2501.01005).  For the states i of one (token, head) row:
 *
 *   m = max_i lse_i,  w_i = exp(lse_i - m),  W = sum_i w_i,
 *   O = sum_i (w_i / W) * O_i,  LSE = m + log W        (exp/log in base e, or base 2 on request)
 *
 *   - an LSE of +inf marks an empty part (FlashAttention-2) and counts as -inf;
 *   - all parts empty: O = 0 and LSE = -inf, never NaN;
 *   - a part whose weight is exactly zero is never read, so NaN in an empty part cannot leak;
 *   - a NaN LSE makes its row NaN (O and LSE);
 *   - arithmetic is float32 whatever the storage type; the output is rounded once.
 *
 * Conventions of every entry point:
 *   - returns ATTNMERGE_SUCCESS or an error status; attnmerge_last_error() then holds a message
 *     for the calling thread that names the offending argument, the expected and the actual value;
 *   - validates every argument before it writes anything;
 *   - never allocates device memory, never synchronizes the host, never throws, never prints;
 *     GPU work is enqueued on the caller's stream, so every op can be captured in a CUDA graph;
 *   - the device is the one the tensors live on (all on one device, or all on the host); the
 *     calling thread's current device is restored before returning;
 *   - host tensors (device == ATTNMERGE_HOST) run on the CPU, synchronously, multi-threaded
 *     for large inputs (ATTNMERGE_NUM_THREADS caps the number of threads).
 */
#ifndef ATTNMERGE_ATTNMERGE_H_
#define ATTNMERGE_ATTNMERGE_H_

#include <stdint.h>

#define ATTNMERGE_VERSION_MAJOR 0
#define ATTNMERGE_VERSION_MINOR 1
#define ATTNMERGE_VERSION_PATCH 0
#define ATTNMERGE_VERSION_STRING "0.1.0"
#define ATTNMERGE_VERSION_NUMBER \
  (ATTNMERGE_VERSION_MAJOR * 10000 + ATTNMERGE_VERSION_MINOR * 100 + ATTNMERGE_VERSION_PATCH)

#if defined(_WIN32)
#define ATTNMERGE_API __declspec(dllexport)
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
  ATTNMERGE_BFLOAT16 = 2
} attnmerge_dtype;

/* The device of host memory. */
#define ATTNMERGE_HOST (-1)

/* attnmerge_tensor.flags */
#define ATTNMERGE_READ_ONLY 1u /* refused where the tensor is an output */

/* A strided view of up to ATTNMERGE_MAX_NDIM dimensions.  In the two-way merge O tensors have
 * ndim 3 ([tokens, heads, head_size], head_size unit-stride), LSE tensors ndim 2 ([tokens, heads],
 * float32; [heads, tokens] with ATTNMERGE_LSE_HEADS_FIRST).  Strides count elements, not bytes,
 * and must be >= 0. */
#define ATTNMERGE_MAX_NDIM 4
typedef struct attnmerge_tensor {
  void* data;
  int64_t shape[ATTNMERGE_MAX_NDIM];
  int64_t strides[ATTNMERGE_MAX_NDIM];
  int32_t ndim;
  int32_t dtype;  /* attnmerge_dtype */
  int32_t device; /* ATTNMERGE_HOST or a CUDA device ordinal */
  uint32_t flags; /* ATTNMERGE_READ_ONLY */
} attnmerge_tensor;

/* attnmerge_options.flags */
#define ATTNMERGE_LSE_BASE2 1u        /* LSEs are log2-sum-exp2 (FlashInfer); default base e */
#define ATTNMERGE_LSE_HEADS_FIRST 2u  /* every LSE tensor is laid out [heads, tokens] (vLLM) */

typedef struct attnmerge_options {
  uint32_t flags;
  /* Two-way merge: only rows of the first a_tokens tokens merge a with b; the others take b alone
   * (its state unchanged; an empty b gives O = 0, LSE = -inf) and never read a.  a then needs only
   * a_tokens tokens.  Negative: all tokens (vLLM's prefill_tokens_with_context). */
  int64_t a_tokens;
} attnmerge_options;

/* Two-way merge: (out, out_lse) = merge((o_a, lse_a), (o_b, lse_b)).
 * out_lse may be NULL (or have a NULL data pointer): no LSE is written.  options may be NULL
 * (base e, [tokens, heads] LSE, all tokens).  stream is a cudaStream_t (NULL: the legacy default
 * stream), ignored for host tensors.  out may be o_a or o_b itself (the same view), never a
 * partial overlap of them.  dtypes: o_a and o_b share one of float32, float16 or bfloat16; out
 * has any of them. */
ATTNMERGE_API attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                               const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                               const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                               const attnmerge_options* options, void* stream);

/* The error message of the calling thread's last call ("" after a success), valid until its next call. */
ATTNMERGE_API const char* attnmerge_last_error(void);
ATTNMERGE_API const char* attnmerge_status_string(attnmerge_status status);

/* Version: ATTNMERGE_VERSION_NUMBER and ATTNMERGE_VERSION_STRING of the library actually loaded. */
ATTNMERGE_API int attnmerge_version(void);
ATTNMERGE_API const char* attnmerge_version_string(void);

/* The GPU architectures compiled in, as "75;80;86;89;90;100;120" (SASS for each, PTX for the last),
 * and the CUDA toolkit version the library was built with (e.g. 13000). */
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
