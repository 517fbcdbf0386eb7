#!/usr/bin/env bash
# Build the CUDA 12 wheel, attnmerge-cu12, as the wheel workflow does: CUDA 12.9 from PyPI (which has
# no nvcc) compiled by clang 19 or newer, PyPI's ptxas assembling each SM's SASS (the toolkit's own,
# so the cubins carry CUDA 12's ELF ABI and load on drivers from R525 on).  Works with no network
# once the toolkit's wheels are in CU12_WHEELS (the first run, with a network, downloads them there).
#
#   PYTHON                        interpreter to build for (default python3); needs pip, scikit-build-core,
#                                 pybind11, CMake 3.24+ and ninja (all on the GPU machines' image)
#   ATTNMERGE_CUDA_ARCHITECTURES  SMs to build (default release, the wheels' list, ~25 min on 2 CPUs; 90 for a
#                                 quick one; auto for the machine's GPUs, PTX alone without one)
#   ATTNMERGE_CUDA_CLANG          the clang++ (default: the newest clang++-NN or clang++ on PATH)
#   ATTNMERGE_BUILD_JAX           build the JAX extension (default 0; needs jaxlib's headers: PYTHON's
#                                 jaxlib, or ATTNMERGE_XLA_FFI_INCLUDE_DIR, the folder holding xla/ffi/api)
#   CU12_WHEELS                   the CUDA 12.9 toolkit's wheels (default build/cu12-wheels)
#   DIST                          where the wheel goes (default dist)
#
# Prints the wheel's path last.  Install it with pip (it replaces the package `attnmerge` of any other
# build: uninstall attnmerge / attnmerge-cu13 first), or hand it to scripts/gpu-test.sh as ATTNMERGE_WHEEL.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"
WHEELS="${CU12_WHEELS:-build/cu12-wheels}"
DIST="${DIST:-dist}"
export ATTNMERGE_CUDA_ARCHITECTURES="${ATTNMERGE_CUDA_ARCHITECTURES:-release}"
export ATTNMERGE_BUILD_JAX="${ATTNMERGE_BUILD_JAX:-0}"
if [ -n "${ATTNMERGE_XLA_FFI_INCLUDE_DIR:-}" ]; then  # scikit-build-core passes CMAKE_ARGS on to CMake
  export CMAKE_ARGS="${CMAKE_ARGS:+$CMAKE_ARGS }-DATTNMERGE_XLA_FFI_INCLUDE_DIR=$ATTNMERGE_XLA_FFI_INCLUDE_DIR"
fi

# The build backend's list (build_backend/_attnmerge_backend.py), read rather than restated.
mapfile -t REQS < <("$PY" - <<'EOF'
import ast
tree = ast.parse(open("build_backend/_attnmerge_backend.py").read())
for node in tree.body:
    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "CUDA12_CLANG_REQUIREMENTS" for t in node.targets):
        print("\n".join(ast.literal_eval(node.value)))
EOF
)
[ "${#REQS[@]}" -gt 0 ] || { echo "build-cu12: no CUDA12_CLANG_REQUIREMENTS in the build backend" >&2; exit 2; }

mkdir -p "$WHEELS" "$DIST"
missing=()
for req in "${REQS[@]}"; do
  name="${req%%=*}"
  compgen -G "$WHEELS/${name//-/_}-*.whl" >/dev/null || missing+=("$req")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "== downloading into $WHEELS: ${missing[*]}"
  "$PY" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "${missing[@]}"
fi

# The toolkit's wheels unpacked where the build backend looks (site-packages/nvidia/*, on sys.path).
site="$(mktemp -d)"
trap 'rm -rf "$site"' EXIT
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" "$WHEELS"/*.whl

echo "== building attnmerge-cu12 for SMs $ATTNMERGE_CUDA_ARCHITECTURES ($($PY -c 'import sys; print(sys.version.split()[0])'))"
start=$SECONDS
PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" ATTNMERGE_CUDA_FLAVOR=cu12 ATTNMERGE_CUDA_FROM_PYPI=1 \
  "$PY" -m pip wheel -v --no-build-isolation --no-deps --no-index -w "$DIST" . >"$DIST/build-cu12.log" 2>&1 || {
  tail -n 40 "$DIST/build-cu12.log"
  echo "build-cu12: the build failed (log: $DIST/build-cu12.log)" >&2
  exit 1
}
grep 'attnmerge build:\|-- attnmerge' "$DIST/build-cu12.log" | sed 's/^ *//'
tag="$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
wheel="$(ls -t "$DIST"/attnmerge_cu12-*-"$tag"-*.whl | head -n 1)"
echo "built in $((SECONDS - start)) s: $(du -h "$wheel" | cut -f1)"
echo "$wheel"
