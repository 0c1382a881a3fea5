"""JSON Lines files, plain (``.jsonl``) or gzip-compressed (``.jsonl.gz``).

Large generated files (raw predictions of a published run) are kept compressed; every reader takes
either form, and a plain path whose file is missing falls back to its ``.gz`` sibling.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator
from pathlib import Path


def resolve(path: str | os.PathLike) -> Path:
    """``path`` if it exists, else ``path.gz`` if that exists, else ``path`` (so the error names it)."""
    path = Path(path)
    if not path.exists() and path.suffix != ".gz":
        compressed = path.with_name(path.name + ".gz")
        if compressed.exists():
            return compressed
    return path


def read_text(path: str | os.PathLike) -> str:
    """The file's text, decompressed when it is gzip (by its ``.gz`` suffix)."""
    path = resolve(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return f.read()
    return path.read_text(encoding="utf-8")


def iter_jsonl(path: str | os.PathLike) -> Iterator[dict]:
    """One parsed object per non-blank line of a ``.jsonl`` or ``.jsonl.gz`` file."""
    for line in read_text(path).splitlines():
        if line.strip():
            yield json.loads(line)


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    return list(iter_jsonl(path))
