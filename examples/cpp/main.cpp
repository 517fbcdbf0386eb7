// Merges two attention states with libattnmerge's C ABI: on the CPU path, and on the GPU on a
// stream of its own when the program was built with CUDA and a GPU is present.  Checks both
// against a double-precision evaluation of the formula; exits 0 when every check passes.
#include <attnmerge/attnmerge.h>

#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#if defined(EXAMPLE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace {

constexpr int64_t kTokens = 7, kHeads = 4, kHeadSize = 64;

// A contiguous float32 tensor: O [tokens, heads, head_size] (ndim 3) or LSE [tokens, heads].
attnmerge_tensor tensor(void* data, int ndim, int device) {
  const int64_t shape[3] = {kTokens, kHeads, kHeadSize};
  return attnmerge_contiguous_tensor(data, ATTNMERGE_FLOAT32, device, ndim, shape);
}

struct States {
  std::vector<float> o_a, lse_a, o_b, lse_b;
};

// The largest |error| of (out, out_lse) against the formula, relative for O, absolute for LSE.
double error(const States& s, const std::vector<float>& out, const std::vector<float>& out_lse) {
  double worst = 0;
  for (int64_t r = 0; r < kTokens * kHeads; ++r) {
    const double la = s.lse_a[r], lb = s.lse_b[r], m = std::max(la, lb);
    const double wa = std::exp(la - m), wb = std::exp(lb - m), w = wa + wb;
    worst = std::max(worst, std::fabs(out_lse[r] - (m + std::log(w))));
    for (int64_t d = 0; d < kHeadSize; ++d) {
      const int64_t i = r * kHeadSize + d;
      const double ref = (wa * s.o_a[i] + wb * s.o_b[i]) / w;
      worst = std::max(worst, std::fabs(out[i] - ref) / std::max(1.0, std::fabs(ref)));
    }
  }
  return worst;
}

bool report(const char* where, attnmerge_status status, double err) {
  if (status != ATTNMERGE_SUCCESS) {
    std::printf("%s: %s: %s\n", where, attnmerge_status_string(status), attnmerge_last_error());
    return false;
  }
  const bool ok = err < 1e-5;
  std::printf("%s: max error %.2e %s\n", where, err, ok ? "ok" : "FAILED");
  return ok;
}

bool merge_on_the_cpu(const States& s) {
  std::vector<float> out(s.o_a.size(), NAN), out_lse(s.lse_a.size(), NAN);
  const attnmerge_tensor t_out = tensor(out.data(), 3, ATTNMERGE_HOST), t_out_lse = tensor(out_lse.data(), 2, ATTNMERGE_HOST);
  const attnmerge_tensor t_oa = tensor(const_cast<float*>(s.o_a.data()), 3, ATTNMERGE_HOST);
  const attnmerge_tensor t_la = tensor(const_cast<float*>(s.lse_a.data()), 2, ATTNMERGE_HOST);
  const attnmerge_tensor t_ob = tensor(const_cast<float*>(s.o_b.data()), 3, ATTNMERGE_HOST);
  const attnmerge_tensor t_lb = tensor(const_cast<float*>(s.lse_b.data()), 2, ATTNMERGE_HOST);
  const attnmerge_status status = attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, nullptr, nullptr);
  return report("cpu", status, status == ATTNMERGE_SUCCESS ? error(s, out, out_lse) : 0);
}

#if defined(EXAMPLE_WITH_CUDA)
bool merge_on_the_gpu(const States& s) {
  const int device = 0;
  if (cudaSetDevice(device) != cudaSuccess) return false;
  const size_t o_bytes = s.o_a.size() * sizeof(float), l_bytes = s.lse_a.size() * sizeof(float);
  float *oa, *la, *ob, *lb, *out, *out_lse;
  cudaStream_t stream;
  if (cudaMalloc(&oa, o_bytes) || cudaMalloc(&ob, o_bytes) || cudaMalloc(&out, o_bytes) || cudaMalloc(&la, l_bytes) ||
      cudaMalloc(&lb, l_bytes) || cudaMalloc(&out_lse, l_bytes) || cudaStreamCreate(&stream)) {
    std::printf("gpu: CUDA setup failed\n");
    return false;
  }
  cudaMemcpy(oa, s.o_a.data(), o_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(ob, s.o_b.data(), o_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(la, s.lse_a.data(), l_bytes, cudaMemcpyHostToDevice);
  cudaMemcpy(lb, s.lse_b.data(), l_bytes, cudaMemcpyHostToDevice);
  const attnmerge_tensor t_out = tensor(out, 3, device), t_out_lse = tensor(out_lse, 2, device);
  const attnmerge_tensor t_oa = tensor(oa, 3, device), t_la = tensor(la, 2, device);
  const attnmerge_tensor t_ob = tensor(ob, 3, device), t_lb = tensor(lb, 2, device);
  const attnmerge_options options = {};  // zero-initialized: the defaults
  const attnmerge_status status = attnmerge_merge(&t_out, &t_out_lse, &t_oa, &t_la, &t_ob, &t_lb, &options, stream);
  std::vector<float> h_out(s.o_a.size(), NAN), h_out_lse(s.lse_a.size(), NAN);
  cudaStreamSynchronize(stream);
  cudaMemcpy(h_out.data(), out, o_bytes, cudaMemcpyDeviceToHost);
  cudaMemcpy(h_out_lse.data(), out_lse, l_bytes, cudaMemcpyDeviceToHost);
  for (float* p : {oa, ob, out, la, lb, out_lse}) cudaFree(p);
  cudaStreamDestroy(stream);
  return report("gpu", status, status == ATTNMERGE_SUCCESS ? error(s, h_out, h_out_lse) : 0);
}
#endif

}  // namespace

int main() {
  std::printf("attnmerge %s (header %s)\n", attnmerge_version_string(), ATTNMERGE_VERSION_STRING);
  std::mt19937 gen(1);
  std::normal_distribution<float> normal;
  States s;
  for (auto* v : {&s.o_a, &s.o_b}) v->resize(kTokens * kHeads * kHeadSize);
  for (auto* v : {&s.lse_a, &s.lse_b}) v->resize(kTokens * kHeads);
  for (auto* v : {&s.o_a, &s.o_b}) for (float& x : *v) x = normal(gen);
  for (auto* v : {&s.lse_a, &s.lse_b}) for (float& x : *v) x = 3 * normal(gen);

  bool ok = merge_on_the_cpu(s);
#if defined(EXAMPLE_WITH_CUDA)
  if (attnmerge_device_count() > 0) {
    ok = merge_on_the_gpu(s) && ok;
  } else {
    std::printf("gpu: no CUDA device, skipped\n");
  }
#else
  std::printf("gpu: built without CUDA, skipped\n");
#endif
  return ok ? 0 : 1;
}
