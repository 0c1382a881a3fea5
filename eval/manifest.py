"""The run manifest: what a sweep's numbers depend on beyond its arguments (library, git commit,
transformers / torch versions, data file hashes, seeds), written once into ``<run>/manifest.json``.

Resuming a run (or adding a shard to it) under another manifest would mix results of two setups in
one table, so it is refused unless the caller allows it; an allowed change is kept in the file's
``history``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import subprocess
from pathlib import Path

from .jsonl import read_json

logger = logging.getLogger(__name__)

#: Manifest keys whose change makes a resumed run inconsistent.
COMPARED = ("locks_hf", "git_commit", "transformers", "torch", "seeds", "data_files")


class ManifestMismatch(ValueError):
    """A run folder holds results of another setup than the one resuming it."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def git_commit(folder: Path) -> str | None:
    """HEAD of the git checkout holding ``folder``, or ``None`` (an installed package, or no git)."""
    try:
        out = subprocess.run(
            ["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and commit else None


def build_manifest(data_files: dict[str, Path], seeds: dict) -> dict:
    """The manifest of this process: versions, commit, ``{role: sha256}`` of ``data_files``, ``seeds``."""
    import torch
    import transformers

    import locks_hf

    return {
        "locks_hf": getattr(locks_hf, "__version__", "?"),
        "git_commit": git_commit(Path(locks_hf.__file__).resolve().parent),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seeds": seeds,
        "data_files": {role: f"{Path(path).name}:{sha256_of(Path(path))}" for role, path in sorted(data_files.items())},
    }


def differences(old: dict, new: dict) -> list[str]:
    return [f"{key}: {old.get(key)!r} -> {new.get(key)!r}" for key in COMPARED if old.get(key) != new.get(key)]


def check_or_write(run_dir: Path, manifest: dict, *, allow_change: bool = False, write=None) -> None:
    """Write ``manifest`` into a new run folder; in an existing one, refuse (`ManifestMismatch`) when
    it differs from the recorded manifest, unless ``allow_change`` (then record the change).

    ``write(path, text)`` writes a file atomically (the runner's).
    """
    path = Path(run_dir) / "manifest.json"
    if not path.exists():
        write(path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        return
    old = read_json(
        path,
        fix="the run folder's manifest is damaged: use another --out folder, or delete "
        "manifest.json to record the current setup afresh (resuming is then not checked against the old one)",
    )
    changed = differences(old, manifest)
    if not changed:
        return
    if not allow_change:
        raise ManifestMismatch(
            f"{run_dir} holds results of another setup ({'; '.join(changed)}): resuming would mix them. Use "
            "another --out folder, or --allow-manifest-change to resume anyway (the change is recorded)"
        )
    logger.warning("resuming %s under a changed setup: %s", run_dir, "; ".join(changed))
    history = old.pop("history", [])
    write(path, json.dumps({**manifest, "history": history + [old]}, indent=1, sort_keys=True) + "\n")
