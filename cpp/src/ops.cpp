// The C ABI's ops: each entry point validates its arguments (validate.h), once, before anything is
// written, assembles one of the sources of sources.h and hands the call to route.h.
#include <cinttypes>

#include "route.h"

namespace attnmerge {
namespace detail {

namespace {
// The start of every op: no error, nothing launched yet.
void begin_call() {
  clear_error();
  forget_launch();
}
}  // namespace

namespace {

OutView out_view(const View& out, const View& out_lse, float inv_scale, const attnmerge_options& opt) {
  return OutView{out.t->data,
                 out.strides[0],
                 out.strides[1],
                 out_lse.present() ? static_cast<float*>(out_lse.t->data) : nullptr,
                 out_lse.present() ? out_lse.strides[0] : 0,
                 out_lse.present() ? out_lse.strides[1] : 0,
                 inv_scale,
                 opt.output_scale_ptr,
                 false};
}

// Argument names of the two ops built on PairSource.
struct PairNames {
  const char *out, *out_lse, *o_a, *lse_a, *o_b, *lse_b, *mask;
};

// The two-way and in-place merges: (out, out_lse) = merge(a, b), rows optionally masked.
attnmerge_status merge_pair(const PairNames& n, const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                            const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a, const attnmerge_tensor* o_b,
                            const attnmerge_tensor* lse_b, const attnmerge_tensor* mask,
                            const attnmerge_options* options, uint32_t allowed_flags, void* stream) {
  begin_call();
  const bool heads_first = options && (options->flags & ATTNMERGE_LSE_HEADS_FIRST);
  View vout, vout_lse, va, vla, vb, vlb, vmask;
  attnmerge_status s;
  if ((s = describe(out, n.out, 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, n.out_lse, 2, kLse, heads_first, true, vout_lse)) ||
      (s = describe(o_a, n.o_a, 3, kInputs, false, false, va)) ||
      (s = describe(lse_a, n.lse_a, 2, kLse, heads_first, false, vla)) ||
      (s = describe(o_b, n.o_b, 3, kInputs, false, false, vb)) ||
      (s = describe(lse_b, n.lse_b, 2, kLse, heads_first, false, vlb)) ||
      (s = describe(mask, n.mask, 1, kMask, false, true, vmask)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, allowed_flags, vout, opt, inv_scale))) return s;
  if (o_a->dtype != o_b->dtype)
    return fail(ATTNMERGE_ERROR_TYPE, "%s: expected the dtype of %s (%s), got %s", n.o_b, n.o_a, dtype_name(o_a->dtype),
                dtype_name(o_b->dtype));

  // Sizes come from o_b, the one input that always covers every token; the rest must agree.
  const int64_t tokens = vb.shape[0], heads = vb.shape[1], head_size = vb.shape[2];
  if ((s = check_head_size(n.o_b, head_size))) return s;
  const int64_t o_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vlb, o_shape, vb)) || (s = check_shape(vout, o_shape, vb)) ||
      (s = check_shape(vout_lse, o_shape, vb)) || (s = check_shape(vmask, o_shape, vb)))
    return s;
  int64_t a_tokens;
  if ((s = check_a_shapes(opt, o_shape, vb, va, vla, a_tokens))) return s;
  if ((s = check_outputs(vout, vout_lse))) return s;
  // out may be o_a or o_b itself and out_lse lse_a or lse_b; nothing else may touch the outputs.
  for (const View* in : {&va, &vla, &vb, &vlb, &vmask})
    if ((s = check_disjoint(vout, *in, in == &va || in == &vb)) ||
        (s = check_disjoint(vout_lse, *in, in == &vla || in == &vlb)))
      return s;

  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  PairSource src{va.state(vla), vb.state(vlb), a_tokens, nullptr, 0};
  if (vmask.present() && !vmask.empty) {
    src.mask = static_cast<const uint8_t*>(mask->data);
    src.mask_stride = vmask.strides[0];
  }
  OutView dst = out_view(vout, vout_lse, inv_scale, opt);
  dst.lse_in_place =
      vout_lse.present() && !vout_lse.empty &&
      ((vla.present() && !vla.empty && same_view(vout_lse, vla)) || (!vlb.empty && same_view(vout_lse, vlb)));
  return run({&vout, &vout_lse, &va, &vla, &vb, &vlb, &vmask}, shape, src, dst, o_a->dtype, out->dtype,
             choose_vec({&vout, &va, &vb}, head_size), stream, opt.flags);
}

