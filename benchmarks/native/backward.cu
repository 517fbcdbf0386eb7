// The merges' backward (merge_backward_kernels.cuh) against the HBM roofline: T x S x 32 x 128
// bfloat16 states ([tokens, S, heads, D]), the forward's O and LSE made by the library's own
// forward, random dO and dLSE; the N-way backward at S = 2, 4, 8 and 16 and the two-way one
// (S = 2 through PairBackward, which the C ABI also takes for N-way calls of S = 2: the "stack"
// row of S = 2 is the alternative), by CUDA-graph replay through the header-only launcher; each with
// the forward's O passed in (the default) and without it (out = NULL), whose bytes omit O, for
// S > 2 a row's states split into G = 1 to 8 groups of threads with C = 2 or 4 states in flight
// (the plan's choice is one of them), and for S > 4 the kernel with 8 states in flight (an
// alternative, not the library's).
//
// bytes = read S O_i + dO + O + S lse_i + LSE + dLSE, write S dO_i + S dlse_i, printed against a
// device-to-device copy of 1 GiB (cudaMemcpyAsync, half writes) and against the ceiling of the
// backward's own mix of S + 2 reads to S writes (mix_ceiling), both measured in the same run; the
// target is >= 90% of the roofline at 8192 tokens, S = 2 and S = 8 (issue 16).  Each case also
// checks a few rows against a host computation of the formula (max relative error printed).
#include <attnmerge/merge_backward_kernels.cuh>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "common.h"

using namespace attnmerge;

namespace {

constexpr int64_t kHeads = 32, kHeadSize = 128;

// Values from a hash of the index: bfloat16 in [-1, 1), LSE in [-4, 4).
__global__ void fill_bf16(uint16_t* x, int64_t n, uint32_t seed) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = uint16_t(__float_as_uint(float(hash_index(i, seed) & 0xffff) / 32768.0f - 1.0f) >> 16);
}
__global__ void fill_f32(float* x, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    x[i] = scale * (float(hash_index(i, seed) & 0xffff) / 32768.0f - 1.0f);
}

template <typename T>
T* device_alloc(int64_t n) {
  void* p = nullptr;
  check_cuda(cudaMalloc(&p, size_t(n) * sizeof(T)), "cudaMalloc");
  return static_cast<T*>(p);
}

// Copy bandwidth of the device, GB/s (read + write bytes over time).
double copy_gbps(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  void *a, *b;
  check_cuda(cudaMalloc(&a, bytes), "cudaMalloc");
  check_cuda(cudaMalloc(&b, bytes), "cudaMalloc");
  check_cuda(cudaMemset(a, 1, bytes), "cudaMemset");
  const double us = graph_us([&](int) { check_cuda(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, stream), "copy"); },
                             stream, 5);
  cudaFree(a);
  cudaFree(b);
  return 2.0 * bytes / us / 1e3;
}

// The HBM ceiling for the backward's mix of traffic, GB/s: R streams read and W written, each as
// long as one state's O (`vectors` 16-byte vectors), one thread a vector keeping its R loads in
// flight at once: no arithmetic, no strides, the most a kernel moving those bytes in that
// proportion (S + 2 reads to S writes a row) was measured to reach on this GPU.
struct Streams {
  const uint4* in[18];
  uint4* out[16];
};
template <int R, int W>
__global__ void mix_kernel(Streams s, int64_t vectors) {
  const int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
  if (i >= vectors) return;
  uint4 v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = s.in[r][i];
  uint4 x = v[0];
#pragma unroll
  for (int r = 1; r < R; ++r) x.x ^= v[r].x, x.y ^= v[r].y, x.z ^= v[r].z, x.w ^= v[r].w;
#pragma unroll
  for (int w = 0; w < W; ++w) s.out[w][i] = make_uint4(x.x + w, x.y, x.z, x.w);
}

