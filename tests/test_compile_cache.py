"""The compiled decode step's inductor cache: persistent by default, the user's folder when named."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

from locks_hf.compile_cache import INDUCTOR_CACHE_ENV, keep_compiled_steps


def test_inductor_cache_defaults_to_a_folder_under_the_library_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LOCKS_HF_CACHE", str(tmp_path / "root"))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="locks_hf.compile_cache"):
        folder = keep_compiled_steps()
    assert folder == str(tmp_path / "root" / "inductor")
    assert os.environ[INDUCTOR_CACHE_ENV] == folder and os.path.isdir(folder)
    assert folder in caplog.text
    assert keep_compiled_steps() == folder  # a second cache changes nothing


def test_torch_default_folder_counts_as_unset(tmp_path, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("LOCKS_HF_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, default_cache_dir())  # what importing torch._dynamo writes
    assert keep_compiled_steps() == str(tmp_path / "root" / "inductor")
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "root" / "inductor")


def test_a_process_that_imported_transformers_gets_the_persistent_folder(tmp_path):
    """A fresh process as users run it: transformers (and so torch._dynamo) imported first."""
    env = {k: v for k, v in os.environ.items() if k != INDUCTOR_CACHE_ENV}
    env["LOCKS_HF_CACHE"] = str(tmp_path / "root")
    code = (
        "import os, transformers, torch._dynamo\n"
        "from locks_hf.compile_cache import keep_compiled_steps\n"
        "print(keep_compiled_steps())\n"
        f"print(os.environ[{INDUCTOR_CACHE_ENV!r}])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(tmp_path / "root" / "inductor")] * 2, out.stderr


def test_a_folder_the_user_named_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("LOCKS_HF_CACHE", str(tmp_path / "root"))
    monkeypatch.setenv(INDUCTOR_CACHE_ENV, str(tmp_path / "mine"))
    assert keep_compiled_steps() == str(tmp_path / "mine")
    assert os.environ[INDUCTOR_CACHE_ENV] == str(tmp_path / "mine")
    assert not (tmp_path / "root").exists()


def test_an_unwritable_cache_root_leaves_torch_default(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LOCKS_HF_CACHE", str(blocker))
    monkeypatch.delenv(INDUCTOR_CACHE_ENV, raising=False)
    with caplog.at_level(logging.WARNING, logger="locks_hf.compile_cache"):
        assert keep_compiled_steps() == ""
    assert INDUCTOR_CACHE_ENV not in os.environ
    assert "cannot create" in caplog.text