// O [tokens, heads, ...] and an LSE, either of which may be absent (null: never read).
StateView state_of(const View& o, const View& lse) {
  return StateView{o.present() ? o.t->data : nullptr,  o.present() ? o.strides[0] : 0,
                   o.present() ? o.strides[1] : 0,     lse.present() ? static_cast<const float*>(lse.t->data) : nullptr,
                   lse.present() ? lse.strides[0] : 0, lse.present() ? lse.strides[1] : 0};
}

// A gradient's pointer and strides where it is given; null and zero strides where it is not, so
// that every address of it a source computes is null (not written).
const void* data_or_null(const View& v) { return v.present() ? v.t->data : nullptr; }
int64_t stride_or_0(const View& v, int axis) { return v.present() ? v.strides[axis] : 0; }

}  // namespace
}  // namespace detail
}  // namespace attnmerge

using namespace attnmerge;
using namespace attnmerge::detail;

extern "C" {

attnmerge_status attnmerge_merge(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                 const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                 const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                 const attnmerge_options* options, void* stream) {
  static const PairNames names = {"out", "out_lse", "o_a", "lse_a", "o_b", "lse_b", "mask"};
  return merge_pair(names, out, out_lse, o_a, lse_a, o_b, lse_b, nullptr, options,
                    ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_A_TOKENS | ATTNMERGE_PDL, stream);
}

attnmerge_status attnmerge_merge_inplace(const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                         const attnmerge_tensor* o_other, const attnmerge_tensor* lse_other,
                                         const attnmerge_tensor* mask, const attnmerge_options* options, void* stream) {
  static const PairNames names = {"o", "lse", "o", "lse", "o_other", "lse_other", "mask"};
  if (o != nullptr && lse == nullptr) {
    begin_call();
    return fail(ATTNMERGE_ERROR_TYPE, "lse: expected a tensor, got NULL");
  }
  return merge_pair(names, o, lse, o, lse, o_other, lse_other, mask, options,
                    ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_PDL, stream);
}

attnmerge_status attnmerge_merge_states(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_options* options, void* stream) {
  begin_call();
  View vout, vout_lse, vo, vl;
  attnmerge_status s;
  if ((s = describe(out, "out", 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, "out_lse", 2, kLse, false, true, vout_lse)) ||
      (s = describe(o, "o", 4, kInputs, false, false, vo)) || (s = describe(lse, "lse", 3, kLse, false, false, vl)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, vout, opt, inv_scale))) return s;
  const int64_t tokens = vo.shape[0], states = vo.shape[1], heads = vo.shape[2], head_size = vo.shape[3];
  if ((s = check_head_size("o", head_size))) return s;
  if (states > INT32_MAX)
    return fail(ATTNMERGE_ERROR_VALUE, "o: expected at most 2^31 - 1 states, got %" PRId64, states);
  const int64_t lse_shape[3] = {tokens, states, heads};
  const int64_t out_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vout, out_shape, vo)) ||
      (s = check_shape(vout_lse, out_shape, vo)) || (s = check_outputs(vout, vout_lse)))
    return s;
  for (const View* v : {&vo, &vl})
    for (const View* w : {&vout, &vout_lse})
      if ((s = check_disjoint(*w, *v, false))) return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const OutView dst = out_view(vout, vout_lse, inv_scale, opt);
  if (states == 2) {  // the two-way merge's kernel: the same weights, fewer registers
    // (no offset from the pointer of an empty tensor, which may be null and is never read)
    const char* o1 =
        static_cast<const char*>(o->data) + (vo.empty ? 0 : vo.strides[1] * static_cast<int64_t>(dtype_size(o->dtype)));
    const float* l0 = static_cast<const float*>(lse->data);
    const StateView a{o->data, vo.strides[0], vo.strides[2], l0, vl.strides[0], vl.strides[2]};
    const StateView b{o1,           vo.strides[0], vo.strides[2], l0 + (vl.empty ? 0 : vl.strides[1]), vl.strides[0],
                      vl.strides[2]};
    return run({&vout, &vout_lse, &vo, &vl}, shape, PairSource{a, b, tokens, nullptr, 0}, dst, o->dtype, out->dtype,
               choose_vec({&vout, &vo}, head_size), stream, opt.flags);
  }
  const StackSource src{
      o->data,       vo.strides[0], vo.strides[1], vo.strides[2], static_cast<const float*>(lse->data),
      vl.strides[0], vl.strides[1], vl.strides[2], states};
  return run({&vout, &vout_lse, &vo, &vl}, shape, src, dst, o->dtype, out->dtype, choose_vec({&vout, &vo}, head_size),
             stream, opt.flags);
}

