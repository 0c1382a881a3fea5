"""What the harness is given: every file it reads, corrupted, is an error naming file:line and what to
do (one reader, one tolerance policy: `locks_hf.eval.jsonl`); every path the user names must exist
(never replaced by another folder); every numeric or list option is range-checked when parsed; help
answers without torch / transformers and shows every default."""

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from locks_hf.eval.cli import HelpFormatter, Number, build_parser, main, sweep_plan
from locks_hf.eval.jsonl import InputFileError, InputPathMissing

REPO = Path(__file__).resolve().parents[1]


def _message(call) -> str:
    """The error ``call`` ends in: a library `InputFileError` / `InputPathMissing`, or the CLI's exit."""
    with pytest.raises((InputFileError, InputPathMissing, SystemExit)) as info:
        call()
    err = info.value
    if isinstance(err, SystemExit):
        assert err.code not in (0, None), "exited 0"
        return str(err.code)
    return str(err)


# -------------------------------------------------------------------------------------------------
# every reader, every corruption
PRED = {
    "id": "t-0",
    "task": "t",
    "length": 1024,
    "arm": "full",
    "family": "full",
    "budget": None,
    "selector": "full",
    "sample": 0,
    "pred": "x",
    "score": 1.0,
}


def _published_run(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(
        json.dumps({"model": "m", "benchmark": {"name": "ruler"}, "arms": [{"name": "full"}]}, indent=1)
    )
    (run / "results.jsonl").write_text("".join(json.dumps({**PRED, "id": f"t-{i}"}) + "\n" for i in range(3)))
    return run


def _report(tmp_path):
    run = _published_run(tmp_path)
    return lambda: main(["report", "--run", str(run), "--out", str(tmp_path / "docs")])


def _sweep_run(tmp_path):
    """A sweep run folder as a killed sweep leaves it (config, records, predictions, manifest)."""
    run = _published_run(tmp_path)
    (run / "results.jsonl").unlink()
    (run / "records").mkdir()
    (run / "records" / "t-1024.jsonl").write_text(
        "".join(
            json.dumps(
                {"id": f"t-1024-{i}", "task": "t", "length": 1024, "index": i, "input": "in", "answer_prefix": ":"}
            )
            + "\n"
            for i in range(3)
        )
    )
    (run / "predictions").mkdir()
    (run / "predictions" / "shard-0-of-1.jsonl").write_text(
        "".join(json.dumps({**PRED, "id": f"t-1024-{i}"}) + "\n" for i in range(3))
    )
    (run / "manifest.json").write_text(json.dumps({"seeds": {"sweep": 0}}, indent=1))
    return run


def _data_dir(tmp_path):
    """A data folder (the layout ``--data-dir`` names) holding the files corrupted below."""
    from locks_hf.eval.paths import package_data

    data = tmp_path / "data"
    for rel, sample in [
        ("ruler/ruler_tasks.json", "ruler_tasks.json"),
        ("ruler/qa_sources/squad_v2_dev_sample500.jsonl", "ruler_squad_v2_dev_sample12.jsonl"),
        ("ruler/qa_sources/hotpotqa_dev_distractor_subset1100.json", "ruler_hotpotqa_dev_distractor_sample5.json"),
        ("math/math500.jsonl", "math500_sample8.jsonl"),
        ("longbench/longbench_tasks.json", "longbench_tasks.json"),
        ("infinitebench/infinitebench_tasks.json", "infinitebench_tasks.json"),
    ]:
        (data / rel).parent.mkdir(parents=True, exist_ok=True)
        (data / rel).write_bytes(package_data(sample).read_bytes())
    return data


def _ruler_source(method):
    def setup(tmp_path):
        from locks_hf.eval.ruler import RulerSources

        data = _data_dir(tmp_path)
        return lambda: getattr(RulerSources(data_dir=str(data)), method)()

    return setup


def _math(tmp_path):
    from locks_hf.eval.mathbench import load_problems

    data = _data_dir(tmp_path)
    return lambda: load_problems("math500", data_dir=str(data))


def _spec(module):
    def setup(tmp_path):
        import importlib

        data = _data_dir(tmp_path)
        return lambda: importlib.import_module(f"locks_hf.eval.{module}").load_spec(str(data))

    return setup


def _ib_score(tmp_path):
    folder = tmp_path / "yi-34b-200k"
    folder.mkdir()
    (folder / "preds_passkey.jsonl").write_text(
        "".join(json.dumps({"prediction": "12345", "ground_truth": ["12345"]}) + "\n" for _ in range(3))
    )
    return lambda: main(["infinitebench-score", "--predictions", str(folder)])


def _longbench(tmp_path):
    from locks_hf.eval.longbench import LongBenchBenchmark
    from locks_hf.eval.paths import package_data
    from locks_hf.eval.testing import ByteTokenizer

    records = tmp_path / "records"
    records.mkdir()
    (records / "multi_news.jsonl").write_bytes(package_data("longbench_multi_news_sample2.jsonl").read_bytes())
    return lambda: LongBenchBenchmark(ByteTokenizer(), ["multi_news"], records_dir=str(records)).records()


def _fidelity_records(tmp_path):
    run = _sweep_run(tmp_path)
    return lambda: main(
        [
            "fidelity",
            "--model",
            "tiny-llama",
            "--records-from",
            str(run),
            "--arms",
            "oracle",
            "--budgets",
            "64",
            "--out",
            str(tmp_path / "fid"),
        ]
    )


def _merge(tmp_path):
    run = _sweep_run(tmp_path)
    return lambda: main(["merge", "--out", str(run)])


def _manifest(tmp_path):
    from locks_hf.eval.manifest import check_or_write

    run = _sweep_run(tmp_path)
    return lambda: check_or_write(run, {"seeds": {"sweep": 0}}, write=None)


def _report_fidelity(tmp_path):
    run = _published_run(tmp_path)
    fid = tmp_path / "fid"
    fid.mkdir()
    (fid / "fidelity_raw.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"p{i}", "layer": 0, "length": 64, "arm": "oracle-b64", "recall": 1.0}) + "\n"
            for i in range(3)
        )
    )
    return lambda: main(["report", "--run", str(run), "--fidelity", str(fid), "--out", str(tmp_path / "docs")])


