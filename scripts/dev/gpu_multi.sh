#!/usr/bin/env bash
# Several GPUs of one machine: a RULER sweep split by `accelerate launch` vs one process, then
# generate() on a model split over both GPUs vs one GPU. Writes under ${OUT:-out}.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi -L
env | grep -E 'NCCL_NVLS|MULTICAST|NVSHMEM' || true
python3 -c 'import torch, transformers, accelerate, triton; print(torch.__version__, transformers.__version__, accelerate.__version__, triton.__version__, torch.cuda.device_count())'
S="--benchmark ruler --model tiny-llama-d64 --dtype bfloat16 --tasks niah_single_1,niah_multikey_1 --lengths 4096 --num-samples 4 --arms full,oracle,locks-r4i4,quest --budgets 64,256"
python3 scripts/locks_hf_cli.py sweep $S --out "$OUT/sweep-1proc" 2>&1 | tail -2
accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    scripts/locks_hf_cli.py sweep $S --out "$OUT/sweep-2proc" 2>&1 | tail -4
for f in results.jsonl scores.csv; do
    cmp "$OUT/sweep-1proc/$f" "$OUT/sweep-2proc/$f" && echo "sweep $f: identical (1 vs 2 processes)"
done
wc -l "$OUT"/sweep-*/results.jsonl "$OUT"/sweep-2proc/predictions/*
python3 scripts/multi_gpu_generate.py --context "${CONTEXT:-128K}" --new-tokens "${NEW_TOKENS:-24}" --out "$OUT/multi_gpu.json"
