"""torch.ops.attnmerge: the merge family as registered PyTorch operators.

- Registered whenever attnmerge and torch are both imported, in either order; `import attnmerge`
  never imports torch.
- Overloads: merge / merge.out, merge_inplace (writes o, lse) / merge_inplace.functional,
  merge_states / merge_states.out, merge_varlen / merge_varlen.out, merge_share / merge_share.out;
  the schemas mark exactly the
  tensors each writes.  Results equal the float64 oracle (tests/oracle.py) as the eager API's do.
- torch.library.opcheck passes for every overload; fake (meta) results have the real shapes and dtypes.
- torch.compile(fullgraph=True) over every public and compat function: no graph break, the op in the
  graph, the oracle's results; torch.export records the op.
- Eager calls keep the direct path (no torch op dispatched).
- Autograd: until backward lands, an input that requires grad is refused by name (NotImplementedError),
  in eager and through the ops; the in-place overloads bump the versions of what they write.
CUDA variants carry the `gpu` marker: the current stream, CUDA graph capture, mode="reduce-overhead".
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch", minversion="2.4")  # torch.library.register_fake

import attnmerge  # noqa: E402
from attnmerge.compat import flashinfer as fi  # noqa: E402
from attnmerge.compat import sglang  # noqa: E402
from attnmerge.compat import vllm  # noqa: E402
from oracle import (  # noqa: E402
    DTYPES,
    assert_merge_matches,
    random_lse,
    random_o,
    random_stacked,
    random_pair,
    random_state,
    reference_merge,
    reference_merge_share,
    reference_merge_stacked,
    reference_merge_varlen,
    to_f64,
)

ops = torch.ops.attnmerge


def put(x: np.ndarray, device="cpu"):
    """A torch tensor holding the NumPy array x (bfloat16 through float32)."""
    if x.dtype.name == "bfloat16":
        return torch.from_numpy(x.astype(np.float32)).to(device=device, dtype=torch.bfloat16)
    return torch.from_numpy(np.array(x)).to(device)  # a copy: writes into it leave x as it was


def get(t) -> np.ndarray:
    t = t.detach().cpu()
    return t.float().numpy() if t.dtype == torch.bfloat16 else t.numpy()


def poisoned(shape, dtype="float32", device="cpu"):
    return torch.full(shape, float("nan"), dtype=getattr(torch, dtype), device=device)


def pair(rng, tokens=13, heads=4, head_size=64, dtype="float32"):
    return random_pair(rng, tokens, heads, head_size, dtype)


# --------------------------------------------------------------------------------------------------
# registration


def _run(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()


def test_importing_attnmerge_does_not_import_torch():
    assert _run("import sys, attnmerge; print('torch' in sys.modules)") == ["False"]


@pytest.mark.parametrize("order", ["attnmerge, torch", "torch, attnmerge"])
def test_ops_are_registered_whichever_is_imported_first(order):
    out = _run(f"import {order}; print(hasattr(torch.ops.attnmerge.merge, 'out'), "
               f"torch.ops.attnmerge.merge_varlen.default.name())")
    assert out == ["True", "attnmerge::merge_varlen"]


WRITES = {
    "merge.default": set(), "merge.out": {"out", "out_lse", "group_scales"},
    "merge_inplace.default": {"o", "lse"}, "merge_inplace.functional": set(),
    "merge_states.default": set(), "merge_states.out": {"out", "out_lse", "group_scales"},
    "merge_varlen.default": set(), "merge_varlen.out": {"out", "out_lse", "group_scales"},
    "merge_share.default": set(), "merge_share.out": {"out", "out_lse", "group_scales"},
}


def overload(name):
    packet, over = name.split(".")
    return getattr(getattr(ops, packet), over)


@pytest.mark.parametrize("name", WRITES)
def test_the_schema_marks_exactly_the_tensors_written(name):
    schema = overload(name)._schema
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    assert written == WRITES[name]
    assert all(r.alias_info is None for r in schema.returns)  # results alias no input
    assert torch.Tag.pt2_compliant_tag in overload(name).tags


# --------------------------------------------------------------------------------------------------
# values through the ops


@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_and_merge_out(rng, dtype, out_dtype):
    h = pair(rng, dtype=dtype)
    t = [put(x) for x in h]
    ref = reference_merge(*h)
    out, out_lse = ops.merge(*t, out_dtype=getattr(torch, out_dtype))
    assert out.dtype == getattr(torch, out_dtype) and out_lse.dtype == torch.float32
    assert_merge_matches(get(out), get(out_lse), ref, out_dtype)
    out, out_lse = poisoned(out.shape, out_dtype), poisoned(out_lse.shape)
    assert ops.merge.out(*t, out=out, out_lse=out_lse) is None
    assert_merge_matches(get(out), get(out_lse), ref, out_dtype)


def test_merge_out_without_out_lse_base_2_and_a_tokens(rng):
    h = pair(rng, tokens=20)
    out = poisoned((20, 4, 64))
    ops.merge.out(*[put(x) for x in h], out=out, base="2", a_tokens=7)
    assert_merge_matches(get(out), None, reference_merge(*h, base=2, a_tokens=7), "float32")


def test_merge_of_heads_first_lse_views(rng):
    o_a, lse_a, o_b, lse_b = pair(rng)
    ht = [put(np.ascontiguousarray(x.T)) for x in (lse_a, lse_b)]  # stored [heads, tokens]
    out, out_lse = ops.merge(put(o_a), ht[0].T, put(o_b), ht[1].T)
    assert_merge_matches(get(out), get(out_lse), reference_merge(o_a, lse_a, o_b, lse_b), "float32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_inplace_writes_o_and_lse_and_its_functional_twin_writes_nothing(rng, dtype):
    h = pair(rng, tokens=12, dtype=dtype)
    mask = torch.tensor([1, 0] * 6, dtype=torch.bool)
    ref_o, ref_lse = reference_merge(*h)
    keep = ~mask.numpy()
    ref_o[keep], ref_lse[keep] = to_f64(h[0])[keep], to_f64(h[1])[keep]

    o, lse, o_other, lse_other = [put(x) for x in h]
    new_o, new_lse = ops.merge_inplace.functional(o, lse, o_other, lse_other, mask)
    assert_merge_matches(get(new_o), get(new_lse), (ref_o, ref_lse), dtype)
    assert np.array_equal(get(o), to_f64(h[0]).astype(np.float32)) and np.array_equal(get(lse), h[1])

    assert ops.merge_inplace(o, lse, o_other, lse_other, mask) is None
    assert_merge_matches(get(o), get(lse), (ref_o, ref_lse), dtype)


@pytest.mark.parametrize("states_axis", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
def test_merge_states_and_merge_states_out(rng, dtype, states_axis):
    v, s = random_stacked(rng, 11, 5, 4, 64, dtype, states_axis=states_axis)
    ref = reference_merge_stacked(v, s, states_axis=states_axis, base=2)
    out, out_lse = ops.merge_states(put(v), put(s), states_axis=states_axis, base="2")
    assert_merge_matches(get(out), get(out_lse), ref, dtype)
    out, out_lse = poisoned((11, 4, 64), dtype), poisoned((11, 4))
    ops.merge_states.out(put(v), put(s), out=out, out_lse=out_lse, states_axis=states_axis, base="2")
    assert_merge_matches(get(out), get(out_lse), ref, dtype)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_merge_varlen_and_merge_varlen_out(rng, index_dtype):
    indptr = torch.tensor([0, 3, 3, 4, 9], dtype=index_dtype)
    v, s = random_state(rng, 9, 4, 64, "bfloat16")
    ref = reference_merge_varlen(v, s, indptr.numpy())
    out, out_lse = ops.merge_varlen(put(v), put(s), indptr)
    assert out.shape == (4, 4, 64) and np.all(get(out)[1] == 0) and np.all(get(out_lse)[1] == -np.inf)
    assert_merge_matches(get(out), get(out_lse), ref, "bfloat16")
    out, out_lse = poisoned((4, 4, 64), "bfloat16"), poisoned((4, 4))
    ops.merge_varlen.out(put(v), put(s), indptr, out=out, out_lse=out_lse)
    assert_merge_matches(get(out), get(out_lse), ref, "bfloat16")


def test_fp8_output_with_a_scale_tensor(rng):
    from oracle import assert_fp8_close

    h = pair(rng)
    scale = torch.tensor([0.25])
    out, _ = ops.merge(*[put(x) for x in h], out_dtype=torch.float8_e4m3fn, output_scale=scale)
    assert out.dtype == torch.float8_e4m3fn
    assert_fp8_close(out.view(torch.uint8).numpy().view(_fp8()), reference_merge(*h)[0], scale=0.25)


def _fp8():
    from oracle import fp8_dtype

    return fp8_dtype()


def test_bad_arguments_raise_with_the_argument_named(rng):
    t = [put(x) for x in pair(rng)]
    with pytest.raises(ValueError, match="base"):
        ops.merge(*t, base="10")
    with pytest.raises(ValueError, match="states_axis"):
        ops.merge_states(t[0][:, None], t[1][:, None], states_axis=3)
    with pytest.raises(ValueError, match="a_tokens"):
        ops.merge(*t, a_tokens=-1)


# --------------------------------------------------------------------------------------------------
# opcheck and fake tensors


def samples(rng):
    """(overload name, args, kwargs) covering every overload and its options."""
    o_a, lse_a, o_b, lse_b = [put(x) for x in pair(rng, tokens=6, head_size=32, dtype="bfloat16")]
    f = [put(x) for x in pair(rng, tokens=6, head_size=32)]
    v, s = [put(x) for x in random_stacked(rng, 6, 3, 4, 32)]
    v0, s0 = [put(x) for x in random_stacked(rng, 6, 3, 4, 32, states_axis=0)]
    indptr = torch.tensor([0, 2, 2, 6], dtype=torch.int32)
    mask = torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.uint8)
    sink = put(random_lse(rng, (4,)))
    new = lambda *shape, dtype=torch.float32: torch.empty(shape, dtype=dtype)  # noqa: E731
    total = lambda lse: torch.rand(lse.shape, generator=torch.Generator().manual_seed(1)) * 8 + 1  # noqa: E731
    valid2 = torch.tensor([[1, 1], [0, 1], [1, 0], [0, 0], [1, 1], [2, 3]], dtype=torch.int32)  # [tokens, 2]
    valid3 = torch.tensor([[1, 0, 1], [0, 0, 0], [1, 1, 1], [0, 1, 0], [1, 1, 0], [1, 0, 0]], dtype=torch.uint8)
    return [
        ("merge.default", (o_a, lse_a, o_b, lse_b), {}),
        ("merge.default", (o_a, lse_a, o_b, lse_b), dict(out_dtype=torch.float32, base="2", a_tokens=4, pdl=True)),
        ("merge.default", (*f,), dict(out_dtype=torch.float8_e4m3fn, output_scale=torch.tensor([2.0]))),
        ("merge.out", (o_a, lse_a, o_b, lse_b), dict(out=new(6, 4, 32, dtype=torch.bfloat16), out_lse=new(6, 4))),
        ("merge.out", (*f,), dict(out=new(6, 4, 32), a_tokens=0)),
        ("merge_inplace.default", (f[0].clone(), f[1].clone(), f[2], f[3]), {}),
        ("merge_inplace.default", (f[0].clone(), f[1].clone(), f[2], f[3], mask), dict(base="2")),
        ("merge_inplace.functional", (*f, mask > 0), {}),
        ("merge_states.default", (v, s), {}),
        ("merge_states.default", (v0, s0), dict(states_axis=0, out_dtype=torch.float16)),
        ("merge_states.out", (v, s), dict(out=new(6, 4, 32), out_lse=new(6, 4))),
        ("merge_varlen.default", (f[0], f[1], indptr), {}),
        ("merge_varlen.out", (f[0], f[1], indptr.long()), dict(out=new(3, 4, 32), out_lse=None)),
        ("merge_share.default", (f[0], s), dict(index=1)),
        ("merge_share.default", (f[0], s0), dict(index=2, states_axis=0, out_dtype=torch.bfloat16, base="2")),
        ("merge_share.out", (f[0], s), dict(index=0, out=new(6, 4, 32), out_lse=new(6, 4))),
        ("merge.out", (o_a, lse_a, o_b, lse_b), dict(out=new(6, 4, 32, dtype=torch.float8_e4m3fn), out_lse=new(6, 4),
                                                     group_scales=new(6, 4, 2), group_size=16, scale_ue8m0=True)),
        ("merge_states.out", (v, s), dict(out=new(6, 4, 32, dtype=torch.float8_e4m3fn), group_scales=new(6, 4, 1),
                                          group_size=32)),
        ("merge.out", (o_a, lse_a, o_b, lse_b), dict(out=new(6, 4, 16, dtype=torch.uint8), out_lse=new(6, 4),
                                                     group_scales=new(1, 2, 512, dtype=torch.float8_e4m3fn),
                                                     block_format="nvfp4", scale_layout="swizzled")),
        ("merge_states.out", (v, s), dict(out=new(6, 4, 32, dtype=torch.float8_e4m3fn),
                                          group_scales=new(6, 4, 1, dtype=torch.uint8), block_format="mxfp8",
                                          scale_rounding="rceil")),
        ("merge.default", (o_a, lse_a, o_b, lse_b, None, sink), dict(a_tokens=3)),
        ("merge.out", (*f,), dict(out=new(6, 4, 32), out_lse=new(6, 4), sink=sink, base="2,e")),
        ("merge_states.default", (v, s, None, sink), dict(out_base="2")),
        # softmax sums (their LSE argument then holds maxima) and valid states, positional after the sink
        ("merge.default", (*f, None, None, total(f[1]), total(f[3]), valid2), {}),
        ("merge.out", (*f,), dict(out=new(6, 4, 32), out_lse=new(6, 4), sum_b=total(f[3]), valid=valid2.bool())),
        ("merge_inplace.default", (f[0].clone(), f[1].clone(), f[2], f[3], mask, None, total(f[3]), valid2), {}),
        ("merge_inplace.functional", (*f, None, None, total(f[3]), valid2.long()), {}),
        ("merge_states.default", (v0, s0, None, sink, total(s0), valid3), dict(states_axis=0)),
        ("merge_states.out", (v, s), dict(out=new(6, 4, 32), out_lse=new(6, 4), sum_a=total(s), valid=valid3)),
        ("merge_varlen.default", (f[0], f[1], indptr, None, None, total(f[1]), mask.int()), {}),
        ("merge_share.default", (f[0], s, None, None, total(s), valid3), dict(index=1)),
    ]


def _fp8_out(kwargs):
    dtypes = {getattr(kwargs.get(k), "dtype", None) for k in ("out", "group_scales")}
    return torch.float8_e4m3fn in dtypes or torch.uint8 in dtypes


# opcheck's test_schema compares a mutated float8 tensor by arithmetic that torch has no float8 kernel
# for: those samples take the other checks.
_FP8_OUT_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("i", range(31))
def test_opcheck(rng, i):
    name, args, kwargs = samples(rng)[i]
    torch.library.opcheck(overload(name), args, kwargs, **(dict(test_utils=_FP8_OUT_CHECKS) if _fp8_out(kwargs) else {}))


@pytest.mark.parametrize("i", [0, 1, 2, 7, 8, 9, 11, 13, 14])
def test_fake_results_have_the_real_shapes_dtypes_and_strides(rng, i):
    from torch._subclasses.fake_tensor import FakeTensorMode

    name, args, kwargs = samples(rng)[i]
    real = overload(name)(*args, **kwargs)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = overload(name)(*[mode.from_tensor(a) for a in args], **kwargs)
    for r, f in zip(real, fake):
        assert (f.shape, f.dtype, f.stride()) == (r.shape, r.dtype, r.stride())


def test_meta_tensors_through_the_ops_give_meta_results():
    o, lse = torch.empty(5, 4, 64, device="meta"), torch.empty(5, 4, device="meta")
    out, out_lse = ops.merge(o, lse, o, lse, out_dtype=torch.bfloat16)
    assert out.device.type == "meta" and out.shape == (5, 4, 64) and out.dtype == torch.bfloat16
    assert out_lse.shape == (5, 4) and out_lse.dtype == torch.float32


# --------------------------------------------------------------------------------------------------
# eager calls keep the direct path


class _Dispatched(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_eager_calls_dispatch_no_torch_op(rng):
    t = [put(x) for x in pair(rng)]
    out, out_lse = torch.empty(13, 4, 64), torch.empty(13, 4)
    with _Dispatched() as seen:
        attnmerge.merge(*t, out=out, out_lse=out_lse)
        attnmerge.merge_inplace(out, out_lse, t[2], t[3])
    assert [n for n in seen.names if n.startswith("attnmerge::")] == []
    with _Dispatched() as seen:
        ops.merge.out(*t, out=out, out_lse=out_lse)
    assert seen.names == ["attnmerge::merge.out"]


# --------------------------------------------------------------------------------------------------
# torch.compile(fullgraph=True) and torch.export


class _Graphs:
    """A compile backend that keeps the FX graphs Dynamo hands it and runs them through aot_eager
    (functionalization included), so a test can see the ops in the graph."""

    def __init__(self, backend):
        self.graphs, self.backend = [], backend

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        if self.backend == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd
            from torch._functorch.aot_autograd import make_boxed_func

            return aot_autograd(fw_compiler=lambda g, _: make_boxed_func(g.forward))(gm, example_inputs)
        from torch._inductor import compile_fx

        return compile_fx.compile_fx(gm, example_inputs)

    def ops_called(self):
        return {str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"
                and str(n.target).startswith("attnmerge.")}


def compiled(fn, backend="inductor", **kw):
    torch._dynamo.reset()
    graphs = _Graphs(backend)
    return torch.compile(fn, fullgraph=True, backend=graphs, **kw), graphs


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_merge(rng, backend):
    h = pair(rng, dtype="float16")
    f, graphs = compiled(lambda a, b, c, d: attnmerge.merge(a, b, c, d, out_dtype="bfloat16", base=2, a_tokens=9),
                         backend)
    out, out_lse = f(*[put(x) for x in h])
    assert graphs.ops_called() == {"attnmerge.merge.default"}
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h, base=2, a_tokens=9), "bfloat16")


def test_compiled_merge_into_given_outputs(rng):
    h = pair(rng)
    f, graphs = compiled(lambda a, b, c, d, out, out_lse: attnmerge.merge(a, b, c, d, out=out, out_lse=out_lse))
    out, out_lse = poisoned((13, 4, 64)), poisoned((13, 4))
    res, res_lse = f(*[put(x) for x in h], out, out_lse)
    assert graphs.ops_called() == {"attnmerge.merge.out"}
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h), "float32")
    assert res.data_ptr() == out.data_ptr() and res_lse.data_ptr() == out_lse.data_ptr()


def test_compiled_merge_allocates_a_missing_out_lse_and_checks_out_dtype(rng):
    h = pair(rng)
    f, graphs = compiled(lambda a, b, c, d, out: attnmerge.merge(a, b, c, d, out=out), "aot_eager")
    out = poisoned((13, 4, 64))
    res, res_lse = f(*[put(x) for x in h], out)
    assert res is out and res_lse.shape == (13, 4) and res_lse.dtype == torch.float32
    assert_merge_matches(get(out), get(res_lse), reference_merge(*h), "float32")
    f, _ = compiled(lambda a, b, c, d, out: attnmerge.merge(a, b, c, d, out=out, out_dtype="bfloat16"), "aot_eager")
    with pytest.raises(Exception, match="out_dtype: expected None or the dtype of out"):
        f(*[put(x) for x in h], out)


def test_compiled_merge_without_lse_and_a_number_as_fp8_scale(rng):
    from oracle import assert_fp8_close

    h = pair(rng)
    f, _ = compiled(lambda a, b, c, d: attnmerge.merge(a, b, c, d, out_dtype=torch.float8_e4m3fn, output_scale=0.5,
                                                      return_lse=False), "aot_eager")
    out, out_lse = f(*[put(x) for x in h])
    assert out_lse is None
    assert_fp8_close(out.view(torch.uint8).numpy().view(_fp8()), reference_merge(*h)[0], scale=0.5)


def test_compiled_merge_inplace_writes_its_arguments(rng):
    h = pair(rng, tokens=8)
    o, lse, o_other, lse_other = [put(x) for x in h]
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 1, 0], dtype=torch.bool)
    f, graphs = compiled(lambda o, lse, p, q, m: attnmerge.merge_inplace(o, lse, p, q, mask=m))
    res = f(o, lse, o_other, lse_other, mask)
    ref_o, ref_lse = reference_merge(*h)
    ref_o[[2, 7]], ref_lse[[2, 7]] = h[0][[2, 7]], h[1][[2, 7]]
    assert res[0] is o and res[1] is lse
    assert_merge_matches(get(o), get(lse), (ref_o, ref_lse), "float32")
    assert graphs.ops_called() == {"attnmerge.merge_inplace.default"}


def test_compiled_merge_states_and_merge_varlen(rng):
    v, s = random_stacked(rng, 7, 4, 4, 64, "bfloat16", states_axis=0)
    f, _ = compiled(lambda v, s: attnmerge.merge_states(v, s, states_axis=0))
    out, out_lse = f(put(v), put(s))
    assert_merge_matches(get(out), get(out_lse), reference_merge_stacked(v, s, states_axis=0), "bfloat16")

    indptr = np.array([0, 1, 4, 4, 6], np.int64)
    v, s = random_state(rng, 6, 4, 64)
    f, graphs = compiled(lambda v, s, i: attnmerge.merge_varlen(v, s, i, base=2), dynamic=True)
    out, out_lse = f(put(v), put(s), torch.from_numpy(indptr))
    assert_merge_matches(get(out), get(out_lse), reference_merge_varlen(v, s, indptr, base=2), "float32")
    assert graphs.ops_called() == {"attnmerge.merge_varlen.default"}


def test_compiled_per_group_fp8_outputs(rng):
    """group_size takes the out= overload, the scales allocated in the graph and returned."""
    from oracle import assert_group_fp8_close

    h = pair(rng, head_size=128, dtype="bfloat16")
    f, graphs = compiled(lambda a, b, c, d: attnmerge.merge(a, b, c, d, group_size=64, scale_ue8m0=True))
    out, out_lse, scales = f(*[put(x) for x in h])
    assert graphs.ops_called() == {"attnmerge.merge.out"}
    assert out.dtype == torch.float8_e4m3fn and tuple(scales.shape) == (*out.shape[:2], 2)
    as_fp8 = lambda t: t.view(torch.uint8).numpy().view(_fp8())  # noqa: E731
    assert_group_fp8_close(as_fp8(out), get(scales), reference_merge(*h)[0], 64, True)
    v, s = random_stacked(rng, 5, 9, 4, 128, "bfloat16")
    f, graphs = compiled(lambda v, s: attnmerge.merge_states(v, s, group_size=128))
    out, out_lse, scales = f(put(v), put(s))
    assert graphs.ops_called() == {"attnmerge.merge_states.out"}
    assert_group_fp8_close(as_fp8(out), get(scales), reference_merge_stacked(v, s)[0], 128)


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_compiled_block_scaled_outputs(rng, fmt):
    """block_format takes the out= overload, out and the swizzled scales allocated in the graph: the
    bytes of the eager call."""
    h = [put(x) for x in pair(rng, head_size=128, dtype="bfloat16")]
    f, graphs = compiled(lambda a, b, c, d: attnmerge.merge(a, b, c, d, block_format=fmt, scale_layout="swizzled"))
    out, _, scales = f(*h)
    assert graphs.ops_called() == {"attnmerge.merge.out"}
    want, _, want_s = attnmerge.merge(*h, block_format=fmt, scale_layout="swizzled")
    assert torch.equal(out.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(scales.view(torch.uint8), want_s.view(torch.uint8))


def test_no_gradient_through_a_block_scaled_output(rng):
    h = [put(x).requires_grad_() for x in pair(rng, head_size=64, dtype="float32")]
    with pytest.raises(NotImplementedError, match="attnmerge::merge.out"):
        attnmerge.merge(*h, block_format="nvfp4")


def test_compiled_merge_share(rng):
    o, lse = random_o(rng, (7, 4, 64), "bfloat16"), random_lse(rng, (3, 7, 4))
    f, graphs = compiled(lambda o, lse: attnmerge.merge_share(o, lse, 2, states_axis=0, out_dtype=torch.float32))
    out, out_lse = f(put(o), put(lse))
    assert_merge_matches(get(out), get(out_lse), reference_merge_share(o, lse, 2, states_axis=0), "float32")
    assert graphs.ops_called() == {"attnmerge.merge_share.default"}


def test_compiled_vllm_merge_attn_states_as_cascade_attention_calls_it(rng):
    """vLLM's cascade_attention: merge_attn_states(output, prefix_output, prefix_lse, suffix_output,
    suffix_lse), LSEs [heads, tokens], output written in place, None returned."""
    po, so = random_o(rng, (13, 4, 64), "bfloat16"), random_o(rng, (13, 4, 64), "bfloat16")
    pl, sl = random_lse(rng, (4, 13)), random_lse(rng, (4, 13))
    f, graphs = compiled(vllm.merge_attn_states)
    output, output_lse = poisoned((13, 4, 64), "bfloat16"), poisoned((4, 13))
    assert f(output, put(po), put(pl), put(so), put(sl)) is None
    assert_merge_matches(get(output), None, reference_merge(po, pl.T, so, sl.T), "bfloat16", "output")
    f(output, put(po), put(pl), put(so), put(sl), output_lse, 5)
    ref = reference_merge(po, pl.T, so, sl.T, a_tokens=5)
    assert_merge_matches(get(output), get(output_lse).T, ref, "bfloat16", "output")
    assert graphs.ops_called() == {"attnmerge.merge.out"}


def test_compiled_flashinfer_functions(rng):
    h = pair(rng, dtype="float16")
    f, _ = compiled(fi.merge_state)
    v, s = f(*[put(x) for x in h])
    assert_merge_matches(get(v), get(s), reference_merge(*h, base=2), "float16", "v")

    v, s, v_other, s_other = [put(x) for x in h]
    f, _ = compiled(fi.merge_state_in_place)
    assert f(v, s, v_other, s_other) is None
    assert_merge_matches(get(v), get(s), reference_merge(*h, base=2), "float16", "v")

    vs, ss = random_stacked(rng, 9, 3, 4, 64)
    f, _ = compiled(fi.merge_states)
    v, s = f(put(vs), put(ss))
    assert_merge_matches(get(v), get(s), reference_merge_stacked(vs, ss, base=2), "float32", "v")

    indptr = np.array([0, 2, 2, 5], np.int32)
    vv, sv = random_state(rng, 5, 4, 64)
    f, _ = compiled(fi.variable_length_merge_states)
    v, s = f(put(vv), put(sv), torch.from_numpy(indptr))
    assert_merge_matches(get(v), get(s), reference_merge_varlen(vv, sv, indptr, base=2), "float32", "v")


def test_compiled_sglang_functions(rng):
    """SGLang's chunked-prefix merge: allocated results, or written into given ones."""
    h = pair(rng, dtype="bfloat16")
    f, graphs = compiled(sglang.merge_state)
    out, out_lse = f(*[put(x) for x in h])
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h), "bfloat16")
    f, graphs = compiled(sglang.merge_state_v2)
    v, s = poisoned(h[0].shape, "bfloat16"), poisoned(h[1].shape)
    assert f(*[put(x) for x in h], v, s)[0] is v
    assert_merge_matches(get(v), get(s), reference_merge(*h), "bfloat16")
    assert graphs.ops_called() == {"attnmerge.merge.out"}


