"""Where evaluation data lives: a user-given folder, ``$LOCKS_HF_DATA``, ``../shared/data``, or the samples
shipped inside the package (small, so tests run without the full data)."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DATA = Path(__file__).resolve().parent.parent / "locks_hf" / "data"


def _package_data_dir() -> Path:
    try:  # installed (non-editable) layout: locks_hf/data next to locks_hf/eval
        import locks_hf

        return Path(locks_hf.__file__).resolve().parent / "data"
    except Exception:  # pragma: no cover
        return PACKAGE_DATA


def shared_data_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The full evaluation data folder (the layout of ``shared/data``), or ``None`` when absent.

    Order: ``explicit``; ``$LOCKS_HF_DATA`` (``none``: use only the packaged samples); ``../shared/data`` beside the repository; ``./shared/data``
    and ``../shared/data`` from the working directory.
    """
    candidates = []
    if explicit:
        candidates.append(Path(explicit))
    elif os.environ.get("LOCKS_HF_DATA", "").lower() == "none":  # packaged samples only
        return None
    if os.environ.get("LOCKS_HF_DATA"):
        candidates.append(Path(os.environ["LOCKS_HF_DATA"]))
    repo = Path(__file__).resolve().parent.parent
    candidates += [repo.parent / "shared" / "data", Path.cwd() / "shared" / "data", Path.cwd().parent / "shared" / "data"]
    for c in candidates:
        if c.is_dir():
            return c
    if explicit:
        raise FileNotFoundError(f"data folder {explicit} does not exist")
    return None


def data_file(relative: str, sample: str | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """``relative`` inside the full data folder, else the packaged ``sample`` file."""
    root = shared_data_dir(data_dir)
    if root is not None and (root / relative).exists():
        return root / relative
    if sample is not None:
        p = _package_data_dir() / sample
        if p.exists():
            return p
    raise FileNotFoundError(
        f"{relative} not found (looked in {root or 'no data folder: set --data-dir or $LOCKS_HF_DATA'})"
        + (f" and no packaged sample {sample}" if sample else "")
    )


def package_data(name: str) -> Path:
    return _package_data_dir() / name
