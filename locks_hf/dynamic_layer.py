"""`LocksLayer`: the dynamic Locks layer, K/V in buffers grown in chunks, plus page summaries.

The layer of `LocksCache`'s dynamic layout (eager; the CPU reference path): its page grid follows
each row's first real token, complete pages are summarized in one batched pass before attention,
and the generate() hooks (beam reorder, row selection, crop) keep every per-row tensor in step.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable

import torch
from transformers.cache_utils import DynamicLayer

from .buffers import resized_keeping
from .config import LocksConfig
from .errors import LocksConfigError
from .kv_quant import check_same_kv
from .models_support import check_head_dim
from .paged import PagedLayer, pages_to_mask, slot_validity
from .policy_inputs import PolicyInputs
from .selectors import PageSelector, make_selector
from .traffic import selection_reads

# Extra slots reserved past the prompt so that decode appends without reallocating.
_MIN_HEADROOM = 256


class LocksLayer(DynamicLayer, PolicyInputs, PagedLayer):
    """One full-attention layer: K/V in preallocated buffers grown in chunks, plus page summaries.

    ``keys``/``values`` are views ``[b, h, T, d]`` into the buffers (no copy per decoded token).
    ``slot_valid [b, capacity]`` marks padding slots False; they enter no summary and no selection.

    Pages are laid out per row from the row's first real token (``row_start``): page ``j`` of row
    ``b`` holds slots ``row_start[b] + j*B ...``. A left-padded row is thus paged exactly as if it
    ran alone. ``summary`` holds the selector's per-page tensors ``[b, h, page_capacity, ...]``,
    valid for the first ``n_summarized[b]`` (complete) pages of each row.
    """

    #: The ``kv_bits`` this class stores (a subclass declares the quantized ones it stores).
    stored_kv_bits: tuple[int, ...] = (16,)

    #: The K/V buffers ``[b, h, capacity, d]`` (``None`` before the first update).
    _kbuf: torch.Tensor | None
    _vbuf: torch.Tensor | None

    def __new__(cls, config: LocksConfig | None = None, *args, **kwargs):
        # Quantized KV settings make the layer the subclass that declares it stores them
        # (`locks_hf.kv_cache`, loaded with the package), so that every place that builds a layer
        # from a config honours kv_bits.
        if cls is LocksLayer and config is not None and config.kv_bits not in cls.stored_kv_bits:
            storing = [sub for sub in LocksLayer.__subclasses__() if config.kv_bits in sub.stored_kv_bits]
            if not storing:
                raise LocksConfigError(f"no Locks layer stores kv_bits={config.kv_bits}")
            cls = storing[0]
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
        self.clear_policy_inputs()
        self.reset_stats()
        self.refresh_backend()

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
        """Bytes a page selector reads per decode step to choose its pages, over rows and KV heads
        (`locks_hf.traffic`)."""
        reads = selection_reads(self.selector, max(self.n_summarized, default=0), self.length, self.config.page_size)
        summaries = sum(t.numel() * t.element_size() for t in self.summary_view().values()) if reads.summaries else 0
        keys = self.key_read_bytes(reads.key_tokens, every=reads.every_key) if reads.key_tokens else 0
        return summaries + keys

    def key_read_bytes(self, tokens: int, every: bool = False) -> int:
        """Bytes of ``tokens`` stored keys per row and KV head, summed over rows and heads (``every``:
        the ``tokens`` are every written slot)."""
        assert self._kbuf is not None  # full-precision storage (a quantized layer counts its own)
        b, h, _, d = self._kbuf.shape
        return tokens * b * h * d * self._kbuf.element_size()

    def record_selection_traffic(self) -> None:
        self.record_estimate(self.selection_read_bytes())

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
        self.refresh_backend()

    def _grow(self, needed: int) -> None:
        B = self.config.page_size
        new_cap = max(needed + _MIN_HEADROOM, self.capacity + self.capacity // 4)
        new_cap = math.ceil(new_cap / B) * B
        T = self.length
        self._resize_kv(new_cap, T)
        assert self.slot_valid is not None  # grown after lazy_initialization only
        self.slot_valid = resized_keeping(self.slot_valid, 1, new_cap, T, fill=True)
        kept = max(self.n_summarized, default=0)
        self.summary = {n: resized_keeping(t, 2, new_cap // B + 1, kept) for n, t in self.summary.items()}
        self._summary_shared = False  # new tensors of its own
        self.refresh_backend()

    def _resize_kv(self, capacity: int, length: int) -> None:
        """Re-allocate the K/V storage to ``capacity`` slots, keeping the first ``length``."""
        assert self._kbuf is not None and self._vbuf is not None  # grown after lazy_initialization only
        self._kbuf = resized_keeping(self._kbuf, 2, capacity, length)
        self._vbuf = resized_keeping(self._vbuf, 2, capacity, length)

    def _check_batch(self, key_states: torch.Tensor) -> None:
        assert self.slot_valid is not None  # checked after lazy_initialization only
        if key_states.shape[0] != self.slot_valid.shape[0]:
            raise ValueError(
                f"LocksCache holds batch size {self.slot_valid.shape[0]} but got {key_states.shape[0]}: for "
                "beam search or num_return_sequences > 1 pass a fresh (empty) LocksCache"
            )

    def _refresh_views(self) -> None:
        assert self._kbuf is not None and self._vbuf is not None  # allocated by lazy_initialization
        self.keys = self._kbuf[:, :, : self.length]
        self.values = self._vbuf[:, :, : self.length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_batch(key_states)
        T, t = self.length, key_states.shape[2]
        if T + t > self.capacity:
            self._grow(T + t)
        assert self._kbuf is not None and self._vbuf is not None and self.slot_valid is not None  # allocated above
        self._kbuf[:, :, T : T + t].copy_(key_states)
        self._vbuf[:, :, T : T + t].copy_(value_states)
        self.slot_valid[:, T : T + t] = True
        self.length = T + t
        self._refresh_views()
        assert self.keys is not None and self.values is not None  # the views just refreshed
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    # -- padding and pages -------------------------------------------------------------------------
    def mark_new_slots(self, valid: torch.Tensor) -> None:
        """Record which of the last ``valid.shape[1]`` written slots hold real tokens (``[b, t]``).

        Called for multi-token forwards (prefill); decode tokens are real by construction.
        """
        t = valid.shape[1]
        assert self.slot_valid is not None  # called after an update only
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
        assert self.slot_valid is not None  # asked of an initialized layer only
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
        if self.selector is None or self.selector.token_level or not self.n_summarized:
            return  # (no rows yet: a layer before its first forward has nothing to summarize)
        B = self.config.page_size
        target = [max(self.length - s, 0) // B for s in self.row_start]
        lo = min(self.n_summarized)
        hi = max(target)
        if hi <= lo or all(n >= t for n, t in zip(self.n_summarized, target)):
            return
        b, h = self.kv_batch, self.kv_heads
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
        # Pages a row had summarized keep their summary: built once, from the keys as they were then
        # (a quantized layer's "post" summaries come from keys that may be quantized by now).
        fresh = (
            torch.arange(lo, hi, device=self.device)[None, :]
            >= torch.tensor(self.n_summarized, device=self.device)[:, None]
        )
        for name, tensor in new.items():
            keep = fresh.view(b, 1, hi - lo, *([1] * (tensor.dim() - 3)))
            self.summary[name][:, :, lo:hi] = torch.where(keep, tensor, self.summary[name][:, :, lo:hi])
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
                "settings (fork() without a config)"
            )
        if config.summary_layout != self.config.summary_layout:
            self.summary, self.shared, self.n_summarized = {}, {}, [0] * len(self.row_start)
            self._summary_shared = False
        self.config = config
        self.selector = make_selector(config)
        self.policy_state = None
        self.refresh_backend()

    @classmethod
    def from_paged(cls, layer: PagedLayer, config: LocksConfig, length: int) -> LocksLayer:
        """A dynamic layer holding a copy of the first ``length`` slots of another Locks layer (e.g. a
        static one); its summaries are rebuilt, in one batched pass, at the next forward."""
        if config.kv_bits != 16:
            raise ValueError(
                "LocksLayer.from_paged copies full-precision K/V: quantize the copy (`kv_cache.to_quantized`)"
            )
        keys, values = layer.kv_buffers()
        # (the copy of an initialized layer: `fork.dynamic_layers`)
        assert keys is not None and values is not None and layer.slot_valid is not None
        new = cls(config)
        new.lazy_initialization(keys, values)
        new._kbuf = keys[:, :, :length].clone()
        new._vbuf = values[:, :, :length].clone()
        new.slot_valid = layer.slot_valid[:, :length].clone()
        new.length = length
        new.row_start = layer.row_tensors()[0].tolist()
        new.n_summarized = [0] * len(new.row_start)
        new._refresh_views()
        new.refresh_backend()
        return new

    # -- state hooks used by generate() -----------------------------------------------------------
    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], rows: list[int]) -> None:
        """Apply a batch-dim transform to every stored tensor; ``rows`` says where each new row came from."""
        if not self.is_initialized:
            return
        if self._kbuf is not None:  # (a quantized layer keeps its K/V in other tensors)
            assert self._vbuf is not None  # allocated with the keys
            self._kbuf, self._vbuf = fn(self._kbuf), fn(self._vbuf)
        assert self.slot_valid is not None  # set by lazy_initialization
        self.slot_valid = fn(self.slot_valid)
        self.summary = {n: fn(t) for n, t in self.summary.items()}
        self._summary_shared = False  # fn made new tensors
        self.shared = {n: fn(t) for n, t in self.shared.items()}
        self.map_policy_inputs(fn)
        self.row_start = [self.row_start[r] for r in rows]
        self.n_summarized = [self.n_summarized[r] for r in rows]
        self._last_pages = None
        self._refresh_views()
        self.refresh_backend()

    def copy_sharing_summaries(self) -> LocksLayer:
        """An independent copy (K/V and per-row state cloned) whose summaries are shared with this
        layer until either side summarizes a page (each copies them before its first write)."""
        new = copy.copy(self)
        new.summary = {}  # not cloned: shared below
        new._apply(lambda t: t.clone(), list(range(len(self.row_start))))
        new.summary = dict(self.summary)
        self._summary_shared = new._summary_shared = bool(self.summary)
        return new

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
        self.n_summarized = [min(n, max(self.length - s, 0) // B) for n, s in zip(self.n_summarized, self.row_start)]
        self.truncate_policy_inputs(self.length)
        self._refresh_views()

    def reset(self) -> None:
        self._clear()

    def offload(self) -> None:
        raise ValueError("LocksCache does not support offloading: create it with offloading=False")

    prefetch = offload
