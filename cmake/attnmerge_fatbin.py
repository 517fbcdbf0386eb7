"""Write a CUDA fatbinary with the toolkit's nvFatbin library (libnvfatbin), for the clang route
(cmake/attnmerge_clang_cuda.cmake): the SASS images and the PTX that clang embeds in a host object.
nvFatbin is the toolkit's own fatbinary writer, so the container is the one that toolkit's drivers
read.

    python attnmerge_fatbin.py --nvfatbin LIB -o OUT [--option -compress-all ...] sm_90=a.cubin compute_90=a.ptx
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys


def _library(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    lib.nvFatbinGetErrorString.restype = ctypes.c_char_p
    lib.nvFatbinCreate.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_char_p), ctypes.c_size_t]
    lib.nvFatbinAddCubin.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p,
                                     ctypes.c_char_p]
    lib.nvFatbinAddPTX.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p,
                                   ctypes.c_char_p, ctypes.c_char_p]
    lib.nvFatbinSize.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    lib.nvFatbinGet.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.nvFatbinDestroy.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return lib


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvfatbin", required=True, help="path of libnvfatbin.so")
    parser.add_argument("-o", "--output", required=True)
    parser.add_argument("--option", action="append", default=[], help="an nvFatbin option (e.g. -compress-all)")
    parser.add_argument("images", nargs="+", help="sm_NN=FILE.cubin (SASS) or compute_NN=FILE.ptx (PTX)")
    args = parser.parse_args(argv)

    lib = _library(args.nvfatbin)
    handle = ctypes.c_void_p()

    def check(result: int, what: str) -> None:
        if result != 0:
            raise SystemExit(f"attnmerge_fatbin: {what}: {lib.nvFatbinGetErrorString(result).decode()}")

    options = ["-64", *args.option]
    check(lib.nvFatbinCreate(ctypes.byref(handle), (ctypes.c_char_p * len(options))(*(o.encode() for o in options)),
                             len(options)), "nvFatbinCreate")
    try:
        for image in args.images:
            kind, _, path = image.partition("=")
            with open(path, "rb") as f:
                data = f.read()
            name = os.path.basename(path).encode()
            if kind.startswith("sm_"):
                check(lib.nvFatbinAddCubin(handle, data, len(data), kind[3:].encode(), name), image)
            elif kind.startswith("compute_"):
                data += b"\0"  # nvFatbin takes PTX as a C string
                check(lib.nvFatbinAddPTX(handle, data, len(data), kind[8:].encode(), name, b""), image)
            else:
                raise SystemExit(f"attnmerge_fatbin: {image}: expected sm_NN=FILE or compute_NN=FILE")
        size = ctypes.c_size_t()
        check(lib.nvFatbinSize(handle, ctypes.byref(size)), "nvFatbinSize")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvFatbinGet(handle, buf), "nvFatbinGet")
    finally:
        lib.nvFatbinDestroy(ctypes.byref(handle))
    with open(args.output, "wb") as f:
        f.write(buf.raw)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
