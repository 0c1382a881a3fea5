"""`LocksStaticLayer`: a Locks layer whose decode step is one static graph (the static layout of
`LocksCache`, chosen on a GPU; `LocksStaticCache` is that layout at a fixed capacity).

What `torch.compile` and CUDA graphs need from a cache (transformers' `StaticLayer` pattern): buffers
allocated once at their final size, every per-step quantity a tensor (the length, the rows' first real
slot, the number of complete pages), in-place updates, no host synchronisation and no Python value
that changes from step to step. So, compared with `LocksLayer`:

* the page axis always spans the whole capacity (``P = max_cache_len / B``); pages that are not
  complete (or not written) are masked, never sliced off;
* each decode step summarizes the page it completes, with no host-side branch on "did it complete":
  on the GPU one fused launch whose programs return at once unless their row's newest page just
  completed; on the reference path the page holding the newest token is re-summarized every step;
* decode always takes the page path; ``selector="full"`` on the kernels attends every page (dense
  flash-decoding over the written length);
* prefill (several query tokens) runs eagerly, as transformers runs it: it reads padding off the
  mask and summarizes every page in one batched pass;
* the budget is a device tensor (``slots_t``) and the page lists are sized for the widest budget
  (``max_slots``), so budgets switch without a recompile;
* re-allocation (growth, fork, batch selection) happens eagerly between forwards, into fresh
  buffers marked static: a compiled step recompiles once for the new shapes.

Everything else (scoring, selection, sparse attention, the kernels) is shared with `LocksCache`:
both layer classes answer the same page-access methods.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from transformers.cache_utils import StaticLayer
from transformers.utils import is_torchdynamo_compiling

from .buffers import mark_static, resized, selection_tickets
from .config import LocksConfig
from .errors import LocksConfigError
from .kv_quant import check_same_kv
from .paged import PagedLayer, pages_to_mask, slot_validity
from .selectors import make_selector, static_selector_names

__all__ = ["LocksStaticLayer"]

logger = logging.getLogger(__name__)


class LocksStaticLayer(StaticLayer, PagedLayer):
    """One full-attention layer of `LocksStaticCache`: K/V of ``max_cache_len`` slots plus page summaries."""

    #: The ``kv_bits`` this class stores (`locks_hf.static_kv_layer` declares the quantized ones).
    stored_kv_bits: tuple[int, ...] = (16,)
    static_layout = True

    # Device tensors allocated by `lazy_initialization` (``None`` before it; nothing reads them then).
    slot_valid: torch.Tensor
    row_start: torch.Tensor
    pad: torch.Tensor
    length_t: torch.Tensor
    last_selection: torch.Tensor
    n_complete: torch.Tensor

    def __new__(cls, max_cache_len: int = 0, config: LocksConfig | None = None, *args, **kwargs):
        # as `LocksLayer.__new__`: quantized KV settings make the layer the subclass that stores them
        if cls is LocksStaticLayer and config is not None and config.kv_bits not in cls.stored_kv_bits:
            storing = [sub for sub in LocksStaticLayer.__subclasses__() if config.kv_bits in sub.stored_kv_bits]
            if not storing:
                raise LocksConfigError(f"no static Locks layer stores kv_bits={config.kv_bits}")
            cls = storing[0]
        return super().__new__(cls)

    def __init__(self, max_cache_len: int, config: LocksConfig, max_slots: int | None = None, **kwargs) -> None:
        if config.kv_bits not in self.stored_kv_bits:
            raise LocksConfigError(f"{type(self).__name__} does not store kv_bits={config.kv_bits}")
        B = config.page_size
        super().__init__(max_cache_len=-(-max_cache_len // B) * B)
        self.config = config
        self.selector = make_selector(config)
        self.shared = {}  # no sequence-level selector state: every page is summarized on its own
        # The page lists are `max_slots` wide; the budget in use (`slots_t`, a device tensor) may be any
        # k <= max_slots, so that configs differing only in budget share one compiled graph.
        self.max_slots = max(config.page_slots, max_slots or 0)
        # tensors from lazy_initialization on
        self.counts = self.last_selection = self.row_counts = self.slots_t = self.tickets = None
        self.n_complete = None
        self.refresh_backend()
        # Summaries of the layouts not in use (`set_config`), each with the length up to which its
        # complete pages are summarized.
        self._stored_layouts: dict[tuple, tuple[dict[str, torch.Tensor], int]] = {}

    # -- storage ---------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self._init_kv(key_states, value_states)
        b, h, _, d = key_states.shape
        dev = self.device
        P = self.num_pages
        self.slot_valid = torch.ones((b, self.max_cache_len), dtype=torch.bool, device=dev)
        self.row_start = torch.zeros(b, dtype=torch.int32, device=dev)
        self.pad = torch.zeros(b, dtype=torch.int32, device=dev)  # padding slots per row (set by prefill)
        self.length_t = torch.zeros(1, dtype=torch.int32, device=dev)  # int32 copy of cumulative_length
        self.counts = torch.zeros(2, dtype=torch.int64, device=dev)  # tokens attended, cached (see record_step)
        self.row_counts = torch.zeros((b, 2), dtype=torch.int64, device=dev)  # the same per row
        self.last_selection = torch.zeros((b, h, P), dtype=torch.bool, device=dev)
        self.slots_t = torch.full((1,), self.config.page_slots, dtype=torch.int32, device=dev)
        self.n_complete = torch.zeros(b, dtype=torch.int32, device=dev)  # written by the kernels' page update
        # the selection launch's counters, which it leaves zero: kept here, not zeroed anew every step
        self.tickets = torch.zeros(selection_tickets(b * h, P), dtype=torch.int32, device=dev)
        self.refresh_backend()
        self.summary = self._new_summary()
        if not is_torchdynamo_compiling():
            self._mark_static()

    def _init_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """The K/V storage (transformers' static buffers of ``max_cache_len`` slots)."""
        super().lazy_initialization(key_states, value_states)

    def _kv_tensors(self) -> list[torch.Tensor]:
        """The K/V storage, batch axis first (what growth, forks and beam reorders carry)."""
        return [self.keys, self.values]

    def _mark_static(self) -> None:
        mark_static(
            *self._kv_tensors(),
            self.cumulative_length,
            *self._row_state().values(),
            self.length_t,
            self.counts,
            self.slots_t,
            self.tickets,
        )

    def step_tensors(self) -> dict[str, Any]:
        """What a kernel decode step reads and writes (see `PagedLayer.step_tensors`), the bookkeeping
        buffers included: the launches keep this layer's statistics and page mask, and the page update
        writes ``n_complete`` where the selector keeps summaries. Read straight off the buffers: a
        compiled step's trace runs this once or twice a layer."""
        keys, values = self.kv_buffers()
        return {
            "keys": keys,
            "values": values,
            "slot_valid": self.slot_valid,
            "row_start": self.row_start,
            "n_complete": self.n_complete if self.summary else self.row_tensors()[1],
            "length": self.length_t,
            "summary": self.summary,
            "n_pages": self.num_pages,
            "width": self.max_slots,
            "active": self.slots_t,
            "counts": self.counts,
            "row_counts": self.row_counts,
            "pad": self.pad,
            "selection": self.last_selection,
            "tickets": self.tickets,
        }

    def _row_state(self) -> dict[str, torch.Tensor]:
        """The per-row state (batch axis first) other than K/V, by attribute name (summaries as
        ``summary.<name>``)."""
        state = {
            "slot_valid": self.slot_valid,
            "row_start": self.row_start,
            "pad": self.pad,
            "row_counts": self.row_counts,
            "last_selection": self.last_selection,
            "n_complete": self.n_complete,
        }
        return {**state, **{f"summary.{n}": t for n, t in self.summary.items()}}

    def _new_summary(self) -> dict[str, torch.Tensor]:
        """Zeroed summary buffers of the current selector for every page (``{}`` without summaries)."""
        if self.selector is None:
            return {}
        b, h, _, d = self.keys.shape
        B = self.config.page_size
        # The summary layout (names, shapes, dtypes) of one all-zero page, allocated for every page.
        probe = self.summarize_pages(
            self.keys.new_zeros((b, h, 1, B, d)), torch.ones((b, h, 1, B), dtype=torch.bool, device=self.device)
        )
        summary = {n: t.new_zeros((b, h, self.num_pages, *t.shape[3:])) for n, t in probe.items()}
        if not is_torchdynamo_compiling():
            mark_static(*summary.values())
        return summary

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.is_initialized and key_states.shape[0] != self.keys.shape[0]:
            raise ValueError(f"LocksStaticCache holds batch size {self.keys.shape[0]} but got {key_states.shape[0]}")
        t = key_states.shape[2]
        if t > 1 and not is_torchdynamo_compiling():  # prefill is eager: a host check costs nothing there
            held = int(self.cumulative_length) if self.is_initialized else 0
            if held + t > self.max_cache_len:
                raise ValueError(
                    f"LocksStaticCache holds {self.max_cache_len} tokens but {held} + {t} were written: create it "
                    "with max_cache_len >= prompt length + max_new_tokens"
                )
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        self.length_t.copy_(self.cumulative_length.view(1))
        return keys, values

    def kv_buffers(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.keys, self.values

    @property
    def capacity(self) -> int:
        # From the buffer's shape once allocated: a compiled step then specializes on the shape (marked
        # static), not on a Python attribute that changes when the cache grows.
        return self.keys.shape[2] if self.is_initialized else self.max_cache_len

    @property
    def num_pages(self) -> int:
        """The page axis: the whole capacity (a row whose first real slot is ``s`` uses fewer)."""
        return self.capacity // self.config.page_size

    def page_slots(self) -> tuple[int, torch.Tensor | None]:
        """Width of the page lists and the budget in use (``int32 [1]`` page slots on the device)."""
        return self.max_slots, self.slots_t

    def set_budget(self, config: LocksConfig) -> None:
        """Decode with ``config``, which differs from the layer's settings only in its budget, in
        place: no re-allocation, and no recompile up to the widest budget the page lists were sized
        for (wider ones widen them: one recompile, logged). The cache passes one config object to all
        its layers: a compiled step guards on the layers sharing it."""
        if config.replace(budget=self.config.budget) != self.config:
            raise LocksConfigError("set_budget: the new settings may differ from the layer's only in budget")
        self._use_budget(config)
        self.config = config

    def _use_budget(self, config: LocksConfig) -> None:
        if config.page_slots > self.max_slots:
            logger.info(
                "LocksStaticLayer: page lists widened from %d to %d slots (a compiled step recompiles "
                "once; create the cache with max_budget >= %d to avoid it)",
                self.max_slots,
                config.page_slots,
                config.budget,
            )
            self.max_slots = config.page_slots
        if self.slots_t is not None:
            self.slots_t.fill_(config.page_slots)

    def length_tensor(self) -> torch.Tensor:
        """Slots written, ``int32 [1]`` on the cache's device."""
        return self.length_t

    def row_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``row_start`` and the number of complete pages per row, int32 ``[b]``."""
        done = torch.div(self.length_t - self.row_start, self.config.page_size, rounding_mode="floor")
        return self.row_start, done.clamp_min(0).to(torch.int32)

    def summary_view(self) -> dict[str, torch.Tensor]:
        return self.summary

    def real_tokens(self) -> torch.Tensor:
        """Real (non-padding) tokens cached in all rows, a scalar tensor. Only a multi-token forward
        writes padding (decode tokens are real), so the written slots minus the padding counted then:
        no pass over the capacity on a decode step."""
        return (self.length_t - self.pad).sum()

    # -- the attention function's hooks ------------------------------------------------------------
    def prepare(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        """Before attention: on prefill read padding and summarize every page; on decode summarize
        the page this step completed (the backend's `update_newest_page`, or its decode step where the
        backend `summarizes_in_step`, or the cache's launch for several layers, ``page_update_deferred``)."""
        if query_len > 1:
            self._prefill(attention_mask, query_len)
            return
        if not self.backend.counts_row_statistics:
            # per-row statistics: real tokens cached (all of them attended under "full"); decode tokens
            # are real, so a row's count is the written length minus its padding
            context = ((self.length_t - self.pad) * self.keys.shape[1]).to(torch.int64)
            self.row_counts[:, 1] += context
            if self.selector is None:
                self.row_counts[:, 0] += context
        # the page this step completed (the kernels also write the complete-page counts), unless the decode
        # step writes it beside its page choice or the cache's one launch for several layers does
        if self.summary and not self.page_update_deferred and not self.backend.summarizes_in_step(self):
            self.backend.update_newest_page(self)

    def attends_densely(self, query_len: int) -> bool:
        """Dense SDPA for multi-token forwards. Decode steps take the page path (a static graph cannot
        switch on the length); with the ``"full"`` selector on the kernels that attends every page:
        dense flash-decoding over the written length, where SDPA would read the whole capacity through
        a mask. Without the kernels ``"full"`` decodes with SDPA (cheaper than gathering every page)."""
        return query_len > 1 or (self.selector is None and not self.backend.decodes_densely)

    def _prefill(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        self._read_padding(attention_mask, query_len)
        self._sync_complete()
        self._summarize_pages(0)

    def _read_padding(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        """A multi-token forward's padding (from the mask) into ``slot_valid``, ``row_start`` and ``pad``."""
        # Eager (transformers never compiles prefill): host values are fine here.
        end = int(self.cumulative_length)
        if attention_mask is not None:
            mask = attention_mask[..., :end]
            self.slot_valid[:, end - query_len : end] = slot_validity(
                mask, query_len, self.row_start.shape[0], self.device
            )
        slots = torch.arange(end, device=self.device)
        self.row_start.copy_(torch.where(self.slot_valid[:, :end], slots, end).amin(-1).to(torch.int32))
        self.pad.copy_((~self.slot_valid[:, :end]).sum(-1))

    def _sync_complete(self) -> None:
        """``n_complete`` for the current length (eagerly; during decode the page update keeps it)."""
        self.n_complete.copy_(self.row_tensors()[1])

    def _summarize_pages(self, first: int) -> None:
        """Summarize pages ``first ..`` up to the last complete page of any row (eager, one pass)."""
        if self.selector is None:
            return
        n = int(self.row_tensors()[1].max())
        if n <= first:
            return
        b, h = self.keys.shape[:2]
        new = self.summarize_pages(*self.page_inputs(torch.arange(first, n, device=self.device).expand(b, h, -1)))
        for name, tensor in new.items():
            self.summary[name][:, :, first:n] = tensor

    # -- bookkeeping ---------------------------------------------------------------------------------
    def count_buffer(self) -> torch.Tensor:
        return self.counts

    def note_selection(self, pages: torch.Tensor) -> None:
        """Remember the pages a decode step attended (``[b, h, W]``, ``< 0`` = none, no page twice) as
        a page mask, and add the real tokens of those pages to the row's statistics."""
        self.last_selection.copy_(pages_to_mask(pages, self.num_pages))
        taken = self.page_validity_of(pages.clamp_min(0)) & (pages >= 0).unsqueeze(-1)
        self.row_counts[:, 0] += taken.flatten(1).sum(-1)

    def reset_stats(self) -> None:
        if self.is_initialized:
            self.counts.zero_()
            self.row_counts.zero_()

    # -- re-allocation (eager, between forwards; a compiled step recompiles once for new shapes) -------------
    def reallocate(self, capacity: int | None = None, rows: torch.Tensor | None = None) -> None:
        """New buffers (never shared with the old ones): ``capacity`` slots (rounded up to whole pages,
        at least the written length) and/or the batch rows ``rows`` (a row index per new row)."""
        B = self.config.page_size
        if capacity is not None:
            self.max_cache_len = -(-capacity // B) * B
        if not self.is_initialized:
            return
        cap, P = self.max_cache_len, self.max_cache_len // B
        pick = (lambda t: t.index_select(0, rows.to(t.device))) if rows is not None else (lambda t: t)
        self._resize_kv(pick, cap)
        self.batch_size = self.keys.shape[0]
        self.slot_valid = resized(pick(self.slot_valid), 1, cap, fill=True)
        self.row_start, self.pad, self.row_counts, self.n_complete = (
            pick(t).clone() for t in (self.row_start, self.pad, self.row_counts, self.n_complete)
        )
        self.last_selection = resized(pick(self.last_selection), 2, P, fill=False)
        self.summary = {n: resized(pick(t), 2, P) for n, t in self.summary.items()}
        self._stored_layouts = {
            k: ({n: resized(pick(t), 2, P) for n, t in summary.items()}, built)
            for k, (summary, built) in self._stored_layouts.items()
        }
        self.cumulative_length, self.length_t = self.cumulative_length.clone(), self.length_t.clone()
        self.counts, self.slots_t = self.counts.clone(), self.slots_t.clone()
        self.tickets = self.tickets.new_zeros(selection_tickets(self.batch_size * self.kv_heads, P))
        self._mark_static()
        for summary, _ in self._stored_layouts.values():
            mark_static(*summary.values())
        self.refresh_backend()

    def _resize_kv(self, pick, capacity: int) -> None:
        """New K/V buffers of ``capacity`` slots holding the rows ``pick`` takes."""
        self.keys = resized(pick(self.keys), 2, capacity)
        self.values = resized(pick(self.values), 2, capacity)

    def fork(self, config: LocksConfig | None = None, max_slots: int | None = None) -> LocksStaticLayer:
        """An independent copy (fresh buffers) that decodes with ``config`` (see `set_config`: the
        budget switched in place, another summary layout built from the keys in one pass)."""
        new = copy.copy(self)
        new.reallocate()
        if max_slots is not None:
            new.max_slots = max(new.max_slots, max_slots)
        if config is not None:
            new.set_config(config)
        return new

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (as `DynamicCache.crop`). Pages they completed
        are summarized again when decode completes them."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop({tokens_to_remove}): pass a negative number of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        end = max(int(self.cumulative_length) + tokens_to_remove, 0)
        self.cumulative_length.fill_(end)
        self.length_t.fill_(end)
        self.pad.copy_((~self.slot_valid[:, :end]).sum(-1))
        self._sync_complete()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            self.reallocate(rows=torch.arange(self.keys.shape[0]).repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.reallocate(rows=torch.as_tensor(indices).long())

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: reorder every row-indexed buffer in place (their addresses stay static)."""
        if not self.is_initialized:
            return
        idx = beam_idx.to(self.device)
        stored = [t for summary, _ in self._stored_layouts.values() for t in summary.values()]
        for t in (
            *self._kv_tensors(),
            self.slot_valid,
            self.row_start,
            self.pad,
            self.last_selection,
            self.row_counts,
            self.n_complete,
            *self.summary.values(),
            *stored,
        ):
            t.copy_(t.index_select(0, idx))

    def reset(self) -> None:
        if self.is_initialized:
            super().reset()
            self.slot_valid.fill_(True)
            self.row_start.zero_()
            self.pad.zero_()
            self.length_t.zero_()
            self.n_complete.zero_()
            self.last_selection.zero_()
            self.reset_stats()
            for summary, _ in self._stored_layouts.values():  # they hold pages of the old sequence
                for t in summary.values():
                    t.zero_()
            self._stored_layouts = {k: (summary, 0) for k, (summary, _) in self._stored_layouts.items()}

    # -- one prefix, several decode settings (sweeps) -------------------------------------------------
    def rewind(self, length: int) -> None:
        """Forget every slot from ``length`` on: the next token is written at ``length``. Summaries of
        the pages still complete stay valid; pages that become incomplete are masked and summarized
        again once decode completes them. Statistics restart at zero. Eager (reads the length)."""
        held = int(self.cumulative_length) if self.is_initialized else 0
        if not 0 <= length <= held:
            raise ValueError(f"rewind({length}): the layer holds {held} tokens; rewind to 0..{held}")
        if not self.is_initialized:  # nothing written yet: already at 0, and no buffers to reset
            return
        self.cumulative_length.fill_(length)
        self.length_t.fill_(length)
        if length:
            valid = self.slot_valid[:, :length]
            slots = torch.arange(length, device=self.device)
            self.row_start.copy_(torch.where(valid, slots, length).amin(-1))
            self.pad.copy_((~valid).sum(-1))
        else:
            self.row_start.zero_()
            self.pad.zero_()
        self._sync_complete()
        self.last_selection.zero_()
        self.reset_stats()

    def set_config(self, config: LocksConfig) -> None:
        """Decode with other settings from here on (same page size). Summaries are kept per layout
        (`LocksConfig.summary_layout`): switching back to a layout reuses its summaries and builds
        only the pages completed since it was last in use; a new layout summarizes every complete
        page once. Eager: call it between decode runs, not inside a compiled step."""
        if config.page_size != self.config.page_size:
            raise LocksConfigError(
                f"set_config: page_size {config.page_size} differs from the cache's {self.config.page_size}; "
                "the page grid is fixed at creation"
            )
        check_same_kv(self.config, config)
        if config.selector not in static_selector_names() or config.min_context:
            raise LocksConfigError(
                f"set_config: LocksStaticCache supports selector in {static_selector_names()} with "
                f"min_context=0, got selector={config.selector!r} min_context={config.min_context}"
            )
        old, new = self.config.summary_layout, config.summary_layout
        self._use_budget(config)
        self.config, self.selector = config, make_selector(config)
        self.refresh_backend()
        if old == new or not self.is_initialized:
            return
        length = int(self.cumulative_length)
        self._stored_layouts[old] = (self.summary, length)
        if new in self._stored_layouts:
            self.summary, built = self._stored_layouts.pop(new)
            # pages complete at min(built, length) are still those it summarized; later ones are stale
            first = int(
                torch.div(min(built, length) - self.row_start, self.config.page_size, rounding_mode="floor")
                .clamp_min(0)
                .min()
            )
        else:
            self.summary, first = self._new_summary(), 0
        self._summarize_pages(first)
