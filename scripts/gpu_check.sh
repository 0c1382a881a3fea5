#!/usr/bin/env bash
# On the lent GPU machine: compiled-kernel tests (incl. the static cache's compiled generate), the
# eigensolver check, then the complete decode step under CUDA graphs (scripts/gpu_step.sh).
source scripts/gpu_env.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
(cd /tmp/pk && timeout "${TEST_TIMEOUT:-400}" python3 -m pytest tests/test_kernels.py tests/test_eigh.py \
    tests/test_page_update.py tests/test_static_cache.py -q -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tee "$OUT/pytest.txt" | tail -25)
[ -n "$SKIP_EIGH" ] || timeout 120 python3 scripts/check_eigh_gpu.py 2>&1 | tail -30
bash scripts/gpu_step.sh