def test_compiled_with_a_stream_argument_is_refused():
    o, lse = torch.randn(3, 2, 8), torch.randn(3, 2)
    f, _ = compiled(lambda o, lse: attnmerge.merge(o, lse, o, lse, stream=0), "aot_eager")
    with pytest.raises(Exception, match="stream"):
        f(o, lse)


class _Merge(torch.nn.Module):
    def forward(self, o_a, lse_a, o_b, lse_b):
        return attnmerge.merge(o_a, lse_a, o_b, lse_b, base=2)


class _MergeInplace(torch.nn.Module):
    def forward(self, o, lse, o_other, lse_other):
        return attnmerge.merge_inplace(o, lse, o_other, lse_other, base=2)


@pytest.mark.parametrize("strict", [False, True])
@pytest.mark.parametrize("module, op", [(_Merge, "merge.default"), (_MergeInplace, "merge_inplace.default")])
def test_export_records_the_op(rng, module, op, strict):
    h = pair(rng)
    ep = torch.export.export(module(), tuple(put(x) for x in h), strict=strict)
    assert [str(n.target) for n in ep.graph.nodes if str(n.target).startswith("attnmerge.")] == [f"attnmerge.{op}"]
    t = [put(x) for x in h]
    out, out_lse = ep.module()(*t)
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h, base=2), "float32")
    if module is _MergeInplace:  # the mutation of the inputs is part of the exported program
        assert_merge_matches(get(t[0]), get(t[1]), reference_merge(*h, base=2), "float32")


