"""The public functions' per-call path (attnmerge._call.public_call, python/src/road.cpp): a call
whose options are all their defaults gets, without Python, the record the one reading of options
makes; any other call is read in Python; both take the same road and give the same bits."""
from __future__ import annotations

import ast
import inspect
import textwrap

import numpy as np
import pytest

import attnmerge
from attnmerge import _call, _merge, _roads
from oracle import random_pair, random_stacked

PUBLIC = {"merge": _merge.merge, "merge_inplace": _merge.merge_inplace, "merge_states": _merge.merge_states,
          "merge_varlen": _merge.merge_varlen, "merge_share": _merge.merge_share}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_default_record_is_what_the_reading_of_no_options_gives(name):
    """The per-call path's record is DEFAULT with the stream and the names set: what options()
    reads for a call that gives no option."""
    op = _call.OPS[name]
    stream, names = object(), {"o": "mine"}
    assert _call.options(op, stream=stream, names=names) == _call.DEFAULT._replace(stream=stream, names=names)


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_each_public_function_hands_over_its_parameters_in_its_signatures_order(name):
    """The one call in a public function's body passes every parameter, positionally, in the order
    its per-call path was built from (the signature's)."""
    function = PUBLIC[name]
    tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    body = [node for node in tree.body[0].body if not isinstance(node, ast.Expr)]  # the docstring aside
    assert len(body) == 1 and isinstance(body[0], ast.Return) and isinstance(body[0].value, ast.Call)
    call = body[0].value
    assert call.func.id == f"_{name}_call" and not call.keywords
    assert [a.id for a in call.args] == list(inspect.signature(function).parameters)


def _cases(rng):
    """(name, inputs, keyword arguments) of each public function on NumPy arrays, outputs given."""
    t, h, d, s = 6, 3, 32, 4
    o_a, lse_a, o_b, lse_b = random_pair(rng, t, h, d)
    o, lse = random_stacked(rng, t, s, h, d)
    flat_o, flat_lse = o.reshape(t * s, h, d), lse.reshape(t * s, h)
    indptr = np.arange(0, (t + 1) * s, s, dtype=np.int32)
    return [("merge", (o_a, lse_a, o_b, lse_b), {}),
            ("merge_inplace", (o_a.copy(), lse_a.copy(), o_b, lse_b), {}),
            ("merge_states", (o, lse), {}),
            ("merge_varlen", (flat_o, flat_lse, indptr), {}),
            ("merge_share", (o[:, 0], lse), {"index": 1})]


def _run(name, inputs, kwargs):
    if name == "merge_inplace":
        o, lse, *rest = (x.copy() if i < 2 else x for i, x in enumerate(inputs))
        attnmerge.merge_inplace(o, lse, *rest, **kwargs)
        return o, lse
    out = np.full((inputs[0].shape[0] if name != "merge_varlen" else len(inputs[2]) - 1,) + inputs[0].shape[-2:],
                  np.nan, np.float32)
    out_lse = np.full(out.shape[:2], np.nan, np.float32)
    if name == "merge_share":
        return PUBLIC[name](*inputs, kwargs.pop("index"), out=out, out_lse=out_lse, **kwargs)
    return PUBLIC[name](*inputs, out=out, out_lse=out_lse, **kwargs)


# Options given as values equal to their defaults but not the default objects: read in Python.
_EQUAL_NOT_SAME = {"merge": dict(pdl=np.False_), "merge_inplace": dict(batch_invariant=np.False_),
                   "merge_states": dict(states_axis=np.int64(1)), "merge_varlen": dict(return_lse=np.True_),
                   "merge_share": dict(states_axis=np.int64(1), index=np.int64(1))}


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_the_python_reading_and_the_per_call_path_give_the_same_bits(rng, name):
    _, inputs, kwargs = next(c for c in _cases(rng) if c[0] == name)
    fast = _run(name, inputs, dict(kwargs))
    read = _run(name, inputs, dict(kwargs, **_EQUAL_NOT_SAME[name]))
    for f, r in zip(fast, read):
        np.testing.assert_array_equal(np.asarray(f).view(np.uint32), np.asarray(r).view(np.uint32))
        assert not np.isnan(np.asarray(f)).any()


def test_the_torch_road_is_registered_and_unregistered_as_a_whole():
    """_roads.use_torch takes three callables or three None; torch_road says which is registered."""
    before = _roads.torch_road()
    try:
        seen = []
        _roads.use_torch(lambda *arrays: seen.append(len(arrays)) or False, lambda *a: None, lambda: False)
        o_a, lse_a, o_b, lse_b = random_pair(np.random.default_rng(1), 2, 2, 8)
        attnmerge.merge(o_a, lse_a, o_b, lse_b)
        assert seen == [9]  # the 4 inputs, the sink, the 2 sums, out and out_lse
        _roads.use_torch(None, None, None)
        assert _roads.torch_road() is None
        with pytest.raises(TypeError, match="three callables, or three None"):
            _roads.use_torch(None, print, None)
    finally:
        _roads.use_torch(*(before or (None, None, None)))
    assert _roads.torch_road() == before
