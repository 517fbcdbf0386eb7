"""The code blocks of the repository's documents (README.md and docs/*.md), as the tests of the docs
read them: each fenced block with its language, the line it starts on, and the directive on the line
right above it, if any:

    <!-- docs-test: gpu -->              the block needs a CUDA GPU: a `gpu` test (skipped without one)
    <!-- docs-test: skip: REASON -->     the block is not run by the tests (several processes, ...)

An HTML comment, so GitHub and the site show nothing of it.
"""
from __future__ import annotations

import ast
import glob
import os
import re
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOCUMENTS = ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,})(?P<info>[^`]*)$")
DIRECTIVE = re.compile(r"^<!-- docs-test: (?P<body>.*?) -->$")


class Block(NamedTuple):
    document: str  # path from the repository's root
    line: int  # of the opening fence, from 1
    language: str
    code: str
    directive: str | None  # the text of a docs-test directive above the block ("skip: needs a GPU")
    indent: str  # the fence's indentation ("" at the top level)

    @property
    def id(self) -> str:
        return f"{self.document}:{self.line}"

    @property
    def needs_gpu(self) -> bool:
        return self.directive == "gpu"

    @property
    def skip_reason(self) -> str | None:
        if self.directive is not None and self.directive.startswith("skip: "):
            return self.directive[len("skip: "):]
        return None


def blocks(document: str) -> list[Block]:
    """The fenced code blocks of a document, in order."""
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        lines = f.read().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, fence, indent = i, m.group("fence"), m.group("indent")
        language = m.group("info").strip().split(" ")[0]
        i += 1
        while i < len(lines) and lines[i].strip() != fence:
            i += 1
        code = "\n".join(line[len(indent):] if line.startswith(indent) else line for line in lines[start + 1:i])
        above = DIRECTIVE.match(lines[start - 1].strip()) if start > 0 else None
        found.append(Block(document, start + 1, language, code + "\n", above and above.group("body"), indent))
        i += 1
    return found


def all_blocks(language: str | None = None) -> list[Block]:
    return [b for d in DOCUMENTS for b in blocks(d) if language is None or b.language == language]


FRAMEWORKS = ("torch", "jax", "jaxlib", "cupy", "numba")


def imported_modules(code: str) -> set[str]:
    """The modules a piece of code imports, by their full dotted names."""
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def skip_unless_importable(code: str) -> None:
    """Skip, saying why, where the code imports a framework that is not installed, or JAX in a build
    without the JAX extension (attnmerge.jax: the road of every JAX array); any other import error is
    the example's to raise."""
    modules = imported_modules(code)
    uses = {f for f in FRAMEWORKS if any(m == f or m.startswith(f + ".") for m in modules)}
    if "attnmerge.jax" in modules:
        uses.add("jax")
    for framework in sorted(uses):
        pytest.importorskip(framework, reason=f"needs {framework}, which is not installed")
    if "jax" in uses:
        try:
            import attnmerge.jax  # noqa: F401
        except ImportError as e:
            if "without the JAX extension" not in str(e):
                raise
            pytest.skip(f"this build has no JAX extension: {e}")