# --------------------------------------------------------------------------------------------------
# autograd: refused by name until backward lands; in-place writes are versioned


def _grad_calls(t):
    o_a, lse_a, o_b, lse_b = t
    return {
        "attnmerge::merge": lambda: attnmerge.merge(o_a, lse_a, o_b, lse_b),
        "attnmerge::merge.out": lambda: attnmerge.merge(o_a, lse_a, o_b, lse_b, out=torch.empty(13, 4, 64)),
        "attnmerge::merge_inplace": lambda: attnmerge.merge_inplace(torch.zeros(13, 4, 64), torch.zeros(13, 4),
                                                                    o_b, lse_b),
        "attnmerge::merge_states": lambda: attnmerge.merge_states(o_b[:, None], lse_b[:, None]),
        "attnmerge::merge_varlen": lambda: attnmerge.merge_varlen(o_b, lse_b, torch.tensor([0, 13])),
        "attnmerge::merge_share.out": lambda: attnmerge.merge_share(o_b, lse_b[:, None], 0, out=torch.empty(13, 4, 64)),
        "attnmerge::merge_inplace.functional": lambda: ops.merge_inplace.functional(o_a, lse_a, o_b, lse_b),
    }


DIFFERENTIABLE = ("attnmerge::merge", "attnmerge::merge_states", "attnmerge::merge_varlen",  # test_torch_autograd.py
                  "attnmerge::merge_share")


