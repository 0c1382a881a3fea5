#!/usr/bin/env bash
# On the lent GPU machine: compiled-kernel tests (incl. the static cache's compiled generate), the
# eigensolver check, and the complete decode step under CUDA graphs. Writes under ${OUT:-out}.
source scripts/gpu_env.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
(cd /tmp/pk && timeout 300 python3 -m pytest tests/test_kernels.py tests/test_eigh.py tests/test_static_cache.py \
    -q -x -p no:cacheprovider ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 | tail -8)
timeout 120 python3 scripts/check_eigh_gpu.py 2>&1 | tail -30
python3 scripts/bench_decode_step.py --graphs cuda --contexts "${CONTEXTS:-128K,512K}" --arms "${ARMS:-full,r4i4,quest}" \
    --steps 20 --out "$OUT/decode_step_graphs.json" 2>&1 | tail -14
