// The GPU backward kernel (attnmerge/merge_backward_kernels.cuh) run on the CPU, for the tests: its
// own code compiled as host C++ against emulated_cuda/cuda_runtime.h, each row's lanes as host
// threads whose shuffles meet at a barrier.  Loads and stores take the host path of the same
// helpers, and exp2 the host's; what is checked is the kernel's logic (rows, chunks, lanes, which
// state each lane writes, the two passes without O), not the device's instructions.  A shared
// library with one C function per backward source, called through ctypes
// (tests/test_backward_emulated.py); the plan is the library's (plan_backward).
#include <barrier>
#include <memory>
#include <thread>
#include <vector>

#include <attnmerge/merge_backward_kernels.cuh>

using namespace attnmerge;

namespace {

struct Exchange {
  explicit Exchange(int lanes) : bar(lanes) {}
  std::barrier<> bar;
  float slot[32] = {};
};
thread_local Exchange* t_exchange = nullptr;

// Runs every row of `plan`, each of its groups in turn (one host thread a lane).
template <typename Src, typename TIn, typename TOut, int VEC>
void run(const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  const int lanes = plan.lanes, by = static_cast<int>(plan.dims.block[1]);
  for (int64_t row = 0; row < plan.shape.rows * plan.groups; ++row) {  // a row's group: a block's y index
    Exchange ex(lanes);
    std::vector<std::thread> threads;
    for (int lane = 0; lane < lanes; ++lane)
      threads.emplace_back([&, lane] {
        t_exchange = &ex;
        blockDim = dim3(lanes, by, 1);
        gridDim = dim3(plan.dims.grid[0], plan.dims.grid[1], plan.dims.grid[2]);
        const int64_t block = row / by;
        blockIdx = dim3(static_cast<unsigned>(block % gridDim.x), 0, static_cast<unsigned>(block / gridDim.x));
        threadIdx = dim3(lane, static_cast<unsigned>(row % by), 0);
        if (plan.chunk == 2)  // the plan's chunk, as launch_merge_backward takes it
          return merge_backward_kernel<Src, TIn, TOut, VEC, 2>(plan.shape, args, plan.group_shift, plan.span);
        merge_backward_kernel<Src, TIn, TOut, VEC, kSmallChunk>(plan.shape, args, plan.group_shift, plan.span);
      });
    for (std::thread& t : threads) t.join();
  }
}

template <typename Src, typename TIn, typename TOut>
void run_vec(const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  switch (plan.vec) {
    case 8:
      if constexpr (sizeof(TIn) <= 2 && sizeof(TOut) <= 2) return run<Src, TIn, TOut, 8>(plan, args);
      break;
    case 4: return run<Src, TIn, TOut, 4>(plan, args);
    case 2: return run<Src, TIn, TOut, 2>(plan, args);
    default: return run<Src, TIn, TOut, 1>(plan, args);
  }
}

// dtype codes as attnmerge.h: 0 float32, 1 float16, 2 bfloat16.
template <typename Src, typename TIn>
void run_out(int out_dtype, const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  switch (out_dtype) {
    case 0: return run_vec<Src, TIn, float>(plan, args);
    case 1: return run_vec<Src, TIn, half_t>(plan, args);
    default: return run_vec<Src, TIn, bfloat16_t>(plan, args);
  }
}

template <typename Src>
void dispatch(int in_dtype, int out_dtype, const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  switch (in_dtype) {
    case 0: return run_out<Src, float>(out_dtype, plan, args);
    case 1: return run_out<Src, half_t>(out_dtype, plan, args);
    default: return run_out<Src, bfloat16_t>(out_dtype, plan, args);
  }
}

// s: strides in elements, in the logical axis order of each array.
StateView state(const void* o, const int64_t* os, const float* l, const int64_t* ls) {
  return StateView{o, o ? os[0] : 0, o ? os[1] : 0, l, l ? ls[0] : 0, l ? ls[1] : 0};
}

}  // namespace

float emulated_shfl_xor(float v, int offset) {
  Exchange& ex = *t_exchange;
  const int lane = static_cast<int>(threadIdx.x);
  ex.slot[lane] = v;
  ex.bar.arrive_and_wait();
  const float other = ex.slot[lane ^ offset];
  ex.bar.arrive_and_wait();
  return other;
}