@pytest.mark.parametrize("which", ["o", "lse"])
@pytest.mark.parametrize("op", [op for op in _grad_calls([None] * 4) if op not in DIFFERENTIABLE])
def test_an_input_that_requires_grad_is_refused_by_name(rng, op, which):
    t = [put(x) for x in pair(rng)]
    t[3 if which == "lse" else 2].requires_grad_()
    call = _grad_calls(t)[op]
    with pytest.raises(NotImplementedError, match=f"{op}: {which}(_b|_other)? requires grad"):
        call()
    with torch.no_grad():
        call()  # the same call without autograd runs


def test_vllm_merge_attn_states_refuses_an_input_that_requires_grad(rng):
    po, pl = put(random_o(rng, (13, 4, 64))).requires_grad_(), put(random_lse(rng, (4, 13)))
    with pytest.raises(NotImplementedError, match="requires grad"):
        vllm.merge_attn_states(torch.empty(13, 4, 64), po, pl, po.detach(), pl)


def test_the_in_place_overloads_bump_the_version_of_what_they_write(rng):
    o, lse, o_b, lse_b = [put(x) for x in pair(rng)]
    out, out_lse = torch.empty(13, 4, 64), torch.empty(13, 4)
    before = [x._version for x in (o, lse, out, out_lse, o_b, lse_b)]
    ops.merge.out(o, lse, o_b, lse_b, out=out, out_lse=out_lse)
    ops.merge_inplace(o, lse, o_b, lse_b)
    after = [x._version for x in (o, lse, out, out_lse, o_b, lse_b)]
    assert [a > b for a, b in zip(after, before)] == [True, True, True, True, False, False]


