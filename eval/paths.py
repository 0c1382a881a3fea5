"""Where evaluation data lives: a folder the user names (``--data-dir``, else ``$LOCKS_HF_DATA``), or
the files shipped inside the package (complete task specs and word lists, small samples of the rest,
so that smoke runs and tests work without the data). Data sets the harness can download (LongBench,
InfiniteBench) come from the Hugging Face Hub through ``datasets`` when no folder holds them.

A folder the user names must exist: it is never replaced by another one, since the results would
then silently come from other data.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from .jsonl import InputPathMissing

logger = logging.getLogger(__name__)

# The packaged files, found without importing locks_hf (torch, transformers): installed, this is
# locks_hf/eval and they are in locks_hf/data; in a clone eval/ sits beside locks_hf/ (imported as
# locks_hf.eval through a link, which resolve() follows).
_EVAL = Path(__file__).resolve().parent
PACKAGE_DATA = _EVAL.parent / "data" if _EVAL.parent.name == "locks_hf" else _EVAL.parent / "locks_hf" / "data"

#: What a data folder holds (the error for a missing one says so).
LAYOUT = "ruler/, longbench/, infinitebench/, math/, haystack/"

_WARNED: set[tuple[str, str]] = set()


def _package_data_dir() -> Path:
    return PACKAGE_DATA


def existing_path(path: str | os.PathLike, option: str, what: str = "folder") -> Path:
    """``path`` (named by ``option``), which must exist: else `InputPathMissing` naming both."""
    path = Path(path)
    if not path.exists():
        raise InputPathMissing(f"{option} {path}: no such {what}; check the path (it is never replaced by another one)")
    return path


def shared_data_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The evaluation data folder the user named (layout: ``ruler/``, ``longbench/``, ...), or ``None``.

    Order: ``explicit`` (``--data-dir``); ``$LOCKS_HF_DATA`` (``none``: use only the packaged samples).
    A named folder that does not exist is an `InputPathMissing` error, never a fall-through.
    """
    if explicit:
        if not Path(explicit).is_dir():
            raise InputPathMissing(
                f"--data-dir {explicit}: no such folder; name the folder that holds {LAYOUT} "
                "(or leave --data-dir out: $LOCKS_HF_DATA, the HF Hub, the packaged samples)"
            )
        return Path(explicit)
    env = os.environ.get("LOCKS_HF_DATA", "")
    if not env or env.lower() == "none":
        return None
    if not Path(env).is_dir():
        raise InputPathMissing(
            f"$LOCKS_HF_DATA={env}: no such folder; set it to the folder that holds {LAYOUT}, "
            "to 'none' for the packaged samples, or unset it"
        )
    return Path(env)


def data_file(relative: str, sample: str | None = None, data_dir: str | os.PathLike | None = None) -> Path:
    """``relative`` inside the data folder, else the packaged ``sample`` file (with a warning when the
    package holds only a sample of it: a file of another name)."""
    root = shared_data_dir(data_dir)
    if root is not None and (root / relative).exists():
        return root / relative
    if sample is not None:
        p = _package_data_dir() / sample
        if p.exists():
            # same name: a complete copy (a task spec, a word list); once per file, it is looked up often
            if p.name != Path(relative).name and (relative, str(root)) not in _WARNED:
                _WARNED.add((relative, str(root)))
                logger.warning(
                    "%s: the packaged sample %s stands in (%s)",
                    relative,
                    p.name,
                    f"not in {root}" if root else "no data folder: --data-dir or $LOCKS_HF_DATA",
                )
            return p
    raise FileNotFoundError(
        f"{relative} not found (looked in {root or 'no data folder: set --data-dir or $LOCKS_HF_DATA'})"
        + (f" and no packaged sample {sample}" if sample else "")
    )


def package_data(name: str) -> Path:
    return _package_data_dir() / name
