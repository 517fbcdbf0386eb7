"""Which kernels two builds of libattnmerge compile to different machine code: each cubin's SASS
(cuobjdump -sass, which runs nvdisasm), per kernel by its mangled name, addresses and immediate
constants masked.  For a change of the kernels' sources meant to leave their code alone (a
refactor on a machine with no GPU to time it), "0 differ" says a GPU runs what it ran; where they
differ, "beyond register numbers" separates other instructions from a renumbering alone.

    python scripts/sass-diff.py OLD/libattnmerge.so.1 NEW/libattnmerge.so.1 [--names]

Each library from a build of the same SM list (a wheel's attnmerge/lib/libattnmerge.so.1, or a
`pip install --target` folder's).  cuobjdump and nvdisasm: on PATH, in $CUDA_HOME/bin, or PyPI's
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm.  Exit status 0 when every kernel's code is the
same, 1 when some differ, 2 when the tools or the cubins are missing.
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile

FUNCTION = re.compile(r"^\s+Function : (\S+)")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
HEX = re.compile(r"0x[0-9a-fA-F]+")
REGISTER = re.compile(r"\b(U?R|U?P)\d+\b")


def tool(name):
    """The path of a CUDA tool, or None."""
    found = shutil.which(name)
    if found:
        return found
    roots = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin")]
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *sys.path}:
        roots += glob.glob(os.path.join(site or ".", "nvidia", "cu1*", "bin"))
    for root in roots:
        path = os.path.join(root, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def kernels(sass):
    """{kernel name: [instructions, addresses and constants masked]} of cuobjdump -sass text."""
    out, name = {}, None
    for line in sass.splitlines():
        m = FUNCTION.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSTRUCTION.match(line)
        if m and name is not None:
            out[name].append(HEX.sub("X", m.group(1)))
    return out


def compare(old, new):
    """(same, differ, differ beyond register numbers, only in old, only in new): lists of names;
    differ as (name, old count, new count)."""
    both = sorted(set(old) & set(new))
    same = [k for k in both if old[k] == new[k]]
    differ = [(k, len(old[k]), len(new[k])) for k in both if old[k] != new[k]]
    beyond = [k for k, _, _ in differ
              if [REGISTER.sub(r"\1", i) for i in old[k]] != [REGISTER.sub(r"\1", i) for i in new[k]]]
    return same, differ, beyond, sorted(set(old) - set(new)), sorted(set(new) - set(old))


def library_sass(library, cuobjdump, nvdisasm):
    """The SASS text of every cubin in `library` (empty: none)."""
    env = dict(os.environ, PATH=os.path.dirname(nvdisasm) + os.pathsep + os.environ.get("PATH", ""))
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([cuobjdump, "-xelf", "all", os.path.abspath(library)], cwd=tmp, check=True,
                       capture_output=True)
        texts = [subprocess.run([cuobjdump, "-sass", cubin], check=True, capture_output=True, text=True,
                                env=env).stdout for cubin in sorted(glob.glob(os.path.join(tmp, "*.cubin")))]
    return "\n".join(texts)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old")
    p.add_argument("new")
    p.add_argument("--names", action="store_true", help="name each kernel that differs, with its instruction counts")
    args = p.parse_args(argv)
    cuobjdump, nvdisasm = tool("cuobjdump"), tool("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        print("sass-diff: needs cuobjdump and nvdisasm (a CUDA toolkit, or pip install nvidia-cuda-cuobjdump "
              "nvidia-cuda-nvdisasm)", file=sys.stderr)
        return 2
    old, new = (kernels(library_sass(path, cuobjdump, nvdisasm)) for path in (args.old, args.new))
    if not old or not new:
        print(f"sass-diff: no kernel code in {args.old if not old else args.new} (a build without cubins?)",
              file=sys.stderr)
        return 2
    same, differ, beyond, only_old, only_new = compare(old, new)
    print(f"{len(same) + len(differ)} kernels in both: {len(same)} the same, {len(differ)} differ "
          f"({len(beyond)} beyond register numbers); {len(only_old)} only in the old, {len(only_new)} only in the new")
    if args.names:
        for name, a, b in differ:
            print(f"  {name}: {a} -> {b} instructions{'' if name in beyond else ' (registers renumbered)'}")
        for name in only_old:
            print(f"  only in the old: {name}")
        for name in only_new:
            print(f"  only in the new: {name}")
    return 0 if not differ and not only_old and not only_new else 1


if __name__ == "__main__":
    sys.exit(main())