template <int R, int W>
double mix_gbps(int64_t vectors, cudaStream_t stream) {
  Streams s{};
  std::vector<void*> all;
  for (int r = 0; r < R; ++r) {
    s.in[r] = static_cast<const uint4*>(all.emplace_back(device_alloc<uint4>(vectors)));
    check_cuda(cudaMemset(all.back(), r + 1, vectors * 16), "cudaMemset");
  }
  for (int w = 0; w < W; ++w) s.out[w] = static_cast<uint4*>(all.emplace_back(device_alloc<uint4>(vectors)));
  const unsigned blocks = static_cast<unsigned>((vectors + 255) / 256);
  const double us = graph_us([&](int) { mix_kernel<R, W><<<blocks, 256, 0, stream>>>(s, vectors); }, stream, 10);
  for (void* p : all) cudaFree(p);
  return (R + W) * 16.0 * vectors / us / 1e3;
}

// The ceiling for S states' backward (S + 2 streams read: the O_i, dO, O; S written: the dO_i).
double mix_ceiling(int64_t states, int64_t vectors, cudaStream_t stream) {
  switch (states) {
    case 2: return mix_gbps<4, 2>(vectors, stream);
    case 4: return mix_gbps<6, 4>(vectors, stream);
    case 8: return mix_gbps<10, 8>(vectors, stream);
    default: return mix_gbps<18, 16>(vectors, stream);
  }
}

