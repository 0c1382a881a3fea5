#!/usr/bin/env bash
# On the lent GPU machine: Nsight Compute counters of each kernel of one layer's sparse decode (scoring,
# selection, sparse attention, split merge, page mask) at one context, for each shape, so that what
# bounds a kernel (bytes, issue, occupancy, launch) is read rather than guessed. Clocks are left as the
# card has them (--clock-control none). Writes $OUT/ncu_<shape>_<label>.csv and prints a short table.
#   SHAPES=llama3.1-8b,glm4-9b CONTEXT=512K LABELS=r4i4,r8i4 bash scripts/dev/ncu_decode.sh
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
# anchored: the dense baseline that bench_decode times first has its own '..._combine_kernel'
KERNELS='regex:^_(locks_fma|locks_mma|locks_wgmma|score|select|sparse_attn|combine|list_mask|quant_attn)_kernel'
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
        # the sparse arms only: bench_decode.py times dense first, on the same kernels (pages=None)
        timeout "${NCU_TIMEOUT:-240}" ncu --clock-control none --csv --print-units base --kernel-name "$KERNELS" \
            --nvtx --nvtx-include "sparse/" \
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
# launches of one kernel (warm-up and timed repetitions alike): the median of each counter
by_kernel = defaultdict(list)
for (_, kernel), m in per.items():
    by_kernel[kernel].append(m)
print(f"\n{sys.argv[2]}: kernel | launches | us | DRAM MB | DRAM % peak | SM % peak | warps active % | regs | grid x block")
for kernel, ms in by_kernel.items():
    def f(k):
        xs = sorted(float(m.get(k, "nan")) for m in ms)
        return xs[len(xs) // 2]
    m = ms[0]
    print(
        f"{kernel[:28]:28s} | {len(ms):3d} | {f('gpu__time_duration.sum') / 1e3:7.1f} | "
        f"{(f('dram__bytes_read.sum') + f('dram__bytes_write.sum')) / 1e6:7.2f} | "
        f"{f('dram__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} | "
        f"{f('sm__throughput.avg.pct_of_peak_sustained_elapsed'):5.1f} | "
        f"{f('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} | "
        f"{m.get('launch__registers_per_thread', '?')} | {m.get('launch__grid_size', '?')} x {m.get('launch__block_size', '?')}"
    )
EOF
    done
done
