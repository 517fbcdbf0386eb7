#!/usr/bin/env bash
# compute-sanitizer's memcheck, racecheck, initcheck and synccheck over the GPU tests, on a GPU
# machine where attnmerge is already installed (run scripts/gpu-test.sh first).  One line per tool
# with its error summary; the exit status is 1 if any tool reported an error or failed to finish.
#
#   SANITIZE_TESTS    test files (default: the semantic suites of the five ops, FP8, per-group
#                     and block-scaled outputs, sinks, mixed LSE bases, batch invariance,
#                     float64's refusal, softmax statistics and empty shards (valid), device-side
#                     token counts, run on their `cuda` device by -m gpu, packed records,
#                     torch.func, and the GPU interop, compat and raw tests).  The exchange's tests
#                     are not among them: its ranks simulated on one GPU wait for each other's
#                     kernels, which the tools serialize; run them with
#                     SANITIZE_TESTS="tests/semantics/test_merge_exchange.py tests/errors/test_exchange_inputs.py"
#                     SANITIZE_K="alternate or launch_record or inputs" (the cases whose launches
#                     wait on none)
#   SANITIZE_K        pytest -k filter (default: PyTorch only, no multi-GiB tests)
#   SANITIZE_TIMEOUT  seconds per tool (default 900)
#   SANITIZE_TOOLS    the tools to run (default: memcheck racecheck initcheck synccheck); one
#                     tool per invocation lets several run side by side, each with its own OUT
#   OUT               folder for the logs (<tool>.log); a temp folder if unset
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-python3}"
SEMANTICS="tests/semantics/test_merge.py tests/semantics/test_merge_inplace.py tests/semantics/test_merge_states.py
  tests/semantics/test_merge_varlen.py tests/semantics/test_merge_share.py tests/semantics/test_fp8_outputs.py
  tests/semantics/test_sinks.py tests/semantics/test_lse_bases.py tests/semantics/test_group_fp8.py
  tests/semantics/test_block_scaled.py
  tests/semantics/test_batch_invariance.py tests/semantics/test_float64.py tests/interop/test_packed_records.py
  tests/interop/test_torch_func.py tests/semantics/test_softmax_stats.py tests/semantics/test_valid_states.py
  tests/semantics/test_state_forms_options.py tests/semantics/test_live_tokens.py"
INTEROP="tests/interop/test_gpu_arrays.py tests/interop/test_cuda_graphs.py tests/interop/test_streams.py
  tests/interop/test_devices.py tests/compat tests/abi/test_raw_pointers.py"
TESTS="${SANITIZE_TESTS:-$SEMANTICS $INTEROP}"
K="${SANITIZE_K:-not cupy and not jax and not numba and not large and not 2_31 and not 2_30 and not largest}"
LOGS="${OUT:-$(mktemp -d)}"
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck initcheck synccheck}; do
  # shellcheck disable=SC2086
  timeout "${SANITIZE_TIMEOUT:-900}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
    "$PY" -m pytest -q -x -p no:cacheprovider -m gpu $TESTS -k "$K" >"$LOGS/$tool.log" 2>&1
  rc=$?
  summary="$(grep -E 'ERROR SUMMARY' "$LOGS/$tool.log" | tail -n 1)"
  tests="$(grep -E '[0-9]+ (passed|failed)' "$LOGS/$tool.log" | tail -n 1)"
  echo "$tool: rc=$rc | ${summary:-no summary} | ${tests:-no pytest summary}"
  [ "$rc" -eq 0 ] || status=1
done
exit $status
