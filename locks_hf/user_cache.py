"""The folder where the library keeps what it makes for the user: converted models, compiled steps."""

from __future__ import annotations

import os
from pathlib import Path

#: names a folder other than ``~/.cache/locks_hf``.
CACHE_ENV = "LOCKS_HF_CACHE"


def cache_root() -> Path:
    """``$LOCKS_HF_CACHE`` or ``~/.cache/locks_hf``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "locks_hf"
