// Just enough of the CUDA runtime for the header-only kernels to compile as host C++, so that
// backward_emulator.cpp can run the backward kernel's code on the CPU: the launch geometry as
// thread-local variables, a row's lanes as host threads, and __shfl_xor_sync as an exchange
// between them (emulator.h).  Device-only code (__CUDA_ARCH__) is not compiled.
#pragma once

#include <cstddef>
#include <cstdint>

#define __global__
#define __device__
#define __host__
#define __shared__
#define __forceinline__ inline
#define __launch_bounds__(...)

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};
inline thread_local dim3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0}, blockDim, gridDim;

struct uint2 {
  unsigned x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct float2 {
  float x, y;
};
struct float4 {
  float x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }

using cudaError_t = int;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;
using cudaStream_t = void*;
constexpr int cudaLaunchAttributeProgrammaticStreamSerialization = 1;
struct cudaLaunchAttributeValue {
  int programmaticStreamSerializationAllowed;
};
struct cudaLaunchAttribute {
  int id;
  cudaLaunchAttributeValue val;
};
struct cudaLaunchConfig_t {
  dim3 gridDim, blockDim;
  size_t dynamicSmemBytes;
  cudaStream_t stream;
  cudaLaunchAttribute* attrs;
  unsigned numAttrs;
};
// Launches are not emulated (the emulator calls the kernel itself, lane by lane).
template <typename Kernel, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t*, Kernel, Args&&...) {
  return 1;
}

inline void __syncthreads() {}
inline void __syncwarp(unsigned = 0xffffffffu) {}

// The exchange of the calling lane's row (set by the emulator).
float emulated_shfl_xor(float v, int offset);
inline float __shfl_xor_sync(unsigned, float v, int offset) { return emulated_shfl_xor(v, offset); }
// Declared for the forward kernels' code to compile; the emulator runs only the backward kernel.
float __shfl_sync(unsigned, float v, int src_lane);
