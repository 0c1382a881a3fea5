"""`LocksCache`: a transformers `Cache` that keeps every K/V and per-page key summaries.

Full-attention layers become `LocksLayer`s; sliding-window, linear and other layers keep
transformers' own classes. Nothing is ever evicted: positions and masks stay those of full
attention, and selection happens in the attention function (`locks_hf.attention`), the first place
where the decode query exists.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, DynamicLayer, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from . import arguments
from .backend import build_summary as compute_summary  # noqa: F401  (the former name here)
from .compat import find_first_full_attention_index, get_layer_types_and_kwargs
from .concurrency import UseGuard
from .config import LocksConfig, LocksConfigError
from .kv_quant import check_same_kv, full_precision
from .layout import (
    CapacityPlan,
    build_static_layers,
    choose_layout,
    config_refusal,
    crop_hf_layer,
    hf_copy,
    page_slots_width,
    reallocate_hf_layer,
    to_dynamic_layer,
)
from .models_support import (
    REFUSED_GENERATION,
    UnsupportedModelError,
    cache_model_mismatch,
    check_head_dim,
    check_model_supported,
    head_dim_of,
)
from .paged import PagedLayer, pages_to_mask, slot_validity
from .selectors import PageSelector, make_selector

logger = logging.getLogger(__name__)

#: Prompt queries kept per layer (the last ones of the multi-token forwards) for policies that score
#: the prompt with an observation window (RocketKV's SnapKV stage uses 32).
PROMPT_QUERY_WINDOW = 32

# `Cache.update` runs just before the model calls the attention function, which receives the K/V
# but not the cache. The layer that produced them is handed over through this thread-local slot and
# checked there (`take_handoff`) by identity of the key tensor. A slot still set at the next update
# means the model's attention is not "locks" (it never took the hand-off).
class _Handoff(threading.local):
    def __init__(self) -> None:
        # Runs in every thread on first use: the attribute always exists, so a compiled graph's
        # guard on it does not flip (and recompile) the first time a cache sets it.
        self.slot = None


_HANDOFF = _Handoff()

_EMPTY_INPUT = ("the input has no tokens (input_ids of shape [batch, 0]): a Locks cache needs at least one token per "
                "forward; pass a non-empty prompt (e.g. start it with the tokenizer's BOS token)")

# Extra slots reserved past the prompt so that decode appends without reallocating.
_MIN_HEADROOM = 256


class LocksLayer(DynamicLayer, PagedLayer):
    """One full-attention layer: K/V in preallocated buffers grown in chunks, plus page summaries.

    ``keys``/``values`` are views ``[b, h, T, d]`` into the buffers (no copy per decoded token).
    ``slot_valid [b, capacity]`` marks padding slots False; they enter no summary and no selection.

    Pages are laid out per row from the row's first real token (``row_start``): page ``j`` of row
    ``b`` holds slots ``row_start[b] + j*B ...``. A left-padded row is thus paged exactly as if it
    ran alone. ``summary`` holds the selector's per-page tensors ``[b, h, page_capacity, ...]``,
    valid for the first ``n_summarized[b]`` (complete) pages of each row.
    """

    def __new__(cls, config: LocksConfig | None = None, *args, **kwargs):
        # Quantized KV settings make the layer the one that stores them (`locks_hf.kv_cache`), so that
        # every place that builds a layer from a config honours kv_bits.
        if cls is LocksLayer and config is not None and config.kv_bits != 16:
            from .kv_cache import QuantizedLocksLayer

            cls = QuantizedLocksLayer
        return super().__new__(cls)

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
        self.row_start: list[int] = []
        self.n_summarized: list[int] = []
        self.summary: dict[str, torch.Tensor] = {}
        # True while `summary`'s tensors are shared with a fork (or the cache forked from): copied before
        # the first in-place write, so that a fork costs no summary copy until it summarizes a page.
        self._summary_shared = False
        self.shared: dict[str, torch.Tensor] = {}  # sequence-level selector state [b, h, ...]
        self._last_pages: tuple[torch.Tensor, int] | None = None  # page lists of the last step, P
        self.prompt_queries: torch.Tensor | None = None  # [b, Hq, <=PROMPT_QUERY_WINDOW, d]
        self.policy_state = None  # a token-level policy's `PolicyState`, built at the first decode step
        self.expected_new_tokens = 0  # decode length announced by `LocksCache.expect_new_tokens`
        self.text_config = None  # the model's text config, set by `LocksCache` (rotary frequencies)
        self.prefill_scores: dict[str, torch.Tensor] = {}  # per-token scores computed once per prompt (KVzip)
        self.score_request = None  # collects scores from the queries of multi-token forwards (KVzip)
        self.reset_stats()

    def reset_stats(self) -> None:
        self.counts = None  # int64 [2]: tokens attended, real tokens cached, summed over decode steps
        self.decode_steps = 0  # decode steps recorded since the last reset
        self.estimate_bytes = 0  # bytes read to choose what to attend, summed over steps, rows, heads

    def record_step(self, attended: torch.Tensor | None, context: torch.Tensor) -> None:
        super().record_step(attended, context)
        self.decode_steps += 1

    def record_estimate(self, nbytes: int) -> None:
        """Add the bytes one decode step read to choose its tokens (summed over rows and KV heads)."""
        self.estimate_bytes += int(nbytes)

    def selection_read_bytes(self) -> int:
        """Bytes a page selector reads per decode step to score pages, over rows and KV heads: the
        summaries of the scored pages and any sequence-level state, plus the keys of a re-ranked short
        list (the oracle reads every key)."""
        if self.selector is None:
            return 0
        if self.selector.reads_keys:  # every written slot's key (no host sync for the padding count)
            return self.key_read_bytes(self.length, every=True)
        shortlist = self.selector.candidate_key_pages(max(self.n_summarized, default=0))
        return (sum(t.numel() * t.element_size() for t in self.summary_view().values())
                + self.key_read_bytes(shortlist * self.config.page_size))

    def key_read_bytes(self, tokens: int, every: bool = False) -> int:
        """Bytes of ``tokens`` stored keys per row and KV head, summed over rows and heads (``every``:
        the ``tokens`` are every written slot)."""
        b, h, _, d = self._kbuf.shape
        return tokens * b * h * d * self._kbuf.element_size()

    def record_selection_traffic(self) -> None:
        self.record_estimate(self.selection_read_bytes())

    def observe_prompt_queries(self, query: torch.Tensor, scale: float) -> None:
        """Keep the last `PROMPT_QUERY_WINDOW` queries ``[b, Hq, t, d]`` of multi-token forwards (and
        hand them to a pending score request)."""
        held = query if self.prompt_queries is None else torch.cat([self.prompt_queries, query], dim=2)
        self.prompt_queries = held[:, :, -PROMPT_QUERY_WINDOW:].detach()
        if self.score_request is not None:
            self.score_request.update(query, self.keys, scale)

    def count_buffer(self) -> torch.Tensor:
        """The running ``(attended, cached)`` token counts, ``int64 [2]`` on the layer's device (the
        kernels add to it in place)."""
        if self.counts is None:
            self.counts = torch.zeros(2, dtype=torch.int64, device=self.device)
        return self.counts

    def note_selection(self, pages: torch.Tensor) -> None:
        """Remember the pages a decode step attended: ``[b, h, W]`` page numbers, ``< 0`` = none."""
        self._last_pages = (pages, self.num_pages)

    @property
    def last_selection(self) -> torch.Tensor | None:
        """``[b, h, P]`` bool: the pages the last decode step attended (``None`` before one)."""
        return None if self._last_pages is None else pages_to_mask(*self._last_pages)

    # -- storage ---------------------------------------------------------------------------------
    def kv_buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self._kbuf, self._vbuf

    @property
    def capacity(self) -> int:
        return 0 if self._kbuf is None else self._kbuf.shape[2]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_head_dim(self.config, key_states.shape[-1])  # a cache built without a model config
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self._kbuf = key_states.new_empty((b, h, 0, d))
        self._vbuf = value_states.new_empty((b, h, 0, value_states.shape[-1]))
        self.slot_valid = torch.ones((b, 0), dtype=torch.bool, device=self.device)
        self.row_start, self.n_summarized = [0] * b, [0] * b
        self.is_initialized = True

    def _grow(self, needed: int) -> None:
        B = self.config.page_size
        new_cap = max(needed + _MIN_HEADROOM, self.capacity + self.capacity // 4)
        new_cap = math.ceil(new_cap / B) * B
        T = self.length
        self._resize_kv(new_cap, T)
        self.slot_valid = _resized(self.slot_valid, 1, new_cap, T, fill=True)
        kept = max(self.n_summarized, default=0)
        self.summary = {n: _resized(t, 2, new_cap // B + 1, kept) for n, t in self.summary.items()}
        self._summary_shared = False  # new tensors of its own

    def _resize_kv(self, capacity: int, length: int) -> None:
        """Re-allocate the K/V storage to ``capacity`` slots, keeping the first ``length``."""
        self._kbuf = _resized(self._kbuf, 2, capacity, length)
        self._vbuf = _resized(self._vbuf, 2, capacity, length)

    def _check_batch(self, key_states: torch.Tensor) -> None:
        if key_states.shape[0] != self.slot_valid.shape[0]:
            raise ValueError(
                f"LocksCache holds batch size {self.slot_valid.shape[0]} but got {key_states.shape[0]}: for "
                "beam search or num_return_sequences > 1 pass a fresh (empty) LocksCache"
            )

    def _refresh_views(self) -> None:
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_batch(key_states)
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

    # -- padding and pages -------------------------------------------------------------------------
    def mark_new_slots(self, valid: torch.Tensor) -> None:
        """Record which of the last ``valid.shape[1]`` written slots hold real tokens (``[b, t]``).

        Called for multi-token forwards (prefill); decode tokens are real by construction.
        """
        t = valid.shape[1]
        self.slot_valid[:, self.length - t : self.length] = valid
        T = self.length
        slots = torch.arange(T, device=self.device)
        starts = torch.where(self.slot_valid[:, :T], slots, T).amin(-1).tolist()
        for row, start in enumerate(starts):
            if start != self.row_start[row]:  # the row's page grid moved: its summaries are stale
                self.row_start[row], self.n_summarized[row] = start, 0

    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_start`` and ``n_summarized`` (complete pages) per row, int32 ``[b]`` on the device.

        Re-sent (from pinned memory, without blocking) only when the lists change, so a decode step
        makes no host-to-device copy of its own.
        """
        key = (tuple(self.row_start), tuple(self.n_summarized))
        if getattr(self, "_row_cache", (None,))[0] != key:
            host = torch.tensor([self.row_start, self.n_summarized], dtype=torch.int32)
            if self.device.type == "cuda":
                host = host.pin_memory()
            dev = host.to(self.device, non_blocking=True)
            self._row_cache = (key, dev[0], dev[1])
        return self._row_cache[1], self._row_cache[2]

    def length_tensor(self) -> torch.Tensor:
        """Slots written, ``int32 [1]`` on the cache's device (a fill, no host copy; a new tensor per
        length, never written in place, so forks of this layer cannot see each other's length)."""
        if getattr(self, "_length_cache", (None,))[0] != self.length:
            self._length_cache = (self.length, torch.full((1,), self.length, dtype=torch.int32, device=self.device))
        return self._length_cache[1]

    def real_tokens(self) -> torch.Tensor:
        """Real (non-padding) tokens cached in all rows, a scalar tensor."""
        return self.slot_valid[:, : self.length].sum()

    # -- the attention function's hooks ------------------------------------------------------------
    def prepare(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        """Before attention: read padding off the mask of a multi-token forward, then summarize
        every page completed since the last call."""
        self.mark_padding(attention_mask, query_len)
        self.summarize_completed()

    def mark_padding(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        """Read the padding of a multi-token forward's new slots off its attention mask."""
        if attention_mask is not None and query_len > 1:
            self.mark_new_slots(slot_validity(attention_mask, query_len, len(self.row_start), self.device))

    def attends_densely(self, query_len: int) -> bool:
        """Dense for multi-token forwards, the ``"full"`` selector, contexts under ``min_context``
        and contexts that fit in the budget (every page would be selected anyway)."""
        cfg = self.config
        if query_len > 1 or self.selector is None:
            return True
        if self.selector.token_level:  # the policy decides (eviction state evolves)
            return False
        # Measured on the rows' page grids, which start at each row's first real token, not on the
        # written slots: left padding is no context. Counting it sent a row that fits the budget (and
        # has fewer complete pages than the budget's slots, possibly none summarized) down the page
        # path, where a row run alone, with the same pages, attends densely.
        context = self.length - min(self.row_start)
        return context < cfg.min_context or self.num_pages <= cfg.page_slots

    @property
    def num_pages(self) -> int:
        """Pages of the longest row (``P``): every row's page axis has this length."""
        return math.ceil((self.length - min(self.row_start)) / self.config.page_size)

    def _rows_start_at_zero(self) -> bool:
        return not any(self.row_start)

    def summarize_completed(self) -> None:
        """Summarize every complete page not summarized yet, in one batched pass over the rows."""
        if self.selector is None or self.selector.token_level:
            return
        B = self.config.page_size
        target = [max(self.length - s, 0) // B for s in self.row_start]
        lo = min(self.n_summarized)
        hi = max(target)
        if hi <= lo or all(n >= t for n, t in zip(self.n_summarized, target)):
            return
        b, h = self.keys.shape[:2]
        keys, valid = self.page_inputs(torch.arange(lo, hi, device=self.device).expand(b, h, -1))
        if not self.shared:  # the first pass (after prefill) fits any sequence-level state, frozen after
            self.shared = self.selector.fit_sequence(keys, valid)
        new = self.summarize_pages(keys, valid)
        if not self.summary:
            cap = self.capacity // B + 1
            self.summary = {n: t.new_empty((*t.shape[:2], cap, *t.shape[3:])) for n, t in new.items()}
        if self._summary_shared:  # copy on write: the other holder keeps its own pages
            self.summary, self._summary_shared = {n: t.clone() for n, t in self.summary.items()}, False
        # Pages past a row's target are incomplete there: written now, summarized again once complete.
        for name, tensor in new.items():
            self.summary[name][:, :, lo:hi] = tensor
        self.n_summarized = target

    def summary_view(self) -> dict[str, torch.Tensor]:
        """The summaries of the summarized pages, ``[b, h, max(n_summarized), ...]``, and the
        sequence-level selector state."""
        n = max(self.n_summarized, default=0)
        return {**{name: t[:, :, :n] for name, t in self.summary.items()}, **self.shared}

    def set_config(self, config: LocksConfig) -> None:
        """Switch selector settings; summaries are rebuilt (lazily) when their layout changes. The KV
        storage settings (``kv_bits`` ...) cannot change: `LocksCache.fork` converts between them.

        A token-level policy that has started decoding has evicted tokens (and keeps state built at its
        first step) that no other setting can take over: switching it is refused; the same settings
        keep its state."""
        if config == self.config:
            return
        check_same_kv(self.config, config)
        if self.policy_state is not None:
            raise LocksConfigError(
                f"this cache's {self.config.selector!r} policy has started decoding (it may have evicted tokens, "
                f"and its state was built for {self.config.label}): it cannot switch to {config.label}. Fork or "
                "set the budget before the first decode step (e.g. right after prefill), or continue with the same "
                "settings (fork() without a config)")
        if config.summary_layout != self.config.summary_layout:
            self.summary, self.shared, self.n_summarized = {}, {}, [0] * len(self.row_start)
            self._summary_shared = False
        self.config = config
        self.selector = make_selector(config)
        self.policy_state = None

    @classmethod
    def from_paged(cls, layer: PagedLayer, config: LocksConfig, length: int) -> LocksLayer:
        """A dynamic layer holding a copy of the first ``length`` slots of another Locks layer (e.g. a
        static one); its summaries are rebuilt, in one batched pass, at the next forward."""
        if config.kv_bits != 16:  # a full-precision copy, then quantized as `LocksCache.fork` does
            from .kv_cache import to_quantized

            return to_quantized(cls.from_paged(layer, full_precision(config), length), config)
        keys, values = layer.kv_buffers()
        new = cls(config)
        new.lazy_initialization(keys, values)
        new._kbuf = keys[:, :, :length].clone()
        new._vbuf = values[:, :, :length].clone()
        new.slot_valid = layer.slot_valid[:, :length].clone()
        new.length = length
        new.row_start = layer.row_tensors()[0].tolist()
        new.n_summarized = [0] * len(new.row_start)
        new._refresh_views()
        return new

    # -- state hooks used by generate() -----------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: list[int]) -> None:
        """Apply a batch-dim transform to every stored tensor; ``rows`` says where each new row came from."""
        if not self.is_initialized:
            return
        if self._kbuf is not None:  # (a quantized layer keeps its K/V in other tensors)
            self._kbuf, self._vbuf = fn(self._kbuf), fn(self._vbuf)
        self.slot_valid = fn(self.slot_valid)
        self.summary = {n: fn(t) for n, t in self.summary.items()}
        self._summary_shared = False  # fn made new tensors
        self.shared = {n: fn(t) for n, t in self.shared.items()}
        if self.prompt_queries is not None:
            self.prompt_queries = fn(self.prompt_queries)
        self.prefill_scores = {n: fn(t) for n, t in self.prefill_scores.items()}
        if self.policy_state is not None:
            self.policy_state = self.policy_state.mapped(fn)
        self.row_start = [self.row_start[r] for r in rows]
        self.n_summarized = [self.n_summarized[r] for r in rows]
        self._last_pages = None
        self._refresh_views()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)), beam_idx.tolist())

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = indices.tolist() if torch.is_tensor(indices) else list(indices)
        self._apply(lambda t: t[torch.as_tensor(rows, device=t.device)], rows)

    def batch_repeat_interleave(self, repeats: int) -> None:
        rows = [r for r in range(len(self.row_start)) for _ in range(repeats)]
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0), rows)

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
        B = self.config.page_size
        self.n_summarized = [min(n, max(self.length - s, 0) // B)
                             for n, s in zip(self.n_summarized, self.row_start)]
        if self.policy_state is not None:
            self.policy_state.truncate(self.length)
        self._refresh_views()

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        raise ValueError("LocksCache does not support offloading: create it with offloading=False")

    prefetch = offload


def _resized(buf: torch.Tensor, dim: int, size: int, keep: int, fill=None) -> torch.Tensor:
    """A copy of ``buf`` with ``dim`` resized to ``size``, keeping the first ``keep`` entries."""
    shape = list(buf.shape)
    shape[dim] = size
    out = buf.new_full(shape, fill) if fill is not None else buf.new_empty(shape)
    out.narrow(dim, 0, keep).copy_(buf.narrow(dim, 0, keep))
    return out


class LocksCacheMixin:
    """Shared by `LocksCache` and `LocksStaticCache`: the attention hand-off and the statistics."""

    #: ``(layers, kv_heads, head_dim)`` of the model config the cache was built from (``None``: any).
    model_shape: tuple[int, int, int] | None = None
    #: Index of the last layer a forward updates (``None``: not known, a cache built without a config).
    _last_kv_layer: int | None = None

    @property
    def use_guard(self) -> UseGuard:
        """Which thread is in the middle of a forward through this cache (one per cache, fresh in a fork)."""
        guard = self.__dict__.get("_use_guard")
        if guard is None:
            guard = self.__dict__["_use_guard"] = UseGuard()
        return guard

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        _check_handoff_taken()
        if key_states.shape[2] == 0:
            raise ValueError(_EMPTY_INPUT)
        layers = self.layers
        if not is_torchdynamo_compiling():  # a compiled step replays without Python: checked when eager
            last = self._last_kv_layer if self._last_kv_layer is not None else len(layers) - 1
            self.use_guard.enter(layer_idx, last)
        if self.model_shape is not None:
            n, h, d = self.model_shape
            paged = layer_idx < len(layers) and isinstance(layers[layer_idx], PagedLayer)
            problem = cache_model_mismatch(layer_idx, key_states.shape, n, h if paged else None, d)
            if problem:
                raise UnsupportedModelError(problem)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        _HANDOFF.slot = (layer_idx, self.layers[layer_idx], key_states.shape[2])
        return keys, values

    def remember_model_shape(self, text_config: PretrainedConfig) -> None:
        """Record the layer count, KV heads and head dim of the model ``text_config`` describes, so that
        use with another model is refused at its first update."""
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.model_shape = (text_config.num_hidden_layers, heads, head_dim_of(text_config))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = self._batch_size()
        if rows is not None:
            arguments.row_indices(beam_idx, rows, "reorder_cache")
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = self._batch_size()
        if rows is not None:
            arguments.row_indices(indices, rows, "batch_select_indices")
        super().batch_select_indices(indices)

    def _batch_size(self) -> int | None:
        """Rows the cache holds (``None`` before the first forward)."""
        for layer in self.locks_layers:
            keys, _ = layer.kv_buffers()
            if layer.is_initialized and keys is not None:
                return keys.shape[0]
        return None

    def activate_past_recording(self) -> None:
        """Called by generate() for assisted and prompt-lookup decoding, before their first forward."""
        if self.get_seq_length() == 0:
            raise UnsupportedModelError(REFUSED_GENERATION)
        super().activate_past_recording()  # a prefilled cache: refused at the first verification forward

    @property
    def locks_layers(self) -> list[PagedLayer]:
        return [layer for layer in self.layers if isinstance(layer, PagedLayer)]

    # -- statistics (tensors on the layers' devices: reading them is the only sync) ----------------
    def reset_stats(self) -> None:
        for layer in self.locks_layers:
            layer.reset_stats()

    def attended_fraction(self) -> float:
        """Share of cached real tokens that decode steps attended, over all Locks layers (1.0 = dense)."""
        counts = [l.counts.tolist() for l in self.locks_layers if l.counts is not None]
        # per layer: with a model split over GPUs (device_map) the counters live on several devices
        context = sum(c for _, c in counts)
        return sum(a for a, _ in counts) / context if context else float("nan")


class LocksCache(LocksCacheMixin, DynamicCache):
    """A transformers `Cache` whose full-attention layers select pages for sparse decoding.

    Args:
        config: the model's config (its text config is used); full-attention layers become Locks
            layers, others keep transformers' layers. ``None``: every layer is a `LocksLayer`.
        locks: the method's settings; keyword overrides build one (``LocksCache(cfg, budget=256)``).
        max_cache_len: tokens the cache will hold (prompt + generated). Optional: without it the
            static layout starts at the first forward's length plus headroom and grows (each growth
            re-allocates once and recompiles the decode step once).
        max_budget: the widest budget the cache will decode with (`set_budget`); default the
            config's. The static layout sizes its page lists for it, so that budgets up to it share
            one compiled graph.
        layout: ``"auto"`` (default): the static layout (compiled decode: torch.compile + CUDA graphs
            through ``generate``) when a CUDA device and the Triton kernels are available and the
            configuration allows it, else the dynamic layout (eager; the CPU reference path);
            ``"static"`` or ``"dynamic"`` to choose.

    Use with a model loaded with ``attn_implementation="locks"``.
    """

    #: Whether the static layout may grow past its capacity (`LocksStaticCache`: no).
    _growable = True

    def __init__(self, config: PretrainedConfig | None = None, locks: LocksConfig | None = None, *,
                 max_cache_len: int | None = None, max_budget: int | None = None, layout: str = "auto",
                 **overrides) -> None:
        config = arguments.model_config(config)
        locks = (arguments.locks_config(locks, "LocksCache") or LocksConfig()).replace(**overrides)
        max_budget = arguments.max_budget(max_budget, locks.budget)
        if max_cache_len is not None and (isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int)
                                          or max_cache_len < 1):
            raise LocksConfigError(f"max_cache_len must be a positive int (prompt + new tokens), got {max_cache_len!r}")
        self.locks_config = locks
        self.max_budget = max_budget
        self._plan: CapacityPlan | None = None  # the static layout's capacity (None: dynamic layout)
        if config is None:
            choose_layout(layout, locks, None)
            super().__init__()
            self.layer_class_to_replicate = lambda: LocksLayer(locks)
            return
        text_config = config.get_text_config(decoder=True)
        check_model_supported(text_config, locks)
        super().__init__(config=text_config)
        self.remember_model_shape(text_config)
        self._layer_types, self._layer_kwargs = get_layer_types_and_kwargs(text_config)
        self._last_kv_layer = max(i for i, kind in enumerate(self._layer_types) if kind != "dummy")
        for i, layer_type in enumerate(self._layer_types):
            if layer_type == "full_attention":
                self.layers[i] = LocksLayer(locks)
                self.layers[i].text_config = text_config
        if choose_layout(layout, locks, self._layer_types):
            self._plan = CapacityPlan(max_cache_len, locks.page_size, self._growable)
            # every forward updates this layer first: where an eager forward is counted
            self._first_kv_layer = next(i for i, kind in enumerate(self._layer_types) if kind != "dummy")
            if max_cache_len is not None:
                self._allocate(self._plan.capacity)

    # -- the static layout ---------------------------------------------------------------------------
    @property
    def is_static(self) -> bool:
        """Whether the cache keeps the static layout (compiled decode on a GPU)."""
        return self._plan is not None

    @property
    def is_compileable(self) -> bool:
        # Asked by generate() before the first forward, when the static layers may not exist yet.
        return self._plan is not None

    @property
    def capacity(self) -> int | None:
        """Tokens the static layout holds before it grows (``None``: dynamic, or before the first forward)."""
        return None if self._plan is None else self._plan.capacity

    def _allocate(self, capacity: int) -> None:
        self.layers = build_static_layers(self._layer_types, self._layer_kwargs, self.locks_config, capacity,
                                          page_slots_width(self.locks_config, self.max_budget))

    def _ensure(self, capacity: int | None) -> None:
        """Re-allocate every static layer to ``capacity`` slots (``None``: nothing to do)."""
        if capacity is None:
            return
        if not any(layer.is_initialized for layer in self.layers if isinstance(layer, StaticLayer)):
            self._plan.capacity = capacity  # nothing written yet: (re)build the static layers at this size
            self._allocate(capacity)
            return
        logger.warning("LocksCache: growing the static cache from %d to %d tokens (one re-allocation; a compiled "
                       "decode step recompiles once). Pass max_cache_len to allocate it once.",
                       self._plan.capacity, capacity)
        self._plan.capacity = capacity
        for layer, kw in zip(self.layers, self._layer_kwargs):
            if isinstance(layer, PagedLayer):
                layer.reallocate(capacity)
            elif isinstance(layer, StaticLayer):
                reallocate_hf_layer(layer, capacity, window=kw.get("sliding_window"))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._plan is not None and layer_idx == self._first_kv_layer:
            if is_torchdynamo_compiling():
                self._plan.compiled_ran = True  # a constant store: replayed after the graph, no guard
            else:  # an eager forward (prefill, or a step not compiled): counted before any layer writes
                t = key_states.shape[2]
                if self._plan.capacity is None:
                    self._ensure(self._plan.first_capacity(t))
                self._ensure(self._plan.eager_write(t))
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if isinstance(query_length, int) and query_length == 0:  # before any layer: the model would fail in a reshape
            raise ValueError(_EMPTY_INPUT)
        # Runs eagerly before every forward that builds a mask, compiled decode steps included (generate
        # prepares their 4D mask outside the graph): the place to grow the static buffers.
        if self._plan is not None and not is_torchdynamo_compiling() and \
                layer_idx == find_first_full_attention_index(self):
            if self._plan.capacity is None:
                self._ensure(self._plan.first_capacity(query_length))
            self._ensure(self._plan.announce(query_length))
        return super().get_mask_sizes(query_length, layer_idx)

    def set_budget(self, budget: int) -> None:
        """Decode with budget ``budget`` from the next step on; the static layout switches in place
        (no recompile) up to ``max_budget``."""
        config = self.locks_config.replace(budget=budget)
        for layer in self.locks_layers:  # one config object for every layer (see LocksStaticLayer.set_budget)
            if isinstance(layer, LocksLayer):
                layer.set_config(config)
            else:
                layer.set_budget(config)
        self.locks_config = config

    def reset(self) -> None:
        super().reset()
        self.use_guard.release()
        self._rewound_to(0)  # buffers kept (same addresses: a compiled step serves the next prompt)

    def _rewound_to(self, length: int) -> None:
        """The static layout now holds ``length`` tokens (exact: after a host-side rewind)."""
        if self._plan is not None:
            self._plan.written, self._plan.announced, self._plan.compiled_ran = length, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        if self._plan is None or not any(l.is_initialized for l in self.layers if isinstance(l, StaticLayer)):
            return super().crop(tokens_to_remove)
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                layer.crop(tokens_to_remove)
            elif isinstance(layer, StaticLayer):
                crop_hf_layer(layer, -tokens_to_remove)
        self._rewound_to(int(self.locks_layers[0].length_tensor()))  # exact again (a host op may sync)

    def expect_new_tokens(self, count: int) -> None:
        """Announce how many tokens the next decode will generate (policies whose budget rule uses
        the total sequence length, such as RocketKV's, read it; others ignore it)."""
        for layer in self.locks_layers:
            layer.expected_new_tokens = int(count)

    def decode_traffic(self) -> dict[str, float] | None:
        """Per (layer, row, KV head) and decode step, averaged over the Locks layers since the last
        ``reset_stats``: ``attended_tokens`` (tokens whose K/V were read) and ``read_bytes`` (those
        K/V plus what choosing them read: page summaries, reduced keys, ...). ``None`` before any
        decode step."""
        head_steps = attended = read = 0
        for layer in self.locks_layers:
            if not layer.decode_steps or layer.counts is None:
                continue
            b, h = layer.keys.shape[:2]
            tokens = int(layer.counts[0])
            head_steps += layer.decode_steps * b * h
            attended += tokens
            read += layer.attended_kv_bytes() + layer.estimate_bytes
        if not head_steps:
            return None
        return {"attended_tokens": attended / head_steps, "read_bytes": read / head_steps}

    def fork(self, locks: LocksConfig | None = None) -> LocksCache:
        """An independent copy (e.g. of a prefilled prompt) that decodes with other settings.

        The K/V are copied once; summaries are shared when their layout is unchanged (each side copies
        them before it first summarizes a page) and rebuilt in one batched pass otherwise. A fork of a static-layout cache stays static when ``locks`` allows
        it and converts to the dynamic layout (logged) when not. The fork's statistics start at zero.
        """
        import copy

        locks = arguments.locks_config(locks, "LocksCache.fork")
        clone = copy.copy(self)
        clone.__dict__.pop("_use_guard", None)  # the fork is a cache of its own: any thread may use it
        if locks is not None:
            for layer in self.locks_layers:
                if layer.is_initialized:
                    check_head_dim(locks, layer.keys.shape[-1])
        clone.locks_config = locks or self.locks_config
        refusal = None if self._plan is None else config_refusal(clone.locks_config, self._layer_types)
        if self._plan is not None and refusal is None:
            clone._plan = copy.copy(self._plan)
            width = page_slots_width(clone.locks_config, self.max_budget)
            clone.layers = [_copied_layer(layer, locks, width) for layer in self.layers]
        elif self._plan is not None:
            logger.warning("LocksCache.fork(%s): %s; the fork decodes with the dynamic layout",
                           clone.locks_config.label, refusal)
            clone._plan = None
            clone.layers = self._dynamic_layers(clone.locks_config)
        else:
            clone.layers = [_copied_layer(layer, locks, None) for layer in self.layers]
        clone.reset_stats()
        return clone

    def _dynamic_layers(self, locks: LocksConfig) -> list:
        """Dynamic copies of this static-layout cache's layers (Locks layers decoding with ``locks``)."""
        if not any(l.is_initialized for l in self.layers if isinstance(l, StaticLayer)):
            return [_copied_layer(layer, locks, None) for layer in self.layers]
        length = int(self.locks_layers[0].length_tensor())  # a host op: one sync
        return [LocksLayer.from_paged(layer, locks, length) if isinstance(layer, PagedLayer)
                else to_dynamic_layer(layer, length, kw.get("sliding_window")) if isinstance(layer, StaticLayer)
                else _copied_layer(layer, locks, None)
                for layer, kw in zip(self.layers, self._layer_kwargs)]


