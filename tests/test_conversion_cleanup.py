"""A conversion killed before its cleanup ran (kill -9) leaves work folders; the next load removes them,
and never those of a conversion still running."""

import json
import os
import socket
import subprocess
import sys
import time

from locks_hf import models


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_work_folders_are_removed_on_the_next_load(tmp_path):
    name = "smollm2-135m"
    target = tmp_path / name
    target.mkdir()
    (target / models._MARKER).write_text(json.dumps({"format": models.CACHE_FORMAT}))  # a valid cache
    host, dead = socket.gethostname(), _dead_pid()
    stale = [tmp_path / f".{name}.tmp-{host}@{dead}-x1y2", tmp_path / f".{name}.old-{host}@{dead}"]
    legacy = tmp_path / f".{name}.tmp-abc123"  # no owner recorded: removed once old
    live = [
        tmp_path / f".{name}.tmp-{host}@{os.getpid()}-k9",
        tmp_path / f".{name}.tmp-otherhost@{dead}-k9",
        tmp_path / f".{name}.tmp-fresh1",
    ]
    for folder in [*stale, legacy, *live]:
        (folder / "gguf").mkdir(parents=True)
    day_ago = time.time() - 2 * 24 * 3600
    os.utime(legacy, (day_ago, day_ago))
    assert models.convert(name, cache_dir=tmp_path) == target
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name] + [p.name for p in live])
