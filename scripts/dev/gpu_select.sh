#!/usr/bin/env bash
# On the lent GPU machine: the selection / sparse-attention kernels and the decode step without glue
# launches. Compiled tests first (14 workers), then scripts/dev/bench_select.py (one layer: old vs new
# selection and attention, with scoring, vs dense; then the complete decode step, old vs new, with
# its kernel count). Tables on stdout, JSON and logs under ${OUT:-out}. About 5-6 minutes:
# tests <= TEST_TIMEOUT (240 s; PYTEST_K narrows them), kernels <= KERNEL_TIMEOUT (110 s), step <= STEP_TIMEOUT (170 s).
# Skip parts with SKIP_TESTS=1, SKIP_KERNELS=1, SKIP_STEP=1; CONFIGS / SWEEP / STEP_SHAPES are passed on.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
if [ -z "$SKIP_TESTS" ]; then
  rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
  (cd /tmp/pk && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -n "${WORKERS:-14}" -q -rfE --durations=10 ${PYTEST_K:+-k "$PYTEST_K"} \
      -m gpu tests/test_select_attend_fast.py tests/test_kernels.py tests/test_page_update.py tests/test_sweep_engine.py \
      -p no:cacheprovider > "$OUT/pytest.txt" 2>&1; echo "pytest exit $?" >> "$OUT/pytest.txt"; tail -25 "$OUT/pytest.txt" | cut -c1-220)
fi
ARGS=(--out "$OUT/bench_select.json" ${CONFIGS:+--configs "$CONFIGS"} ${SWEEP+--sweep "$SWEEP"}
      ${STEP_SHAPES:+--step-shapes "$STEP_SHAPES"})
[ -n "$SKIP_KERNELS" ] || timeout "${KERNEL_TIMEOUT:-110}" python3 scripts/dev/bench_select.py --kernels "${ARGS[@]}" \
    2>&1 | tee "$OUT/bench_kernels.log" | grep -v Warning | tail -40
if [ -z "$SKIP_STEP" ]; then
  ARGS[1]="$OUT/bench_step.json"
  timeout "${STEP_TIMEOUT:-170}" python3 scripts/dev/bench_select.py --step "${ARGS[@]}" 2>&1 | tee "$OUT/bench_step.log" \
      | grep -v Warning | tail -45
fi