#: (reader, how to set it up, the file it reads, JSON Lines or one JSON document, appended to by the harness)
READERS = [
    ("infinitebench-score predictions", _ib_score, "yi-34b-200k/preds_passkey.jsonl", "jsonl", False),
    ("report: results.jsonl", _report, "run/results.jsonl", "jsonl", False),
    ("report: config.json", _report, "run/config.json", "json", False),
    ("report: fidelity_raw.jsonl", _report_fidelity, "fid/fidelity_raw.jsonl", "jsonl", True),
    ("fidelity --records-from records", _fidelity_records, "run/records/t-1024.jsonl", "jsonl", False),
    ("merge: predictions", _merge, "run/predictions/shard-0-of-1.jsonl", "jsonl", True),
    ("merge: records", _merge, "run/records/t-1024.jsonl", "jsonl", False),
    ("merge / resume: config.json", _merge, "run/config.json", "json", False),
    ("resume: manifest.json", _manifest, "run/manifest.json", "json", False),
    ("LongBench --records-dir", _longbench, "records/multi_news.jsonl", "jsonl", False),
    ("math problems", _math, "data/math/math500.jsonl", "jsonl", False),
    ("RULER squad", _ruler_source("squad"), "data/ruler/qa_sources/squad_v2_dev_sample500.jsonl", "jsonl", False),
    (
        "RULER hotpotqa",
        _ruler_source("hotpotqa"),
        "data/ruler/qa_sources/hotpotqa_dev_distractor_subset1100.json",
        "json",
        False,
    ),
    ("RULER spec", _spec("ruler"), "data/ruler/ruler_tasks.json", "json", False),
    ("LongBench spec", _spec("longbench"), "data/longbench/longbench_tasks.json", "json", False),
    ("InfiniteBench spec", _spec("infinitebench"), "data/infinitebench/infinitebench_tasks.json", "json", False),
]


def _jsonl_corruptions(text: bytes):
    """(name, corrupted bytes, the line the error must name); line 2 of a file of 2+ lines."""
    first, rest = text.split(b"\n", 1)
    return [
        ("garbage line", first + b"\nnot json at all\n" + rest, 2),
        ("torn line inside", first + b'\n{"id": "x", "ta\n' + rest, 2),
        ("not UTF-8", first + b'\n{"id": "\xff\xfe"}\n' + rest, 2),
        ("not an object", first + b"\n[1, 2]\n" + rest, 2),
    ]


