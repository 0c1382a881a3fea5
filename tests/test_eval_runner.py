"""The sweep runner end to end on a tiny random model: 2 records x 3 arms, resume, shard merge, report."""

import json

import pytest
import torch
from conftest import count_forwards

from locks_hf.eval.arms import parse_arms
from locks_hf.eval.benchmarks import RulerBenchmark
from locks_hf.eval.merge import merge
from locks_hf.eval.runner import SweepRunner
from locks_hf.eval.stopping import looping
from locks_hf.eval.testing import ByteTokenizer
from locks_hf.models import tiny_model

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("gemma3", vocab_size=256, max_position_embeddings=8192)


def _bench():
    return RulerBenchmark(TOK, ["niah_single_1", "niah_multikey_2"], [1024], num_samples=1)


def _arms():
    return parse_arms(["full", "oracle", "locks-r4i4"], [64])


def _run(model, out, shard=None):
    r = SweepRunner(
        model, TOK, _bench(), _arms(), out, model_name="tiny-gemma3", shard=shard, progress=False, max_new_tokens=6
    )
    r.run()
    return r


def test_arms():
    arms = parse_arms(["full", "oracle", "locks-r8i4", "r4i4", "quest"], [64, 128])
    assert [a.name for a in arms] == [
        "full",
        "oracle-b64",
        "oracle-b128",
        "locks-r8i4-b64",
        "locks-r8i4-b128",
        "locks-r4i4-b64",
        "locks-r4i4-b128",
        "quest-b64",
        "quest-b128",
    ]
    assert arms[3].config.rank == 8 and arms[3].config.basis_bits == 4 and arms[3].config.budget == 64
    with pytest.raises(ValueError):
        parse_arms(["bogus"], [64])


def test_stop_rules():
    from locks_hf.eval.stopping import stop_position

    assert stop_position(": 7380814. I've seen", "sentence") == len(": 7380814.")
    assert stop_position(": 1. 4380047 2. 3", "sentence") is None  # a list number is no sentence end
    assert stop_position("\n 123\nmore", "newline") == len("\n 123")  # a leading newline does not stop
    assert stop_position("a. b.", "newline") is None
    assert stop_position(":\n 8174154.", "sentence") == len(":\n 8174154.")  # the answer may follow ":\n"


def test_looping_stop_rule():
    assert looping("4380047, 4021361, 4380047, 4380047, 4380047, ")
    assert not looping("7045277") and not looping("1000000") and not looping("dba2610d-4cf8-4f1f-ac61-f4e402ef8128")
    assert looping(": 1. 2. 3. 4. 5. 6.") and not looping(": 1. 2. 3. 4. 5.")  # counting run-on
    assert not looping(": 4380047, 4021361, 2962394, 4232619, 1234567")  # up to 5 numbers: an answer list
    from locks_hf.eval.stopping import loop_cut

    assert loop_cut(": 1. 2. 3. 4. 5. 6. 7. 8.") == ": 1. 2. 3. 4. 5. 6."


@pytest.mark.compat  # the sweep smoke run of the compatibility subset
def test_end_to_end_resume_and_shards(model, tmp_path, monkeypatch):
    single = tmp_path / "single"
    _run(model, single)
    info = merge(single)
    assert info["rows"] == 6  # 2 records x 3 arms
    rows = [json.loads(l) for l in (single / "results.jsonl").read_text().splitlines()]
    assert {r["arm"] for r in rows} == {"full", "oracle-b64", "locks-r4i4-b64"}
    fr = {r["arm"]: r["attended_fraction"] for r in rows if r["task"] == "niah_single_1"}
    assert fr["full"] == 1.0 and fr["oracle-b64"] < 0.2 and fr["locks-r4i4-b64"] < 0.2
    # the first generated token comes from the shared prefill: identical in every arm
    for rid in {r["id"] for r in rows}:
        firsts = {r["pred"][:1] for r in rows if r["id"] == rid and r["new_tokens"] > 0}
        assert len(firsts) <= 1
    assert all(0.0 <= r["score"] <= 1.0 and r["new_tokens"] <= 6 for r in rows)
    cfg = json.loads((single / "config.json").read_text())
    assert cfg["protocol"] == "dense-question" and len(cfg["arms"]) == 3

    # resume: nothing is generated or prefilled again
    pred_file = single / "predictions" / "shard-0-of-1.jsonl"
    before = pred_file.read_text()
    calls = count_forwards(model, monkeypatch)
    _run(model, single)
    monkeypatch.undo()
    assert calls["n"] == 0 and pred_file.read_text() == before

    # a killed run resumes where it stopped: drop the last line, only that (record, arm) is redone
    lines = before.splitlines(keepends=True)
    pred_file.write_text("".join(lines[:-1]) + lines[-1][:10])  # plus a torn line
    _run(model, single)
    merge(single)
    assert (single / "results.jsonl").read_text() == "".join(
        json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows
    )

    # two shards + merge == one process
    sharded = tmp_path / "sharded"
    _run(model, sharded, shard="0/2")
    _run(model, sharded, shard="1/2")
    assert len(list((sharded / "predictions").glob("shard-*-of-2.jsonl"))) == 2
    merge(sharded)
    for name in ("results.jsonl", "scores.csv"):
        assert (sharded / name).read_text() == (single / name).read_text(), name


def test_sparse_question_protocol_and_report(model, tmp_path):
    out = tmp_path / "sq"
    arms = parse_arms(["full", "locks-r4i4"], [64])
    bench = _bench()
    # keep the test fast: only the last 12 prompt bytes count as the question (fed one by one)
    bench.question_start_text = lambda rec: len(bench.prompt_text(rec)) - 12
    r = SweepRunner(
        model,
        TOK,
        bench,
        arms,
        out,
        model_name="tiny-gemma3",
        progress=False,
        max_new_tokens=2,
        protocol="sparse-question",
        limit=1,
    )
    r.run()
    merge(out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["protocol"] == "sparse-question" and "question tokens" in cfg["protocol_text"]
    from locks_hf.eval.report import write_report

    md = write_report([out], tmp_path / "docs", title="tiny")
    text = md.read_text()
    assert "| niah_single_1 | 1 |" in text and "locks-r4i4" in text
    assert (tmp_path / "docs" / "report-sq.png").stat().st_size > 1000
