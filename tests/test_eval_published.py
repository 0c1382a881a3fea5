"""The published evaluation runs in results/eval: their compressed raw predictions re-derive the
shipped score tables, and reading them never rewrites the folder."""

import csv
import gzip
import json
from pathlib import Path

import pytest

from locks_hf.eval.jsonl import read_jsonl, resolve
from locks_hf.eval.report import load_cells

DATA = Path(__file__).resolve().parents[1] / "results" / "eval"
RUNS = sorted(p for p in DATA.glob("ruler-*") if (p / "results.jsonl.gz").exists())


def test_jsonl_reads_plain_and_gzip_and_falls_back_to_gz(tmp_path):
    rows = [{"a": 1, "text": "é"}, {"a": 2}]
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + "\n"
    (tmp_path / "plain.jsonl").write_text(body, encoding="utf-8")
    with gzip.open(tmp_path / "packed.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write(body)
    assert read_jsonl(tmp_path / "plain.jsonl") == rows
    assert read_jsonl(tmp_path / "packed.jsonl.gz") == rows
    assert read_jsonl(tmp_path / "packed.jsonl") == rows  # the .gz sibling of a missing plain file
    assert resolve(tmp_path / "missing.jsonl") == tmp_path / "missing.jsonl"
    with pytest.raises(FileNotFoundError):
        read_jsonl(tmp_path / "missing.jsonl")


@pytest.mark.parametrize("run", RUNS, ids=[p.name for p in RUNS])
def test_published_predictions_give_the_published_scores(run):
    before = {p.name: p.stat().st_mtime_ns for p in run.iterdir()}
    cells = load_cells(run)
    with open(run / "scores.csv") as f:
        want = {(r["task"], r["arm"]): (int(r["n"]), float(r["score"])) for r in csv.DictReader(f)}
    got = {(c["task"], c["arm"]): (c["n"], round(c["score"], 2)) for c in cells}
    assert got == want
    assert {p.name: p.stat().st_mtime_ns for p in run.iterdir()} == before  # nothing merged over it


def test_the_published_runs_are_there():
    assert [p.name for p in RUNS] == [
        "ruler-baselines-4k",
        "ruler-baselines-8k",
        "ruler-gemma3-4k",
        "ruler-gemma3-8k",
        "ruler-hf-quantized-4k",
        "ruler-hf-quantized-4k-12",
        "ruler-kivi-4k",
        "ruler-kivi-4k-seed43",
        "ruler-kivi-8k",
        "ruler-tight-4k",
        "ruler-tight-8k",
    ]
