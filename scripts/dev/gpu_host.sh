#!/usr/bin/env bash
# On the lent GPU machine: the figures behind the decode step's compile time and speed.
# 1. attention only at 512K, both model shapes, r8i4/r4i4/r2i4 at batch 1 and 8, from a fresh Triton cache (the
#    wall time of the cold run is printed: its compiles);
# 2. the complete GLM-4-9B step at 512K captured by hand in one CUDA graph (`--graphs compile-cuda`): r4i4, r8i4
#    and dense in one run;
# 3. the one-liner's first generate() at 128K from cold caches: torch.compile's share and the library's Triton
#    compiles by kernel (`triton_compiles` in the JSON).
# Tables on stdout, JSON and logs under ${OUT:-out}. About 11 minutes, more than one device call: skip parts
# with SKIP_ATTN=1, SKIP_STEP=1, SKIP_GENERATE=1 (e.g. SKIP_GENERATE=1, then SKIP_ATTN=1 SKIP_STEP=1).
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
show() {  # log lines
  grep -v -i "warn" "$1" | tail -"$2" | cut -c1-260
}
if [ -z "$SKIP_ATTN" ]; then
  rm -rf /tmp/tc_attn
  start=$SECONDS
  TRITON_CACHE_DIR=/tmp/tc_attn timeout 200 python3 scripts/bench_decode.py --contexts 512K --batch 1,8 \
      --labels r8i4,r4i4,r2i4 --reps 30 --out "$OUT/decode_attention_512k.json" > "$OUT/decode_attention_512k.log" 2>&1
  echo "attention only 512K: exit $?, $((SECONDS - start)) s from a cold Triton cache"; show "$OUT/decode_attention_512k.log" 20
fi
if [ -z "$SKIP_STEP" ]; then
  timeout 330 python3 scripts/bench_decode_step.py --graphs compile-cuda --shape glm4-9b --contexts 512K \
      --arms r4i4,r8i4,full --steps 20 --out "$OUT/decode_step_glm4-9b_compile-cuda.json" \
      > "$OUT/decode_step_glm4-9b_compile-cuda.log" 2>&1
  echo "compile-cuda glm4-9b: exit $?"; show "$OUT/decode_step_glm4-9b_compile-cuda.log" 10
fi
if [ -z "$SKIP_GENERATE" ]; then
  rm -rf /tmp/tc_generate /tmp/ti_generate
  TRITON_CACHE_DIR=/tmp/tc_generate TORCHINDUCTOR_CACHE_DIR=/tmp/ti_generate timeout 220 python3 scripts/bench_generate.py --runs 128K:1 --arms r4i4 \
      --out "$OUT/generate_128k_cold.json" > "$OUT/generate_128k_cold.log" 2>&1
  echo "generate 128K cold: exit $?"; show "$OUT/generate_128k_cold.log" 4
  python3 -c "import json, sys; r = json.load(open(sys.argv[1]))['rows'][0]; print(json.dumps(r['triton_compiles'], indent=1))" \
      "$OUT/generate_128k_cold.json" | head -40
fi
