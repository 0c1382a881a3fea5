#!/usr/bin/env bash
# On the lent GPU machine: where a decode kernel spends its warps' time, by SASS line. Nsight Compute's
# warp-state sampling and instruction counts of one launch of each kernel of one layer's sparse decode
# (scoring, the two selection stages), by opcode and the most-sampled lines first.
#   SHAPE=glm4-9b LABEL=r4i4 CONTEXT=512K bash scripts/dev/ncu_lines.sh
# Writes $OUT/lines_<shape>_<label>.ncu-rep and prints a table per kernel; REPORT=path.ncu-rep reads a saved
# report instead of profiling. The source view is the SASS one (Triton's line info maps the kernels back to
# their Python file, but that view carries no counters): the stalls fall on the instruction that waits.
source scripts/dev/gpu_env.sh || exit 1
OUT=${OUT:-out}
mkdir -p "$OUT"
SHAPE=${SHAPE:-glm4-9b}
LABEL=${LABEL:-r4i4}
KERNELS=${KERNELS:-regex:^_(locks_fma|locks_mma|locks_wgmma|select)_kernel}
rep="$OUT/lines_${SHAPE}_${LABEL}"
if [ -n "$REPORT" ]; then rep="${REPORT%.ncu-rep}"; else
# one launch of each kernel past bench_decode's warm-up ones (--launch-skip), sparse arm only
timeout "${NCU_TIMEOUT:-200}" ncu --clock-control none --import-source yes --kernel-name "$KERNELS" \
    --nvtx --nvtx-include "sparse/" --launch-skip "${SKIP:-3}" --launch-count "${LAUNCHES:-3}" \
    --section SourceCounters --section WarpStateStats --section LaunchStats --section Occupancy \
    -f -o "$rep" python3 scripts/bench_decode.py --models "$SHAPE" --contexts "${CONTEXT:-512K}" --labels "$LABEL" \
    --reps 1 --out "$OUT/lines_bench.json" > "$OUT/lines.log" 2>&1 || { echo "ncu_lines: ncu failed"; tail -5 "$OUT/lines.log"; exit 1; }
fi
ncu -i "$rep.ncu-rep" --page source --csv --print-source sass > "$OUT/lines_src.csv" 2> "$OUT/lines_src.err" \
    || ncu -i "$rep.ncu-rep" --page source --csv > "$OUT/lines_src.csv" 2>> "$OUT/lines_src.err"
ncu -i "$rep.ncu-rep" --page details --print-details all 2>/dev/null \
    | grep -E "^  [_a-z]|Stall|Warp Cycles Per Issued|Registers Per|Achieved Occupancy|Issue Slots" | head -60
python3 - "$OUT/lines_src.csv" <<'EOF'
import csv, sys
from collections import defaultdict

rows = list(csv.reader(open(sys.argv[1])))
if not rows:
    sys.exit("no source page: " + open(sys.argv[1].replace(".csv", ".err")).read()[-400:])
# the page holds one table per kernel (a "Kernel Name"/"Source" header line starts each)
tables, cur, pending = [], None, ""
for r in rows:
    if any(c in ("Source", "# Source") for c in r) and len(r) > 3:
        cur = {"head": r, "body": [], "name": ""}
        tables.append(cur)
    elif cur is not None and len(r) == len(cur["head"]):
        cur["body"].append(r)
    elif r and r[0] == "Kernel Name" and len(r) > 1:
        pending = r[1]
    if cur is not None and not cur["name"] and pending:
        cur["name"] = pending
for t in tables:
    h = t["head"]
    def col(*names):
        for n in names:
            for i, c in enumerate(h):
                if c.startswith(n):
                    return i
        return None
    src = col("Source", "# Source")
    stall = col("Warp Stall Sampling (All Samples)", "Warp Stall Sampling")
    inst = col("Instructions Executed")
    line = col("Address", "# Address", "Line", "#")
    vals = []
    for r in t["body"]:
        try:
            s = float((r[stall] if stall is not None else "0").replace(",", "") or 0)
            n = float((r[inst] if inst is not None else "0").replace(",", "") or 0)
        except ValueError:
            continue
        if s or n:
            vals.append((s, n, (r[line] if line is not None else ""), r[src].strip()[:110]))
    tot_s = sum(v[0] for v in vals) or 1
    tot_n = sum(v[1] for v in vals) or 1
    print(f"\n{t['name']} {len(t['body'])} lines; samples {tot_s:.0f}, instructions {tot_n:.0f}; by opcode:")
    by_op = defaultdict(lambda: [0.0, 0.0])
    for s, n, ln, text in vals:
        op = text.split()[0] if text.split() else "?"
        op = text.split()[1] if op.startswith("@") and len(text.split()) > 1 else op
        by_op[op.split(".")[0]][0] += s
        by_op[op.split(".")[0]][1] += n
    for op, (s, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:14]:
        print(f"  {100 * s / tot_s:5.1f}% samp {100 * n / tot_n:5.1f}% inst  {op}")
    print("  top instructions by samples:")
    for s, n, ln, text in sorted(vals, reverse=True)[:24]:
        print(f"  {100 * s / tot_s:5.1f}% samp {100 * n / tot_n:5.1f}% inst  {ln:>6s}  {text}")
EOF