def test_a_tensor_saved_for_backward_then_merged_into_is_caught_by_autograd(rng):
    o, lse, o_b, lse_b = [put(x) for x in pair(rng)]
    w = torch.ones(13, 4, 64, requires_grad=True)
    y = (w * o).sum()  # saves o for the gradient of w
    ops.merge_inplace(o, lse, o_b, lse_b)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


# --------------------------------------------------------------------------------------------------
# CUDA: torch's current stream, graph capture, reduce-overhead


def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("torch sees no CUDA device")


@pytest.mark.gpu
@pytest.mark.parametrize("i", range(13))
def test_cuda_opcheck(rng, i):
    _cuda()
    name, args, kwargs = samples(rng)[i]
    to = lambda x: x.cuda() if isinstance(x, torch.Tensor) else x  # noqa: E731
    torch.library.opcheck(overload(name), tuple(map(to, args)), {k: to(v) for k, v in kwargs.items()})


@pytest.mark.gpu
@pytest.mark.parametrize("how", ["op", "compiled"])
def test_cuda_ops_run_on_the_current_stream(rng, how):
    """The inputs get new values on a side stream after a long sleep there; a merge on that stream
    sees them, one on any other stream would read the old values."""
    _cuda()
    h_old = pair(rng, tokens=512, heads=8, head_size=128, dtype="bfloat16")
    h_new = pair(rng, tokens=512, heads=8, head_size=128, dtype="bfloat16")
    t, new = [put(x, "cuda") for x in h_old], [put(x, "cuda") for x in h_new]
    out, out_lse = poisoned((512, 8, 128), "bfloat16", "cuda"), poisoned((512, 8), device="cuda")
    merge = ops.merge.out
    if how == "compiled":
        merge, _ = compiled(lambda a, b, c, d, out, out_lse: attnmerge.merge(a, b, c, d, out=out, out_lse=out_lse))
        merge(*t, out=out, out_lse=out_lse)  # compile first, outside the timed region
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        for x, n in zip(t, new):
            x.copy_(n)
        merge(*t, out=out, out_lse=out_lse)
    torch.cuda.synchronize()
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h_new), "bfloat16")


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay(rng):
    _cuda()
    h = pair(rng, dtype="float16")
    t = [put(x, "cuda") for x in h]
    out, out_lse = poisoned((13, 4, 64), "float16", "cuda"), poisoned((13, 4), device="cuda")
    ops.merge.out(*t, out=out, out_lse=out_lse)  # warm-up outside the capture, as torch asks
    torch.cuda.synchronize()
    out.fill_(float("nan"))
    out_lse.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.merge.out(*t, out=out, out_lse=out_lse)
    h2 = pair(rng, dtype="float16")
    for x, new in zip(t, h2):
        x.copy_(put(new, "cuda"))
    graph.replay()
    torch.cuda.synchronize()
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h2), "float16")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_cuda_compiled_public_functions(rng, mode):
    _cuda()
    h = pair(rng, dtype="bfloat16")
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c, d: attnmerge.merge(a, b, c, d), fullgraph=True, mode=mode)
    for _ in range(3):  # reduce-overhead records a CUDA graph after warm-up runs, then replays it
        out, out_lse = f(*[put(x, "cuda") for x in h])
    assert_merge_matches(get(out), get(out_lse), reference_merge(*h), "bfloat16")
    v, s = random_stacked(rng, 9, 3, 4, 64, "float16")
    g = torch.compile(fi.merge_states, fullgraph=True, mode=mode)
    for _ in range(3):
        out, out_lse = g(put(v, "cuda"), put(s, "cuda"))
    assert_merge_matches(get(out), get(out_lse), reference_merge_stacked(v, s, base=2), "float16")


