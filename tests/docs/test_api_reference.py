"""The Python API page (docs/api.md) renders every public function of attnmerge, attnmerge.jax,
attnmerge.raw and attnmerge.compat.*, one `::: name` line each, and the examples of their
docstrings run (doctest; NumPy's `np` given, as numpydoc assumes, everything else imported by the
example).  Public: a module's __all__ where it has one, else its functions not named with an
underscore, read from the source, so that a new public function without its line fails here."""
from __future__ import annotations

import ast
import doctest
import importlib
import os
import re

import numpy as np
import pytest

from doc_blocks import ROOT, skip_unless_importable

PACKAGE = os.path.join(ROOT, "python", "attnmerge")
MODULES = {"attnmerge": "__init__.py", "attnmerge.jax": "jax.py", "attnmerge.raw": "raw.py",
           "attnmerge.compat.vllm": "compat/vllm.py", "attnmerge.compat.flashinfer": "compat/flashinfer.py",
           "attnmerge.compat.sglang": "compat/sglang.py"}


def public_functions(module: str) -> list[str]:
    with open(os.path.join(PACKAGE, MODULES[module])) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return [n for n in ast.literal_eval(node.value) if not n.startswith("_")]
    return [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")]


def documented() -> list[str]:
    with open(os.path.join(ROOT, "docs", "api.md")) as f:
        return re.findall(r"^::: (\S+)$", f.read(), re.M)


def test_every_compat_module_is_listed():
    compat = sorted(f[:-3] for f in os.listdir(os.path.join(PACKAGE, "compat")) if f.endswith(".py") and f[0] != "_")
    assert sorted(m.rsplit(".", 1)[1] for m in MODULES if m.startswith("attnmerge.compat.")) == compat


@pytest.mark.parametrize("module", sorted(MODULES))
def test_every_public_function_has_its_line(module):
    names = public_functions(module)
    assert names, module
    missing = [n for n in names if f"{module}.{n}" not in documented()]
    assert not missing, f"docs/api.md lacks `::: {module}.NAME` for {missing}"


def is_function(name: str) -> bool:
    module, _, attr = name.rpartition(".")
    return module in MODULES and attr in public_functions(module)


FUNCTIONS = [name for name in documented() if is_function(name)]


@pytest.mark.parametrize("name", FUNCTIONS)
def test_docstring_examples_run(name):
    module, attr = name.rsplit(".", 1)
    skip_unless_importable(f"import {module}\n")
    obj = getattr(importlib.import_module(module), attr)
    tests = doctest.DocTestFinder(recurse=False).find(obj, name, globs={"np": np})
    examples = [t for t in tests if t.examples]
    if not examples:
        pytest.skip(f"{name}: no example in its docstring yet")
    for test in examples:
        skip_unless_importable("\n".join(e.source for e in test.examples))
        runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
        report = []
        runner.run(test, out=report.append)
        assert runner.failures == 0, "".join(report)