extern "C" {

// N-way: o [T, S, H, D], lse [T, S, H], grad_o, grad_lse alike (null: not asked for); out (null:
// none), grad_out [T, H, D]; out_lse, grad_out_lse (null: zero) [T, H].
void emulate_states_backward(int64_t tokens, int64_t states, int64_t heads, int64_t head_size, int in_dtype,
                             int out_dtype, int base2, int vec, int sms, void* grad_o, const int64_t* go_s,
                             float* grad_lse, const int64_t* gl_s, const void* grad_out, const int64_t* d_s,
                             const float* grad_out_lse, const int64_t* dl_s, const void* out, const int64_t* out_s,
                             const float* out_lse, const int64_t* ol_s, const void* o, const int64_t* o_s,
                             const float* lse, const int64_t* l_s) {
  const MergeShape shape(tokens, heads, head_size, base2 != 0);
  const StackSource in{o, o_s[0], o_s[1], o_s[2], lse, l_s[0], l_s[1], l_s[2], states};
  const StackSource grad{grad_o,   grad_o ? go_s[0] : 0,   grad_o ? go_s[1] : 0,   grad_o ? go_s[2] : 0, grad_lse,
                         grad_lse ? gl_s[0] : 0, grad_lse ? gl_s[1] : 0, grad_lse ? gl_s[2] : 0, states};
  const BackwardArgs<StackBackward> args{StackBackward{in, grad}, state(out, out_s, out_lse, ol_s),
                                         state(grad_out, d_s, grad_out_lse, dl_s), grad_o != nullptr,
                                         grad_lse != nullptr};
  dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}), args);
}

// Variable length: o [N, H, D], lse [N, H] and their gradients; indptr int64 [rows + 1]; out,
// grad_out [rows, H, D].
void emulate_varlen_backward(int64_t rows, int64_t total, int64_t heads, int64_t head_size, int in_dtype,
                             int out_dtype, int base2, int vec, int sms, void* grad_o, const int64_t* go_s,
                             float* grad_lse, const int64_t* gl_s, const void* grad_out, const int64_t* d_s,
                             const float* grad_out_lse, const int64_t* dl_s, const void* out, const int64_t* out_s,
                             const float* out_lse, const int64_t* ol_s, const void* o, const int64_t* o_s,
                             const float* lse, const int64_t* l_s, const int64_t* indptr) {
  const MergeShape shape(rows > 0 ? rows : total > 0 ? 1 : 0, heads, head_size, base2 != 0);
  const RangeSource in{o, o_s[0], o_s[1], lse, l_s[0], l_s[1], indptr, 1, true, total};
  const RangeSource grad{grad_o,   grad_o ? go_s[0] : 0,   grad_o ? go_s[1] : 0, grad_lse, grad_lse ? gl_s[0] : 0,
                         grad_lse ? gl_s[1] : 0, indptr, 1, true, total};
  const BackwardArgs<RangeBackward> args{RangeBackward{in, grad, rows}, state(out, out_s, out_lse, ol_s),
                                         state(grad_out, d_s, grad_out_lse, dl_s), grad_o != nullptr,
                                         grad_lse != nullptr};
  dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}), args);
}

// Two-way: o_a [>= a_tokens, H, D], o_b [T, H, D] and LSEs; grad_o_a [a_tokens, H, D] ...
void emulate_merge_backward(int64_t tokens, int64_t a_tokens, int64_t heads, int64_t head_size, int in_dtype,
                            int out_dtype, int base2, int vec, int sms, void* grad_o_a, const int64_t* gao_s,
                            float* grad_lse_a, const int64_t* gal_s, void* grad_o_b, const int64_t* gbo_s,
                            float* grad_lse_b, const int64_t* gbl_s, const void* grad_out, const int64_t* d_s,
                            const float* grad_out_lse, const int64_t* dl_s, const void* out, const int64_t* out_s,
                            const float* out_lse, const int64_t* ol_s, const void* o_a, const int64_t* oa_s,
                            const float* lse_a, const int64_t* la_s, const void* o_b, const int64_t* ob_s,
                            const float* lse_b, const int64_t* lb_s) {
  const MergeShape shape(tokens, heads, head_size, base2 != 0);
  const PairSource in{state(o_a, oa_s, lse_a, la_s), state(o_b, ob_s, lse_b, lb_s), a_tokens, nullptr, 0};
  const PairSource grad{state(grad_o_a, gao_s, grad_lse_a, gal_s), state(grad_o_b, gbo_s, grad_lse_b, gbl_s), a_tokens,
                        nullptr, 0};
  const BackwardArgs<PairBackward> args{PairBackward{in, grad}, state(out, out_s, out_lse, ol_s),
                                        state(grad_out, d_s, grad_out_lse, dl_s), grad_o_a || grad_o_b,
                                        grad_lse_a || grad_lse_b};
  dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}), args);
}

// Whether launch_merge_backward would take an N-way plan of `chunk` states in flight for rows of
// `states` states, with or without the forward's O (backward_plan_fits).
int emulate_backward_plan_fits(int64_t states, int chunk, int with_out) {
  const MergeShape shape(1, 1, 8, false);
  uint16_t o[8] = {};
  float lse[1] = {};
  const StackSource in{o, 8, 8, 8, lse, 1, 1, 1, states};
  const BackwardArgs<StackBackward> args{StackBackward{in, in}, StateView{with_out ? o : nullptr, 8, 8, lse, 1, 1},
                                         StateView{o, 8, 8, nullptr, 1, 1}, true, true};
  BackwardFacts facts = backward_facts(args, 8, false);
  facts.chunk = chunk;
  return backward_plan_fits(plan_backward(shape, facts, DeviceInfo{132, 9}), args) ? 1 : 0;
}

}  // extern "C"
