"""Rules of the C ABI that follow from its one table of arguments per op (cpp/src/ops.cpp, read by
cpp/src/validate.cpp), each stated once for every op, with the full message it gives."""
from __future__ import annotations

import numpy as np
import pytest

import c_abi

T, H, D = 4, 3, 8
t = c_abi.tensor_from


def state(rng, tokens=T):
    return rng.random((tokens, H, D), np.float32) + 0.5, rng.standard_normal((tokens, H)).astype(np.float32)


def refused(status, message):
    assert status != c_abi.SUCCESS
    assert c_abi.last_error() == message


def test_the_in_place_state_takes_the_dtypes_of_a_read_o(rng):
    _, lse = state(rng)
    o = np.ones((T, H, D), np.uint8)
    o_other, lse_other = state(rng)
    status = c_abi.merge_inplace(t(o), t(lse), t(o_other), t(lse_other))
    refused(status, "o: expected dtype float32, float16, bfloat16 or float64, got uint8")
    assert (o == 1).all()


def test_an_output_is_kept_apart_from_the_outputs_before_it_and_named_first(rng):
    o_a, lse_a = state(rng)
    o_b, lse_b = state(rng)
    out = np.full((T, H, D), np.nan, np.float32)
    out_lse = out.reshape(-1)[: T * H].reshape(T, H)  # inside out
    status = c_abi.merge(t(out), t(out_lse), t(o_a), t(lse_a), t(o_b), t(lse_b))
    refused(status, "out_lse: expected memory disjoint from out, got overlapping ranges")
    assert np.isnan(out).all()
    # the same rule in a backward, whose outputs are its gradients
    grad_o_b = np.full((T, H, D), np.nan, np.float32)
    grad_lse_b = grad_o_b.reshape(-1)[: T * H].reshape(T, H)
    out, out_lse = o_b.copy(), lse_b.copy()
    status = c_abi.merge_backward(None, None, t(grad_o_b), t(grad_lse_b), t(o_b.copy()), None, t(out), t(out_lse),
                                  t(o_a), t(lse_a), t(o_b), t(lse_b))
    refused(status, "grad_lse_b: expected memory disjoint from grad_o_b, got overlapping ranges")
    assert np.isnan(grad_o_b).all()


@pytest.mark.parametrize("outputs", ["none", "like-o_b"])
def test_the_input_at_odds_with_the_others_is_named(rng, outputs):
    # o_b is the op's source (its sizes are read off it), but with one token too many it is the one
    # input of four that disagrees: it is named, against the others, not they against it.  Outputs
    # with o_b's sizes (as Python allocates them) have no say: they would otherwise outvote the others
    o_a, lse_a = state(rng)
    _, lse_b = state(rng)
    o_b, _ = state(rng, T + 1)
    tokens = T + 1 if outputs == "like-o_b" else T
    out, out_lse = np.full((tokens, H, D), np.nan, np.float32), np.full((tokens, H), np.nan, np.float32)
    status = c_abi.merge(t(out), t(out_lse) if outputs == "like-o_b" else None, t(o_a), t(lse_a), t(o_b), t(lse_b))
    refused(status, f"o_b: expected shape [{T}, {H}, {D}] (the number of tokens of o_a, lse_a and lse_b), "
                    f"got [{T + 1}, {H}, {D}]")
    assert np.isnan(out).all() and np.isnan(out_lse).all()


def test_two_inputs_that_disagree_with_no_other_to_side_with_are_both_named(rng):
    o_a, lse_a = state(rng)
    o_b, lse_b = rng.random((T, H, 2 * D), np.float32) + 0.5, rng.standard_normal((T, H)).astype(np.float32)
    out = np.full((T, H, D), np.nan, np.float32)
    status = c_abi.merge(t(out), None, t(o_a), t(lse_a), t(o_b), t(lse_b))
    refused(status, f"o_a and o_b: expected the same head_size, got {D} (o_a, shape [{T}, {H}, {D}]) and {2 * D} "
                    f"(o_b, shape [{T}, {H}, {2 * D}])")
    assert np.isnan(out).all()
