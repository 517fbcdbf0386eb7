// Host time per call, in microseconds: libattnmerge's C ABI (validation, device selection,
// dispatch and launch) against launching the same kernel directly through the header-only
// launcher, and the CUDA calls the C ABI makes.  The difference of the first two is the C ABI's
// host overhead with the kernel launch excluded.  Each figure: the median over 15 batches of 200
// calls, timed on the host with nothing waited for inside a batch (1 x 32 x 128 bfloat16, the
// decode shape, whose kernels finish about as fast as they are queued).  Below them, what one
// launch of an empty kernel costs through each launch API, the driver's included: the floor
// under any call that launches a kernel.
#include <attnmerge/attnmerge.h>
#include <attnmerge/merge_kernels.cuh>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "common.h"

namespace {

constexpr int64_t kTokens = 1, kHeads = 32, kHeadSize = 128;

__global__ void empty_kernel() {}

// A driver call's result, as check_cuda does for the runtime's: its name and an exit on failure.
void check_cu(CUresult r, const char* what) {
  if (r != CUDA_SUCCESS) {
    std::fprintf(stderr, "%s: CUresult %d\n", what, static_cast<int>(r));
    std::exit(1);
  }
}

attnmerge_tensor tensor(void* data, int ndim, int dtype, uint32_t flags) {
  const int64_t shape[3] = {kTokens, kHeads, kHeadSize};
  attnmerge_tensor t = attnmerge_contiguous_tensor(data, dtype, 0, ndim, shape);
  t.flags = flags;
  return t;
}

}  // namespace

