"""The run manifest: written once per run folder; a resume under another setup is refused."""

import json

import pytest
import torch

from locks_hf.eval.arms import parse_arms
from locks_hf.eval.benchmarks import RulerBenchmark
from locks_hf.eval.manifest import ManifestMismatch, sha256_of
from locks_hf.eval.ruler import RulerSources
from locks_hf.eval.runner import SweepRunner
from locks_hf.eval.testing import ByteTokenizer

TOK = ByteTokenizer()


def _runner(out, monkeypatch, seed=0, haystack=None, allow=False):
    bench = RulerBenchmark(TOK, ["niah_single_1"], [1024], num_samples=1, haystack_path=haystack)
    runner = SweepRunner(
        torch.nn.Linear(1, 1),
        TOK,
        bench,
        parse_arms(["full"], [64]),
        out,
        progress=False,
        seed=seed,
        allow_manifest_change=allow,
    )
    monkeypatch.setattr(runner, "_run_record", _no_generation)  # the manifest is all this test is about
    return runner


def _no_generation(rec, work, bar):
    return iter(())


def test_manifest_records_versions_commit_data_hashes_and_seeds(tmp_path, monkeypatch):
    import transformers

    import locks_hf

    _runner(tmp_path / "run", monkeypatch, seed=3).run()
    manifest = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert manifest["locks_hf"] == locks_hf.__version__ and manifest["transformers"] == transformers.__version__
    assert manifest["torch"] == torch.__version__ and manifest["seeds"]["sweep"] == 3
    assert manifest["seeds"]["benchmark"] is not None
    assert "git_commit" in manifest  # a hash in a git checkout, None in an installed package
    haystack = RulerSources().haystack_file()
    assert manifest["data_files"]["haystack"] == f"{haystack.name}:{sha256_of(haystack)}"
    assert {"spec", "wordlist_noun"} <= set(manifest["data_files"])


def test_resume_under_another_setup_is_refused(tmp_path, monkeypatch):
    out = tmp_path / "run"
    haystack = tmp_path / "haystack.txt"
    haystack.write_text(RulerSources().haystack_file().read_text())
    _runner(out, monkeypatch, haystack=str(haystack)).run()
    _runner(out, monkeypatch, haystack=str(haystack)).run()  # same setup: resumes
    with pytest.raises(ManifestMismatch, match="seeds"):
        _runner(out, monkeypatch, seed=1, haystack=str(haystack)).run()
    haystack.write_text(haystack.read_text() + " One more sentence.")
    with pytest.raises(ManifestMismatch, match="data_files"):
        _runner(out, monkeypatch, haystack=str(haystack)).run()
    _runner(out, monkeypatch, haystack=str(haystack), allow=True).run()  # allowed: recorded in the history
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["history"]) == 1 and manifest["history"][0]["data_files"] != manifest["data_files"]
    _runner(out, monkeypatch, haystack=str(haystack)).run()  # the new setup is the reference now
