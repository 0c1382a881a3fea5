"""Where a `LocksCache` keeps its state: the static layout (compiled decode) or the dynamic one.

On a machine with a CUDA device and the Triton kernels, `LocksCache` stores its full-attention layers
as `LocksStaticLayer`s and its other layers as transformers' static layers: buffers of a fixed
capacity, every per-step quantity a device tensor, so that ``generate()`` compiles the decode step
(torch.compile + CUDA graphs). Elsewhere it keeps the dynamic layers (the PyTorch reference path).

The static buffers' capacity is ``max_cache_len`` when given, else the first forward's length plus
headroom, grown geometrically when a forward would overflow it. Growth is decided on the host,
without reading the device: `CapacityPlan` counts the tokens written by eager forwards exactly and,
for compiled forwards, the tokens announced by the eager mask-size hook that runs before each of them
(`Cache.get_mask_sizes`, called by ``generate``'s input preparation and by the model's mask
creation). A growth re-allocates every layer once (eager) and costs the compiled step one recompile.
"""

from __future__ import annotations

import copy
import logging
import math

import torch
from transformers.cache_utils import (
    STATIC_LAYER_TYPE_MAPPING,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)

from .backends import KERNELS_ENV, kernels_available, kernels_enabled
from .buffers import mark_static, resized
from .config import LocksConfig
from .selectors import static_selector_names
from .static_kv_layer import static_refusal  # (also registers the quantized static layer)
from .static_layer import LocksStaticLayer

logger = logging.getLogger(__name__)

#: ``layout=`` values of `LocksCache`.
LAYOUTS = ("auto", "static", "dynamic")
#: Transformers layer classes the static layout can re-allocate (grow, fork, select rows).
_RESIZABLE = (StaticLayer, StaticSlidingWindowLayer)
#: Fewest slots of headroom past the first forward when no ``max_cache_len`` is given.
MIN_HEADROOM = 1024


def config_refusal(locks: LocksConfig, layer_types: list[str] | None) -> str | None:
    """Why ``locks`` (on a model with ``layer_types``) cannot use the static layout; ``None`` if it can."""
    if layer_types is None:
        return "no model config was given (its layer types decide the static layers)"
    if locks.selector not in static_selector_names():
        return (
            f"selector {locks.selector!r} keeps state beyond its pages (static layout supports "
            f"{', '.join(static_selector_names())})"
        )
    quantized = static_refusal(locks)
    if quantized:
        return quantized
    if locks.min_context:
        return (
            f"min_context={locks.min_context}: a static graph cannot switch between dense and sparse "
            "decode on the length (use min_context=0)"
        )
    other = sorted(
        {kind for kind in layer_types if kind not in ("full_attention", "sliding_attention", "chunked_attention")}
    )
    if other:
        return f"layer types {other} have no re-allocatable static layer"
    return None


def device_refusal() -> str | None:
    """Why this machine cannot run the compiled decode (``None`` if it can): no CUDA device, no
    Triton, or the kernels switched off with ``LOCKS_HF_KERNELS=0``."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if not kernels_enabled():
        return f"{KERNELS_ENV}=0"
    return None if kernels_available() else "Triton (locks_hf.kernels) cannot be imported"


def choose_layout(layout: str, locks: LocksConfig, layer_types: list[str] | None) -> bool:
    """True for the static layout. ``"auto"`` picks it when the machine runs the compiled decode and
    the configuration allows it, and logs why not when only the configuration stands in the way;
    ``"static"`` insists (a `LocksConfigError` says why it cannot); ``"dynamic"`` never."""
    from .errors import LocksConfigError

    if layout not in LAYOUTS:
        raise LocksConfigError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "dynamic":
        return False
    refusal = config_refusal(locks, layer_types)
    if layout == "static":
        if refusal:
            raise LocksConfigError(
                f"the static layout cannot serve this configuration: {refusal}; "
                "use layout='dynamic' (or the default 'auto')"
            )
        return True
    if device_refusal() is not None:
        return False
    if refusal:
        logger.warning("LocksCache: %s; decoding with the dynamic layout (eager, no compiled decode)", refusal)
        return False
    return True


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class CapacityPlan:
    """The static buffers' capacity and, on the host, an upper bound of the tokens written.

    Eager forwards are counted exactly at their first layer's update. A compiled forward cannot count
    on the host, so it leaves a mark (``compiled_ran``, a constant stored from the graph: no guard,
    no recompile) and is counted, with the tokens announced for it, at the next host hook. The
    announcements come from the mask-size hook, which may run twice for one forward (generate's input
    preparation and the model's mask creation): they are merged, not added. The one forward this
    cannot see is a compiled one that nothing announced (a model compiled by hand and given a ready
    4D mask): create the cache with ``max_cache_len`` then.
    """

    def __init__(self, max_cache_len: int | None, page_size: int, growable: bool) -> None:
        self.page_size = page_size
        self.growable = growable
        self.capacity: int | None = None if max_cache_len is None else round_up(max_cache_len, page_size)
        self.limit = max_cache_len  # tokens the user asked for: the page rounding is storage, not capacity
        self.written = 0  # tokens written, counted on the host (exact after an eager forward)
        self.announced = 0  # tokens of the forward about to run
        self.compiled_ran = False  # set from inside a compiled forward

    def first_capacity(self, tokens: int) -> int:
        """The capacity to allocate for a first forward of ``tokens``."""
        if self.capacity is None:
            self.capacity = round_up(tokens + max(MIN_HEADROOM, tokens // 32), 256)
        return self.capacity

    def settle(self) -> None:
        """Count a compiled forward that ran since the last host hook."""
        if self.compiled_ran:
            self.written += self.announced
            self.announced, self.compiled_ran = 0, False

    def announce(self, tokens: int) -> int | None:
        """A forward of ``tokens`` is about to run: the new capacity it needs, or ``None``."""
        self.settle()
        self.announced = max(self.announced, tokens)
        return self._needed(self.written + self.announced)

    def eager_write(self, tokens: int) -> int | None:
        """An eager forward writes ``tokens`` now: the new capacity it needs, or ``None``."""
        self.settle()
        self.announced = 0  # the forward announced (if any) is this one
        need = self._needed(self.written + tokens)
        self.written += tokens
        return need

    def _needed(self, total: int) -> int | None:
        capacity = self.capacity
        assert capacity is not None  # allocated (`first_capacity`) before any write is planned
        if not self.growable and total > (self.limit or capacity):
            raise ValueError(
                f"the cache was created with max_cache_len={self.limit or capacity} tokens but {total} would be "
                "written: create it with max_cache_len >= prompt length + max_new_tokens"
            )
        if total <= capacity:
            return None
        # Geometric (each growth recompiles the decode step): doubling up to 64K slots, then +25% so
        # that a long cache does not hold twice its size during the copy.
        grown = capacity * 2 if capacity < 1 << 16 else capacity * 5 // 4
        return round_up(max(grown, total + MIN_HEADROOM), 256)


# -- transformers' static layers: re-allocation --------------------------------------------------------------
def build_static_layers(
    layer_types: list[str], layer_kwargs: list[dict], locks: LocksConfig, capacity: int, max_slots: int | None = None
) -> list:
    """The static layers of a model: `LocksStaticLayer` for full attention, transformers' otherwise."""
    return [
        LocksStaticLayer(capacity, locks, max_slots=max_slots)
        if kind == "full_attention"
        else STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=capacity, **kw)
        for kind, kw in zip(layer_types, layer_kwargs)
    ]


