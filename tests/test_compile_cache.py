"""The compiled decode step's inductor cache: persistent by default, the user's folder when named."""

from __future__ import annotations

import logging
import os

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
