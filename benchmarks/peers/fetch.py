"""Fetches the peers' code that the vs_seed and vs_flashinfer routines build and time, from their
published packages on PyPI, into ignored folders beside this file:

    vllm-0.8.5/                 vLLM's csrc/attention/merge_attn_states.cu (the kernel this project
                                started from, "the seed") and the headers it includes, from the
                                vllm 0.8.5 source distribution
    flashinfer-0.7.2.post1/     FlashInfer's include/flashinfer/attention/cascade.cuh (MergeState,
                                MergeStateInPlace, MergeStates, VariableLengthMergeStates) and the
                                headers it includes, from the flashinfer-python 0.7.2.post1 wheel

Each archive is checked against its pinned SHA-256 before anything is extracted; only the files the
entry point includes (transitively) are kept, with the project's LICENSE and a SOURCE note.  Run it
where PyPI is reachable (the GPU machine has no network) and carry both folders to the GPU machine:

    python benchmarks/peers/fetch.py [--force]

The index is pip's: $PIP_INDEX_URL, else pip's configured global.index-url, else PyPI, read through
its JSON simple API (PEP 691).  Nothing these folders hold may be committed, nor anything built from
them: each holds a .gitignore of its own that ignores all of it, and the repository's ignores them.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import posixpath
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
import zipfile
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Peer:
    folder: str       # beside this file
    project: str      # the distribution's name on the index
    version: str
    filename: str     # the archive on the index
    sha256: str
    root: str         # the archive's folder that the kept paths are relative to
    entry: str        # the file whose transitive quoted includes are kept (relative to root)
    include_root: str  # where an include not found beside its includer is looked up (relative to root)
    license: str      # the project's license file (path in the archive)


VLLM = Peer(folder="vllm-0.8.5", project="vllm", version="0.8.5", filename="vllm-0.8.5.tar.gz",
            sha256="c7e04d1046304397b4580334038b558fe491af155fdea508224f140172cf9a82",
            root="vllm-0.8.5", entry="csrc/attention/merge_attn_states.cu", include_root="csrc",
            license="vllm-0.8.5/LICENSE")
FLASHINFER = Peer(folder="flashinfer-0.7.2.post1", project="flashinfer-python", version="0.7.2.post1",
                  filename="flashinfer_python-0.7.2.post1-py3-none-any.whl",
                  sha256="bfdc18b9e1e4d8d0730fe4343dc0e284cd0c160086de80f99888bc4867922d49",
                  root="flashinfer/data", entry="include/flashinfer/attention/cascade.cuh",
                  include_root="include", license="flashinfer_python-0.7.2.post1.dist-info/licenses/LICENSE")
PEERS = (VLLM, FLASHINFER)
INCLUDE = re.compile(r'^\s*#\s*include\s*[<"]([^">]+)[">]', re.M)


def folder(peer):
    return os.path.join(HERE, peer.folder)


def source_line(peer):
    """The first line of the SOURCE note a complete fetch writes."""
    return f"{peer.project} {peer.version}"


def fetched(peer):
    """Whether the peer's folder holds a complete fetch of this version (its SOURCE note's first line
    names it; the note is written last)."""
    try:
        with open(os.path.join(folder(peer), "SOURCE")) as f:
            return f.readline().strip() == source_line(peer)
    except OSError:
        return False


def index_url():
    url = os.environ.get("PIP_INDEX_URL")
    if not url:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = got.stdout.strip() if got.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # pip's default index, as pip itself resolves it

        url = PyPI.simple_url
    return url.rstrip("/") + "/"


def download(peer, into):
    """The peer's archive, downloaded into `into` and checked against its pinned SHA-256."""
    page = urllib.parse.urljoin(index_url(), f"{peer.project}/")
    request = urllib.request.Request(page, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=120) as r:
        files = json.load(r)["files"]
    links = [f for f in files if f["filename"] == peer.filename]
    if not links:
        raise SystemExit(f"fetch.py: the index at {page} lists no {peer.filename}")
    path = os.path.join(into, peer.filename)
    print(f"fetch.py: downloading {peer.filename} ...", flush=True)
    with urllib.request.urlopen(urllib.parse.urljoin(page, links[0]["url"]), timeout=600) as r, \
            open(path, "wb") as f:
        shutil.copyfileobj(r, f)
    return verified(peer, path)


def verified(peer, path):
    """path, once its SHA-256 is the pinned one (else SystemExit)."""
    with open(path, "rb") as f:
        got = hashlib.sha256(f.read()).hexdigest()
    if got != peer.sha256:
        raise SystemExit(f"fetch.py: {os.path.basename(path)} has SHA-256 {got}, expected {peer.sha256}")
    return path


def members(path):
    """name -> bytes reader of an sdist (.tar.gz) or a wheel (.whl)."""
    if path.endswith(".whl"):
        z = zipfile.ZipFile(path)
        return {n: (lambda n=n: z.read(n)) for n in z.namelist()}
    t = tarfile.open(path, "r:gz")
    return {m.name: (lambda m=m: t.extractfile(m).read()) for m in t.getmembers() if m.isfile()}


def include_closure(peer, files):
    """The archive paths of the entry file and of every file it includes with quotes or by a path
    under the include root, transitively; system and toolkit headers (not in the archive) are left."""
    root = peer.root
    todo, seen = [posixpath.join(root, peer.entry)], []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        if name not in files:
            raise SystemExit(f"fetch.py: {peer.filename} lacks {name}")
        seen.append(name)
        for inc in INCLUDE.findall(files[name]().decode("utf-8", "replace")):
            for cand in (posixpath.normpath(posixpath.join(posixpath.dirname(name), inc)),
                         posixpath.normpath(posixpath.join(root, peer.include_root, inc))):
                if cand in files:
                    todo.append(cand)
                    break
    return sorted(seen)


def extract(peer, archive):
    files = members(archive)
    kept = include_closure(peer, files)
    tmp = tempfile.mkdtemp(dir=HERE, prefix=f".{peer.folder}.")
    try:
        for name in kept:
            dst = os.path.join(tmp, posixpath.relpath(name, peer.root))
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            with open(dst, "wb") as f:
                f.write(files[name]())
        with open(os.path.join(tmp, "LICENSE"), "wb") as f:
            f.write(files[peer.license]())
        with open(os.path.join(tmp, ".gitignore"), "w") as f:
            f.write(f"# {peer.project} {peer.version}'s files, fetched by benchmarks/peers/fetch.py: "
                    "never committed\n*\n")
        with open(os.path.join(tmp, "SOURCE"), "w") as f:
            f.write(f"{source_line(peer)}\n{peer.filename}, sha256 {peer.sha256}, extracted by "
                    f"benchmarks/peers/fetch.py\nfiles (path in the archive -> path here):\n")
            for name in kept + [peer.license]:
                dst = "LICENSE" if name == peer.license else posixpath.relpath(name, peer.root)
                f.write(f"  {name} -> {dst}\n")
        shutil.rmtree(folder(peer), ignore_errors=True)
        os.replace(tmp, folder(peer))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return kept


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="download and extract again")
    args = parser.parse_args(argv)
    for peer in PEERS:
        if fetched(peer) and not args.force:
            print(f"fetch.py: {peer.folder}/ already holds {source_line(peer)}; nothing to do (--force fetches again)")
            continue
        with tempfile.TemporaryDirectory() as tmp:
            kept = extract(peer, download(peer, tmp))
        print(f"fetch.py: wrote {os.path.relpath(folder(peer))}/ ({len(kept)} files, LICENSE, SOURCE)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
