#!/usr/bin/env bash
# On the lent GPU machine: the complete decode step under CUDA graphs (with a kernel profile of eager
# steps when PROFILE > 0). Writes under ${OUT:-out}.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 scripts/bench_decode_step.py --shape "${SHAPE:-llama3.1-8b}" --graphs "${GRAPHS:-cuda}" \
    --contexts "${CONTEXTS:-128K,512K}" --arms "${ARMS:-full,r4i4,quest}" --budget "${BUDGET:-2048}" --steps "${STEPS:-10}" --profile "${PROFILE:-0}" \
    --out "$OUT/decode_step_${SHAPE:-llama3.1-8b}_${GRAPHS:-cuda}.json" 2>&1 | tee "$OUT/decode_step_${SHAPE:-llama3.1-8b}_${GRAPHS:-cuda}.log" | tail -"${TAIL:-40}"