void run_case(int64_t tokens, int64_t states, bool pair, int sms, double roof, cudaStream_t stream) {
  const int64_t o_elems = tokens * states * kHeads * kHeadSize, l_elems = tokens * states * kHeads;
  const int64_t out_elems = tokens * kHeads * kHeadSize, row_elems = tokens * kHeads;
  uint16_t *o = device_alloc<uint16_t>(o_elems), *grad_o = device_alloc<uint16_t>(o_elems);
  uint16_t *out = device_alloc<uint16_t>(out_elems), *grad_out = device_alloc<uint16_t>(out_elems);
  float *lse = device_alloc<float>(l_elems), *grad_lse = device_alloc<float>(l_elems);
  float *out_lse = device_alloc<float>(row_elems), *grad_out_lse = device_alloc<float>(row_elems);
  fill_bf16<<<1024, 256, 0, stream>>>(o, o_elems, 1);
  fill_bf16<<<1024, 256, 0, stream>>>(grad_out, out_elems, 2);
  fill_f32<<<1024, 256, 0, stream>>>(lse, l_elems, 3, 4.0f);
  fill_f32<<<1024, 256, 0, stream>>>(grad_out_lse, row_elems, 4, 1.0f);
  const int64_t o_st = states * kHeads * kHeadSize, o_ss = kHeads * kHeadSize, l_st = states * kHeads;
  // The forward's results, by the library's own forward.
  MergeShape shape(tokens, kHeads, kHeadSize, false);
  const StackSource in{o, o_st, o_ss, kHeadSize, lse, l_st, kHeads, 1, states};
  const OutView fwd{out, kHeads * kHeadSize, kHeadSize, out_lse, kHeads, 1, 1.0f, nullptr, false};
  const int64_t fwd_bytes = o_elems * 2 + l_elems * 4 + out_elems * 2 + row_elems * 4;
  check_cuda(launch_bf16(bf16_plan(shape, in, fwd, fwd_bytes, sms), in, fwd, stream),
             "forward");
  const StateView out_v{out, kHeads * kHeadSize, kHeadSize, out_lse, kHeads, 1};
  const StateView grad_out_v{grad_out, kHeads * kHeadSize, kHeadSize, grad_out_lse, kHeads, 1};
  const StackSource grad{grad_o, o_st, o_ss, kHeadSize, grad_lse, l_st, kHeads, 1, states};
  BackwardFacts facts;
  facts.vec = 8;
  facts.max_states = states;
  facts.saved_o = true;
  const BackwardPlan plan = plan_backward(shape, facts, DeviceInfo{sms, 9});
  facts.saved_o = false;
  const BackwardPlan plan_no_o = plan_backward(shape, facts, DeviceInfo{sms, 9});
  // The backward with the forward's O (the default) and without it (out = NULL: <dO, O> from the
  // states' dots, one vector a row less to read).
  const auto time_backward = [&](const StateView& saved, const BackwardPlan& how) {
    const auto call = [&](const auto& args) {
      return graph_us(
          [&](int) { check_cuda(launch_merge_backward<bfloat16_t, bfloat16_t, 8>(how, args, stream), "backward"); },
          stream, 10);
    };
    if (!pair) return call(BackwardArgs<StackBackward>{StackBackward{in, grad}, saved, grad_out_v, true, true});
    const auto pair_of = [&](const StackSource& s) {  // states 0 and 1 of the stack as a and b
      return PairSource{StateView{s.o, s.o_st, s.o_sh, s.lse, s.lse_st, s.lse_sh},
                        StateView{static_cast<const uint16_t*>(s.o) + s.o_ss, s.o_st, s.o_sh, s.lse + s.lse_ss,
                                  s.lse_st, s.lse_sh},
                        tokens, nullptr, 0};
    };
    return call(BackwardArgs<PairBackward>{PairBackward{pair_of(in), pair_of(grad)}, saved, grad_out_v, true, true});
  };
  StateView no_o = out_v;
  no_o.o = nullptr;
  no_o.o_st = no_o.o_sh = 0;
  const double us_no_o = time_backward(no_o, plan_no_o);
  // Alternatives with the forward's O: the row's states split into G groups (1 to 8) of
  // threads, each keeping C (2 or 4) states in flight.
  char split[256] = "";
  if (!pair && states > 2) {
    int at = 0;
    for (int g = 1; g <= 8; g *= 2)
      for (int c : {2, kSmallChunk}) {
        if (g > 1 && c > (states + g - 1) / g) continue;  // a group of fewer states than its chunk
        BackwardFacts f = facts;
        f.saved_o = true, f.groups = g, f.chunk = c;
        const BackwardPlan alt = plan_backward(shape, f, DeviceInfo{sms, 9});
        if (alt.groups != g) continue;
        at += std::snprintf(split + at, sizeof(split) - at, " G%dC%d %.1f", g, c, time_backward(out_v, alt));
      }
  }
  // An alternative for S > 4: the kernel with 8 states in flight (one round trip for S = 8, at
  // the cost of registers), launched on the library's grid.
  double us_chunk8 = 0;
  if (!pair && states > kSmallChunk) {
    const BackwardArgs<StackBackward> args{StackBackward{in, grad}, out_v, grad_out_v, true, true};
    cudaLaunchConfig_t config = {};
    config.stream = stream;
    config.gridDim = dim3(plan_no_o.dims.grid[0], plan_no_o.dims.grid[1], plan_no_o.dims.grid[2]);
    config.blockDim = dim3(plan_no_o.dims.block[0], plan_no_o.dims.block[1], plan_no_o.dims.block[2]);
    us_chunk8 = graph_us(
        [&](int) {
          check_cuda(cudaLaunchKernelEx(&config, merge_backward_kernel<StackBackward, bfloat16_t, bfloat16_t, 8, 8>,
                                        plan_no_o.shape, args, 0, 0),
                     "backward, 8 states in flight");
        },
        stream, 10);
  }
  const double us = time_backward(out_v, plan);  // last: its gradients are the ones checked below
  const double bytes = 2.0 * (2 * o_elems + 2 * out_elems) + 4.0 * (2 * l_elems + 2 * row_elems);
  const double gbps = bytes / us / 1e3;
  const double gbps_no_o = (bytes - 2.0 * out_elems) / us_no_o / 1e3;

  // A few rows against the formula on the host.
  std::vector<uint16_t> h_o(o_elems), h_go(o_elems), h_out(out_elems), h_gout(out_elems);
  std::vector<float> h_l(l_elems), h_gl(l_elems), h_ol(row_elems), h_gol(row_elems);
  check_cuda(cudaStreamSynchronize(stream), "synchronize");
  check_cuda(cudaMemcpy(h_o.data(), o, o_elems * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_go.data(), grad_o, o_elems * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_out.data(), out, out_elems * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_gout.data(), grad_out, out_elems * 2, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_l.data(), lse, l_elems * 4, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_gl.data(), grad_lse, l_elems * 4, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_ol.data(), out_lse, row_elems * 4, cudaMemcpyDeviceToHost), "copy");
  check_cuda(cudaMemcpy(h_gol.data(), grad_out_lse, row_elems * 4, cudaMemcpyDeviceToHost), "copy");
  double worst = 0;
  for (int64_t row = 0; row < row_elems; row += row_elems / 97 + 1) {
    const int64_t t = row / kHeads, h = row % kHeads;
    for (int64_t s = 0; s < states; ++s) {
      const double p = std::exp(double(h_l[t * l_st + s * kHeads + h]) - h_ol[row]);
      double dot = 0;
      for (int64_t d = 0; d < kHeadSize; ++d) {
        const int64_t i = t * o_st + s * o_ss + h * kHeadSize + d, j = row * kHeadSize + d;
        dot += double(bf16_to_float(h_gout[j])) * (bf16_to_float(h_o[i]) - bf16_to_float(h_out[j]));
        const double want = p * bf16_to_float(h_gout[j]);
        worst = std::max(worst, std::abs(bf16_to_float(h_go[i]) - want) / (std::abs(want) + 1e-3));
      }
      const double want = p * (h_gol[row] + dot);
      worst = std::max(worst, std::abs(h_gl[t * l_st + s * kHeads + h] - want) / (std::abs(want) + 1e-3));
    }
  }
  // The mix's ceiling where the streams exceed L2 (50 MB on an H200), else not measured (0).
  const double mix = out_elems * 2 * (2 * states + 2) > (int64_t{256} << 20) ? mix_ceiling(states, out_elems / 8, stream) : 0;
  std::printf("%6lld tokens  S=%-3lld %-5s  %9.1f us  %7.1f GB/s  %5.1f%% of copy  %5.1f%% of the mix's %6.0f GB/s"
              "  | without O: %9.1f us  %7.1f GB/s  | 8 in flight: %9.1f us  | G%d C%d block %ux%u grid %u  max rel err %.2e"
              "  | split (us):%s\n",
              (long long)tokens, (long long)states, pair ? "pair" : "stack", us, gbps, 100.0 * gbps / roof,
              mix > 0 ? 100.0 * gbps / mix : 0.0, mix, us_no_o, gbps_no_o, us_chunk8, plan.groups, plan.chunk,
              plan.dims.block[0], plan.dims.block[1], plan.dims.grid[0], worst, split);
  for (void* p : {static_cast<void*>(o), static_cast<void*>(grad_o), static_cast<void*>(out), static_cast<void*>(grad_out),
                  static_cast<void*>(lse), static_cast<void*>(grad_lse), static_cast<void*>(out_lse),
                  static_cast<void*>(grad_out_lse)})
    cudaFree(p);
}

}  // namespace

// Arguments (optional): the N-way cases to run, each T:S; none: every case below.
int main(int argc, char** argv) {
  if (!have_gpu("backward")) return 0;
  int device = 0, sms = 0;
  check_cuda(cudaGetDevice(&device), "device");
  check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "sms");
  cudaStream_t stream;
  check_cuda(cudaStreamCreate(&stream), "stream");
  const double roof = copy_gbps(stream);
  std::printf("backward of T x S x 32 x 128 bfloat16; device-to-device copy: %.1f GB/s\n", roof);
  if (argc > 1) {
    for (int i = 1; i < argc; ++i) {
      long long t = 0, st = 0;
      if (std::sscanf(argv[i], "%lld:%lld", &t, &st) != 2) {
        std::fprintf(stderr, "backward: a case is T:S, not %s\n", argv[i]);
        return 2;
      }
      run_case(t, st, st == 2, sms, roof, stream);
    }
    return 0;
  }
  for (int64_t tokens : {8192, 1024, 16})
    for (int64_t states : {2, 4, 8, 16}) {
      if (states == 2) run_case(tokens, states, true, sms, roof, stream);
      run_case(tokens, states, false, sms, roof, stream);
    }
  cudaStreamDestroy(stream);
  return 0;
}
