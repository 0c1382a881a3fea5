#!/usr/bin/env bash
# On the lent GPU machine: the compiled decode step's host side and the first generate()'s compile.
# 1. GLM-4-9B shape at 512K under `--graphs captured` (the library's capture; each row records whether its
#    steps replayed: `captured_steps`), then `--graphs compile-cuda` (captured by hand) for r8i4 and the
#    Llama-3.1-8B shape;
# 2. the "fma" scoring kernel at rank 4 unrolled (today's form) and rolled, each from a fresh Triton cache:
#    attention-only times and the wall time of the cold run (scripts/dev/fma_roll.py);
# 3. the one-liner's first generate() at 128K from cold caches: torch.compile's share and the library's Triton
#    compiles by kernel (`triton_compiles` in the JSON).
# Tables on stdout, JSON and logs under ${OUT:-out}. About 12 minutes, more than one device call: skip parts
# with SKIP_STEP=1, SKIP_ROLL=1, SKIP_GENERATE=1 (e.g. SKIP_ROLL=1 SKIP_GENERATE=1, then SKIP_STEP=1).
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
step() {  # graphs shape arms timeout
  timeout "$4" python3 scripts/bench_decode_step.py --graphs "$1" --shape "$2" --contexts 512K --arms "$3" --steps 20 \
      --out "$OUT/decode_step_$2_$1.json" > "$OUT/decode_step_$2_$1.log" 2>&1
  echo "$1 $2: exit $?"; grep -v -i "warn" "$OUT/decode_step_$2_$1.log" | tail -8 | cut -c1-260
}
if [ -z "$SKIP_STEP" ]; then
  step captured glm4-9b r4i4,full 170
  step compile-cuda glm4-9b r8i4 110
  step compile-cuda llama3.1-8b r4i4,full,r8i4 170
fi
if [ -z "$SKIP_ROLL" ]; then
  for rank in 8 4; do
    rm -rf "/tmp/tc$rank"
    TRITON_CACHE_DIR="/tmp/tc$rank" timeout 150 python3 scripts/dev/fma_roll.py "$rank" scripts/bench_decode.py \
        --models llama3.1-8b --contexts 512K --labels r4i4 --reps 30 --out "$OUT/fma_roll$rank.json" \
        > "$OUT/fma_roll$rank.log" 2>&1
    echo "fma rolled from rank $rank: exit $?"; grep -v -i "warn" "$OUT/fma_roll$rank.log" | tail -6 | cut -c1-220
  done
fi
if [ -z "$SKIP_GENERATE" ]; then
  rm -rf /tmp/tc_generate
  TRITON_CACHE_DIR=/tmp/tc_generate timeout 220 python3 scripts/bench_generate.py --runs 128K:1 --arms r4i4 \
      --out "$OUT/generate_128k_cold.json" > "$OUT/generate_128k_cold.log" 2>&1
  echo "generate 128K cold: exit $?"; grep -v -i "warn" "$OUT/generate_128k_cold.log" | tail -4 | cut -c1-260
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]; print(json.dumps(r['triton_compiles'], indent=1))" \
      "$OUT/generate_128k_cold.json" | head -40
fi
