#!/usr/bin/env bash
# On the lent GPU machine: the GPU suite (`pytest -m gpu`: the kernel test files compiled, and every
# test that needs CUDA: the static cache's compiled generate, the one-liner's compiled generate across
# budgets and through a growth, the sweep engine's graph / compiled steps), the eigensolver check, then
# the complete decode step under CUDA graphs (scripts/dev/gpu_step.sh).
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
# Compiling every kernel variant cold is most of the run: spread the tests over the host's cores (on the H200,
# 2026-12-04: 264 tests in 182 s on 16 workers).
(cd /tmp/pk && timeout "${TEST_TIMEOUT:-400}" python3 -m pytest -m gpu -n "${WORKERS:-16}" -v --durations=25 -rfE \
    tests -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/pytest.txt" 2>&1; tail -40 "$OUT/pytest.txt" | cut -c1-200)
[ -n "$SKIP_EIGH" ] || timeout 120 python3 scripts/dev/check_eigh_gpu.py 2>&1 | tail -30
bash scripts/dev/gpu_step.sh