def reallocate_hf_layer(
    layer: StaticLayer, capacity: int | None = None, rows: torch.Tensor | None = None, window: int | None = None
) -> None:
    """New buffers for one of transformers' static layers: ``capacity`` slots (a sliding layer keeps
    ``min(window, capacity)``) and/or the batch rows ``rows``; fresh tensors even when neither changes."""
    if not isinstance(layer, _RESIZABLE):
        raise ValueError(f"LocksCache cannot re-allocate a {type(layer).__name__}: create it with max_cache_len")
    size = layer.max_cache_len if capacity is None else (min(window, capacity) if window else capacity)
    if isinstance(layer, StaticSlidingWindowLayer) and size < layer.max_cache_len:
        raise ValueError("a sliding-window layer cannot shrink")
    layer.max_cache_len = size
    if not layer.is_initialized:
        return
    pick = (lambda t: t.index_select(0, rows.to(t.device))) if rows is not None else (lambda t: t)
    layer.keys = resized(pick(layer.keys), 2, size)
    layer.values = resized(pick(layer.values), 2, size)
    layer.batch_size = layer.keys.shape[0]
    layer.cumulative_length = layer.cumulative_length.clone()
    mark_static(layer.keys, layer.values, layer.cumulative_length)


def crop_hf_layer(layer: StaticLayer, tokens: int) -> None:
    """Drop the last ``tokens`` written slots of one of transformers' static layers."""
    if isinstance(layer, StaticSlidingWindowLayer):
        if layer.cumulative_length_int > layer.max_cache_len:
            raise ValueError("cannot crop a sliding-window layer that has already dropped tokens from its window")
        layer.cumulative_length_int -= tokens
    layer.cumulative_length.sub_(tokens)


def to_dynamic_layer(layer: StaticLayer, length: int, window: int | None = None):
    """A transformers dynamic layer holding what the static ``layer`` holds after ``length`` tokens
    (``window``: the sliding window of a sliding layer)."""
    held = min(length, layer.max_cache_len)  # a sliding layer past its window keeps the last ones, in order
    new = DynamicSlidingWindowLayer(sliding_window=window) if window else DynamicLayer()
    if not layer.is_initialized:
        return new
    assert layer.keys is not None and layer.values is not None  # an initialized layer holds both
    new.lazy_initialization(layer.keys, layer.values)
    keep = slice(max(held - window + 1, 0) if window else 0, held)
    new.keys, new.values = layer.keys[:, :, keep].clone(), layer.values[:, :, keep].clone()
    if window:
        new.cumulative_length = length
    return new


def hf_copy(layer):
    """An independent copy of one of transformers' static layers (fresh buffers, same contents)."""
    new = copy.copy(layer)
    reallocate_hf_layer(new)
    return new


def page_slots_width(locks: LocksConfig, max_budget: int | None) -> int:
    """Page slots of the widest budget a static layer serves (``k`` of ``max_budget``, at least the
    config's own)."""
    widest = locks.budget if max_budget is None else max(max_budget, locks.budget)
    return math.ceil(widest / locks.page_size)
