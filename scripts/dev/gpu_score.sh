#!/usr/bin/env bash
# On the lent GPU machine: the Locks scoring variants (tests compiled on the GPU, then
# scripts/dev/bench_score.py: parallel compiles, float64 checks at 512K, scoring alone over a tile grid,
# the whole attention step against dense), optionally ncu counters. Writes under ${OUT:-out}.
#   SKIP_TESTS=1  skip the pytest part          TEST_TIMEOUT (s, default 150)
#   PHASES=precompile,check,score,attn          BUDGET (s of the benchmark after which phases are skipped, 330)
#   MODELS / LABELS / CONTEXTS / BATCH          as scripts/dev/bench_score.py
#   NCU=1         ncu counters of one launch per variant at Llama and GLM 512K r4i4 (NCU_TIMEOUT, 100 s)
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
T0=$(date +%s)
if [ -z "$SKIP_TESTS" ]; then
    rm -rf /tmp/pk/tests && cp -r tests /tmp/pk/tests
    N=$(python3 -c "import xdist" 2>/dev/null && echo "-n ${WORKERS:-14}")
    (cd /tmp/pk && timeout "${TEST_TIMEOUT:-150}" python3 -m pytest $N -q -rfE -p no:cacheprovider \
        -m gpu tests/test_score_variants.py tests/test_kernels_real_shapes.py \
        > "$OUT/pytest_score.txt" 2>&1; echo "pytest exit $?" >> "$OUT/pytest_score.txt")
    tail -15 "$OUT/pytest_score.txt" | cut -c1-220
    echo "tests: $(( $(date +%s) - T0 )) s"
fi
python3 scripts/dev/bench_score.py --phases "${PHASES:-precompile,check,score,attn}" --budget "${BUDGET:-330}" \
    --models "${MODELS:-llama3.1-8b,glm4-9b}" --labels "${LABELS:-r4i4,r8i4}" --contexts "${CONTEXTS:-512K,1M}" \
    --batch "${BATCH:-1,8}" --out "$OUT/score_bench.json" > "$OUT/score_bench.log" 2>&1
echo "bench exit $?: $(( $(date +%s) - T0 )) s"
grep -v "^  " "$OUT/score_bench.log" | tail -80 | cut -c1-240
if [ -n "$NCU" ] && command -v ncu >/dev/null; then
    METRICS=dram__bytes_read.sum,gpu__time_duration.sum,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,sm__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__occupancy_limit_registers,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum
    for shape in llama3.1-8b:r4i4 glm4-9b:r4i4; do
        timeout "${NCU_TIMEOUT:-100}" ncu --clock-control none --kernel-name "regex:_locks_(mma|fma)_kernel|_score_kernel" \
            --metrics "$METRICS" --csv python3 scripts/dev/bench_score.py --ncu-one "$shape" > "$OUT/ncu_${shape%%:*}.csv" 2>&1
        echo "ncu $shape: exit $?"
    done
    python3 - "$OUT" <<'PY'
import csv, glob, sys
for f in sorted(glob.glob(sys.argv[1] + "/ncu_*.csv")):
    rows = [r for r in csv.reader(open(f)) if len(r) > 10]
    if not rows:
        continue
    head = rows[0]
    k, m, v = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
    print(f)
    for r in rows[1:]:
        print(f"  {r[k][:40]:40s} {r[m]:62s} {r[v]}")
PY
fi