# --------------------------------------------------------------------------------------------------
# the live number of tokens (num_tokens): an optional tensor of every forward overload


def _count(n, dtype=torch.int32):
    return torch.tensor([n], dtype=dtype)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_merge_with_a_live_count_writes_the_live_rows_alone(rng, backend):
    """One compiled graph, the count a tensor input: rows below it are the oracle's, rows past it
    keep what they held (the NaN poison), whatever the count."""
    h = pair(rng)
    f, graphs = compiled(lambda a, b, c, d, out, out_lse, n: attnmerge.merge(a, b, c, d, out=out, out_lse=out_lse,
                                                                              num_tokens=n), backend)
    ref = reference_merge(*h)
    for n in (0, 5, 13):
        out, out_lse = poisoned((13, 4, 64)), poisoned((13, 4))
        f(*[put(x) for x in h], out, out_lse, _count(n, torch.int64))
        assert_merge_matches(get(out)[:n], get(out_lse)[:n], (ref[0][:n], ref[1][:n]), "float32")
        assert torch.isnan(out[n:]).all() and torch.isnan(out_lse[n:]).all()
    assert graphs.ops_called() == {"attnmerge.merge.out"}


def test_compiled_functional_merges_with_a_live_count(rng):
    """The functional overloads take the count positionally (after valid); their results have the
    capacity's tokens."""
    v, s = random_stacked(rng, 7, 4, 4, 64, "bfloat16")
    f, graphs = compiled(lambda v, s, n: attnmerge.merge_states(v, s, num_tokens=n))
    out, out_lse = f(put(v), put(s), _count(3))
    assert out.shape == (7, 4, 64)
    ref = reference_merge_stacked(v, s)
    assert_merge_matches(get(out)[:3], get(out_lse)[:3], (ref[0][:3], ref[1][:3]), "bfloat16")
    assert graphs.ops_called() == {"attnmerge.merge_states.default"}
    o, lse, o_other, lse_other = [put(x) for x in pair(rng, tokens=8)]
    held_o, held_lse = o.clone(), lse.clone()
    g, graphs = compiled(lambda o, lse, p, q, n: attnmerge.merge_inplace(o, lse, p, q, num_tokens=n))
    g(o, lse, o_other, lse_other, _count(5))
    assert torch.equal(o[5:], held_o[5:]) and torch.equal(lse[5:], held_lse[5:])
    ref = reference_merge(get(held_o), get(held_lse), get(o_other), get(lse_other))
    assert_merge_matches(get(o)[:5], get(lse)[:5], (ref[0][:5], ref[1][:5]), "float32")


