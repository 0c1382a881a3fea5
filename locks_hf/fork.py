"""Copies of a cache's layers for `LocksCache.fork`: independent K/V, shared summaries where the
layout allows, and the conversion of a static-layout cache's layers to the dynamic layout."""

from __future__ import annotations

import copy

from transformers.cache_utils import StaticLayer

from .config import LocksConfig
from .dynamic_layer import LocksLayer
from .kv_cache import adopt_config, to_quantized
from .kv_quant import full_precision
from .layout import hf_copy, to_dynamic_layer
from .paged import PagedLayer
from .static_layer import LocksStaticLayer


def copied_layer(layer, locks: LocksConfig | None, width: int | None):
    """An independent copy of one cache layer, its Locks settings switched to ``locks`` if given
    (``width``: the page-list width of a static Locks layer's copy)."""
    if isinstance(layer, LocksLayer):
        new = layer.copy_sharing_summaries()
        return new if locks is None else adopt_config(new, locks)
    if isinstance(layer, LocksStaticLayer):
        return layer.fork(locks, width)
    if isinstance(layer, StaticLayer):
        return hf_copy(layer)
    return copy.deepcopy(layer)


def dynamic_copy(layer: PagedLayer, locks: LocksConfig, length: int) -> LocksLayer:
    """A dynamic layer holding the first ``length`` slots of ``layer`` (a static one), decoding with
    ``locks``: quantized KV is a full-precision copy quantized as `LocksCache.fork` does."""
    if layer.packed_kv() is not None:
        from .errors import LocksConfigError

        raise LocksConfigError(
            "this cache's K/V are stored quantized in the static layout, which cannot be converted to the "
            f"dynamic layout that {locks.label} needs: fork it with settings the static layout serves, or "
            "prefill a LocksCache(..., layout='dynamic') for them"
        )
    if locks.kv_bits != 16:
        return to_quantized(LocksLayer.from_paged(layer, full_precision(locks), length), locks)
    return LocksLayer.from_paged(layer, locks, length)


def dynamic_layers(layers: list, layer_kwargs: list[dict], locks: LocksConfig) -> list:
    """Dynamic copies of a static-layout cache's ``layers`` (Locks layers decoding with ``locks``)."""
    if not any(layer.is_initialized for layer in layers if isinstance(layer, StaticLayer)):
        return [copied_layer(layer, locks, None) for layer in layers]
    length = int(next(layer for layer in layers if isinstance(layer, PagedLayer)).length_tensor())  # one sync
    return [
        dynamic_copy(layer, locks, length)
        if isinstance(layer, PagedLayer)
        else to_dynamic_layer(layer, length, kw.get("sliding_window"))
        if isinstance(layer, StaticLayer)
        else copied_layer(layer, locks, None)
        for layer, kw in zip(layers, layer_kwargs)
    ]