def _copied_layer(layer, locks: LocksConfig | None, width: int | None):
    """An independent copy of one cache layer, its Locks settings switched to ``locks`` if given."""
    import copy

    if isinstance(layer, LocksLayer):
        new = copy.copy(layer)
        new.summary = {}  # not cloned: shared below, each side copies it before its first write
        new._apply(lambda t: t.clone(), list(range(len(layer.row_start))))
        new.summary = dict(layer.summary)
        layer._summary_shared = new._summary_shared = bool(layer.summary)
        from .kv_cache import adopt_config  # (it subclasses LocksLayer)

        return new if locks is None else adopt_config(new, locks)
    if isinstance(layer, PagedLayer):  # a static Locks layer
        return layer.fork(locks, width)
    if isinstance(layer, StaticLayer):
        return hf_copy(layer)
    return copy.deepcopy(layer)


def take_handoff(layer_idx: int | None, key: torch.Tensor, sliding_window: int | None = None
                 ) -> PagedLayer | None:
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
            "between layers, which Locks cannot select pages for; use attn_implementation='sdpa' and a DynamicCache")
    if not isinstance(layer, PagedLayer):
        if getattr(layer, "is_sliding", False) and sliding_window is None:
            raise UnsupportedModelError(
                f"layer {layer_idx} of the Locks cache is a sliding-window layer but the model's layer "
                f"{layer_idx} is full attention: build the cache from this model's config, LocksCache(model.config)")
        return None
    return layer


def _check_handoff_taken() -> None:
    """Raise when the previous decode step's hand-off was never taken: the model's attention function
    is not Locks' (it was loaded with "sdpa" / "eager"), so every step would silently run dense."""
    slot = _HANDOFF.slot
    _HANDOFF.slot = None
    if slot is not None and slot[2] == 1:
        raise UnsupportedModelError(
            "the model did not call Locks' attention function on a decode step: load it with "
            "attn_implementation='locks' (after `import locks_hf`); with 'sdpa' or 'eager' a Locks cache "
            "would decode densely")
