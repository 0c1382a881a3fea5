"""`PagedLayer`: what every Locks cache layer answers, with the page and slot logic written once.

A Locks layer keeps a key and a value buffer ``[b, h, capacity, d]`` and per-row page bookkeeping:
page ``j`` of row ``i`` holds slots ``row_start[i] + j*B ...`` (a left-padded row is paged exactly as
if it ran alone), and ``n_complete[i]`` of its pages are complete. Everything the attention function,
its decode backend (`locks_hf.backends`) and the selectors read from a layer is derived here from
three accessors a storage class provides: `kv_buffers` (the key and value buffers), `row_tensors`
and `length_tensor` (all tensors, so the same code runs in an eager dynamic cache and in a compiled
static one).

Subclasses (`locks_hf.dynamic_layer.LocksLayer`, `locks_hf.static_layer.LocksStaticLayer`) keep only storage,
prefill and per-step summarizing, as transformers' ``DynamicLayer`` / ``StaticLayer`` do.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

from .backends import DecodeBackend, choose_backend

if TYPE_CHECKING:
    from .config import LocksConfig
    from .selectors import PageSelector


def slot_validity(attention_mask: torch.Tensor | None, query_len: int, batch: int, device) -> torch.Tensor:
    """``[b, Tq]`` validity of the slots just written, read off the model's attention mask.

    With left padding the mask is ``[b, 1, Tq, Tk]`` (its last ``Tq`` key columns are the new slots);
    a key slot is real iff some query attends it.
    """
    if attention_mask is None:
        return torch.ones((batch, query_len), dtype=torch.bool, device=device)
    mask = (
        attention_mask
        if attention_mask.dtype == torch.bool
        else attention_mask > torch.finfo(attention_mask.dtype).min / 2
    )
    return mask[:, 0].any(dim=1)[:, -query_len:].expand(batch, query_len)


def pages_to_mask(pages: torch.Tensor, n_pages: int) -> torch.Tensor:
    """Page lists ``[..., W]`` (``< 0`` = none) as a mask ``[..., n_pages]``."""
    index = torch.where(pages >= 0, pages, n_pages).long()
    mask = torch.zeros((*pages.shape[:-1], n_pages + 1), dtype=torch.bool, device=pages.device)
    return mask.scatter_(-1, index, True)[..., :n_pages]


class PagedLayer(ABC):
    """One full-attention layer of a Locks cache, seen as pages.

    Attributes a subclass sets: ``config`` (`LocksConfig`), ``selector`` (`PageSelector` or ``None``
    for dense), ``summary`` (the selector's page-axis tensors ``[b, h, pages, ...]``), ``shared`` (its
    sequence-level state ``[b, h, ...]``), ``slot_valid [b, capacity]`` (False for padding slots),
    ``counts`` (``int64 [2]`` statistics or ``None``) and ``device``; ``backend``, the `DecodeBackend`
    its decode steps run on, is set by `refresh_backend`.
    """

    backend: DecodeBackend
    #: What ``backend`` derives from the settings for its steps (`DecodeBackend.plan`), or ``None``.
    kernel_plan: Any = None
    config: LocksConfig
    selector: PageSelector | None
    summary: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor]
    slot_valid: torch.Tensor | None
    counts: torch.Tensor | None
    device: torch.device
    # Set by transformers' cache layer the storage class also derives from.
    keys: torch.Tensor | None
    is_initialized: bool

    #: Set by the cache (`locks_hf.page_updates`): the per-step page summary of this layer is written by one
    #: launch for several layers, at the last of them, so neither its decode step nor its `prepare` writes it.
    page_update_deferred: bool = False

    #: Set by ``Cache.activate_past_recording`` (assisted / prompt-lookup decoding): a multi-token
    #: forward is then a verification of drafted tokens, which Locks refuses (see `attention`).
    recording_past: bool = False

    def activate_past_recording(self, **kwargs) -> None:  # kwargs: recurrent layers' options (none here)
        self.recording_past = True

    # -- storage: what a subclass provides ----------------------------------------------------------
    @abstractmethod
    def kv_buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The key and value storage, ``[b, h, capacity, d]`` each (``None`` before the first update);
        slots at or past the length are unwritten memory."""

    def packed_kv(self) -> dict | None:
        """The K/V as `locks_hf.kernels.quantized_attention` reads them (its keyword arguments) where the
        layer stores them quantized and has allocated its storage; ``None`` for full-precision buffers
        (`kv_buffers`)."""
        return None

    def append_buffers(self) -> dict:
        """What a decode step's write into quantized storage reads and updates (`DecodeBackend.append_kv`):
        only a static layer storing its K/V quantized writes its decode tokens through the backend."""
        raise TypeError(
            f"{type(self).__name__} writes its decode tokens itself: only a static layer storing quantized K/V "
            "has append buffers"
        )

    def refresh_backend(self) -> None:
        """(Re)choose where this layer's decode runs (`locks_hf.backends.choose_backend`), and keep what
        that backend derives from the settings (``kernel_plan``): called when its buffers are
        (re)allocated and when its settings change, never per step."""
        self.backend = choose_backend(self)
        self.kernel_plan = self.backend.plan(self.config)

    @property
    def kv_batch(self) -> int:
        """Rows cached."""
        assert self.keys is not None  # asked of an initialized layer only
        return self.keys.shape[0]

    @property
    def kv_heads(self) -> int:
        """KV heads cached."""
        assert self.keys is not None  # asked of an initialized layer only
        return self.keys.shape[1]

    def key_buffer(self) -> torch.Tensor | None:
        """All key slots ``[b, h, capacity, d]`` (see `kv_buffers`)."""
        return self.kv_buffers()[0]

    def value_buffer(self) -> torch.Tensor | None:
        """All value slots ``[b, h, capacity, d_v]`` (see `kv_buffers`)."""
        return self.kv_buffers()[1]

    @abstractmethod
    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_start`` and ``n_complete`` (complete pages) per row, int32 ``[b]`` on the device."""

    @abstractmethod
    def length_tensor(self) -> torch.Tensor:
        """Slots written, ``int32 [1]`` on the device."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Slots allocated per row."""

    @property
    @abstractmethod
    def num_pages(self) -> int:
        """Length ``P`` of the page axis of every row."""

    @abstractmethod
    def count_buffer(self) -> torch.Tensor:
        """The running ``(attended, cached)`` token counts, ``int64 [2]`` (the kernels add in place)."""

    @abstractmethod
    def note_selection(self, pages: torch.Tensor) -> None:
        """Remember the pages a decode step attended: ``[b, h, W]`` page numbers, ``< 0`` = none."""

    @abstractmethod
    def real_tokens(self) -> torch.Tensor:
        """Real (non-padding) tokens cached in all rows, a scalar tensor."""

    @abstractmethod
    def summary_view(self) -> dict[str, torch.Tensor]:
        """The summaries the selector scores with (page axis first ``P`` or fewer pages) and its
        sequence-level state."""

    @abstractmethod
    def prepare(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        """Called by the attention function before attention: padding and summaries up to date."""

    @abstractmethod
    def attends_densely(self, query_len: int) -> bool:
        """Whether this forward runs dense attention rather than the page path."""

    @abstractmethod
    def reset_stats(self) -> None:
        """Zero the statistics (`attended`, `context`)."""

    def _rows_start_at_zero(self) -> bool:
        """True when no row is padded, known on the host (then every page is a view of the buffer)."""
        return False

    #: The static layout's layer: its decode step is one static graph whose launches keep the layer's
    #: bookkeeping (`step_tensors`).
    static_layout = False

    # -- statistics -----------------------------------------------------------------------------------
    #: Decode steps and estimation bytes counted on the host (`decode_traffic`); a static layer,
    #: whose steps run in a compiled graph, keeps no host count.
    decode_steps = 0
    estimate_bytes = 0

    def step_tensors(self) -> dict[str, Any]:
        """What a kernel decode step reads and writes besides the query, in one call (a compiled step's
        trace runs it once or twice a layer): ``keys`` / ``values`` (`kv_buffers`), ``slot_valid``,
        ``row_start`` / ``n_complete`` (`row_tensors`), ``length`` (`length_tensor`), ``summary``,
        ``n_pages``, ``width`` / ``active`` (`page_slots`), ``counts`` (`count_buffer`); and the buffers
        in which the launches keep the layer's bookkeeping, or ``None`` where the glue keeps it:
        ``row_counts`` (per-row statistics), ``pad`` (padding slots per row) and ``selection`` (the
        page mask); ``tickets``, the selection launch's counters (`locks_hf.buffers.selection_tickets`), or
        ``None`` for a new zeroed buffer a step. Where they are given and the selector keeps summaries,
        ``n_complete`` is the buffer the per-step page update writes."""
        keys, values = self.kv_buffers()
        row_start, n_complete = self.row_tensors()
        width, active = self.page_slots()
        return {
            "keys": keys,
            "values": values,
            "slot_valid": self.slot_valid,
            "row_start": row_start,
            "n_complete": n_complete,
            "length": self.length_tensor(),
            "summary": self.summary,
            "n_pages": self.num_pages,
            "width": width,
            "active": active,
            "counts": self.count_buffer(),
            "row_counts": None,
            "pad": None,
            "selection": None,
            "tickets": None,
        }

    def page_slots(self) -> tuple[int, torch.Tensor | None]:
        """Width of the kernels' page lists and the budget in use as a device tensor (``None``: the
        width is the budget)."""
        return self.config.page_slots, None

    def record_step(self, attended: torch.Tensor | None, context: torch.Tensor) -> None:
        """Add one decode step: tokens attended and real tokens cached, summed over rows and heads
        (``attended=None``: the kernels already added it)."""
        counts = self.count_buffer()
        if attended is not None:
            counts[0] += attended
        counts[1] += context

    def attended_kv_bytes(self) -> int:
        """Bytes of the K/V the decode steps attended since the last ``reset_stats``, at their stored size."""
        keys, values = self.kv_buffers()
        attended = self.attended
        assert attended is not None and keys is not None and values is not None  # asked after decode steps
        return int(attended) * (keys.shape[-1] + values.shape[-1]) * keys.element_size()

    def release_forward_kv(self) -> None:
        """After attention: drop what `update` built for this forward only (a quantized layer's
        dequantized K/V), so that it is not held until the next forward. Storage layers keep views."""

    def observe_prompt_queries(self, query: torch.Tensor, scale: float) -> None:
        """Prefill hook (``query [b, Hq, t, d]``, t > 1): layers that keep prompt queries override it."""

    def record_selection_traffic(self) -> None:
        """After a page-selected decode step: layers that count estimation traffic override it."""

    @property
    def attended(self) -> torch.Tensor | None:
        """Tokens attended over the decode steps since the last ``reset_stats`` (int64 scalar)."""
        return None if self.counts is None else self.counts[0]

    @property
    def context(self) -> torch.Tensor | None:
        """Real tokens cached, summed over the same decode steps (int64 scalar)."""
        return None if self.counts is None else self.counts[1]

    # -- slots and pages ------------------------------------------------------------------------------
    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Slot index of every token of ``pages [b, ...]`` (page numbers per row): ``[b, ..., B]``."""
        B = self.config.page_size
        start = self.row_tensors()[0].long().view(-1, *([1] * pages.dim()))
        return start + pages.unsqueeze(-1) * B + torch.arange(B, device=self.device)

    def _gather_slots(self, buf: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """``buf [b, h, cap, d]`` at ``slots [b, h, n]`` -> ``[b, h, n, d]`` (clamped in range)."""
        index = slots.clamp(0, self.capacity - 1).unsqueeze(-1).expand(-1, -1, -1, buf.shape[-1])
        return buf.gather(2, index)

    def _slot_ok(self, slots: torch.Tensor) -> torch.Tensor:
        """Real, written slots among ``slots [b, ...]``."""
        inside = (slots >= 0) & (slots < self.length_tensor().long())
        flat = slots.flatten(1).clamp(0, self.capacity - 1)
        assert self.slot_valid is not None  # the pages of an initialized layer only
        return self.slot_valid.gather(1, flat).view_as(slots) & inside

    def page_validity(self) -> torch.Tensor:
        """``[b, 1, P, B]``: which slots of each row's pages hold real tokens."""
        assert self.slot_valid is not None  # the pages of an initialized layer only
        pages = torch.arange(self.num_pages, device=self.device).expand(self.slot_valid.shape[0], -1)
        return self._slot_ok(self._page_slots(pages)).unsqueeze(1)

    def page_validity_of(self, pages: torch.Tensor) -> torch.Tensor:
        """``[b, h, n, B]``: real slots of the pages ``pages [b, h, n]``."""
        return self._slot_ok(self._page_slots(pages))

    def page_keys(self, pages: torch.Tensor, values: bool = False) -> torch.Tensor:
        """Keys (or values) ``[b, h, n, B, d]`` of the pages ``pages [b, h, n]``."""
        slots = self._page_slots(pages)  # [b, h, n, B]
        buf = self.value_buffer() if values else self.key_buffer()
        assert buf is not None  # the pages of an initialized layer only
        out = self._gather_slots(buf, slots.flatten(2))
        return out.unflatten(2, slots.shape[2:])

    def all_page_keys(self) -> torch.Tensor:
        """Keys ``[b, h, P, B, d]`` of every page (a view when no row is padded, else a gather)."""
        B, P = self.config.page_size, self.num_pages
        keys = self.key_buffer()
        assert keys is not None  # the pages of an initialized layer only
        if self._rows_start_at_zero() and P * B <= self.capacity:
            return keys[:, :, : P * B].unflatten(2, (P, B))
        b, h = keys.shape[:2]
        return self.page_keys(torch.arange(P, device=self.device).expand(b, h, -1))

    def complete_pages(self) -> torch.Tensor:
        """``[b, P]``: pages complete (summarized) per row."""
        return torch.arange(self.num_pages, device=self.device) < self.row_tensors()[1][:, None]

    # -- summaries ------------------------------------------------------------------------------------
    def page_inputs(self, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What a selector summarizes for ``pages [b, h, n]`` (the same pages for every head): keys
        ``[b, h, n, B, d]`` and slot validity ``[b, h, n, B]``."""
        valid = self.page_validity_of(pages[:, :1]).expand(-1, pages.shape[1], -1, -1)
        return self.page_keys(pages), valid

    def summarize_pages(self, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """The selector's per-page tensors for ``keys [b, h, n, B, d]`` (``valid [b, h, n, B]``), built
        where the layer's backend builds them (GPU kernels or the selector's reference)."""
        return self.backend.build_summary(self, keys, valid)
