// A C ABI over FlashInfer's cascade launchers (flashinfer/attention/cascade.cuh: MergeState,
// MergeStateInPlace, MergeStates, VariableLengthMergeStates), so that the vs_flashinfer routine can
// call FlashInfer's own CUDA kernels through ctypes with device pointers and a cudaStream_t, with no
// FlashInfer Python package, JIT or tvm-ffi.  FlashInfer's headers come from its PyPI wheel
// (benchmarks/peers/fetch.py); the library built from this file and them lives in the ignored
// benchmarks/peers/build/ and is never committed.  benchmarks/routines/peers.py builds it with the
// flags FlashInfer's JIT gives its cascade module.
//
// Element types: float16 (1) and bfloat16 (2), the ones FlashInfer's Python API dispatches; the
// output type is the input's.  indptr: int32.  Every function returns 0, a cudaError_t (> 0) when
// CUDA failed, or -1 when the launcher threw (FlashInfer takes head dims 64, 128, 256 and 512 only)
// or a code is unknown; am_fi_last_error() then says what happened (per thread).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>

#include <flashinfer/attention/cascade.cuh>

namespace {

thread_local std::string last_error;

enum ElementType : int { kFloat16 = 1, kBFloat16 = 2 };

// Calls f with a null pointer of the element type `code` names.
template <typename F>
cudaError_t for_element(int code, F&& f) {
  if (code == kFloat16) return f(static_cast<half*>(nullptr));
  if (code == kBFloat16) return f(static_cast<nv_bfloat16*>(nullptr));
  throw std::invalid_argument("element type " + std::to_string(code) + ": expected 1 (float16) or 2 (bfloat16)");
}

// The launcher's cudaError_t, or its exception, as the return code and the message.
template <typename F>
int guarded(const char* what, F&& f) noexcept {
  try {
    const cudaError_t e = f();
    last_error = e == cudaSuccess ? std::string() : std::string(what) + ": " + cudaGetErrorString(e);
    return static_cast<int>(e);
  } catch (const std::exception& ex) {
    last_error = std::string(what) + ": " + ex.what();
  } catch (...) {
    last_error = std::string(what) + ": an exception of unknown type";
  }
  return -1;
}

}  // namespace

extern "C" {

const char* am_fi_last_error(void) { return last_error.c_str(); }

// This library links its own CUDA runtime (statically): its current device is set once, to the
// caller's.
int am_fi_set_device(int device) {
  return guarded("cudaSetDevice", [&] { return cudaSetDevice(device); });
}

// v_a, v_b, v_merged [tokens, heads, head_dim]; s_a, s_b, s_merged float32 [tokens, heads], base 2.
int am_fi_merge_state(int type, void* v_a, float* s_a, void* v_b, float* s_b, void* v_merged, float* s_merged,
                      uint32_t tokens, uint32_t heads, uint32_t head_dim, void* stream) {
  return guarded("MergeState", [&] {
    return for_element(type, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return flashinfer::MergeState<T, T>(static_cast<T*>(v_a), s_a, static_cast<T*>(v_b), s_b,
                                          static_cast<T*>(v_merged), s_merged, tokens, heads, head_dim,
                                          static_cast<cudaStream_t>(stream));
    });
  });
}

// (v, s) <- merge((v, s), (v_other, s_other)) for the tokens whose uint8 mask is not 0 (every token
// where mask is null).
int am_fi_merge_state_in_place(int type, void* v, float* s, void* v_other, float* s_other, uint8_t* mask,
                               uint32_t tokens, uint32_t heads, uint32_t head_dim, void* stream) {
  return guarded("MergeStateInPlace", [&] {
    return for_element(type, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return flashinfer::MergeStateInPlace<T>(static_cast<T*>(v), s, static_cast<T*>(v_other), s_other, tokens,
                                              heads, head_dim, mask, static_cast<cudaStream_t>(stream));
    });
  });
}

// v [tokens, states, heads, head_dim], s float32 [tokens, states, heads] -> v_merged [tokens, heads,
// head_dim], s_merged [tokens, heads].
int am_fi_merge_states(int type, void* v, float* s, void* v_merged, float* s_merged, uint32_t states, uint32_t tokens,
                       uint32_t heads, uint32_t head_dim, void* stream) {
  return guarded("MergeStates", [&] {
    return for_element(type, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return flashinfer::MergeStates<T, T>(static_cast<T*>(v), s, static_cast<T*>(v_merged), s_merged, states,
                                           tokens, heads, head_dim, static_cast<cudaStream_t>(stream));
    });
  });
}

// Row r of v_merged [rows, heads, head_dim] merges states indptr[r] .. indptr[r + 1] - 1 of v
// [total, heads, head_dim] (s float32 [total, heads]); every row is merged (no device row count), as
// FlashInfer's decode and prefill call it.
int am_fi_variable_length_merge_states(int type, void* v, float* s, int32_t* indptr, void* v_merged, float* s_merged,
                                       uint32_t rows, uint32_t heads, uint32_t head_dim, int enable_pdl,
                                       void* stream) {
  return guarded("VariableLengthMergeStates", [&] {
    return for_element(type, [&](auto* tag) {
      using T = std::remove_pointer_t<decltype(tag)>;
      return flashinfer::VariableLengthMergeStates<T, T, int32_t>(
          static_cast<T*>(v), s, indptr, static_cast<T*>(v_merged), s_merged, rows, nullptr, heads, head_dim,
          enable_pdl != 0, static_cast<cudaStream_t>(stream));
    });
  });
}

}  // extern "C"
