"""The merge of a sweep's shards: ``results.jsonl``, ``scores.csv`` and ``timing.csv`` of a run folder,
identical for any sharding, and `read_scores` to read the scores back.
"""

from __future__ import annotations

import csv
import json
from collections import defaultdict
from pathlib import Path

from .jsonl import read_json
from .rundir import CONFIG_FIX, PREDICTION_KEYS, read_rows, record_order, write_atomic

#: Prediction keys that depend on the machine or the sharding: left out of ``results.jsonl``.
VOLATILE = ("seconds", "prefill_seconds", "host", "shard")
#: Decode-traffic columns of scores.csv (means over the cell's generations) and their rounding.
TRAFFIC = {"attended_fraction": 4, "attended_tokens": 1, "read_bytes": 0}


def merge(run_dir) -> dict:
    """Combine every shard's predictions into ``results.jsonl`` / ``scores.csv`` / ``timing.csv``.

    The merged files depend only on the predictions, not on how the work was sharded.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "predictions").is_dir():
        raise FileNotFoundError(f"{run_dir} is not a sweep run folder (no predictions/ in it): check --out")
    cfg = read_json(run_dir / "config.json", fix=CONFIG_FIX) if (run_dir / "config.json").exists() else {}
    arm_order = {a["name"]: i for i, a in enumerate(cfg.get("arms", []))}
    rows: dict[tuple, dict] = {}
    timing: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for path in sorted((run_dir / "predictions").glob("shard-*.jsonl")):
        for r in read_rows(path, PREDICTION_KEYS, appended=True):
            key = (r["id"], r["arm"], r.get("sample", 0))
            if key not in rows:
                rows[key] = r
                timing[r["arm"]][0] += r.get("seconds", 0.0)
                timing[r["arm"]][1] += 1
    order = {rid: i for i, rid in enumerate(record_order(run_dir))}
    keyf = lambda k: (order.get(k[0], len(order)), k[0], arm_order.get(k[1], len(arm_order)), k[1], k[2])
    merged = [{k: v for k, v in rows[key].items() if k not in VOLATILE} for key in sorted(rows, key=keyf)]
    write_atomic(
        run_dir / "results.jsonl", "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in merged)
    )

    # per (task, length, arm): mean score x 100 (avg over samples first, then records: avg@k)
    agg: dict[tuple, list] = defaultdict(list)
    per_rec: dict[tuple, list] = defaultdict(list)
    traffic: dict[str, defaultdict[tuple, list]] = {name: defaultdict(list) for name in TRAFFIC}
    meta = {}
    for r in merged:
        per_rec[(r["task"], r["length"], r["arm"], r["id"])].append(r.get("score", 0.0))
        for name, values in traffic.items():
            if r.get(name) is not None:
                values[(r["task"], r["length"], r["arm"])].append(r[name])
        meta[r["arm"]] = (r["family"], r["budget"], r["selector"])
    for (task, length, arm, _), scores in per_rec.items():
        agg[(task, length, arm)].append(sum(scores) / len(scores))
    lines = ["task,length,arm,family,budget,selector,n,score," + ",".join(TRAFFIC)]
    for task, length, arm in sorted(agg, key=lambda k: (str(k[1]), k[0], arm_order.get(k[2], 999), k[2])):
        vals = agg[(task, length, arm)]
        fam, bud, sel = meta[arm]
        means = []
        for name, digits in TRAFFIC.items():
            got = traffic[name].get((task, length, arm))
            means.append("" if not got else str(round(sum(got) / len(got), digits)))
        lines.append(
            f"{task},{'' if length is None else length},{arm},{fam},{'' if bud is None else bud},{sel},"
            f"{len(vals)},{round(100 * sum(vals) / len(vals), 2)}," + ",".join(means)
        )
    write_atomic(run_dir / "scores.csv", "\n".join(lines) + "\n")
    tl = ["arm,generations,seconds_total,seconds_per_generation"]
    for arm in sorted(timing, key=lambda a: arm_order.get(a, 999)):
        s, c = timing[arm]
        tl.append(f"{arm},{c},{round(s, 1)},{round(s / max(c, 1), 2)}")
    write_atomic(run_dir / "timing.csv", "\n".join(tl) + "\n")
    return {"rows": len(merged), "cells": len(agg)}


def read_scores(run_dir) -> list[dict]:
    with open(Path(run_dir) / "scores.csv") as f:
        return list(csv.DictReader(f))
