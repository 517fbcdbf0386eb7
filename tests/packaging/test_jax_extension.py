"""The JAX extension (attnmerge.jax's XLA FFI handlers) is opt-in for source builds: a build that
asked for it (ATTNMERGE_BUILD_JAX=1, as the release wheels and scripts/gpu-test.sh do, and as their
test runs say) carries it; a build without it says, on import, how to get it."""
from __future__ import annotations

import importlib
import os
import sys

import pytest

import attnmerge


def test_a_build_that_asked_for_the_jax_extension_carries_it():
    if os.environ.get("ATTNMERGE_BUILD_JAX", "").strip().lower() not in ("1", "true", "yes", "on"):
        pytest.skip("ATTNMERGE_BUILD_JAX is not set: this build did not ask for the JAX extension")
    if sys.version_info < (3, 11):
        pytest.skip("the build asks for jaxlib (XLA's FFI headers) from Python 3.11 on")
    assert attnmerge.build_info()["jax_extension"], "ATTNMERGE_BUILD_JAX=1, yet attnmerge has no JAX extension"


def test_without_the_extension_attnmerge_jax_says_how_to_get_it():
    pytest.importorskip("jax")
    if attnmerge.build_info()["jax_extension"]:
        pytest.skip("this attnmerge carries the JAX extension")
    with pytest.raises(ImportError) as info:
        importlib.import_module("attnmerge.jax")
    msg = str(info.value)
    # No wheel on PyPI carries it yet, so the message must not send the user to one.
    assert "JAX extension" in msg and "ATTNMERGE_BUILD_JAX=1" in msg and "no wheel with it is published" in msg, msg
