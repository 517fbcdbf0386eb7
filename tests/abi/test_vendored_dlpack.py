"""The binding reads DLPack through DLPack's own header, vendored whole with its license
(python/src/third_party/dlpack/), not through structs of its own: one owner of that layout, the
DLPack project's."""
from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENDORED = os.path.join(ROOT, "python", "src", "third_party", "dlpack")
SOURCES = os.path.join(ROOT, "python", "src")


def read(*parts):
    with open(os.path.join(*parts)) as f:
        return f.read()


def test_the_header_is_dlpacks_own_of_a_version_with_the_exchange_api():
    header = read(VENDORED, "dlpack.h")
    assert re.search(r"^#define DLPACK_MAJOR_VERSION 1$", header, flags=re.M)
    minor = int(re.search(r"^#define DLPACK_MINOR_VERSION (\d+)$", header, flags=re.M).group(1))
    assert minor >= 3  # the C exchange API and its current_work_stream
    for name in ("DLManagedTensorVersioned", "DLPackExchangeAPI"):
        assert re.search(rf"}}\s*{name};", header), name
    assert "DLPackCurrentWorkStream current_work_stream;" in header


def test_its_license_comes_with_it_and_the_notice_says_so():
    assert "Apache License" in read(VENDORED, "LICENSE") and "Version 2.0" in read(VENDORED, "LICENSE")
    notice = read(ROOT, "NOTICE")
    assert "DLPack" in notice and "python/src/third_party/dlpack" in notice


def test_no_source_of_the_binding_restates_a_dlpack_struct():
    for name in sorted(os.listdir(SOURCES)):
        if not name.endswith((".cpp", ".h")):
            continue
        text = read(SOURCES, name)
        defined = re.findall(r"\b(?:struct|enum)\s+(DL\w+)\s*(?::[^{;]*)?\{", text)
        assert not defined, (name, defined)
    assert '#include "third_party/dlpack/dlpack.h"' in read(SOURCES, "array_view.cpp")
