// Host time per call of libattnmerge's C ABI on the CPU path, in microseconds: attnmerge_merge of
// float32 host arrays with no options, at a size whose merge is nothing (1 x 1 x 8: what the call
// itself costs, validation and dispatch) and at the decode shape (1 x 32 x 128, the size
// benchmarks/host_cpu.py times from Python).  The median over 15 batches of 20,000 calls.  Builds
// and runs without a GPU or a CUDA toolkit.
#include <attnmerge/attnmerge.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

double median_us(int64_t heads, int64_t head_size) {
  const int64_t o_shape[3] = {1, heads, head_size}, lse_shape[2] = {1, heads};
  std::vector<float> o_a(heads * head_size), o_b(o_a.size()), out(o_a.size()), lse_a(heads), lse_b(heads),
      out_lse(heads);
  for (size_t i = 0; i < o_a.size(); ++i) o_a[i] = 0.01f * static_cast<float>(i % 97), o_b[i] = -o_a[i];
  for (int64_t h = 0; h < heads; ++h) lse_a[h] = 0.5f + 0.01f * h, lse_b[h] = 0.3f - 0.02f * h;
  const auto o = [&](std::vector<float>& v) {
    return attnmerge_contiguous_tensor(v.data(), ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 3, o_shape);
  };
  const auto lse = [&](std::vector<float>& v) {
    return attnmerge_contiguous_tensor(v.data(), ATTNMERGE_FLOAT32, ATTNMERGE_HOST, 2, lse_shape);
  };
  const attnmerge_tensor t_out = o(out), t_out_lse = lse(out_lse), t_a = o(o_a), t_lse_a = lse(lse_a), t_b = o(o_b),
                         t_lse_b = lse(lse_b);
  constexpr int kBatches = 15, kCalls = 20000;
  std::vector<double> per_call;
  for (int b = 0; b < kBatches; ++b) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i)
      if (attnmerge_merge(&t_out, &t_out_lse, &t_a, &t_lse_a, &t_b, &t_lse_b, nullptr, nullptr) != ATTNMERGE_SUCCESS) {
        std::fprintf(stderr, "attnmerge_merge: %s\n", attnmerge_last_error());
        std::exit(1);
      }
    per_call.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count() /
                       kCalls);
  }
  std::nth_element(per_call.begin(), per_call.begin() + kBatches / 2, per_call.end());
  return per_call[kBatches / 2];
}

}  // namespace

int main() {
  std::printf("attnmerge_merge on the CPU, float32, no options (median of 15 batches of 20,000 calls)\n");
  std::printf("  1 x 1 x 8     %.3f us per call (the call alone)\n", median_us(1, 8));
  std::printf("  1 x 32 x 128  %.3f us per call\n", median_us(32, 128));
  return 0;
}
