"""The CLI end to end on a tiny random model (sweep -> report), and ruler-generate / infinitebench-score."""

import json

import pytest

from locks_hf.eval.cli import main


def test_cli_sweep_report(tmp_path, capsys):
    out = tmp_path / "run"
    main(
        [
            "sweep",
            "--model",
            "tiny-gemma3",
            "--tasks",
            "niah_single_1",
            "--lengths",
            "1024",
            "--num-samples",
            "2",
            "--arms",
            "full,locks-r4i4",
            "--budgets",
            "64",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    plan = capsys.readouterr().err  # said before it ran
    assert "records: 2 records = 1 task(s) (niah_single_1) x 1 length(s) (1024) x 2 records" in plan
    assert "arms: 2 = 2 families (full, locks-r4i4) x 1 budget(s) (64)" in plan and "total: 4 generations" in plan
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 4 and {r["arm"] for r in rows} == {"full", "locks-r4i4-b64"}
    main(
        [
            "sweep",
            "--model",
            "tiny-gemma3",
            "--tasks",
            "niah_single_1",
            "--lengths",
            "1024",
            "--num-samples",
            "2",
            "--arms",
            "full,locks-r4i4",
            "--budgets",
            "64",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
            "--shard",
            "0/1",
        ]
    )
    assert len((out / "predictions" / "shard-0-of-1.jsonl").read_text().splitlines()) == 4  # resumed: nothing new
    main(["report", "--run", str(out), "--out", str(tmp_path / "docs"), "--name", "r"])
    md = (tmp_path / "docs" / "r.md").read_text()
    assert "| niah_single_1 | 2 |" in md


BASELINES = "rocketkv,kvzip,shadowkv,rkv,triattention,lazy_eviction"


def test_cli_sweep_runs_every_baseline_arm_and_lists_what_does_not_fit(tmp_path):
    out = tmp_path / "run"
    main(
        [
            "sweep",
            "--model",
            "tiny-gemma3",
            "--tasks",
            "niah_single_1",
            "--lengths",
            "1024",
            "--num-samples",
            "1",
            "--arms",
            f"full,locks-r4i4,{BASELINES},lazy_eviction-a0.0005",
            "--budgets",
            "64,512",
            "--max-new-tokens",
            "3",
            "--out",
            str(out),
            "--threads",
            "1",
        ]
    )
    rows = {r["arm"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    families = BASELINES.split(",") + ["lazy_eviction-a0.0005"]
    want = {f"{f}-b{b}" for f in families for b in (64, 512)} - {"shadowkv-b64"}
    assert want <= set(rows) and "shadowkv-b64" not in rows
    cfg = json.loads((out / "config.json").read_text())
    assert [a["name"] for a in cfg["arms_not_run"]] == ["shadowkv-b64"]
    assert next(a for a in cfg["arms"] if a["name"] == "lazy_eviction-a0.0005-b64")["config"]["lazy_alpha"] == 5e-4
    for arm in want:  # every arm decoded and read its tokens (the accounting is there)
        assert rows[arm]["new_tokens"] >= 1 and rows[arm]["attended_tokens"] > 0 and rows[arm]["read_bytes"] > 0
    assert rows["rocketkv-b64"]["attended_tokens"] == 32 and rows["kvzip-b64"]["attended_tokens"] < 1024


def test_cli_ruler_generate(tmp_path):
    main(
        [
            "ruler-generate",
            "--model",
            "tiny-llama",
            "--tasks",
            "vt,cwe",
            "--lengths",
            "8192",
            "--num-samples",
            "2",
            "--out",
            str(tmp_path),
        ]
    )
    recs = [json.loads(l) for l in (tmp_path / "cwe-8192.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and len(recs[0]["outputs"]) == 10


def test_cli_math_sampled_avg_at_k(tmp_path):
    import pytest

    pytest.importorskip("math_verify")
    out = tmp_path / "m"
    main(
        [
            "sweep",
            "--benchmark",
            "math",
            "--model",
            "tiny-llama",
            "--tasks",
            "aime2024",
            "--num-samples",
            "1",
            "--k",
            "2",
            "--temperature",
            "0.8",
            "--max-new-tokens",
            "3",
            "--arms",
            "full,oracle",
            "--budgets",
            "32",
            "--out",
            str(out),
        ]
    )
    rows = [json.loads(l) for l in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["arm"], r["sample"]) for r in rows) == [
        ("full", 0),
        ("full", 1),
        ("oracle-b32", 0),
        ("oracle-b32", 1),
    ]
    assert all(r["new_tokens"] <= 3 and "extracted" in r for r in rows)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["samples"] == 2 and cfg["sampling"]["temperature"] == 0.8 and "sampled" in cfg["protocol"]
    assert all(r["attended_fraction"] < 0.1 for r in rows if r["arm"] == "oracle-b32")  # sparse decode ran


def test_cli_math_one_sample_with_sampling_is_a_sampled_run(tmp_path):
    pytest.importorskip("math_verify")
    out = tmp_path / "m1"
    main(
        [
            "sweep",
            "--benchmark",
            "math",
            "--model",
            "tiny-llama",
            "--tasks",
            "aime2024",
            "--num-samples",
            "1",
            "--k",
            "1",
            "--temperature",
            "0.8",
            "--max-new-tokens",
            "3",
            "--arms",
            "full",
            "--out",
            str(out),
        ]
    )
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["samples"] == 1 and "sampled" in cfg["protocol"] and "last prompt token" in cfg["protocol_text"]


def test_tiny_model_names_set_head_dim():
    from locks_hf.eval.cli import load_any_model

    model, _ = load_any_model("tiny-llama-d64")
    assert model.config.head_dim == 64 and model.model.layers[0].self_attn.k_proj.out_features == 2 * 64
    assert load_any_model("tiny-llama")[0].config.head_dim == 16


SWEEP = [
    "sweep",
    "--model",
    "tiny-llama",
    "--tasks",
    "niah_single_1",
    "--lengths",
    "1024",
    "--num-samples",
    "1",
    "--arms",
    "full",
    "--budgets",
    "64",
    "--max-new-tokens",
    "2",
]


@pytest.mark.parametrize(
    "flag,value,needle",
    [
        ("--max-new-tokens", "0", "positive integer"),
        ("--lengths", "0", "positive integer"),
        ("--num-samples", "-3", "positive integer"),
        ("--budgets", "64,abc", "positive integer"),
        ("--shard", "abc", "expected i/n"),
        ("--shard", "3/2", "0 <= i < n"),
        ("--dtype", "float99", "invalid choice"),
    ],
)
def test_sweep_arguments_that_mean_nothing_are_refused_before_loading(
    tmp_path, capsys, monkeypatch, flag, value, needle
):
    import locks_hf.eval.cli as cli

    monkeypatch.setattr(cli, "load_any_model", _must_not_load)
    args = list(SWEEP)
    if flag in args:
        args[args.index(flag) + 1] = value
    else:
        args += [flag, value]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--out", str(tmp_path / "run")])
    assert exit_info.value.code == 2 and needle in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _must_not_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the arguments were checked")


def test_merge_of_a_folder_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="not a sweep run folder"):
        main(["merge", "--out", str(tmp_path / "typo")])
    assert not (tmp_path / "typo").exists()


def test_ruler_length_too_short_for_the_task_is_refused():
    from locks_hf.eval.ruler import RulerGenerator
    from locks_hf.eval.testing import ByteTokenizer

    with pytest.raises(ValueError, match="choose a longer --lengths"):
        RulerGenerator(ByteTokenizer()).record("niah_single_1", 100, 0)


def test_every_sweep_argument_has_a_help_text():
    from locks_hf.eval.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    sweep = sub.choices["sweep"]
    options = {o for a in sweep._actions for o in a.option_strings}
    assert {"--arms", "--budgets", "--tasks", "--lengths", "--out", "--device", "--dtype"} <= options
    assert [a.dest for a in sweep._actions if not a.help] == []
