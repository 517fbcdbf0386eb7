// The GPU backward (attnmerge/merge_backward_kernels.cuh) run on the CPU, for the tests: the
// library's plan (plan_backward) and launcher (launch_merge_backward) with the kernel's own code
// compiled as host C++ against emulated_cuda/cuda_runtime.h, whose launch runs each block's threads
// as fibers that meet at its shuffles.  Loads and stores take the host path of the same helpers,
// and exp2 the host's; what is checked is the kernel's logic (rows, chunks, lanes, which state each
// lane writes, the two passes without O), not the device's instructions.  A shared library with
// one C function per backward source, called through ctypes (tests/semantics/
// test_backward_kernel_emulated.py); each returns the launch's cudaError_t (emulate_error: why).
#include <attnmerge/merge_backward_kernels.cuh>

#include "emulator.h"

using namespace attnmerge;
using emu::state;
using emu::Types;

namespace {

// The storage types compiled (emulate_types): every input and output O dtype a backward takes.
using Compiled = emu::TypeList<Types<float, float>, Types<float, half_t>, Types<float, bfloat16_t>,
                               Types<half_t, float>, Types<half_t, half_t>, Types<half_t, bfloat16_t>,
                               Types<bfloat16_t, float>, Types<bfloat16_t, half_t>, Types<bfloat16_t, bfloat16_t>>;

template <typename Src>
int dispatch(int in_dtype, int out_dtype, const BackwardPlan& plan, const BackwardArgs<Src>& args) {
  return emu::with_types<16>(Compiled{}, in_dtype, out_dtype, plan.vec, [&](auto types, auto vec) {
    using T = decltype(types);
    return launch_merge_backward<typename T::TIn, typename T::TOut, decltype(vec)::value>(plan, args, nullptr);
  });
}

}  // namespace

extern "C" {

// The (input, output) storage types compiled, as dtype codes at codes[2 i], codes[2 i + 1]; how many.
int emulate_types(int* codes, int most) { return emu::codes_of(Compiled{}, codes, most); }

// N-way: o [T, S, H, D], lse [T, S, H], grad_o, grad_lse alike (null: not asked for); out (null:
// none), grad_out [T, H, D]; out_lse, grad_out_lse (null: zero) [T, H].
int emulate_states_backward(int64_t tokens, int64_t states, int64_t heads, int64_t head_size, int in_dtype,
                            int out_dtype, int base2, int vec, int sms, void* grad_o, const int64_t* go_s,
                            float* grad_lse, const int64_t* gl_s, const void* grad_out, const int64_t* d_s,
                            const float* grad_out_lse, const int64_t* dl_s, const void* out, const int64_t* out_s,
                            const float* out_lse, const int64_t* ol_s, const void* o, const int64_t* o_s,
                            const float* lse, const int64_t* l_s) {
  const MergeShape shape(tokens, heads, head_size, base2 != 0);
  const StackSource in{o, o_s[0], o_s[1], o_s[2], lse, l_s[0], l_s[1], l_s[2], states};
  const StackSource grad{grad_o,   grad_o ? go_s[0] : 0,   grad_o ? go_s[1] : 0,   grad_o ? go_s[2] : 0,
                         grad_lse, grad_lse ? gl_s[0] : 0, grad_lse ? gl_s[1] : 0, grad_lse ? gl_s[2] : 0,
                         states};
  const BackwardArgs<StackBackward> args{StackBackward{in, grad}, state(out, out_s, out_lse, ol_s),
                                         state(grad_out, d_s, grad_out_lse, dl_s), grad_o != nullptr,
                                         grad_lse != nullptr};
  return dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}),
                  args);
}

// Variable length: o [N, H, D], lse [N, H] and their gradients; indptr int64 [rows + 1]; out,
// grad_out [rows, H, D].
int emulate_varlen_backward(int64_t rows, int64_t total, int64_t heads, int64_t head_size, int in_dtype, int out_dtype,
                            int base2, int vec, int sms, void* grad_o, const int64_t* go_s, float* grad_lse,
                            const int64_t* gl_s, const void* grad_out, const int64_t* d_s, const float* grad_out_lse,
                            const int64_t* dl_s, const void* out, const int64_t* out_s, const float* out_lse,
                            const int64_t* ol_s, const void* o, const int64_t* o_s, const float* lse,
                            const int64_t* l_s, const int64_t* indptr) {
  const MergeShape shape(rows > 0 ? rows : total > 0 ? 1 : 0, heads, head_size, base2 != 0);
  const RangeSource in{o, o_s[0], o_s[1], lse, l_s[0], l_s[1], indptr, 1, true, total};
  const RangeSource grad{grad_o,
                         grad_o ? go_s[0] : 0,
                         grad_o ? go_s[1] : 0,
                         grad_lse,
                         grad_lse ? gl_s[0] : 0,
                         grad_lse ? gl_s[1] : 0,
                         indptr,
                         1,
                         true,
                         total};
  const BackwardArgs<RangeBackward> args{RangeBackward{in, grad, rows}, state(out, out_s, out_lse, ol_s),
                                         state(grad_out, d_s, grad_out_lse, dl_s), grad_o != nullptr,
                                         grad_lse != nullptr};
  return dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}),
                  args);
}

// Two-way: o_a [>= a_tokens, H, D], o_b [T, H, D] and LSEs; grad_o_a [a_tokens, H, D] ...
int emulate_merge_backward(int64_t tokens, int64_t a_tokens, int64_t heads, int64_t head_size, int in_dtype,
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
  return dispatch(in_dtype, out_dtype, plan_backward(shape, backward_facts(args, vec, false), DeviceInfo{sms, 9}),
                  args);
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
