"""Results the Python layer allocates: a size read off an input that no memory could hold (a
broadcast view, a wrong axis) is refused by name before anything is allocated, not left to the
allocator's own failure."""
from __future__ import annotations

import numpy as np
import pytest

import attnmerge
from oracle import random_lse, random_o


def huge(x):
    """x's first row broadcast (no memory) to 2^40 tokens."""
    return np.broadcast_to(x[:1], (1 << 40,) + x.shape[1:])


@pytest.mark.parametrize("op", ["merge", "merge_states", "merge_share"])
def test_a_result_past_any_memory_is_refused_before_allocation(rng, op):
    o, lse = random_o(rng, (2, 3, 16)), random_lse(rng, (2, 3))
    with pytest.raises(ValueError, match=r"^(o_b|o): expected sizes whose results fit in memory, got a result of "
                                         r"shape \[1099511627776, 3, 16\]"):
        if op == "merge":
            attnmerge.merge(huge(o), huge(lse), huge(o), huge(lse))
        elif op == "merge_states":
            attnmerge.merge_states(huge(o)[:, None], huge(lse)[:, None])
        else:
            attnmerge.merge_share(huge(o), huge(lse)[:, None], 0)


def test_a_large_result_that_fits_is_allocated(rng):
    o, lse = random_o(rng, (2, 3, 16)), random_lse(rng, (2, 3))
    out, out_lse = attnmerge.merge(o, lse, o, lse)
    assert out.shape == (2, 3, 16) and out_lse.shape == (2, 3)
