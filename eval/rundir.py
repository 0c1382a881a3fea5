"""The sweep's results folder (layout in `runner`): shards, the records cached under ``records/``,
the JSON-lines reader and the atomic writer every file of the folder goes through.
"""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

from .benchmarks import Benchmark
from .jsonl import read_jsonl

#: What to do about a damaged config.json of a run folder (it is written atomically: a tool or a copy broke it).
CONFIG_FIX = "restore the run folder's config.json from a copy, or use another --out folder"

#: Keys every prediction row has (`merge` reads them all).
PREDICTION_KEYS = ("id", "arm", "task", "length", "family", "budget", "selector")


def parse_shard(shard: str | None) -> tuple[int, int]:
    """``"i/n"`` -> (i, n); ``None`` -> from accelerate/torchrun env (RANK, WORLD_SIZE) or (0, 1)."""
    if shard:
        first, _, count = str(shard).partition("/")
        if not (first.strip().isdigit() and count.strip().isdigit()) or not 0 <= int(first) < int(count):
            raise ValueError(f"--shard {shard!r}: expected i/n with 0 <= i < n, e.g. 0/2")
        return int(first), int(count)
    n = int(os.environ.get("WORLD_SIZE", "1"))
    i = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return i, n


def safe_name(name: str) -> str:
    """``name`` as a file name (runs of other characters become ``_``)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))


def read_rows(path: Path, required: tuple[str, ...] = ("id",), appended: bool = False) -> list[dict]:
    """The rows of a JSON-lines file of the run folder (none when it is not there yet), read by the
    harness's one reader (`read_jsonl`: a torn last line of a file appended to is dropped, anything
    else that does not parse is an error naming file:line)."""
    if not path.exists():
        return []
    fix = (
        "remove that line (a prediction's work is redone on resume), or use another --out folder"
        if appended
        else "that file was not written whole by locks-hf-eval: delete it (it is made again) or use another --out folder"
    )
    return read_jsonl(path, required=required, appended=appended, fix=fix)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def load_or_make_records(run_dir: Path, bench: Benchmark, keys=None) -> list[dict]:
    """Records in a fixed order, cached under ``records/`` so every arm, shard and resume sees the same."""
    rdir = run_dir / "records"
    if hasattr(bench, "record_keys"):  # records made one key at a time (RULER): each cached once made
        keyed: Any = bench
        keys = keyed.record_keys()
        by_task: dict[str, list] = defaultdict(list)
        for k in keys:
            by_task[f"{k[0]}-{k[1]}" if len(k) > 2 else str(k[0])].append(k)
        out = {}
        for group, gkeys in by_task.items():
            path = rdir / f"{safe_name(group)}.jsonl"
            cached = {r["id"]: r for r in read_rows(path)}
            recs = []
            for k in gkeys:
                rid = f"{k[0]}-{k[1]}-{k[2]}"
                recs.append(cached[rid] if rid in cached else keyed.make_record(k))
            if any(r["id"] not in cached for r in recs):
                merged = {**cached, **{r["id"]: r for r in recs}}
                write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in merged.values()))
            out.update({r["id"]: r for r in recs})
        return [out[f"{k[0]}-{k[1]}-{k[2]}"] for k in keys]
    recs = bench.records()
    path = rdir / f"{safe_name(bench.name)}.jsonl"
    if not path.exists():
        write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    return recs


def record_order(run_dir: Path) -> list[str]:
    ids = []
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        ids += [r["id"] for r in read_rows(path)]
    return ids