attnmerge_status attnmerge_merge_varlen(const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                        const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                        const attnmerge_tensor* indptr, const attnmerge_options* options,
                                        void* stream) {
  begin_call();
  View vout, vout_lse, vo, vl, vi;
  attnmerge_status s;
  if ((s = describe(out, "out", 3, kOutputs, false, false, vout)) ||
      (s = describe(out_lse, "out_lse", 2, kLse, false, true, vout_lse)) ||
      (s = describe(o, "o", 3, kInputs, false, false, vo)) || (s = describe(lse, "lse", 2, kLse, false, false, vl)) ||
      (s = describe(indptr, "indptr", 1, kIndex, false, false, vi)))
    return s;
  attnmerge_options opt;
  float inv_scale;
  if ((s = read_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, vout, opt, inv_scale))) return s;
  const int64_t total = vo.shape[0], heads = vo.shape[1], head_size = vo.shape[2];
  if ((s = check_head_size("o", head_size))) return s;
  if (vi.shape[0] < 1) return fail(ATTNMERGE_ERROR_VALUE, "indptr: expected rows + 1 >= 1 entries, got 0");
  const int64_t rows = vi.shape[0] - 1;
  const int64_t lse_shape[2] = {total, heads};
  const int64_t out_shape[3] = {rows, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vout, out_shape, vo)) ||
      (s = check_shape(vout_lse, out_shape, vo)) || (s = check_outputs(vout, vout_lse)))
    return s;
  for (const View* v : {&vo, &vl, &vi})
    for (const View* w : {&vout, &vout_lse})
      if ((s = check_disjoint(*w, *v, false))) return s;
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  if ((s = check_indptr(vi, out, rows, total))) return s;
  const MergeShape shape{rows, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const RangeSource src{o->data,       vo.strides[0], vo.strides[1], static_cast<const float*>(lse->data),
                        vl.strides[0], vl.strides[1], indptr->data,  vi.strides[0],
                        wide,          total};
  return run({&vout, &vout_lse, &vo, &vl, &vi}, shape, src, out_view(vout, vout_lse, inv_scale, opt), o->dtype,
             out->dtype, choose_vec({&vout, &vo}, head_size), stream, opt.flags);
}

