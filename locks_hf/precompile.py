"""Compile a static cache's decode kernels while the prefill runs.

The first decode step of a static-layout cache launches the library's Triton kernels for the first time,
and they compile one after the other at their launch: 10.6 s at 128K on the Llama-3.1-8B shape (H200, cold
caches: scoring 5.0 s, the page update 3.3 s, selection 1.4 s, attention 0.8 s), after torch.compile's
own work. What they specialize on (dtypes, shapes, strides, the cache's capacity) is known as soon as the
first layer's buffers exist, at the start of the prefill. `DecodePrecompile` then runs that layer's decode
step in a background thread under `kernels.compile_only`: every launch compiles its kernel exactly as the
real launch would and runs nothing, so no buffer is written. Triton keeps what it compiled in memory and
in its cache, where the first real step finds it; its compiler releases Python's lock, so the prefill goes
on meanwhile (H200, 128K: the first `generate()` compiles for 30.9 s from empty caches against 42.8 s).

The thread is joined by the first decode-time launch that follows (`kernels.join_before_decode`), so it
runs on through whatever precedes that launch: the rest of the prefill, and at the first compiled step
torch.compile's own work (dynamo's trace, inductor), which a short prompt's prefill does not cover. That
launch is the first real one of the step, run eagerly (a first compiled call is uncaptured: the warm-up of
CUDA-graph trees, the eager steps of `captured_backend`), so in `generate()` the thread never allocates
while a CUDA graph is being captured (a step captured by hand needs one eager step after the prefill). A
compile that failed is logged there (the kernels then compile at their first launch, as without this). A
cache that re-allocates its buffers, forks or is copied waits for the thread first.
``LOCKS_HF_PRECOMPILE=0`` turns it off. The thread itself is `BackgroundCompile`, which
`locks_hf.gemv_projections` also runs for the projections' GEMV kernel.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .paged import PagedLayer

logger = logging.getLogger(__name__)

#: Set to ``0`` to compile the decode kernels at their first launch instead.
PRECOMPILE_ENV = "LOCKS_HF_PRECOMPILE"


def precompile_applies(layer: PagedLayer) -> bool:
    """Whether `DecodePrecompile` serves ``layer``: a CUDA layer decoding on the Triton kernels (bf16/fp16
    K/V), and ``LOCKS_HF_PRECOMPILE`` not ``0``."""
    from .backends import TRITON

    keys = layer.key_buffer()
    return os.environ.get(PRECOMPILE_ENV, "1") != "0" and layer.backend is TRITON and keys is not None and keys.is_cuda


class BackgroundCompile:
    """A background thread that runs ``compile_kernels`` (launches under `kernels.compile_only`); `wait` joins
    it, as does the next decode-time launch. ``owner`` and ``what`` name it in the warning of a compile that
    failed (the kernels then compile at their first launch)."""

    def __init__(self, compile_kernels: Callable[[], None], owner: str, what: str) -> None:
        from . import kernels

        self.error: BaseException | None = None
        self._owner, self._what = owner, what
        self._thread: threading.Thread | None = threading.Thread(
            target=self._run, args=(compile_kernels,), name="locks_hf-precompile", daemon=True
        )
        self._thread.start()
        kernels.join_before_decode(self.wait)

    def __getstate__(self) -> dict:
        self.wait()  # a copy (deepcopy, pickle) starts with its kernels compiled
        return {"_owner": self._owner, "_what": self._what}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.error, self._thread = None, None

    def _run(self, compile_kernels: Callable[[], None]) -> None:
        try:
            compile_kernels()
        except Exception as e:  # reported by `wait`, in the caller's thread
            self.error = e

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the kernels are compiled; log (once) a compile that failed."""
        if self._thread is not None:
            self._thread.join()
        if self.error is not None:
            logger.warning(
                "%s: compiling %s failed (%s: %s); they compile at their first launch instead",
                self._owner,
                self._what,
                type(self.error).__name__,
                self.error,
            )
            self.error = None


class DecodePrecompile(BackgroundCompile):
    """`BackgroundCompile` of the kernels of ``layer``'s decode step (queries of ``query_heads`` heads), its
    page update as launches for ``launch_sizes`` layers like it (`locks_hf.page_updates`) where given."""

    def __init__(self, layer: PagedLayer, query_heads: int, launch_sizes: tuple[int, ...] = ()) -> None:
        from .backends.triton import compile_decode_kernels

        super().__init__(
            lambda: compile_decode_kernels(layer, query_heads, launch_sizes),
            "LocksCache",
            "the decode kernels during the prefill",
        )
