"""attnmerge.h documents every entry point's parameters one per line, in the declaration's order,
each with its direction (`\\param[in]`, `\\param[out]` or `\\param[in,out]`), in the doc comment
right above the declaration: what a C caller reads before calling it."""
from __future__ import annotations

import os
import re

import pytest

HEADER = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "cpp", "include", "attnmerge", "attnmerge.h")


def declarations() -> list[tuple[str, list[str], str]]:
    """(function, its parameters' names, the comment right above it) of every ATTNMERGE_API entry point."""
    with open(HEADER) as f:
        text = f.read()
    found = []
    for m in re.finditer(r"^ATTNMERGE_API\s+[^;{(]*?\b(attnmerge_\w+)\s*\(([^)]*)\)\s*;", text, flags=re.S | re.M):
        name, params = m.group(1), m.group(2).strip()
        before = text[: m.start()].rstrip()
        comment = before[before.rfind("/*"):] if before.endswith("*/") else ""
        names = [] if params in ("", "void") else [re.findall(r"\w+", p)[-1] for p in params.split(",")]
        found.append((name, names, comment))
    return found


DECLARED = declarations()


def test_the_header_declares_the_entry_points():
    assert len(DECLARED) >= 20 and {"attnmerge_merge", "attnmerge_merge_varlen_backward"} <= {d[0] for d in DECLARED}


@pytest.mark.parametrize("name, params, comment", [d for d in DECLARED if d[1]], ids=[d[0] for d in DECLARED if d[1]])
def test_each_parameter_has_one_param_line_with_its_direction(name, params, comment):
    assert comment.startswith("/**"), f"{name}: no doc comment right above its declaration"
    documented = re.findall(r"\\param\[(in|out|in,out)\]\s+(\w+)", comment)
    assert [p for _, p in documented] == params, (name, documented)
    # every \param line has a direction
    assert len(re.findall(r"\\param\b", comment)) == len(documented), name
