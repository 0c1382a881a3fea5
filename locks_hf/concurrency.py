"""One cache, one forward at a time: detect a second thread using a cache in the middle of a forward.

A cache's layers are written in place by every forward (buffers, lengths, summaries, a token policy's
state); two threads interleaving forwards through one cache corrupt it in ways that vary from run to
run. `UseGuard` marks the thread that is between the first and the last layer update of a forward
and refuses an update from any other thread meanwhile. Separate caches never conflict, so one model
may serve several threads, each with its own cache.
"""

from __future__ import annotations

import threading


class CacheInUseError(RuntimeError):
    """A cache was updated by a thread while another thread was in the middle of a forward through it."""


class UseGuard:
    """The thread in the middle of a forward through one cache (``None`` between forwards)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def __getstate__(self) -> dict:
        return {"thread": None}  # a copy (deepcopy, pickle) is a new cache: no forward is in flight through it

    def __setstate__(self, state: dict) -> None:
        self._lock = threading.Lock()
        self.thread = state["thread"]

    def enter(self, layer_idx: int, last_layer: int) -> None:
        """Called at every layer update: refuse if another live thread is mid-forward, else hold the
        cache until the update of ``last_layer`` (the forward's last)."""
        me = threading.current_thread()
        with self._lock:
            holder = self.thread
            if holder is not None and holder is not me and holder.is_alive():
                raise CacheInUseError(
                    f"this Locks cache is in use by thread {holder.name!r} (in the middle of a forward) and was "
                    f"updated from thread {me.name!r}: a cache holds one sequence batch and cannot serve two "
                    "threads at once. Give each thread its own cache (LocksCache(model.config, ...) or "
                    "cache.fork()); if that thread's forward failed, call cache.reset() before reusing the cache"
                )
            self.thread = None if layer_idx >= last_layer else me

    def release(self) -> None:
        with self._lock:
            self.thread = None