attnmerge_status attnmerge_merge_backward(const attnmerge_tensor* grad_o_a, const attnmerge_tensor* grad_lse_a,
                                          const attnmerge_tensor* grad_o_b, const attnmerge_tensor* grad_lse_b,
                                          const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                          const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                          const attnmerge_tensor* o_a, const attnmerge_tensor* lse_a,
                                          const attnmerge_tensor* o_b, const attnmerge_tensor* lse_b,
                                          const attnmerge_options* options, void* stream) {
  begin_call();
  const bool heads_first = options && (options->flags & ATTNMERGE_LSE_HEADS_FIRST);
  BackwardViews v;
  View vga, vgla, vgb, vglb, va, vla, vb, vlb;
  attnmerge_status s;
  if ((s = describe(grad_o_a, "grad_o_a", 3, kInputs, false, true, vga)) ||
      (s = describe(grad_lse_a, "grad_lse_a", 2, kLse, heads_first, true, vgla)) ||
      (s = describe(grad_o_b, "grad_o_b", 3, kInputs, false, true, vgb)) ||
      (s = describe(grad_lse_b, "grad_lse_b", 2, kLse, heads_first, true, vglb)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, heads_first, v)) ||
      (s = describe(o_a, "o_a", 3, kInputs, false, false, va)) ||
      (s = describe(lse_a, "lse_a", 2, kLse, heads_first, false, vla)) ||
      (s = describe(o_b, "o_b", 3, kInputs, false, false, vb)) ||
      (s = describe(lse_b, "lse_b", 2, kLse, heads_first, false, vlb)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options,
                                 ATTNMERGE_LSE_BASE2 | ATTNMERGE_LSE_HEADS_FIRST | ATTNMERGE_A_TOKENS | ATTNMERGE_PDL,
                                 v.grad_out, opt)) ||
      (s = check_dtype_of(vb, va)) || (s = check_dtype_of(vga, va)) || (s = check_dtype_of(vgb, va)))
    return s;
  // Sizes come from o_b, as in the forward.
  const int64_t tokens = vb.shape[0], heads = vb.shape[1], head_size = vb.shape[2];
  if ((s = check_head_size("o_b", head_size))) return s;
  const int64_t o_shape[3] = {tokens, heads, head_size};
  int64_t a_tokens;
  if ((s = check_shape(vlb, o_shape, vb)) || (s = check_backward_shapes(v, o_shape, vb)) ||
      (s = check_shape(vgb, o_shape, vb)) || (s = check_shape(vglb, o_shape, vb)) ||
      (s = check_a_shapes(opt, o_shape, vb, va, vla, a_tokens)))
    return s;
  const int64_t a_shape[3] = {a_tokens, heads, head_size};  // a's gradients: the tokens of a that were read
  if ((s = check_shape(vga, a_shape, vb)) || (s = check_shape(vgla, a_shape, vb)) ||
      (s = check_grads({&vga, &vgla, &vgb, &vglb},
                       {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &va, &vla, &vb, &vlb})))
    return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const auto grad_state = [](const View& o, const View& l) {
    return StateView{data_or_null(o),   stride_or_0(o, 0),
                     stride_or_0(o, 1), static_cast<const float*>(data_or_null(l)),
                     stride_or_0(l, 0), stride_or_0(l, 1)};
  };
  const PairSource in{va.state(vla), vb.state(vlb), a_tokens, nullptr, 0};
  const PairSource grad{grad_state(vga, vgla), grad_state(vgb, vglb), a_tokens, nullptr, 0};
  const BackwardArgs<PairBackward> args{PairBackward{in, grad}, state_of(v.out, v.out_lse),
                                        state_of(v.grad_out, v.grad_out_lse), vga.present() || vgb.present(),
                                        vgla.present() || vglb.present()};
  return run_backward(
      {&vga, &vgla, &vgb, &vglb, &v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &va, &vla, &vb, &vlb}, shape, args,
      2, o_a->dtype, grad_out->dtype,
      choose_vec({vga.present() ? &vga : &va, vgb.present() ? &vgb : &vb, &v.grad_out,
                  v.out.present() ? &v.out : &v.grad_out, &va, &vb},
                 head_size),
      stream, opt.flags);
}

