#!/usr/bin/env bash
# GPU truth in one go, on a GPU machine with no network: build a wheel (scripts/gpu-test.sh's
# settings), the GPU suite from it with compute-sanitizer's four tools beside it (and memcheck over
# the exchange's cases whose launches wait on none), then the benchmark routines the docs quote,
# each as far as the time left allows.  Every phase packs its logs into OUT as it ends, so that a
# run cut short still leaves what it finished (OUT/summary.txt, suite.tgz, san.tgz, bench.tgz).
#
#   OUT            folder for the results (default: a temp folder, printed)
#   LIMIT          seconds the whole run may take (default 1800); the suite and the sanitizers
#                  end by SUITE_END seconds (default 600), the routines share the rest
#   ATTNMERGE_WHEEL  a wheel to test instead of building one (as scripts/gpu-test.sh takes it)
#   WHEELS         a folder of wheels to install beside (e.g. torchao, for the block-scaled
#                  outputs' reference tests); none by default
#   ROUTINES       the routines of benchmarks/run.py, in order (default below); vs_seed and
#                  vs_flashinfer need `python benchmarks/peers/fetch.py` run where PyPI is reachable
#   SUITE          0: no suite and no sanitizers, the routines alone (a second call on the same
#                  wheel); default 1
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export ATTNMERGE_CUDA_ARCHITECTURES="${ATTNMERGE_CUDA_ARCHITECTURES-90}" ATTNMERGE_BUILD_JAX="${ATTNMERGE_BUILD_JAX-1}"
PY="${PYTHON:-python3}"
T0=$SECONDS; LIMIT=${LIMIT:-1800}; SUITE_END=${SUITE_END:-600}
OUT="${OUT:-$(mktemp -d)}"; W="$(mktemp -d)"; mkdir -p "$OUT" "$W/gpu" "$W/san" "$W/sanx" "$W/bench"
S="$OUT/summary.txt"
say() { echo "$*" | tee -a "$S"; }
say "$(nvidia-smi -L 2>/dev/null | head -1) | tree $(git rev-parse --short HEAD 2>/dev/null || echo unknown) | logs $OUT"
if [ -n "${WHEELS:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" "$WHEELS"/*.whl \
    && export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}" && say "installed beside: $(ls "$WHEELS")"
fi
if [ -n "${ATTNMERGE_WHEEL:-}" ]; then
  WHL="$ATTNMERGE_WHEEL"; say "wheel given: $(basename "$WHL")"
else
  "$PY" -m pip wheel --no-build-isolation --no-deps --no-index -w "$W" . > "$W/gpu/wheel.log" 2>&1 \
    || { say "the wheel did not build: $W/gpu/wheel.log"; tar czf "$OUT/suite.tgz" -C "$W" gpu; exit 2; }
  WHL=$(ls "$W"/*.whl); say "wheel in $((SECONDS - T0)) s: $(basename "$WHL")"
fi
if [ "${SUITE:-1}" = 0 ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/am" "$WHL" \
    && export PYTHONPATH="$W/am${PYTHONPATH:+:$PYTHONPATH}" && say "routines alone, on $(basename "$WHL")"
else
  ATTNMERGE_WHEEL="$WHL" OUT="$W/gpu" PYTEST_ARGS="${PYTEST_ARGS:--n 12}" \
    timeout $((SUITE_END - (SECONDS - T0))) bash scripts/gpu-test.sh > "$W/gpu/run.log" 2>&1 &
  suite=$!
  while [ ! -s "$W/gpu/info.txt" ] && kill -0 $suite 2>/dev/null; do sleep 2; done  # installed
  for tool in memcheck racecheck initcheck synccheck; do
    SANITIZE_TOOLS=$tool OUT="$W/san" SANITIZE_TIMEOUT=$((SUITE_END - (SECONDS - T0))) \
      bash scripts/sanitize.sh > "$W/san/$tool.summary" 2>&1 &
  done
  SANITIZE_TOOLS=memcheck OUT="$W/sanx" SANITIZE_TIMEOUT=$((SUITE_END - (SECONDS - T0))) \
    SANITIZE_TESTS="tests/semantics/test_merge_exchange.py tests/errors/test_exchange_inputs.py" \
    SANITIZE_K="alternate or launch_record or inputs" bash scripts/sanitize.sh > "$W/sanx/memcheck.summary" 2>&1 &
  wait $suite; say "gpu-test rc=$? at $((SECONDS - T0)) s: $(grep -E 'passed|failed' "$W/gpu/run.log" | tail -1)"
  grep -E "^(FAILED|ERROR)" "$W/gpu/pytest.log" 2>/dev/null | head -40 | tee -a "$S"
  tar czf "$OUT/suite.tgz" -C "$W" gpu
  wait; say "sanitizers done at $((SECONDS - T0)) s"; cat "$W"/san/*.summary "$W/sanx/memcheck.summary" | tee -a "$S"
  tar czf "$OUT/san.tgz" -C "$W" san sanx
fi
for spec in ${ROUTINES:-pdl_chain block_scaled vs_flashinfer vs_seed layouts exchange state_forms}; do
  left=$((LIMIT - (SECONDS - T0) - 10))
  [ $left -lt 20 ] && { say "$spec: no time left"; continue; }
  timeout $left "$PY" benchmarks/run.py "$spec" --json "$W/bench/$spec.json" > "$W/bench/$spec.log" 2>&1
  say "$spec rc=$? at $((SECONDS - T0)) s"; tail -n 3 "$W/bench/$spec.log" >> "$S"
  tar czf "$OUT/bench.tgz" -C "$W" bench
done
say "done at $((SECONDS - T0)) s"