def _live_samples(rng):
    """The forward overloads with num_tokens at the capacity (every row written: opcheck compares
    results), as tensors of both integer dtypes."""
    f = [put(x) for x in pair(rng, tokens=6, head_size=32)]
    v, s = (put(x) for x in random_stacked(rng, 6, 3, 4, 32))
    indptr = torch.tensor([0, 2, 2, 5, 6, 6, 8])
    o8, l8 = (put(x) for x in random_state(rng, 8, 4, 32))
    n32, n64 = _count(6), _count(6, torch.int64)
    new = lambda *shape: torch.empty(shape)  # noqa: E731
    return [
        ("merge.default", (*f, None, None, None, None, None, n32), {}),
        ("merge.out", (*f,), dict(out=new(6, 4, 32), out_lse=new(6, 4), num_tokens=n64)),
        ("merge_inplace.default", (f[0].clone(), f[1].clone(), f[2], f[3], None, None, None, None, n32), {}),
        ("merge_inplace.functional", (*f, None, None, None, None, n64), {}),
        ("merge_states.default", (v, s, None, None, None, None, n32), {}),
        ("merge_varlen.default", (o8, l8, indptr, None, None, None, None, n64), {}),
        ("merge_share.default", (f[0], s, None, None, None, None, n32), dict(index=1)),
    ]


