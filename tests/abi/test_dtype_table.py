"""One table of dtypes: libattnmerge's (attnmerge_dtype_info_of), which the binding, the package and
the ctypes binding read instead of restating it; here it is held to the contract (DESIGN.md)."""
from __future__ import annotations

import numpy as np
import pytest

import c_abi
from attnmerge import _C, _types

# The contract: which dtypes each argument takes, as the Python API names them (float64 on host
# arrays alone: tests/abi/test_dtype_dispatch.py).
CONTRACT = {
    _C.ROLE_O_IN: ("float32", "float16", "bfloat16", "float64"),
    _C.ROLE_O_OUT: ("float32", "float16", "bfloat16", "float8_e4m3fn", "float64"),
    _C.ROLE_LSE: ("float32", "float64"),
    _C.ROLE_MASK: ("uint8", "bool"),
    _C.ROLE_INDPTR: ("int32", "int64"),
    c_abi.ROLE_SCALE: ("float32",),  # the FP8 output's scales
}


@pytest.mark.parametrize("role", sorted(CONTRACT))
def test_each_role_takes_the_dtypes_of_the_contract(role):
    assert _types.dtypes_of(role) == CONTRACT[role]


def test_the_library_binding_and_package_read_one_table():
    rows = c_abi.dtypes()
    assert [(d.code, d.c_name, d.name, d.size, d.roles) for d in _types.DTYPES] == [
        (code, *rows[code]) for code in sorted(rows)]
    assert sorted(rows) == list(range(len(rows)))
    for bad in (-1, len(rows), 99):
        assert not c_abi.load().attnmerge_dtype_info_of(bad)


def test_the_ctypes_codes_are_the_library_codes():
    for code, (name, *_) in c_abi.dtypes().items():
        assert getattr(c_abi, name.upper()) == code, name
    assert (_C.ROLE_O_IN, _C.ROLE_O_OUT, _C.ROLE_LSE, _C.ROLE_MASK, _C.ROLE_INDPTR) == (
        c_abi.ROLE_O_IN, c_abi.ROLE_O_OUT, c_abi.ROLE_LSE, c_abi.ROLE_MASK, c_abi.ROLE_INDPTR)


def test_numpy_and_torch_name_every_dtype_as_the_table_does():
    """The package reads arrays' dtypes by name: NumPy's (float64 among them) and torch's name each
    of the table's dtypes with its array name."""
    from attnmerge._arrays import name_of

    ml_dtypes = pytest.importorskip("ml_dtypes")
    torch = pytest.importorskip("torch")
    for d in _types.DTYPES:
        np_dtype = np.dtype(getattr(ml_dtypes, d.name)) if d.name in ("bfloat16", "float8_e4m3fn") else np.dtype(d.name)
        assert name_of(np_dtype) == name_of(getattr(torch, d.name)) == d.name, d


def test_sizes_are_those_of_the_array_libraries():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for d in _types.DTYPES:
        dtype = np.dtype(getattr(ml_dtypes, d.name)) if d.name in ("bfloat16", "float8_e4m3fn") else np.dtype(d.name)
        assert dtype.itemsize == d.size, d


def test_the_c_spelling_of_fp8_is_an_alias_of_the_array_libraries():
    assert _types.ALIASES == {"float8_e4m3": "float8_e4m3fn"}
    assert _types.NO_GRADIENT_DTYPES == ("float8_e4m3fn",)
