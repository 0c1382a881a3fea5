"""The CLI end to end on a tiny random model (sweep -> report), and ruler-generate / infinitebench-score."""

import json

from locks_hf.eval.cli import main


def test_cli_sweep_report(tmp_path, capsys):
    out = tmp_path / "run"
    main(["sweep", "--model", "tiny-gemma3", "--tasks", "niah_single_1", "--lengths", "768", "--num-samples", "2",
          "--arms", "full,locks-r4i4", "--budgets", "64", "--max-new-tokens", "3", "--out", str(out), "--threads", "1"])
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["arm"] for r in rows} == {"full", "locks-r4i4-b64"}
    main(["sweep", "--model", "tiny-gemma3", "--tasks", "niah_single_1", "--lengths", "768", "--num-samples", "2",
          "--arms", "full,locks-r4i4", "--budgets", "64", "--max-new-tokens", "3", "--out", str(out), "--shard", "0/1"])
    assert len((out / "predictions" / "shard-0-of-1.jsonl").read_text().splitlines()) == 4  # resumed: nothing new
    main(["report", "--run", str(out), "--out", str(tmp_path / "docs"), "--name", "r"])
    md = (tmp_path / "docs" / "r.md").read_text()
    assert "| niah_single_1 | 2 |" in md


def test_cli_ruler_generate(tmp_path):
    main(["ruler-generate", "--model", "tiny-llama", "--tasks", "vt,cwe", "--lengths", "4096", "--num-samples", "2",
          "--out", str(tmp_path)])
    recs = [json.loads(l) for l in (tmp_path / "cwe-4096.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and len(recs[0]["outputs"]) == 10


def test_cli_math_sampled_avg_at_k(tmp_path):
    import pytest

    pytest.importorskip("math_verify")
    out = tmp_path / "m"
    main(["sweep", "--benchmark", "math", "--model", "tiny-llama", "--tasks", "aime2024", "--num-samples", "1",
          "--k", "2", "--temperature", "0.8", "--max-new-tokens", "3", "--arms", "full,oracle", "--budgets", "32",
          "--out", str(out)])
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["arm"], r["sample"]) for r in rows) == [("full", 0), ("full", 1), ("oracle-b32", 0), ("oracle-b32", 1)]
    assert all(r["new_tokens"] <= 3 and "extracted" in r for r in rows)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["samples"] == 2 and cfg["sampling"]["temperature"] == 0.8 and "sampled" in cfg["protocol"]
    assert all(r["attended_fraction"] < 0.1 for r in rows if r["arm"] == "oracle-b32")  # sparse decode ran


def test_tiny_model_names_set_head_dim():
    from locks_hf.eval.cli import load_any_model

    model, _ = load_any_model("tiny-llama-d64")
    assert model.config.head_dim == 64 and model.model.layers[0].self_attn.k_proj.out_features == 2 * 64
    assert load_any_model("tiny-llama")[0].config.head_dim == 16