int main() {
  if (!have_gpu("host_overhead")) return 1;
  check_cuda(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop;
  check_cuda(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
  cudaStream_t stream;
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  const size_t o_bytes = kTokens * kHeads * kHeadSize * 2, lse_bytes = kTokens * kHeads * 4;
  void *o_a, *o_b, *out, *lse_a, *lse_b, *out_lse;
  for (void** p : {&o_a, &o_b, &out}) check_cuda(cudaMalloc(p, o_bytes), "cudaMalloc");
  for (void** p : {&lse_a, &lse_b, &out_lse}) check_cuda(cudaMalloc(p, lse_bytes), "cudaMalloc");
  check_cuda(cudaMemset(o_a, 0, o_bytes), "cudaMemset");
  check_cuda(cudaMemset(o_b, 0, o_bytes), "cudaMemset");
  check_cuda(cudaMemset(lse_a, 0, lse_bytes), "cudaMemset");
  check_cuda(cudaMemset(lse_b, 0, lse_bytes), "cudaMemset");

  std::printf("%s, CUDA driver %d, attnmerge %s, 1 x 32 x 128 bfloat16, host us per call (median)\n", prop.name,
              attnmerge_cuda_driver_version(), attnmerge_version_string());
  const double empty = host_us([&] { empty_kernel<<<1, 32, 0, stream>>>(); }, stream);

  // The kernel the C ABI launches for this call, launched directly (no validation).
  using namespace attnmerge;
  const MergeShape shape{kTokens, kHeads, kHeadSize, false};
  const StateView a{o_a, kHeads * kHeadSize, kHeadSize, static_cast<const float*>(lse_a), kHeads, 1};
  const StateView b{o_b, kHeads * kHeadSize, kHeadSize, static_cast<const float*>(lse_b), kHeads, 1};
  const PairSource src{a, b, kTokens, nullptr, 0};
  const OutView dst{out, kHeads * kHeadSize, kHeadSize, static_cast<float*>(out_lse), kHeads, 1, 1.0f, nullptr, false};
  const LaunchPlan plan = bf16_plan(shape, src, dst, 3 * o_bytes + 3 * lse_bytes, prop.multiProcessorCount);
  const double direct =
      host_us([&] { check_cuda(launch_bf16(plan, src, dst, stream), "launch"); }, stream);

  double abi[2];
  for (int known = 0; known < 2; ++known) {
    const uint32_t f = known ? ATTNMERGE_DEVICE_KNOWN : 0u;
    const attnmerge_tensor t_out = tensor(out, 3, ATTNMERGE_BFLOAT16, f), t_lse = tensor(out_lse, 2, ATTNMERGE_FLOAT32, f),
                           t_oa = tensor(o_a, 3, ATTNMERGE_BFLOAT16, f), t_la = tensor(lse_a, 2, ATTNMERGE_FLOAT32, f),
                           t_ob = tensor(o_b, 3, ATTNMERGE_BFLOAT16, f), t_lb = tensor(lse_b, 2, ATTNMERGE_FLOAT32, f);
    abi[known] = host_us(
        [&] {
          if (attnmerge_merge(&t_out, &t_lse, &t_oa, &t_la, &t_ob, &t_lb, nullptr, stream) != ATTNMERGE_SUCCESS) {
            std::fprintf(stderr, "attnmerge_merge: %s\n", attnmerge_last_error());
            std::exit(1);
          }
        },
        stream);
  }
  cudaPointerAttributes attr;
  const double query = host_us([&] { check_cuda(cudaPointerGetAttributes(&attr, o_a), "query"); }, stream);
  int dev = 0;
  const double get_device = host_us([&] { check_cuda(cudaGetDevice(&dev), "cudaGetDevice"); }, stream);

  // One empty launch through each API (the driver's entry points fetched through the runtime).
  PFN_cuLaunchKernel_v4000 cu_launch = nullptr;
  PFN_cuLaunchKernelEx_v11060 cu_launch_ex = nullptr;
  check_cuda(cudaGetDriverEntryPointByVersion("cuLaunchKernel", reinterpret_cast<void**>(&cu_launch), 12000,
                                              cudaEnableDefault, nullptr),
             "cuLaunchKernel entry point");
  check_cuda(cudaGetDriverEntryPointByVersion("cuLaunchKernelEx", reinterpret_cast<void**>(&cu_launch_ex), 12000,
                                              cudaEnableDefault, nullptr),
             "cuLaunchKernelEx entry point");
  cudaFunction_t empty_function;
  check_cuda(cudaGetFuncBySymbol(&empty_function, reinterpret_cast<const void*>(empty_kernel)), "cudaGetFuncBySymbol");
  const CUfunction f = reinterpret_cast<CUfunction>(empty_function);
  const double runtime_ex = host_us(
      [&] {
        cudaLaunchConfig_t config = {};
        config.gridDim = dim3(1);
        config.blockDim = dim3(32);
        config.stream = stream;
        check_cuda(cudaLaunchKernelEx(&config, empty_kernel), "cudaLaunchKernelEx");
      },
      stream);
  const double driver = host_us(
      [&] {
        check_cu(cu_launch(f, 1, 1, 1, 32, 1, 1, 0, reinterpret_cast<CUstream>(stream), nullptr, nullptr), "cuLaunchKernel");
      },
      stream);
  const double driver_ex = host_us(
      [&] {
        CUlaunchConfig config = {};
        config.gridDimX = config.gridDimY = config.gridDimZ = 1;
        config.blockDimX = 32;
        config.blockDimY = config.blockDimZ = 1;
        config.hStream = reinterpret_cast<CUstream>(stream);
        check_cu(cu_launch_ex(&config, f, nullptr, nullptr), "cuLaunchKernelEx");
      },
      stream);

  std::printf("  empty kernel launch (<<<1, 32>>>)                 %6.2f\n", empty);
  std::printf("  the merge kernel launched directly (header-only)  %6.2f\n", direct);
  std::printf("  attnmerge_merge, pointers checked by CUDA         %6.2f\n", abi[0]);
  std::printf("  attnmerge_merge, ATTNMERGE_DEVICE_KNOWN           %6.2f\n", abi[1]);
  std::printf("  cudaPointerGetAttributes                          %6.2f\n", query);
  std::printf("  cudaGetDevice                                     %6.2f\n", get_device);
  std::printf("  empty kernel, cudaLaunchKernelEx                  %6.2f\n", runtime_ex);
  std::printf("  empty kernel, cuLaunchKernel (driver)             %6.2f\n", driver);
  std::printf("  empty kernel, cuLaunchKernelEx (driver)           %6.2f\n", driver_ex);
  std::printf("C ABI host overhead, kernel launch excluded: %.2f us (pointers checked), %.2f us (device known)\n",
              abi[0] - direct, abi[1] - direct);
  return 0;
}