def _json_corruptions(text: bytes):
    return [
        ("truncated", text[: len(text) // 2], None),
        ("garbage", b"\x00garbage", 1),
        ("empty", b"", 1),
        ("not UTF-8", b'{"a": "\xff"}', 1),
    ]


CASES = []
for _name, _setup, _rel, _kind, _appended in READERS:
    for _corruption in (
        ["garbage line", "torn line inside", "not UTF-8", "not an object"]
        if _kind == "jsonl"
        else ["truncated", "garbage", "empty", "not UTF-8"]
    ):
        CASES.append(pytest.param(_setup, _rel, _kind, _corruption, id=f"{_name}: {_corruption}"))


@pytest.mark.parametrize("setup,rel,kind,corruption", CASES)
def test_every_file_the_harness_reads_corrupted_is_an_error_naming_file_and_line(
    tmp_path, setup, rel, kind, corruption
):
    call = setup(tmp_path)
    path = tmp_path / rel
    variants = (_jsonl_corruptions if kind == "jsonl" else _json_corruptions)(path.read_bytes())
    data, line = next((d, n) for name, d, n in variants if name == corruption)
    path.write_bytes(data)
    message = _message(call)
    assert f"{path}:{line if line is not None else ''}" in message, message
    # and it says what to do (every fix text gives a way out: fix/remove/delete/restore/use/name another)
    assert any(word in message for word in ("fix", "remove", "delete", "restore", "use another", "name")), message


@pytest.mark.parametrize(
    "name,setup,rel,kind,appended",
    [r for r in READERS if r[3] == "jsonl"],
    ids=[r[0] for r in READERS if r[3] == "jsonl"],
)
def test_a_torn_last_line_is_dropped_only_in_files_the_harness_appends_to(
    tmp_path, name, setup, rel, kind, appended, caplog
):
    call = setup(tmp_path)
    path = tmp_path / rel
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"id": "x", "ta')  # a kill in the middle of a write
    line = whole.count(b"\n") + 1
    if appended:
        call()
        assert f"{path}:{line}: dropped a line torn" in caplog.text
    else:
        assert f"{path}:{line}: not valid JSON" in _message(call)


def test_a_truncated_gzip_is_an_error_naming_it(tmp_path):
    run = _published_run(tmp_path)
    body = (run / "results.jsonl").read_bytes()
    (run / "results.jsonl").unlink()
    (run / "results.jsonl.gz").write_bytes(gzip.compress(body)[:-12])
    assert f"{run / 'results.jsonl.gz'}: not a complete gzip file" in _message(
        lambda: main(["report", "--run", str(run), "--out", str(tmp_path / "docs")])
    )


def test_an_empty_predictions_file_is_an_error(tmp_path):
    call = _ib_score(tmp_path)
    (tmp_path / "yi-34b-200k" / "preds_passkey.jsonl").write_text("")
    assert "preds_passkey.jsonl: no predictions in it" in _message(call)


def test_infinitebench_score_of_a_folder_without_predictions_is_an_error(tmp_path):
    (tmp_path / "yi-34b-20k").mkdir()  # a misspelled model folder: exists, holds nothing
    message = _message(lambda: main(["infinitebench-score", "--predictions", str(tmp_path / "yi-34b-20k")]))
    assert "yi-34b-20k: no preds_<task>.jsonl" in message and "name the folder" in message


def test_fidelity_records_from_a_folder_without_records_is_an_error(tmp_path):
    message = _message(
        lambda: main(
            ["fidelity", "--model", "tiny-llama", "--records-from", str(tmp_path), "--out", str(tmp_path / "fid")]
        )
    )
    assert f"--records-from {tmp_path}: no records/<task>.jsonl" in message
    assert not (tmp_path / "fid").exists()


def test_resume_of_a_run_with_a_truncated_config_is_an_error(tmp_path):
    out = tmp_path / "run"
    sweep = [
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
        "--max-new-tokens",
        "1",
        "--threads",
        "1",
        "--out",
        str(out),
    ]
    main(sweep)
    text = (out / "config.json").read_text()
    (out / "config.json").write_text(text[: len(text) // 2])
    message = _message(lambda: main(sweep))
    assert f"{out / 'config.json'}:" in message and "another --out folder" in message


# -------------------------------------------------------------------------------------------------
# paths the user names
def test_named_data_folders_that_do_not_exist_are_errors_not_fall_throughs(tmp_path, monkeypatch):
    from locks_hf.eval.infinitebench import InfiniteBenchBenchmark
    from locks_hf.eval.longbench import LongBenchBenchmark, load_records
    from locks_hf.eval.paths import data_file, shared_data_dir
    from locks_hf.eval.testing import ByteTokenizer

    missing = str(tmp_path / "nonexistent")
    with pytest.raises(InputPathMissing, match=f"--data-dir {missing}: no such folder"):
        shared_data_dir(missing)
    with pytest.raises(InputPathMissing, match="--data-dir"):
        data_file("ruler/ruler_tasks.json", "ruler_tasks.json", missing)  # not the packaged spec instead
    with pytest.raises(InputPathMissing, match=f"--records-dir {missing}: no such folder"):
        load_records("multi_news", records_dir=missing)
    with pytest.raises(InputPathMissing, match=f"--records-dir {missing}: no such folder"):
        InfiniteBenchBenchmark(ByteTokenizer(), ["passkey"], records_dir=missing)
    (tmp_path / "empty").mkdir()  # a named records folder without the task's file: not the Hub instead
    with pytest.raises(InputPathMissing, match="no multi_news.jsonl"):
        LongBenchBenchmark(ByteTokenizer(), ["multi_news"], records_dir=str(tmp_path / "empty"))
    monkeypatch.setenv("LOCKS_HF_DATA", missing)
    with pytest.raises(InputPathMissing, match=f"LOCKS_HF_DATA={missing}: no such folder"):
        shared_data_dir()
    monkeypatch.setenv("LOCKS_HF_DATA", "none")
    assert shared_data_dir() is None  # the packaged samples, as asked


PATH_OPTIONS = [
    ["sweep", "--data-dir", "{missing}"],
    ["sweep", "--benchmark", "longbench", "--records-dir", "{missing}"],
    ["sweep", "--benchmark", "infinitebench", "--records-dir", "{missing}"],
    ["sweep", "--haystack", "{missing}"],
    ["sweep", "--wordlists", "{missing}"],
    ["fidelity", "--records-from", "{missing}"],
    ["fidelity", "--data-dir", "{missing}"],
    ["ruler-generate", "--data-dir", "{missing}"],
    ["report", "--run", "{missing}"],
    ["report", "--run", "{tmp}", "--notes", "{missing}"],
    ["report", "--run", "{tmp}", "--fidelity", "{missing}"],
    ["infinitebench-score", "--predictions", "{missing}"],
    ["infinitebench-score", "--predictions", "{tmp}", "--data-dir", "{missing}"],
]


@pytest.mark.parametrize("argv", PATH_OPTIONS, ids=[" ".join(a[:1] + a[-2:-1]) for a in PATH_OPTIONS])
def test_every_path_option_naming_nothing_is_refused_before_any_work(tmp_path, capsys, argv):
    missing = tmp_path / "nonexistent"
    argv = [a.format(missing=missing, tmp=tmp_path) for a in argv]
    if "--out" not in argv and argv[0] != "infinitebench-score":
        argv += ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"{missing}: no such" in err and "check the path" in err
    assert not (tmp_path / "out").exists()


def test_every_path_option_is_checked():
    """The class: every option whose value is an input path exists-checked when parsed."""
    from locks_hf.eval.cli import ExistingPath

    inputs = {
        "--data-dir",
        "--records-dir",
        "--haystack",
        "--wordlists",
        "--records-from",
        "--run",
        "--notes",
        "--fidelity",
        "--predictions",
    }
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if set(action.option_strings) & inputs:
                assert isinstance(action.type, ExistingPath), (name, action.option_strings)


# -------------------------------------------------------------------------------------------------
# numeric and list options
def _subparsers():
    return next(a for a in build_parser()._actions if a.dest == "cmd").choices


def _numeric_options():
    out = []
    for name, sub in _subparsers().items():
        for action in sub._actions:
            if isinstance(action.type, Number):
                out += [
                    pytest.param(name, action.option_strings[-1], bad, id=f"{name} {action.option_strings[-1]} {bad!r}")
                    for bad in action.type.out_of_range()
                ]
    return out


def test_no_numeric_option_takes_an_unchecked_number():
    for name, sub in _subparsers().items():
        for action in sub._actions:
            assert action.type not in (int, float), (name, action.option_strings, "use a cli.Number range")
            if isinstance(action.default, (int, float)) and not isinstance(action.default, bool):
                assert isinstance(action.type, Number), (name, action.option_strings)


@pytest.mark.parametrize("cmd,option,bad", _numeric_options())
def test_every_numeric_option_refuses_values_out_of_its_range(tmp_path, capsys, cmd, option, bad):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args([cmd, f"{option}={bad}"])  # refused as it is parsed, before anything else
    assert info.value.code == 2 and "expected" in capsys.readouterr().err


@pytest.mark.parametrize("option", ["--tasks", "--arms", "--budgets", "--lengths"])
@pytest.mark.parametrize("value", ["", ",", " "])
def test_empty_lists_are_refused_not_read_as_the_default(tmp_path, capsys, option, value):
    with pytest.raises(SystemExit) as info:
        main(["sweep", f"{option}={value}", "--out", str(tmp_path / "run")])
    assert info.value.code == 2 and f"argument {option}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "option,value",
    [("--top-p", "1"), ("--top-p", "0.01"), ("--temperature", "0"), ("--budgets", "64,128"), ("--seed", "0")],
)
def test_values_in_range_are_taken(tmp_path, option, value):
    args = build_parser().parse_args(["sweep", option, value, "--out", str(tmp_path)])
    assert float(str(getattr(args, option[2:].replace("-", "_"))).split(",")[0]) == float(value.split(",")[0])


# -------------------------------------------------------------------------------------------------
# help and the plan
def test_help_loads_no_evaluation_dependency_and_shows_every_default():
    """`--help` imports the package (which registers the attention with transformers, so torch comes
    along, and transformers brings accelerate) but none of what a sweep needs: datasets, plotting, scorers."""
    code = (
        "import runpy, sys\n"
        "for argv in (['--help'], ['sweep', '--help']):\n"
        "    sys.argv = ['locks-hf-eval', *argv]\n"
        "    try:\n"
        "        runpy.run_module('locks_hf.eval.cli', run_name='__main__', alter_sys=True)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, e.code\n"
        "heavy = ('datasets', 'matplotlib', 'rouge_score', 'rouge', 'math_verify', 'jieba', 'gguf')\n"
        "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "HEAVY []" in out.stdout, out.stdout.splitlines()[-1]
    text = "".join(out.stdout.split())  # argparse wraps lines, also after a hyphen
    for shown in (
        "(default: 0.95)",
        "(default: 0.6)",
        "(default: 64,128,256,512,1024,2048)",
        "(default: ruler)",
        "(default: 16)",
        "(default: eager)",
        "(default: dense-question)",
        "(default: off)",
    ):
        assert shown.replace(" ", "") in text, shown
    assert "shared/data" not in out.stdout  # users are not pointed at the developers' data folder


def test_every_option_of_every_command_says_its_default():
    for name, sub in _subparsers().items():
        formatter = HelpFormatter(name)
        for action in sub._actions:
            if action.option_strings and action.dest != "help" and not action.required:
                assert "default" in formatter._get_help_string(action), (name, action.option_strings)


def test_a_sweep_says_what_it_is_about_to_run(tmp_path):
    from locks_hf.eval.arms import parse_arms

    args = build_parser().parse_args(
        [
            "sweep",
            "--arms",
            "full,oracle,quest",
            "--budgets",
            "64,128",
            "--lengths",
            "4096,8192",
            "--out",
            str(tmp_path),
        ]
    )
    arms = parse_arms(["full", "oracle", "quest"], [64, 128])
    plan = sweep_plan(args, arms, [])
    assert "260 records = default tasks (all 13 tasks) x 2 length(s) (4096, 8192) x 10 records" in plan
    assert "arms: 5 = 3 families (full, oracle, quest) x 2 budget(s) (64, 128)" in plan
    assert "total: 1300 generations" in plan
