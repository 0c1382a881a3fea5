#!/usr/bin/env bash
# On the lent GPU machine: the fast path's CUDA tests (the one-liner compiled across budgets and
# through a growth, the sweep engine's graph / compiled steps and their replay across budgets), then
# the sweep benchmark's jobs (default: the 17-arm warm-up, cold Triton cache) and, with GENERATE set,
# a generate() row. Writes under ${OUT:-out}. Parts: SKIP_TESTS=1, JOBS=warmup,b, GENERATE=32K:8.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
if [ -z "$SKIP_TESTS" ]; then
    rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
    (cd /tmp/pk && timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -m gpu -n "${WORKERS:-6}" -v -rfE -p no:cacheprovider \
        tests/test_layout.py tests/test_sweep_engine.py \
        > "$OUT/pytest_fastpath.txt" 2>&1; tail -15 "$OUT/pytest_fastpath.txt" | cut -c1-220)
fi
# a cold Triton cache: the warm-up figure includes every kernel compile of the sweep
export TRITON_CACHE_DIR=$(mktemp -d)
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout "${SWEEP_TIMEOUT:-400}" python3 scripts/bench_sweep.py \
    --jobs "${JOBS:-warmup}" ${SWEEP_ARGS} --out "$OUT/sweep_${JOBS:-warmup}.json" 2>&1 | tee "$OUT/sweep.log" | grep -v Warning | tail -40
if [ -n "$GENERATE" ]; then
    timeout "${GENERATE_TIMEOUT:-240}" python3 scripts/bench_generate.py --runs "$GENERATE" --arms "${GENERATE_ARMS:-hf-dynamic,r4i4}" \
        --out "$OUT/generate_${GENERATE/:/_}.json" 2>&1 | tee "$OUT/generate.log" | grep -v Warning | tail -20
fi