@pytest.mark.parametrize("i", range(7))
def test_opcheck_with_a_live_count(rng, i):
    name, args, kwargs = _live_samples(rng)[i]
    torch.library.opcheck(overload(name), args, kwargs)


def test_a_live_count_under_vmap_counts_each_examples_tokens(rng):
    o_a, o_b = random_o(rng, (3, 6, 2, 16)), random_o(rng, (3, 6, 2, 16))
    lse_a, lse_b = random_lse(rng, (3, 6, 2)), random_lse(rng, (3, 6, 2))
    counts = torch.tensor([[1], [4], [6]], dtype=torch.int32)
    out, out_lse = torch.func.vmap(lambda a, x, c, y, n: attnmerge.merge(a, x, c, y, num_tokens=n))(
        put(o_a), put(lse_a), put(o_b), put(lse_b), counts)
    for i, n in enumerate(counts[:, 0].tolist()):
        ref = reference_merge(o_a[i], lse_a[i], o_b[i], lse_b[i])
        assert_merge_matches(get(out[i])[:n], get(out_lse[i])[:n], (ref[0][:n], ref[1][:n]), "float32")


def test_no_gradient_with_a_live_count(rng):
    a, b, c, d = [put(x) for x in pair(rng)]
    a.requires_grad_(True)
    with pytest.raises(NotImplementedError, match="num_tokens"):
        attnmerge.merge(a, b, c, d, num_tokens=_count(4))


def test_a_tokens_as_a_tensor_is_refused_where_the_ops_take_the_call(rng):
    """The ops take a_tokens as an int: a tensor of it (the native road's, read on the device) is
    refused by name where torch.compile or autograd takes the call, never dropped."""
    a, b, c, d = [put(x) for x in pair(rng)]
    f, _ = compiled(lambda a, b, c, d, k: attnmerge.merge(a, b, c, d, a_tokens=k), "aot_eager")
    with pytest.raises(Exception, match="a_tokens: expected None or an int"):
        f(a, b, c, d, _count(4))
