"""The documentation site (mkdocs.yml, docs/) builds with every warning an error, and what its pages
take from the repository is what the repository holds at build time (docs/hooks.py): the
performance tables rendered from benchmarks/results/*.json, attnmerge.h whole, plan.h's comment.
Skips, saying so, where MkDocs or mkdocstrings' Python handler is not installed (the test extra has
them from Python 3.11 on)."""
from __future__ import annotations

import html
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from doc_blocks import ROOT

pytest.importorskip("mkdocs", reason="MkDocs is not installed (pip install mkdocs, or the test extra)")
pytest.importorskip("mkdocstrings_handlers.python",
                    reason="mkdocstrings' Python handler is not installed (pip install 'mkdocstrings[python]')")


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                            "-d", str(out)], capture_output=True, text=True, timeout=600)
    log = build.stdout + build.stderr
    assert build.returncode == 0, log
    assert "WARNING" not in log, log
    return out


def page_text(site, page):
    """A page's text, tags dropped and entities decoded."""
    with open(site / page / "index.html", encoding="utf-8") as f:
        return html.unescape(re.sub(r"<[^>]+>", "", f.read()))


def test_every_page_of_the_nav_is_built(site):
    with open(os.path.join(ROOT, "mkdocs.yml")) as f:
        pages = re.findall(r"^  - [^:]+: (\S+)\.md$", f.read(), re.M)
    assert "index" in pages and "api" in pages
    for page in pages:
        path = site / ("" if page == "index" else page) / "index.html"
        assert path.is_file(), path


def test_the_performance_tables_are_rendered_from_the_results(site):
    text = page_text(site, "performance")
    with open(os.path.join(ROOT, "benchmarks", "results", "h200-vs-seed.json")) as f:
        seed = json.load(f)
    for row in seed["rows"]:
        assert f"{row['ours_graph_us']:.2f}" in text and f"{row['seed_graph_us']:.2f}" in text
    with open(os.path.join(ROOT, "benchmarks", "results", "h200-vs-flashinfer.json")) as f:
        fi = json.load(f)
    cases = [r["case"] for r in fi["rows"] if "attnmerge" in r["impls"]]
    assert cases and all(case in text for case in cases)
    assert "geometric mean" in text


def test_the_c_page_shows_the_header_as_it_is(site):
    text = page_text(site, "c")
    with open(os.path.join(ROOT, "cpp", "include", "attnmerge", "attnmerge.h")) as f:
        header = f.read()
    for line in header.splitlines():
        assert line.strip() in text, line


def test_the_design_page_shows_the_plans_comment(site):
    text = page_text(site, "design")
    with open(os.path.join(ROOT, "cpp", "include", "attnmerge", "plan.h")) as f:
        comment = [line[3:] for line in f.read().splitlines() if line.startswith("// ")]
    assert comment[0] in text and "Strategies:" in text


def test_a_marker_that_names_no_file_stops_the_build():
    spec = importlib.util.spec_from_file_location("docs_hooks", os.path.join(ROOT, "docs", "hooks.py"))
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    assert "attnmerge_merge(" in hooks.fill("<!-- include: cpp/include/attnmerge/attnmerge.h -->\n", "p.md")
    for marker in ("<!-- include: cpp/no_such_file.h -->", "<!-- include-markdown: ../outside.md -->",
                   "<!-- generated: python benchmarks/no_such_table.py -->",
                   "<!-- generated: python benchmarks/vs_seed_table.py no_such_results.json -->"):
        with pytest.raises(hooks.MarkerError, match="p.md"):
            hooks.fill(marker + "\n", "p.md")
