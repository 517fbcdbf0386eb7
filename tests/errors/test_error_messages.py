"""Error messages that are no row of the bad-input table (bad_inputs.py): a mistake that reaches the
library by a path of its own, whose message must still be the table's.

- A torch meta tensor is refused by the name of the argument it was passed as, with no C++ backtrace,
  though the outputs are allocated like it (outside torch.compile's tracing, where the ops take it).
- A scale of 0 means none to the C ABI but not to Python: every path that turns a Python number into
  the C ABI's scale (attnmerge.jax, the torch.ops path taken under autograd, vLLM's layer) refuses it
  with the direct path's words.
"""

from __future__ import annotations

import pytest

import attnmerge
from attnmerge.compat.vllm import merge_attn_states
from bad_inputs import names
from oracle import random_state

T, H, D = 8, 3, 16


@pytest.mark.parametrize("meta", ["o_a", "o_b"])
def test_a_meta_tensor_is_refused_by_its_own_name(rng, meta):
    torch = pytest.importorskip("torch")
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    a = {k: torch.from_numpy(v) for k, v in dict(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b).items()}
    a[meta] = torch.empty(a[meta].shape, device="meta")
    with pytest.raises(ValueError) as info:  # no out=: attnmerge allocates it like o_b, on the meta device
        attnmerge.merge(a["o_a"], a["lse_a"], a["o_b"], a["lse_b"])
    msg = str(info.value)
    assert msg.startswith(f"{meta}: "), msg
    assert "meta tensors are not supported outside torch.compile tracing" in msg, msg
    assert not names("out", msg), f"the caller passed no out, yet the message blames it: {msg!r}"
    assert "\n" not in msg and "frame #" not in msg, f"a backtrace in the message: {msg!r}"


def _scale_0_through(path, o_a, lse_a, o_b, lse_b):
    if path == "jax":
        jax = pytest.importorskip("jax")
        if not attnmerge.build_info()["jax_extension"]:
            pytest.skip("attnmerge was built without the JAX extension")
        import attnmerge.jax as amj

        x = [jax.numpy.asarray(v) for v in (o_a, lse_a, o_b, lse_b)]
        return amj.merge(*x, out_dtype=jax.numpy.float8_e4m3fn, output_scale=0.0)
    torch = pytest.importorskip("torch")
    a, la, b, lb = (torch.from_numpy(v) for v in (o_a, lse_a, o_b, lse_b))
    if path == "torch.ops":  # taken for tensors that require grad
        return attnmerge.merge(a.requires_grad_(), la, b, lb, out_dtype=torch.float8_e4m3fn, output_scale=0.0)
    out = torch.zeros((T, H, D)).to(torch.float8_e4m3fn)
    return merge_attn_states(out, a, la.T.contiguous(), b, lb.T.contiguous(), output_scale=0.0)


@pytest.mark.parametrize("path", ["torch.ops", "jax", "vllm"])
def test_a_scale_of_0_is_refused_on_every_path(rng, path):
    """attnmerge.jax, the torch.ops path and the vLLM layer turn a number into a scale as the direct
    path does: 0 is not Python's none."""
    o_a, lse_a = random_state(rng, T, H, D)
    o_b, lse_b = random_state(rng, T, H, D)
    with pytest.raises(ValueError) as info:
        _scale_0_through(path, o_a, lse_a, o_b, lse_b)
    assert str(info.value) == "output_scale: expected None or a finite scale > 0, got 0.0"
