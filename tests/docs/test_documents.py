"""The README is a front door and no document points outside the repository: the README under 150
lines with the two commands `.ci/run` runs, every relative link of the README and docs/ naming a
file of the repository, and no commit hash or path outside the repository in any of them."""
from __future__ import annotations

import os
import re

import pytest

from doc_blocks import DOCUMENTS, ROOT

COMMANDS = ('pip install ".[test]" && python -m attnmerge', "python -m pytest -q")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A revision: 7 to 40 hex digits with a letter and a digit among them (a word, not a number or a name).
REVISION = re.compile(r"(?<![\w/.-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")


def read(document):
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        return f.read()


def test_the_readme_is_short_and_has_the_two_commands():
    text = read("README.md")
    assert len(text.splitlines()) < 150
    lines = text.splitlines()
    for command in COMMANDS:
        assert command in lines, f"README.md no longer has the line {command!r} (.ci/run runs it)"


@pytest.mark.parametrize("document", DOCUMENTS + ["CONTRIBUTING.md"])
def test_no_document_points_outside_the_repository(document):
    text = read(document)
    assert "../shared" not in text and ".shared/" not in text, document
    assert not REVISION.findall(text), f"{document}: commit hashes {REVISION.findall(text)}"
    base = os.path.dirname(os.path.join(ROOT, document))
    for target in LINK.findall(text):
        if re.match(r"[a-z]+://", target) or target.startswith("#"):
            continue
        path = os.path.normpath(os.path.join(base, target.split("#")[0]))
        assert path.startswith(ROOT + os.sep), f"{document}: {target} leaves the repository"
        assert os.path.exists(path), f"{document}: {target} names no file"


def test_every_cited_decision_has_its_anchor_in_the_notes():
    """Code comments, the CHANGELOG and the docs cite a decision as benchmarks/NOTES.md#anchor: each
    anchor must be a heading's id there, so that a citation never leads nowhere."""
    anchors = set(re.findall(r'<a id="([^"]+)"></a>', read("benchmarks/NOTES.md")))
    cited = {}
    for folder in ("cpp", "python", "docs"):
        for root, _, files in os.walk(os.path.join(ROOT, folder)):
            for name in files:
                if name.endswith((".h", ".cuh", ".cpp", ".cu", ".py", ".md")):
                    path = os.path.join(root, name)
                    with open(path, encoding="utf-8") as f:
                        for anchor in re.findall(r"NOTES\.md#([\w-]+)", f.read()):
                            cited.setdefault(anchor, os.path.relpath(path, ROOT))
    for anchor in re.findall(r"NOTES\.md#([\w-]+)", read("CHANGELOG.md")):
        cited.setdefault(anchor, "CHANGELOG.md")
    assert cited, "no citation found: the walk is wrong"
    missing = {a: where for a, where in cited.items() if a not in anchors}
    assert not missing, f"citations of anchors benchmarks/NOTES.md does not have: {missing}"


# A file of the repository a document names in code, and a routine of the benchmarks' driver.
NAMED_FILE = re.compile(r"(?<![\w/.-])((?:benchmarks|scripts|examples|tests)/[\w./-]+\.(?:py|sh|cu|cpp|json|txt|png))")
ROUTINE = re.compile(r"python benchmarks/run\.py ([a-z0-9_]+)")


@pytest.mark.parametrize("document", DOCUMENTS + ["CONTRIBUTING.md", "benchmarks/NOTES.md"])
def test_every_script_and_routine_a_document_names_exists(document):
    """A command a document gives runs: each script, program or result it names is a file of the
    repository (a script renamed or folded into a routine takes its mentions along) and each
    `python benchmarks/run.py ROUTINE` names a routine of the driver."""
    import sys

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        from routines import ROUTINES
    finally:
        sys.path.remove(os.path.join(ROOT, "benchmarks"))
    text = read(document)
    missing = sorted({path for path in NAMED_FILE.findall(text) if not os.path.exists(os.path.join(ROOT, path))})
    assert not missing, f"{document} names files the repository does not have: {missing}"
    unknown = sorted(set(ROUTINE.findall(text)) - set(ROUTINES))
    assert not unknown, f"{document} runs routines benchmarks/run.py does not have: {unknown}"
