"""The report's tables from a run's merged rows: averages over the arms the run has (a method that
fits only some budgets, as ShadowKV, still enters them) and the decode-traffic tables."""

import json

from locks_hf.eval.report import load_cells, tables_markdown, write_report

ARMS = [
    ("full", "full", None),
    ("quest-b64", "quest", 64),
    ("quest-b512", "quest", 512),
    ("shadowkv-b512", "shadowkv", 512),
]


def _run(tmp_path, skip=(), length=1024, name="run", arms=ARMS):
    """A published-style run folder (config.json + results.jsonl): tasks t1, t2 of one record each
    at ``length``; ``skip`` lists (task, arm) rows left out."""
    run = tmp_path / name
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps({"model": "m", "benchmark": {"name": "ruler"}, "arms": [{"name": a} for a, _, _ in arms]})
    )
    rows = []
    for t, task in enumerate(["t1", "t2"]):
        for i, (arm, family, budget) in enumerate(arms):
            if (task, arm) in skip:
                continue
            tokens = 1000 if budget is None else budget
            rows.append(
                {
                    "id": f"{task}-0",
                    "task": task,
                    "length": length,
                    "arm": arm,
                    "family": family,
                    "budget": budget,
                    "selector": family,
                    "pred": "x",
                    "score": (t + i) % 2,
                    "attended_fraction": tokens / 1000,
                    "attended_tokens": tokens,
                    "read_bytes": 2048.0 * tokens + 1024 * t,
                }
            )
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_averages_cover_the_arms_the_run_has(tmp_path):
    md, averages = tables_markdown(load_cells(_run(tmp_path)))
    assert "Tasks in the average: t1, t2." in md
    assert averages[(1024, "shadowkv", 512)] == (50.0, 2) and averages[(1024, "quest", 64)] == (50.0, 2)
    assert (1024, "shadowkv", 64) not in averages
    assert "| shadowkv |  | 50.0 |" in md  # no b=64 cell: blank, not a task left out


def test_a_run_of_dense_arms_only_has_one_score_column(tmp_path):
    """Full attention on bf16 and on quantized KV, and transformers' own cache: no arm has a budget, so
    the tables have one column rather than none, and no budget plot is drawn."""
    arms = [("full", "full", None), ("full+kv4", "full+kv4", None), ("hf-quanto4", "hf-quanto4", None)]
    md, averages = tables_markdown(load_cells(_run(tmp_path, arms=arms)))
    assert "| arm | any budget |" in md and "| full+kv4 | 50.0 |" in md and "| hf-quanto4 | 50.0 |" in md
    assert "| KV | any budget |" in md and "| 4-bit | 50.0 |" in md
    assert averages[(1024, "full", None)] == (50.0, 2)
    path = write_report([tmp_path / "run"], tmp_path / "docs", name="r")
    assert "any budget" in path.read_text() and not (tmp_path / "docs" / "r-run.png").exists()


def test_a_task_missing_an_arm_leaves_the_averages(tmp_path):
    md, averages = tables_markdown(load_cells(_run(tmp_path, skip=[("t2", "shadowkv-b512")]), complete_only=False))
    assert "Tasks in the average: t1." in md
    assert averages[(1024, "quest", 64)] == (100.0, 1)


def test_traffic_tables_show_tokens_and_bytes_per_arm_and_budget(tmp_path):
    path = write_report([_run(tmp_path)], tmp_path / "docs", name="r")
    text = path.read_text()
    tokens = text.split("tokens attended per (layer, KV head) and decode step")[1]
    assert "| full | 1000 | 1000 |" in tokens and "| quest | 64 | 512 |" in tokens and "| shadowkv |  | 512 |" in tokens
    kib = text.split("KiB read per (layer, KV head) and decode step")[1]
    # 2 KiB a token, plus 1 KiB on t2: the mean over the two tasks adds 0.5 KiB
    assert "| full | 2000.5 | 2000.5 |" in kib and "| quest | 128.5 | 1024.5 |" in kib
    assert (tmp_path / "docs" / "r-run.png").stat().st_size > 1000


