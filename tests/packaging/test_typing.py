"""The package is typed: py.typed ships, the public API is annotated, and the stub of the compiled
module (_C.pyi) names exactly what _C exports, with the same parameters in the same order."""
from __future__ import annotations

import ast
import inspect
import os
import re

import pytest

import attnmerge
from attnmerge import _C, raw
from attnmerge.compat import flashinfer, vllm

PACKAGE = os.path.dirname(os.path.abspath(attnmerge.__file__))


def _params(fn):
    return [a.arg for a in fn.args.posonlyargs + fn.args.args if a.arg != "self"]


def stub():
    """{function: [parameter names]} and {attribute} declared in _C.pyi; a class's methods are
    functions named Class.method (its __init__: Class)."""
    path = os.path.join(PACKAGE, "_C.pyi")
    assert os.path.isfile(path), f"no stub at {path}"
    with open(path) as f:
        tree = ast.parse(f.read())
    functions = {n.name: _params(n) for n in tree.body if isinstance(n, ast.FunctionDef)}
    for c in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for m in (n for n in c.body if isinstance(n, ast.FunctionDef)
                  and not any(getattr(d, "id", None) == "property" for d in n.decorator_list)):
            functions[c.name if m.name == "__init__" else f"{c.name}.{m.name}"] = _params(m)
    attributes = {n.target.id for n in tree.body if isinstance(n, ast.AnnAssign)}
    return functions, attributes


def exported():
    """{function: [parameter names]} and {attribute} of the compiled module, from pybind11's signatures."""
    functions, attributes = {}, set()
    for name in dir(_C):
        if name.startswith("__"):
            continue
        value = getattr(_C, name)
        if isinstance(value, type):  # a class: its constructor and methods, from their signatures
            init = re.search(r"__init__\(self: [\w.]+(?:, )?(.*)\) ->", value.__init__.__doc__ or "")
            assert init, f"_C.{name} has no pybind11 constructor signature"
            functions[name] = re.findall(r"(?:^|, )(\w+):", init.group(1))
            for method in (m for m in vars(value) if not m.startswith("_") and callable(getattr(value, m))):
                doc = getattr(value, method).__doc__ or ""
                m = re.match(rf"{method}\(self: [\w.]+(?:, )?(.*)\) ->", doc)
                assert m, f"_C.{name}.{method} has no pybind11 signature: {doc!r}"
                functions[f"{name}.{method}"] = re.findall(r"(?:^|, )(\w+):", m.group(1))
            continue
        if callable(value):
            m = re.match(rf"{name}\((.*)\) ->", value.__doc__ or "")
            assert m, f"_C.{name} has no pybind11 signature: {value.__doc__!r}"
            functions[name] = re.findall(r"(?:^|, )(\w+):", m.group(1))
        else:
            attributes.add(name)
    return functions, attributes


def test_the_package_is_marked_typed():
    assert os.path.isfile(os.path.join(PACKAGE, "py.typed"))


def test_the_stub_names_exactly_what_the_module_exports():
    (stub_functions, stub_attributes), (functions, attributes) = stub(), exported()
    assert set(stub_functions) == set(functions), (
        f"only in _C: {sorted(set(functions) - set(stub_functions))}, "
        f"only in _C.pyi: {sorted(set(stub_functions) - set(functions))}")
    assert stub_attributes == attributes
    for name, params in functions.items():
        assert stub_functions[name] == params, f"_C.{name}: the stub says {stub_functions[name]}, _C {params}"


PUBLIC = [attnmerge.merge, attnmerge.merge_inplace, attnmerge.merge_states, attnmerge.merge_varlen, attnmerge.merge_share,
          attnmerge.build_info, attnmerge.last_launch, attnmerge.cmake_dir, attnmerge.include_dir,
          attnmerge.library_path, raw.merge, vllm.merge_attn_states, flashinfer.merge_state,
          flashinfer.merge_state_in_place, flashinfer.merge_states, flashinfer.variable_length_merge_states]


@pytest.mark.parametrize("fn", PUBLIC, ids=lambda f: f"{f.__module__}.{f.__name__}")
def test_the_public_api_is_annotated(fn):
    sig = inspect.signature(fn)
    missing = [p for p in sig.parameters.values() if p.annotation is inspect.Parameter.empty]
    assert not missing, f"{fn.__name__}: parameters without a type: {[p.name for p in missing]}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{fn.__name__} has no return type"


def test_import_attnmerge_brings_the_raw_layer():
    """`import attnmerge` is enough for attnmerge.raw.merge, as the docs use it (a fresh process: no
    test has imported the submodule before)."""
    import subprocess
    import sys
    code = "import attnmerge; print(callable(attnmerge.raw.merge))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
