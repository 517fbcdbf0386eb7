"""MkDocs hooks: the parts of a page that come from the repository itself, filled in at build time so
that the site cannot drift from the files it shows.  A page marks each place with an HTML comment on
a line of its own (invisible where the Markdown is read as it is, on GitHub say):

    <!-- generated: python benchmarks/vs_seed_table.py benchmarks/results/h200-vs-seed.json -->
        the script's standard output, run from the repository's root by this Python
        (Markdown tables; every other line its own paragraph)
    <!-- include: cpp/include/attnmerge/attnmerge.h -->
        the file, whole, as a fenced code block (its language from its extension)
    <!-- include-comment: cpp/include/attnmerge/plan.h -->
        the file's leading // comment, as a text block
    <!-- include-markdown: CONTRIBUTING.md -->
        the file's Markdown, as it is
    <!-- include-image: benchmarks/results/h200-bench.png ALT TEXT -->
        the image, copied into the site's assets/ and shown with that alt text

A marker that names a missing file or a script that fails stops the build.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

from mkdocs.exceptions import PluginError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- (generated|include|include-comment|include-markdown|include-image): (.+?) -->[ \t]*$",
                    re.M)
LANGUAGES = {".h": "c", ".c": "c", ".cpp": "cpp", ".cuh": "cpp", ".py": "python", ".toml": "toml"}


class MarkerError(PluginError):
    """A marker the build cannot fill: the page and the reason (stops the build)."""


def _repo_file(arg: str, page: str) -> str:
    path = os.path.normpath(os.path.join(ROOT, arg))
    if not path.startswith(ROOT + os.sep) or not os.path.isfile(path):
        raise MarkerError(f"{page}: {arg!r} is not a file of the repository")
    return path


def _read(arg: str, page: str) -> str:
    with open(_repo_file(arg, page), encoding="utf-8") as f:
        return f.read()


def _generated(arg: str, page: str) -> str:
    """A script's output as Markdown: its table lines kept together, every other line a paragraph."""
    argv = shlex.split(arg)
    if len(argv) < 2 or argv[0] != "python":
        raise MarkerError(f"{page}: expected 'python SCRIPT [ARGS]', got {arg!r}")
    _repo_file(argv[1], page)
    run = subprocess.run([sys.executable, *argv[1:]], cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        raise MarkerError(f"{page}: {arg!r} exited with {run.returncode}: {run.stderr.strip()}")
    blocks: list[list[str]] = []
    for line in run.stdout.splitlines():
        if not line.strip():
            continue
        table = line.lstrip().startswith("|")
        if blocks and table and blocks[-1][0].lstrip().startswith("|"):
            blocks[-1].append(line)
        else:
            blocks.append([line])
    return "\n\n".join("\n".join(block) for block in blocks)


def _include(arg: str, page: str) -> str:
    text = _read(arg, page)
    fence = "```"
    while fence in text:
        fence += "`"
    language = LANGUAGES.get(os.path.splitext(arg)[1], "text")
    return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def _include_comment(arg: str, page: str) -> str:
    lines = []
    for line in _read(arg, page).splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[3:] if line.startswith("// ") else line[2:])
    if not lines:
        raise MarkerError(f"{page}: {arg!r} has no leading // comment")
    return "```text\n" + "\n".join(lines) + "\n```"


def _asset(path: str) -> str:
    return "assets/" + os.path.basename(path)


def _include_image(arg: str, page: str) -> str:
    path, _, alt = arg.partition(" ")
    _repo_file(path, page)
    return f"![{alt}]({'../' * page.count('/')}{_asset(path)})"  # relative to the page's source


FILL = {"generated": _generated, "include": _include, "include-comment": _include_comment,
        "include-markdown": _read, "include-image": _include_image}


def fill(markdown: str, page: str) -> str:
    """The page with every marker replaced by what it names."""
    return MARKER.sub(lambda m: FILL[m.group(1)](m.group(2).strip(), page), markdown)


def on_page_markdown(markdown, page, config, files):
    return fill(markdown, page.file.src_uri)


def on_files(files, config):
    """The images the pages' include-image markers name, added to the site's assets/."""
    from mkdocs.structure.files import File

    for page in files.documentation_pages():
        for kind, arg in MARKER.findall(page.content_string):
            if kind == "include-image":
                path = _repo_file(arg.partition(" ")[0], page.src_uri)
                if files.get_file_from_path(_asset(path)) is None:
                    files.append(File.generated(config, _asset(path), abs_src_path=path))
    return files