attnmerge_status attnmerge_merge_states_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_options* options, void* stream) {
  begin_call();
  BackwardViews v;
  View vg, vgl, vo, vl;
  attnmerge_status s;
  if ((s = describe(grad_o, "grad_o", 4, kInputs, false, true, vg)) ||
      (s = describe(grad_lse, "grad_lse", 3, kLse, false, true, vgl)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, false, v)) ||
      (s = describe(o, "o", 4, kInputs, false, false, vo)) || (s = describe(lse, "lse", 3, kLse, false, false, vl)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, v.grad_out, opt)) ||
      (s = check_dtype_of(vg, vo)))
    return s;
  const int64_t tokens = vo.shape[0], states = vo.shape[1], heads = vo.shape[2], head_size = vo.shape[3];
  if ((s = check_head_size("o", head_size))) return s;
  if (states > INT32_MAX)
    return fail(ATTNMERGE_ERROR_VALUE, "o: expected at most 2^31 - 1 states, got %" PRId64, states);
  const int64_t lse_shape[3] = {tokens, states, heads};
  const int64_t out_shape[3] = {tokens, heads, head_size};
  if ((s = check_shape(vl, lse_shape, vo)) || (s = check_shape(vg, vo.shape, vo)) ||
      (s = check_shape(vgl, lse_shape, vo)) || (s = check_backward_shapes(v, out_shape, vo)) ||
      (s = check_grads({&vg, &vgl}, {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl})))
    return s;
  const MergeShape shape{tokens, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const std::initializer_list<const View*> views = {&vg,    &vgl,       &v.grad_out, &v.grad_out_lse,
                                                    &v.out, &v.out_lse, &vo,         &vl};
  const int vec =
      choose_vec({vg.present() ? &vg : &vo, &v.grad_out, v.out.present() ? &v.out : &v.grad_out, &vo}, head_size);
  const StackSource in{o->data,       vo.strides[0], vo.strides[1], vo.strides[2], static_cast<const float*>(lse->data),
                       vl.strides[0], vl.strides[1], vl.strides[2], states};
  const StackSource grad{data_or_null(vg),
                         stride_or_0(vg, 0),
                         stride_or_0(vg, 1),
                         stride_or_0(vg, 2),
                         static_cast<const float*>(data_or_null(vgl)),
                         stride_or_0(vgl, 0),
                         stride_or_0(vgl, 1),
                         stride_or_0(vgl, 2),
                         states};
  if (states == 2) {  // the two-way merge's kernel, as in the forward: 64 registers against 108
    // (no offset from the pointer of an empty tensor, which may be null and is never read)
    const auto pair = [&](const StackSource& x, int dtype, bool empty_o, bool empty_lse) {
      const char* o1 = static_cast<const char*>(x.o) + (empty_o ? 0 : x.o_ss * static_cast<int64_t>(dtype_size(dtype)));
      return PairSource{StateView{x.o, x.o_st, x.o_sh, x.lse, x.lse_st, x.lse_sh},
                        StateView{o1, x.o_st, x.o_sh, x.lse + (empty_lse ? 0 : x.lse_ss), x.lse_st, x.lse_sh}, tokens,
                        nullptr, 0};
    };
    const BackwardArgs<PairBackward> args{
        PairBackward{pair(in, o->dtype, vo.empty, vl.empty), pair(grad, o->dtype, vg.empty, vgl.empty)},
        state_of(v.out, v.out_lse), state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
    return run_backward(views, shape, args, states, o->dtype, grad_out->dtype, vec, stream, opt.flags);
  }
  const BackwardArgs<StackBackward> args{StackBackward{in, grad}, state_of(v.out, v.out_lse),
                                         state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
  return run_backward(views, shape, args, states, o->dtype, grad_out->dtype, vec, stream, opt.flags);
}

attnmerge_status attnmerge_merge_varlen_backward(const attnmerge_tensor* grad_o, const attnmerge_tensor* grad_lse,
                                                 const attnmerge_tensor* grad_out, const attnmerge_tensor* grad_out_lse,
                                                 const attnmerge_tensor* out, const attnmerge_tensor* out_lse,
                                                 const attnmerge_tensor* o, const attnmerge_tensor* lse,
                                                 const attnmerge_tensor* indptr, const attnmerge_options* options,
                                                 void* stream) {
  begin_call();
  BackwardViews v;
  View vg, vgl, vo, vl, vi;
  attnmerge_status s;
  if ((s = describe(grad_o, "grad_o", 3, kInputs, false, true, vg)) ||
      (s = describe(grad_lse, "grad_lse", 2, kLse, false, true, vgl)) ||
      (s = describe_backward_outputs(grad_out, grad_out_lse, out, out_lse, false, v)) ||
      (s = describe(o, "o", 3, kInputs, false, false, vo)) || (s = describe(lse, "lse", 2, kLse, false, false, vl)) ||
      (s = describe(indptr, "indptr", 1, kIndex, false, false, vi)))
    return s;
  attnmerge_options opt;
  if ((s = read_backward_options(options, ATTNMERGE_LSE_BASE2 | ATTNMERGE_PDL, v.grad_out, opt)) ||
      (s = check_dtype_of(vg, vo)))
    return s;
  const int64_t total = vo.shape[0], heads = vo.shape[1], head_size = vo.shape[2];
  if ((s = check_head_size("o", head_size))) return s;
  if (vi.shape[0] < 1) return fail(ATTNMERGE_ERROR_VALUE, "indptr: expected rows + 1 >= 1 entries, got 0");
  const int64_t rows = vi.shape[0] - 1;
  const int64_t o_shape[3] = {total, heads, head_size};
  const int64_t out_shape[3] = {rows, heads, head_size};
  if ((s = check_shape(vl, o_shape, vo)) || (s = check_shape(vg, o_shape, vo)) || (s = check_shape(vgl, o_shape, vo)) ||
      (s = check_backward_shapes(v, out_shape, vo)) ||
      (s = check_grads({&vg, &vgl}, {&v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl, &vi})) ||
      (s = check_indptr(vi, grad_out, rows, total)))
    return s;
  // With no rows, one row over every state writes their zeros (RangeBackward).
  const MergeShape shape{rows > 0 ? rows : total > 0 ? 1 : 0, heads, head_size, (opt.flags & ATTNMERGE_LSE_BASE2) != 0};
  const bool wide = indptr->dtype == ATTNMERGE_INT64;
  const RangeSource in{o->data,       vo.strides[0], vo.strides[1], static_cast<const float*>(lse->data),
                       vl.strides[0], vl.strides[1], indptr->data,  vi.strides[0],
                       wide,          total};
  const RangeSource grad{data_or_null(vg),
                         stride_or_0(vg, 0),
                         stride_or_0(vg, 1),
                         static_cast<const float*>(data_or_null(vgl)),
                         stride_or_0(vgl, 0),
                         stride_or_0(vgl, 1),
                         indptr->data,
                         vi.strides[0],
                         wide,
                         total};
  const BackwardArgs<RangeBackward> args{RangeBackward{in, grad, rows}, state_of(v.out, v.out_lse),
                                         state_of(v.grad_out, v.grad_out_lse), vg.present(), vgl.present()};
  const int64_t states = rows > 0 ? (total + rows - 1) / rows : total;
  return run_backward(
      {&vg, &vgl, &v.grad_out, &v.grad_out_lse, &v.out, &v.out_lse, &vo, &vl, &vi}, shape, args, states, o->dtype,
      grad_out->dtype,
      choose_vec({vg.present() ? &vg : &vo, &v.grad_out, v.out.present() ? &v.out : &v.grad_out, &vo}, head_size),
      stream, opt.flags);
}

}  // extern "C"
