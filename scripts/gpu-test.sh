#!/usr/bin/env bash
# Build attnmerge (or install a wheel) and run the whole test suite, the `gpu` tests and the CPU
# tests, on a GPU machine with no network (its python3 already has torch, cupy, jax, numba-cuda, pytest, hypothesis, numpy,
# ml_dtypes, pybind11, scikit-build-core and cmake).  Ends with pytest's summary line; the exit
# status is pytest's.
#
#   ATTNMERGE_CUDA_ARCHITECTURES  GPU architectures to build (default 90, the H200; release for the wheels'
#                                 list; "" or auto for the machine's GPUs)
#   ATTNMERGE_BUILD_JAX           build the JAX extension (default 1: the GPU suite covers attnmerge.jax)
#   ATTNMERGE_WHEEL               install this wheel instead of building (e.g. the CUDA 12 one that
#                                 scripts/build-cu12.sh made on a machine with clang)
#   PYTHON                        interpreter (default python3)
#   OUT                           folder for the logs (build.log, info.txt, pytest.log); a temp folder if unset
#   PYTEST_ARGS                   extra pytest arguments
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"
export ATTNMERGE_CUDA_ARCHITECTURES="${ATTNMERGE_CUDA_ARCHITECTURES-90}"
export ATTNMERGE_BUILD_JAX="${ATTNMERGE_BUILD_JAX-1}"
export PYTHONUNBUFFERED=1
LOGS="${OUT:-$(mktemp -d)}"
mkdir -p "$LOGS"

if ! command -v nvcc >/dev/null 2>&1 && [ -z "${CUDACXX:-}" ]; then
  for d in "${CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-13*; do
    if [ -n "$d" ] && [ -x "$d/bin/nvcc" ]; then export PATH="$d/bin:$PATH"; break; fi
  done
fi

echo "== machine"
nvidia-smi -L 2>/dev/null || echo "nvidia-smi: none"
echo "nvcc: $(command -v nvcc || echo none) $(nvcc --version 2>/dev/null | grep -o 'release [0-9.]*' || true)"
echo "python: $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
echo "architectures: ${ATTNMERGE_CUDA_ARCHITECTURES:-auto, the GPUs of this machine}"

# Every build installs the package attnmerge, whatever its distribution's name: one at a time.
"$PY" -m pip uninstall -y -q attnmerge attnmerge-cu12 attnmerge-cu13 >/dev/null 2>&1 || true
if [ -n "${ATTNMERGE_WHEEL:-}" ]; then
  echo "== install $ATTNMERGE_WHEEL (no build; log: $LOGS/build.log)"
  if ! "$PY" -m pip install --no-deps --no-index --force-reinstall "$ATTNMERGE_WHEEL" >"$LOGS/build.log" 2>&1; then
    cat "$LOGS/build.log"
    echo "gpu-test: the wheel did not install" >&2
    exit 2
  fi
else
  echo "== build (log: $LOGS/build.log)"
  start=$SECONDS
  if ! "$PY" -m pip install --no-build-isolation --no-deps --no-index --force-reinstall -v . \
      >"$LOGS/build.log" 2>&1; then
    tail -n 60 "$LOGS/build.log"
    echo "gpu-test: the build failed (see $LOGS/build.log)" >&2
    exit 2
  fi
  echo "built and installed in $((SECONDS - start)) s"
fi

echo "== python -m attnmerge"
(cd /tmp && "$PY" -m attnmerge) 2>&1 | tee "$LOGS/info.txt"
info_rc=${PIPESTATUS[0]}
[ "$info_rc" -eq 0 ] || echo "gpu-test: python -m attnmerge exited $info_rc" >&2

# The cubins' ELF ABI, SM and toolkit (7 for a CUDA 12 build below sm_100, 8 for CUDA 13).
CUOBJDUMP="$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)"
if [ -x "$CUOBJDUMP" ]; then
  echo "== cubins ($CUOBJDUMP -elf)"
  lib="$(cd /tmp && "$PY" -c 'import attnmerge; print(attnmerge.build_info()["library"])')"
  "$CUOBJDUMP" -elf "$lib" 2>/dev/null | grep -i 'bit elf:' | sort | uniq -c | tee "$LOGS/cubins.txt"
fi

echo "== the gpu tests: $("$PY" -m pytest -q --collect-only -m gpu -p no:cacheprovider tests 2>/dev/null | tail -n 1)"
echo "== pytest: every test (gpu and cpu)"
# shellcheck disable=SC2086
"$PY" -m pytest -q -rfEs -p no:cacheprovider tests ${PYTEST_ARGS:-} 2>&1 | tee "$LOGS/pytest.log"
exit "${PIPESTATUS[0]}"