def test_runs_of_two_lengths_get_one_summary_table_and_plot(tmp_path):
    runs = [_run(tmp_path, name="short"), _run(tmp_path, length=2048, skip=[("t2", "quest-b64")], name="long")]
    text = write_report(runs, tmp_path / "docs", name="r").read_text()
    summary = text.split("## Summary: average over tasks")[1].split("\n## ")[0]
    assert "| arm | 1K b=64 | 1K b=512 | 2K b=64 | 2K b=512 |" in summary
    # at 2K only t1 has every arm: quest-b64 scores 100 there
    assert "| quest | 50.0 | 50.0 | 100.0 | 0.0 |" in summary and "| shadowkv |  | 50.0 |  | 100.0 |" in summary
    assert "![score vs budget](r.png)" in summary and (tmp_path / "docs" / "r.png").stat().st_size > 1000
    assert "## Summary" not in write_report(runs[:1], tmp_path / "one", name="r").read_text()


def test_quantized_kv_differences_are_paired_by_record_with_a_bootstrap_interval(tmp_path):
    """The Table 4-shaped report gives each quantized row minus KV bf16, paired by record: the mean over
    tasks and the percentile interval of that mean, against the exact resampling distribution."""
    run = tmp_path / "kv"
    run.mkdir()
    arms = [("locks-r4i4-b64", "locks-r4i4"), ("r4i4+kv4-post", "locks-r4i4+kv4-post")]
    arms += [("r4i4+kv4-pre", "locks-r4i4+kv4-pre")]
    (run / "config.json").write_text(json.dumps({"model": "m", "arms": [{"name": a} for a, _ in arms]}))
    # bf16 gets every record; post misses one of t1's three (and none of t2's); pre equals bf16
    score = {("t1", "locks-r4i4+kv4-post", 1): 0}
    rows = [
        {
            "id": f"{task}-{i}",
            "task": task,
            "length": 1024,
            "arm": arm,
            "family": family,
            "budget": 64,
            "selector": "locks",
            "score": score.get((task, family, i), 1),
        }
        for task in ("t1", "t2")
        for i in range(3)
        for arm, family in arms
    ]
    (run / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    md, _ = tables_markdown(load_cells(run))
    table = md.split("locks-r4i4 on quantized KV, difference to KV bf16 (points, 95% interval)\n")[1]
    lines = [line for line in table.split("\n\n")[1].splitlines() if line.startswith("| 4-bit")]
    # t1's resampled mean is -100 * (misses drawn)/3: P(3 misses) = 1/27 = 3.7% > 2.5%, P(none) = 29.6%;
    # halved over two tasks, the 2.5th percentile is -50 and the 97.5th 0; the mean is -100/3/2
    assert lines == ["| 4-bit post | -16.7 [-50.0, +0.0] |", "| 4-bit pre | +0.0 [+0.0, +0.0] |"]


def test_pooled_cells_join_the_records_of_several_runs(tmp_path):
    """`report --pool`: two draws of one benchmark (the same record ids) are pooled record by record, for
    the arms both have; runs of another model are refused."""
    import pytest

    from locks_hf.eval.report import load_pooled_cells

    first = _run(tmp_path, name="seed42")
    second = _run(tmp_path, name="seed43", arms=ARMS[:3])  # no ShadowKV arm
    pooled = {(c["task"], c["arm"]): c for c in load_pooled_cells([first, second])}
    assert {arm for _, arm in pooled} == {"full", "quest-b64", "quest-b512"}
    one = {(c["task"], c["arm"]): c for c in load_cells(first)}
    for key, cell in pooled.items():
        assert cell["n"] == 2 and cell["score"] == one[key]["score"]  # the same scores drawn twice
        assert set(cell["records"]) == {f"0:seed42/{key[0]}-0", f"1:seed43/{key[0]}-0"}
    md = write_report([first, second], tmp_path / "out", pool=True).read_text()
    assert "## Pooled: seed42 + seed43" in md
    config = json.loads((second / "config.json").read_text())
    (second / "config.json").write_text(json.dumps({**config, "model": "other"}))
    with pytest.raises(ValueError, match="--pool: .* has model='other'"):
        load_pooled_cells([first, second])
    with pytest.raises(ValueError, match="at least two --run folders"):
        write_report([first], tmp_path / "one", pool=True)
