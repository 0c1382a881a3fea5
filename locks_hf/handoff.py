"""The hand-off from `Cache.update` to the attention function.

`Cache.update` runs just before the model calls the attention function, which receives the K/V but not
the cache. The layer that produced them is handed over through a thread-local slot and checked there
(`take_handoff`) by identity of the key tensor. A slot still set at the next update means the model's
attention is not "locks" (it never took the hand-off).
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from .errors import UnsupportedModelError
from .paged import PagedLayer


class _Handoff(threading.local):
    def __init__(self) -> None:
        # Runs in every thread on first use: the attribute always exists, so a compiled graph's
        # guard on it does not flip (and recompile) the first time a cache sets it.
        self.slot: tuple[int, Any, int] | None = None


_HANDOFF = _Handoff()


def hand_over(layer_idx: int, layer, query_len: int) -> None:
    """Leave ``layer`` (just updated with ``query_len`` tokens) for the attention function."""
    _HANDOFF.slot = (layer_idx, layer, query_len)


def take_handoff(layer_idx: int | None, key: torch.Tensor, sliding_window: int | None = None) -> PagedLayer | None:
    """The Locks layer whose `update` produced ``key`` just now, if any (consumes the hand-off).

    ``None`` when no Locks cache was updated (another cache, or none) or the layer is one of its
    non-Locks layers. Raises `UnsupportedModelError` when the keys reaching attention are not the ones
    the Locks layer just stored (a model that transforms them after the cache, such as MLA), or when
    the cache's layer kinds do not match the model's.
    """
    slot = _HANDOFF.slot
    _HANDOFF.slot = None
    if slot is None:
        return None
    idx, layer, _ = slot
    if idx != layer_idx or (isinstance(layer, PagedLayer) and layer.keys is not key):
        raise UnsupportedModelError(
            f"attention of layer {layer_idx} did not receive the keys the Locks cache stored for layer {idx}: "
            "this model changes keys after the cache (e.g. multi-head latent attention) or shares caches "
            "between layers, which Locks cannot select pages for; use attn_implementation='sdpa' and a DynamicCache"
        )
    if not isinstance(layer, PagedLayer):
        if getattr(layer, "is_sliding", False) and sliding_window is None:
            raise UnsupportedModelError(
                f"layer {layer_idx} of the Locks cache is a sliding-window layer but the model's layer "
                f"{layer_idx} is full attention: build the cache from this model's config, LocksCache(model.config)"
            )
        return None
    return layer


def check_handoff_taken() -> None:
    """Raise when the previous decode step's hand-off was never taken: the model's attention function
    is not Locks' (it was loaded with "sdpa" / "eager"), so every step would silently run dense."""
    slot = _HANDOFF.slot
    _HANDOFF.slot = None
    if slot is not None and slot[2] == 1:
        raise UnsupportedModelError(
            "the model did not call Locks' attention function on a decode step: load it with "
            "attn_implementation='locks' (after `import locks_hf`); with 'sdpa' or 'eager' a Locks cache "
            "would decode densely"
        )
