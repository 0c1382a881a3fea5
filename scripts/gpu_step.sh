#!/usr/bin/env bash
# On the lent GPU machine: the kernel-glue tests compiled, then the complete decode step under CUDA graphs.
source scripts/gpu_env.sh
OUT=${OUT:-out}
mkdir -p "$OUT"
rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
(cd /tmp/pk && timeout 90 python3 -m pytest tests/test_kernels.py -q -x -p no:cacheprovider -k "glue or generate" 2>&1 | tail -2)
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench_decode_step.py --graphs cuda \
    --contexts "${CONTEXTS:-128K,512K}" --arms "${ARMS:-full,r4i4,quest}" --steps "${STEPS:-10}" --profile "${PROFILE:-0}" \
    --out "$OUT/decode_step_graphs.json" 2>&1 | tee "$OUT/decode_step.log" | tail -120
