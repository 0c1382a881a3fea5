#!/usr/bin/env bash
# On the lent GPU machine: Nsight Compute counters of each kernel of one layer's sparse decode (scoring,
# selection, sparse attention, split merge, page mask) at one context, for each shape, so that what
# bounds a kernel (bytes, issue, occupancy, launch) is read rather than guessed. Clocks are left as the
# card has them (--clock-control none). Writes $OUT/ncu_<shape>_<label>.csv and prints a short table.
#   SHAPES=llama3.1-8b,glm4-9b CONTEXT=512K LABELS=r4i4,r8i4 bash scripts/dev/ncu_decode.sh
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
KERNELS='regex:_locks_fma_kernel|_locks_mma_kernel|_score_kernel|_select_chunk_kernel|_select_merge_kernel|_sparse_attn_kernel|_combine_kernel|_list_mask_kernel|_union_kernel|_quant_attn_kernel'
METRICS=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed
METRICS=$METRICS,sm__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
METRICS=$METRICS,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__shared_mem_per_block_static
METRICS=$METRICS,launch__shared_mem_per_block_dynamic,smsp__inst_executed.sum
IFS=, read -r -a shapes <<< "${SHAPES:-llama3.1-8b,glm4-9b}"
IFS=, read -r -a labels <<< "${LABELS:-r4i4}"
for shape in "${shapes[@]}"; do
    for label in "${labels[@]}"; do
        csv="$OUT/ncu_${shape}_${label}.csv"
        # one timed repetition: the first launches of each kernel are the warm-up's, the rest the step's
        timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --csv --print-units base --kernel-name "$KERNELS" \
            --launch-count "${LAUNCHES:-24}" --metrics "$METRICS" \
            python3 scripts/bench_decode.py --models "$shape" --contexts "${CONTEXT:-512K}" --labels "$label" \
            --reps 1 --out "$OUT/ncu_bench_${shape}_${label}.json" > "$csv" 2> "$OUT/ncu_${shape}_${label}.err" \
            || { echo "ncu_decode: $shape $label failed (see $OUT/ncu_${shape}_${label}.err)"; tail -5 "$OUT/ncu_${shape}_${label}.err"; continue; }
        python3 - "$csv" "$shape $label" <<'EOF'
import csv, sys
from collections import defaultdict

rows = list(csv.reader(open(sys.argv[1])))  # the program's own output is in the file too
at = next(i for i, r in enumerate(rows) if "Kernel Name" in r and "Metric Name" in r)
head, body = rows[at], [r for r in rows[at + 1 :] if len(r) == len(rows[at])]
name, metric, value = head.index("Kernel Name"), head.index("Metric Name"), head.index("Metric Value")
per = defaultdict(dict)
for r in body:
    per[(r[head.index("ID")], r[name].split("(")[0])][r[metric]] = r[value].replace(",", "")
print(f"\n{sys.argv[2]}: kernel | us | DRAM MB | DRAM % peak | SM % peak | warps active % | regs | grid x block")
for (_, kernel), m in per.items():
    f = lambda k: float(m.get(k, "nan"))  # noqa: E731
    print(
        f"{kernel[:28]:28s} | {f('gpu__time_duration.sum') / 1e3:7.1f} | "
        f"{(f('dram__bytes_read.sum') + f('dram__bytes_write.sum')) / 1e6:7.2f} | "
        f"{f('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} | "
        f"{f('sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} | "
        f"{f('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} | "
        f"{m.get('launch__registers_per_thread', '?')} | {m.get('launch__grid_size', '?')} x {m.get('launch__block_size', '?')}"
    )
EOF
    done
done
