// The floor under any launch in a CUDA graph: a trivial kernel (512 threads, each writing one word)
// with 16 to 1024 bytes of parameters, and the same kernel as 2 x 256, 4 x 128, 8 x 64 and 16 x 32
// threads.  us per launch by graph replay (median); figures in benchmarks/NOTES.md.
#include <cstdint>
#include <cstdio>

#include "common.h"

namespace {

template <int N>
struct Blob {
  uint32_t w[N / 4];
};

template <int N>
__global__ void touch(Blob<N> p, uint32_t* out) {
  out[blockIdx.x * blockDim.x + threadIdx.x] = p.w[threadIdx.x % (N / 4)];
}

template <int N>
double launch_us(uint32_t* out, cudaStream_t s, int blocks, int threads) {
  Blob<N> b{};
  for (int i = 0; i < N / 4; ++i) b.w[i] = i;
  return graph_us([&](int) { touch<N><<<blocks, threads, 0, s>>>(b, out); }, s, 100);
}

}  // namespace

int main() {
  if (!have_gpu("launch_floor")) return 1;
  cudaStream_t s;
  check_cuda(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  uint32_t* out;
  check_cuda(cudaMalloc(&out, 1 << 20), "cudaMalloc");
  std::printf("parameters, 2 x 256 threads:  16 B %.3f | 64 B %.3f | 128 B %.3f | 256 B %.3f | 512 B %.3f | 1024 B %.3f us\n",
              launch_us<16>(out, s, 2, 256), launch_us<64>(out, s, 2, 256), launch_us<128>(out, s, 2, 256),
              launch_us<256>(out, s, 2, 256), launch_us<512>(out, s, 2, 256), launch_us<1024>(out, s, 2, 256));
  std::printf("blocks, 64 B parameters:      2 x 256 %.3f | 4 x 128 %.3f | 8 x 64 %.3f | 16 x 32 %.3f us\n",
              launch_us<64>(out, s, 2, 256), launch_us<64>(out, s, 4, 128), launch_us<64>(out, s, 8, 64),
              launch_us<64>(out, s, 16, 32));
  return 0;
}
