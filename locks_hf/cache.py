"""`LocksCache`: a transformers `Cache` that keeps every K/V and per-page key summaries.

Full-attention layers become `LocksLayer`s; sliding-window, linear and other layers keep
transformers' own classes. Nothing is ever evicted: positions and masks stay those of full
attention, and selection happens in the attention function (`locks_hf.attention`), the first place
where the decode query exists.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer, get_layer_types_and_kwargs

from .config import LocksConfig
from .models_support import check_model_supported
from .selectors import PageSelector, make_selector

# `Cache.update` runs just before the model calls the attention function, which receives the K/V
# but not the cache. The layer that produced them is handed over through this thread-local slot and
# checked there (`take_handoff`) by identity of the key tensor.
_HANDOFF = threading.local()

# Extra slots reserved past the prompt so that decode appends without reallocating.
_MIN_HEADROOM = 256


def _summary_fields(config: LocksConfig) -> tuple:
    return (config.selector, config.page_size, config.rank, config.basis_bits,
            config.coef_bits, config.centroid_bits)


class LocksLayer(DynamicLayer):
    """One full-attention layer: K/V in preallocated buffers grown in chunks, plus page summaries.

    ``keys``/``values`` are views ``[b, h, T, d]`` into the buffers (no copy per decoded token).
    ``slot_valid [b, capacity]`` marks padding slots False; they enter no summary and no selection.
    ``summary`` holds the selector's per-page tensors ``[b, h, page_capacity, ...]`` for the first
    ``n_summarized`` (complete) pages.
    """

    def __init__(self, config: LocksConfig, selector: PageSelector | None = None) -> None:
        super().__init__()
        self.config = config
        self.selector = selector if selector is not None else make_selector(config)
        self._clear()

    def _clear(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self._kbuf = self._vbuf = self.slot_valid = None
        self.length = 0
        self.summary: dict[str, torch.Tensor] = {}
        self.n_summarized = 0
        self.last_selection: torch.Tensor | None = None  # [b, h, P] pages attended at the last step
        self.reset_stats()

    def reset_stats(self) -> None:
        self.attended = self.context = None  # running token counts over decode steps (tensors)

    def record_step(self, attended: torch.Tensor, context: torch.Tensor) -> None:
        """Add one decode step: tokens attended and real tokens cached, summed over rows and heads."""
        if self.attended is None:
            self.attended, self.context = attended.float(), context.float()
        else:
            self.attended, self.context = self.attended + attended, self.context + context

    # -- storage ---------------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty((b, h, 0, d))
        self._vbuf = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.slot_valid = torch.ones((b, 0), dtype=torch.bool, device=self.device)
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        B = self.config.page_size
        new_cap = max(needed + _MIN_HEADROOM, self.capacity + self.capacity // 4)
        new_cap = math.ceil(new_cap / B) * B
        T = self.length

        self._kbuf = self._resized(self._kbuf, 2, new_cap, T)
        self._vbuf = self._resized(self._vbuf, 2, new_cap, T)
        self.slot_valid = self._resized(self.slot_valid, 1, new_cap, T, fill=True)
        pages = new_cap // B
        self.summary = {n: self._resized(t, 2, pages, self.n_summarized) for n, t in self.summary.items()}

    @staticmethod
    def _resized(buf: torch.Tensor, dim: int, size: int, keep: int, fill=None) -> torch.Tensor:
        shape = list(buf.shape)
        shape[dim] = size
        out = buf.new_full(shape, fill) if fill is not None else buf.new_empty(shape)
        out.narrow(dim, 0, keep).copy_(buf.narrow(dim, 0, keep))
        return out

    def _refresh_views(self) -> None:
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if key_states.shape[0] != self._kbuf.shape[0]:
            raise ValueError(
                f"LocksCache holds batch size {self._kbuf.shape[0]} but got {key_states.shape[0]}: for "
                "beam search or num_return_sequences > 1 pass a fresh (empty) LocksCache"
            )
        T, t = self.length, key_states.shape[2]
        if T + t > self.capacity:
            self._grow(T + t)
        self._kbuf[:, :, T : T + t].copy_(key_states)
        self._vbuf[:, :, T : T + t].copy_(value_states)
        self.slot_valid[:, T : T + t] = True
        self.length = T + t
        self._refresh_views()
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    # -- padding and summaries ---------------------------------------------------------------------
    def mark_new_slots(self, valid: torch.Tensor) -> None:
        """Record which of the last ``valid.shape[1]`` written slots hold real tokens (``[b, t]``)."""
        t = valid.shape[1]
        self.slot_valid[:, self.length - t : self.length] = valid

    def paged(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Keys and values ``[b, h, P, B, d]`` and slot validity ``[b, 1, P, B]`` over ``P = ceil(T/B)``."""
        B = self.config.page_size
        P = math.ceil(self.length / B)
        keys = self._kbuf[:, :, : P * B].unflatten(2, (P, B))
        values = self._vbuf[:, :, : P * B].unflatten(2, (P, B))
        written = torch.arange(P * B, device=self.device) < self.length
        valid = (self.slot_valid[:, : P * B] & written).unflatten(1, (P, B)).unsqueeze(1)
        return keys, values, valid

    def summarize_completed(self) -> None:
        """Summarize every complete page not summarized yet, in one batched pass."""
        if self.selector is None:
            return
        B = self.config.page_size
        start, stop = self.n_summarized, self.length // B
        if stop <= start:
            return
        keys = self._kbuf[:, :, start * B : stop * B].unflatten(2, (stop - start, B))
        valid = self.slot_valid[:, start * B : stop * B].unflatten(1, (stop - start, B))
        new = self.selector.summarize(keys, valid.unsqueeze(1).expand(-1, keys.shape[1], -1, -1))
        if not self.summary:
            pages = self.capacity // B
            self.summary = {n: t.new_empty((*t.shape[:2], pages, *t.shape[3:])) for n, t in new.items()}
        for name, tensor in new.items():
            self.summary[name][:, :, start:stop] = tensor
        self.n_summarized = stop

    def summary_view(self) -> dict[str, torch.Tensor]:
        """The summaries of the complete pages, ``[b, h, n_summarized, ...]``."""
        return {n: t[:, :, : self.n_summarized] for n, t in self.summary.items()}

    def set_config(self, config: LocksConfig) -> None:
        """Switch selector settings; summaries are rebuilt (lazily) when their layout changes."""
        if _summary_fields(config) != _summary_fields(self.config):
            self.summary, self.n_summarized = {}, 0
        self.config = config
        self.selector = make_selector(config)

    # -- state hooks used by generate() -----------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim transform to every stored tensor (K/V, validity, summaries)."""
        if not self.is_initialized:
            return
        self._kbuf, self._vbuf, self.slot_valid = fn(self._kbuf), fn(self._vbuf), fn(self.slot_valid)
        self.summary = {n: fn(t) for n, t in self.summary.items()}
        self.last_selection = None
        self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices.to(t.device) if torch.is_tensor(indices) else indices])

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): pass a negative number of tokens to remove, as for DynamicCache"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self.length = max(self.length + tokens_to_remove, 0)
        # A page that lost its last slot is no longer complete: its summary is dropped, and it is
        # summarized again once decode completes it.
        self.n_summarized = min(self.n_summarized, self.length // self.config.page_size)
        self._refresh_views()

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        raise ValueError("LocksCache does not support offloading: create it with offloading=False")

    prefetch = offload


class LocksCache(DynamicCache):
    """A `DynamicCache` whose full-attention layers select pages for sparse decoding.

    Args:
        config: the model's config (its text config is used); full-attention layers become
            `LocksLayer`s, others keep transformers' layers. ``None``: every layer is a `LocksLayer`.
        locks: the method's settings; keyword overrides build one (``LocksCache(cfg, budget=256)``).

    Use with a model loaded with ``attn_implementation="locks"``.
    """

    def __init__(self, config: PretrainedConfig | None = None, locks: LocksConfig | None = None,
                 **overrides) -> None:
        locks = (locks or LocksConfig()).replace(**overrides) if overrides else (locks or LocksConfig())
        self.locks_config = locks
        if config is None:
            super().__init__()
            self.layer_class_to_replicate = lambda: LocksLayer(locks)
            return
        text_config = config.get_text_config(decoder=True)
        check_model_supported(text_config, locks)
        super().__init__(config=text_config)
        layer_types, _ = get_layer_types_and_kwargs(text_config)
        for i, layer_type in enumerate(layer_types):
            if layer_type == "full_attention":
                self.layers[i] = LocksLayer(locks)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        layer = self.layers[layer_idx]
        _HANDOFF.slot = (layer_idx, layer) if isinstance(layer, LocksLayer) else None
        return keys, values

    @property
    def locks_layers(self) -> list[LocksLayer]:
        return [layer for layer in self.layers if isinstance(layer, LocksLayer)]

    def fork(self, locks: LocksConfig | None = None) -> "LocksCache":
        """An independent copy (e.g. of a prefilled prompt) that decodes with other settings.

        The K/V are copied once; summaries are reused when their layout is unchanged and rebuilt in
        one batched pass at the next forward otherwise. The fork's statistics start at zero.
        """
        import copy

        clone = copy.copy(self)
        clone.layers = []
        for layer in self.layers:
            new = copy.copy(layer)
            if isinstance(layer, LocksLayer):
                new._apply(lambda t: t.clone())
            else:
                new = copy.deepcopy(layer)
            clone.layers.append(new)
        if locks is not None:
            clone.locks_config = locks
            for layer in clone.locks_layers:
                layer.set_config(locks)
        clone.reset_stats()
        return clone

    # -- statistics (tensors on the cache's device: reading them is the only sync) -----------------
    def reset_stats(self) -> None:
        for layer in self.locks_layers:
            layer.reset_stats()

    def attended_fraction(self) -> float:
        """Share of cached real tokens that decode steps attended, over all Locks layers (1.0 = dense)."""
        steps = [(l.attended, l.context) for l in self.locks_layers if l.attended is not None]
        if not steps:
            return float("nan")
        return float(sum(a for a, _ in steps) / sum(c for _, c in steps))


def take_handoff(layer_idx: int | None, key: torch.Tensor) -> LocksLayer | None:
    """The `LocksLayer` whose `update` produced ``key`` just now, if any (consumes the hand-off)."""
    slot = getattr(_HANDOFF, "slot", None)
    _HANDOFF.slot = None
    if slot is None or slot[0] != layer_idx or slot[1].keys is not key:
        return None
    return slot[1]
