"""The harness's one reader of the JSON and JSON Lines files it is given, plain or gzip-compressed.

Large generated files (raw predictions of a published run) are kept compressed; every reader takes
either form, and a plain path whose file is missing falls back to its ``.gz`` sibling.

Tolerance policy (one for every file, so a damaged input is never read one way here and another there):

* A file the harness itself appends to line by line (``predictions/shard-*.jsonl``,
  ``fidelity_raw.jsonl``: ``appended=True``) may end in a line torn by a kill: its *last* line, not
  ended by a newline, that does not parse. That line is dropped with a warning (its work is redone
  on resume). Nothing else is tolerated.
* Anything else that does not parse -- a line in the middle, a line that ends with a newline, any
  line of a file written whole (records, results, data sets, prediction files from elsewhere), a
  truncated gzip, a row that is not a JSON object or lacks a required key -- raises `InputFileError`
  naming ``file:line`` and what to do.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import zlib
from pathlib import Path

logger = logging.getLogger(__name__)


class InputFileError(ValueError):
    """A file the harness reads is torn, empty or not in the form expected; the message names
    ``file[:line]`` and what to do about it."""


class InputPathMissing(FileNotFoundError):
    """A path the user named (an option, ``$LOCKS_HF_DATA``) does not exist; the message names it and
    what to do. Never replaced by another folder: results would silently come from other data."""


def resolve(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else ``path.gz`` if that exists, else ``path`` (so the error names it)."""
    path = Path(path)
    if not path.exists() and path.suffix != ".gz":
        compressed = path.with_name(path.name + ".gz")
        if compressed.exists():
            return compressed
    return path


def _read_bytes(path: Path, fix: str) -> bytes:
    if not path.exists():
        raise InputPathMissing(f"{path} does not exist: {fix}")
    if path.suffix != ".gz":
        return path.read_bytes()
    try:
        with gzip.open(path, "rb") as f:
            return f.read()
    except (OSError, EOFError, zlib.error) as err:  # BadGzipFile is an OSError; a cut stream is an EOFError
        raise InputFileError(f"{path}: not a complete gzip file ({err}): {fix}") from None


def read_text(path: str | os.PathLike, fix: str = "check the path") -> str:
    """The file's UTF-8 text, decompressed when it is gzip (by its ``.gz`` suffix)."""
    path = resolve(path)
    data = _read_bytes(path, fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise InputFileError(f"{path}:{line}: not UTF-8 text ({err.reason} at byte {err.start}): {fix}") from None


def read_json(path: str | os.PathLike, fix: str = "restore the file or use another folder"):
    """The JSON document in ``path``; a truncated or garbage file is an `InputFileError` naming its line."""
    path = resolve(path)
    text = read_text(path, fix)
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        what = "empty" if not text.strip() else f"not valid JSON ({err.msg}, column {err.colno})"
        raise InputFileError(f"{path}:{err.lineno}: {what}: {fix}") from None


def read_jsonl(
    path: str | os.PathLike,
    *,
    required: tuple[str, ...] = (),
    appended: bool = False,
    fix: str = "fix or remove that line",
) -> list[dict]:
    """The rows (JSON objects) of a ``.jsonl`` or ``.jsonl.gz`` file; blank lines are skipped.

    ``required``: keys every row must have. ``appended``: the harness appends to this file line by
    line, so a torn last line is dropped with a warning (see the module's policy); everything else
    that does not parse is an `InputFileError` ``file:line: ...: fix``.
    """
    path = resolve(path)
    data = _read_bytes(path, fix)
    lines = data.split(b"\n")
    rows = []
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
            problem = None
        except UnicodeDecodeError:
            problem = "not UTF-8 text"
        except json.JSONDecodeError as err:
            problem = f"not valid JSON ({err.msg}, column {err.colno})"
        if problem is not None:
            if appended and number == len(lines):  # the last line, with no newline after it
                logger.warning(
                    "%s:%d: dropped a line torn by an interrupted write (%s); its work is redone", path, number, problem
                )
                continue
            raise InputFileError(f"{path}:{number}: {problem}: {fix}")
        missing = [k for k in required if k not in row] if isinstance(row, dict) else list(required)
        if not isinstance(row, dict) or missing:
            what = f"a row without {missing}" if isinstance(row, dict) else f"a {type(row).__name__}, not an object"
            raise InputFileError(f"{path}:{number}: {what}: {fix}")
        rows.append(row)
    return rows


def end_last_line(path: Path) -> None:
    """Before appending to a file the harness appends to: end its last line if a kill left it without
    a newline -- cut it off when it is torn (`read_jsonl` dropped it: its work is redone), add the
    newline when it is a whole row (`read_jsonl` counted it done) -- so only the last line of such a
    file can ever be torn."""
    data = path.read_bytes() if path.exists() else b""
    if not data or data.endswith(b"\n"):
        return
    keep = data.rfind(b"\n") + 1
    try:
        json.loads(data[keep:].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        with open(path, "r+b") as f:
            f.truncate(keep)
        return
    with open(path, "ab") as f:
        f.write(b"\n")
