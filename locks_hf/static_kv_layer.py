"""`QuantizedStaticLayer`: a static Locks layer whose K/V are stored KIVI-quantized (`locks_hf.kv_quant`).

``LocksStaticLayer(capacity, config)`` is this class when ``config.kv_bits`` is 2 or 4. It keeps the
static layout's contract (buffers allocated once, every per-step quantity a device tensor, no host
synchronisation in a decode step) with the storage and the schedule of the dynamic quantized layer
(`locks_hf.kv_cache.QuantizedLocksLayer`), so that both layouts give the same codes and tokens:

* packed codes, scales and zero points for the whole capacity, laid out as `kernels.attend_quant` reads
  them (keys per channel over groups of ``kv_group`` slots, values per slot over groups of channels);
* the newest slots in full precision in a ring of `kernels.kivi.ring_slots` slots (slot ``s`` at
  ``s % ring``): KIVI's residual plus the slack by which "post" summaries may hold key quantization;
* ``quantized``, the ``int32 [2]`` device tensor ``(qk, qv)``: keys of slots ``< qk`` and values of slots
  ``< qv`` are quantized.

A decode step first quantizes what the previous forward left due and writes its token into the ring:
one launch on the GPU (`kernels.kivi`), fixed-shape tensor code on the reference path
(`backends.reference.reference_append_kv`). A multi-token forward (prefill) is eager, as in the dynamic layer: attention
gets the dequantized slots followed by the forward's own full-precision K/V; then the completed pages
are summarized from full-precision keys and what is due is quantized. The full-precision K/V of a
prompt exist only for its forward: a chunked prefill keeps one chunk's.

Summaries are built from the keys before they are quantized (``summary_from="post"``, the dynamic
layer's order); ``"pre"``, the oracle and exact re-ranking (which read arbitrary pages' keys) need the
dynamic layout. A decode step's K/V arguments hold no data (zero tensors expanded over the capacity):
the kernels and `page_keys` read the packed storage.
"""

from __future__ import annotations

import torch

from .buffers import mark_static
from .config import LocksConfig
from .kv_quant import (
    check_kv_head_dim,
    dequantize_keys,
    dequantize_values,
    due_counts,
    kv_token_bytes,
    quantize_keys,
    quantize_values,
)
from .static_layer import LocksStaticLayer

__all__ = ["QuantizedStaticLayer", "ring_slots", "static_refusal"]


def ring_slots(config: LocksConfig) -> int:
    """Slots of the full-precision ring: KIVI's residual, the token written before the due slots are
    quantized and the slack of a page and a group ("post" summaries in a padded batch), a power of two."""
    need = config.kv_residual + config.page_size + config.kv_group + 1
    return 1 << (need - 1).bit_length()


def static_refusal(config: LocksConfig) -> str | None:
    """Why the static layout cannot store ``config``'s quantized KV (``None`` if it can)."""
    if config.kv_bits == 16:
        return None
    from .selectors import selector_class

    cls = selector_class(config.selector)
    if config.summary_from != "post" and not cls.dense:
        return (
            f"summary_from={config.summary_from!r} on quantized KV: the static layout builds summaries from the "
            "keys before they are quantized ('post'); 'pre' rebuilds them from dequantized keys, which the "
            "dynamic layout does"
        )
    if cls.reads_keys or config.rerank:
        return (
            f"selector {config.selector!r}{' with rerank' if config.rerank else ''} reads every candidate page's "
            "keys, which a static quantized layer does not dequantize in its compiled step"
        )
    return None


class QuantizedStaticLayer(LocksStaticLayer):
    """A `LocksStaticLayer` storing its K/V KIVI-quantized (see the module docstring)."""

    stored_kv_bits = (2, 4)

    def __init__(self, max_cache_len: int, config: LocksConfig, max_slots: int | None = None, **kwargs) -> None:
        refusal = static_refusal(config)
        if refusal:
            from .errors import LocksConfigError

            raise LocksConfigError(f"{refusal}; use LocksCache(..., layout='dynamic')")
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # a multi-token forward's K/V
        super().__init__(max_cache_len, config, max_slots, **kwargs)

    # -- storage ---------------------------------------------------------------------------------
    def _init_kv(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        check_kv_head_dim(cfg, d, dv)
        self.device = key_states.device
        self.batch_size, self.num_heads = b, h
        self.k_head_dim, self.v_head_dim = d, dv
        self.cumulative_length = self.cumulative_length.to(self.device)
        self.kv_dtype = key_states.dtype
        self._allocate_kv(b, self.max_cache_len)
        self.is_initialized = True

    def _allocate_kv(self, b: int, capacity: int) -> None:
        """Zeroed packed storage and rings for ``b`` rows of ``capacity`` slots, and the placeholders. The
        packed storage has a ring's worth of spare slots past the capacity: the reference step quantizes a
        fixed window of slots from ``qk`` / ``qv`` and writes back what is not due, so its window must not
        wrap onto slots it quantizes."""
        cfg, h, d, dv = self.config, self.num_heads, self.k_head_dim, self.v_head_dim
        per, G, ring = 8 // cfg.kv_bits, cfg.kv_group, ring_slots(cfg)
        dev = self.device
        slots = capacity + ring
        self.key_codes = torch.zeros((b, h, slots, d // per), dtype=torch.uint8, device=dev)
        self.key_scale = torch.zeros((b, h, -(-slots // G), d), dtype=self.kv_dtype, device=dev)
        self.key_zero = torch.zeros_like(self.key_scale)
        self.value_codes = torch.zeros((b, h, slots, dv // per), dtype=torch.uint8, device=dev)
        self.value_scale = torch.zeros((b, h, slots, dv // G), dtype=self.kv_dtype, device=dev)
        self.value_zero = torch.zeros_like(self.value_scale)
        self.key_ring = torch.zeros((b, h, ring, d), dtype=self.kv_dtype, device=dev)
        self.value_ring = torch.zeros((b, h, ring, dv), dtype=self.kv_dtype, device=dev)
        self.quantized = torch.zeros(2, dtype=torch.int32, device=dev)
        self.counter = torch.zeros(1, dtype=torch.int32, device=dev)  # the append kernel's arrivals
        self._placeholders(b, capacity)

    def _placeholders(self, b: int, capacity: int) -> None:
        """What a decode step hands attention as K/V: zeros expanded over the capacity (no memory)."""
        h = self.num_heads
        self.keys = torch.zeros((1, 1, 1, self.k_head_dim), dtype=self.kv_dtype, device=self.device).expand(
            b, h, capacity, -1
        )
        self.values = torch.zeros((1, 1, 1, self.v_head_dim), dtype=self.kv_dtype, device=self.device).expand(
            b, h, capacity, -1
        )

    def _kv_tensors(self) -> list[torch.Tensor]:
        return [
            self.key_codes,
            self.key_scale,
            self.key_zero,
            self.value_codes,
            self.value_scale,
            self.value_zero,
            self.key_ring,
            self.value_ring,
        ]

    def _mark_static(self) -> None:
        super()._mark_static()
        mark_static(self.quantized, self.counter)

    def _resize_kv(self, pick, capacity: int) -> None:
        old = self._kv_tensors()
        qk, qv = (int(n) for n in self.quantized.tolist())
        quantized, b = self.quantized.clone(), pick(self.key_ring).shape[0]
        self._allocate_kv(b, capacity)
        G = self.config.kv_group
        keep = (qk, -(-qk // G), qk, qv, qv, qv, None, None)  # written slots (rings: whole)
        for new, src, n in zip(self._kv_tensors(), old, keep):
            src = pick(src)
            n = src.shape[2] if n is None else min(n, src.shape[2], new.shape[2])
            new[:, :, :n].copy_(src[:, :, :n])
        self.quantized = quantized

    @property
    def capacity(self) -> int:
        # from the storage's shape (spare slots excluded), whatever a prefill hands attention meanwhile
        return self.key_codes.shape[2] - self.key_ring.shape[2] if self.is_initialized else self.max_cache_len

    def kv_buffers(self) -> tuple[None, None]:
        # No full-precision buffers: the bf16 kernels never take this layer (`packed_kv` is its storage).
        return None, None

    def packed_kv(self) -> dict | None:
        """The storage as `kernels.quantized_attention` reads it (see `QuantizedLocksLayer.packed_kv`); the
        tails are the rings (``ring``: their slots)."""
        if not self.is_initialized:
            return None
        cfg = self.config
        return dict(
            key_codes=self.key_codes,
            key_scale=self.key_scale,
            key_zero=self.key_zero,
            value_codes=self.value_codes,
            value_scale=self.value_scale,
            value_zero=self.value_zero,
            key_tail=self.key_ring,
            value_tail=self.value_ring,
            quantized=self.quantized,
            bits=cfg.kv_bits,
            group=cfg.kv_group,
            ring=self.key_ring.shape[2],
            page_size=cfg.page_size,
            slot_valid=self.slot_valid,
            row_start=self.row_start,
            length=self.length_t,
        )

    def append_buffers(self) -> dict:
        """What a decode step's write reads and updates (`DecodeBackend.append_kv`): `packed_kv`'s storage,
        the arrival ``counter`` of the kernel and ``post`` (whether key quantization waits for the pages'
        summaries: a selector that keeps them)."""
        packed = self.packed_kv()
        assert packed is not None  # a decode step writes into an initialized layer
        return {**packed, "counter": self.counter, "post": self.selector is not None}

    def storage_bytes(self) -> dict[str, int]:
        """Bytes the written slots occupy (as `QuantizedLocksLayer.storage_bytes`): the quantized slots'
        codes, scales and zero points, and the full-precision ring (all of it: it is allocated)."""
        qk, qv = (int(n) for n in self.quantized.tolist())
        G = self.config.kv_group

        def nbytes(t: torch.Tensor, n: int) -> int:
            return t[:, :, :n].numel() * t.element_size()

        quantized = (
            nbytes(self.key_codes, qk)
            + 2 * nbytes(self.key_scale, qk // G)
            + nbytes(self.value_codes, qv)
            + 2 * nbytes(self.value_scale, qv)
        )
        b, h = self.key_ring.shape[:2]
        ring = (self.key_ring.numel() + self.value_ring.numel()) * self.key_ring.element_size()
        return {"quantized": quantized, "quantized_tokens": b * h * (qk + qv), "full_precision": ring}

    def attended_kv_bytes(self) -> int:
        """The attended K/V at their packed size (codes and their share of scales and zero points); the
        few attended slots still in the ring (at most the residual a step) are counted packed too."""
        key, value = kv_token_bytes(self.config, self.k_head_dim, self.v_head_dim, self.key_ring.element_size())
        attended = self.attended
        assert attended is not None  # asked after decode steps
        return round(int(attended) * (key + value))

    # -- writes ------------------------------------------------------------------------------------
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        elif key_states.shape[0] != self.batch_size:
            raise ValueError(f"LocksStaticCache holds batch size {self.batch_size} but got {key_states.shape[0]}")
        t = key_states.shape[2]
        if t == 1:  # a decode step: quantize what is due, then the token goes into the ring
            self.backend.append_kv(self, key_states.to(self.kv_dtype), value_states.to(self.kv_dtype))
            self.cumulative_length.add_(1)
            self.length_t.add_(1)
            assert self.keys is not None and self.values is not None  # the placeholders
            return self.keys, self.values
        held = int(self.cumulative_length)
        if held + t > self.max_cache_len:
            raise ValueError(
                f"LocksStaticCache holds {self.max_cache_len} tokens but {held} + {t} were written: create it "
                "with max_cache_len >= prompt length + max_new_tokens"
            )
        self._flush(held, self._dequantized(held))  # what a decode step before this forward left due
        keys, values = self._dequantized(held)
        self._pending = (
            torch.cat([keys, key_states.to(self.kv_dtype)], dim=2),
            torch.cat([values, value_states.to(self.kv_dtype)], dim=2),
        )
        self.cumulative_length.add_(t)
        self.length_t.add_(t)
        self.keys, self.values = self._pending  # what attention receives (the hand-off checks them)
        return self.keys, self.values

    def _dequantized(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of slots ``[0, length)`` in full precision (eager)."""
        slots = torch.arange(length, device=self.device).expand(self.batch_size, self.num_heads, -1)
        return self._gather(slots, values=False), self._gather(slots, values=True)

    def _flush(self, length: int, full: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Eagerly quantize what KIVI holds quantized once ``length`` tokens are attended, from ``full`` (the
        full-precision keys and values of slots ``[0, length)``), and leave the rest in the rings."""
        cfg = self.config
        G, B = cfg.kv_group, cfg.page_size
        qk, qv = (int(n) for n in self.quantized.tolist())
        bound = None
        if self.selector is not None:  # "post": keys wait for their page's summary (the first incomplete page)
            rs = self.row_start.long()
            bound = int((rs + (length - rs).clamp_min(0) // B * B).min())
        keys_to, values_to = due_counts(length, (qk, qv), residual=cfg.kv_residual, group=G, first_unsummarized=bound)
        keys, values = full
        valid = self.slot_valid[:, :length]
        if keys_to > qk:
            codes, scale, zero = quantize_keys(keys[:, :, qk:keys_to], cfg.kv_bits, G, valid[:, qk:keys_to])
            self.key_codes[:, :, qk:keys_to] = codes
            self.key_scale[:, :, qk // G : keys_to // G] = scale
            self.key_zero[:, :, qk // G : keys_to // G] = zero
        if values_to > qv:
            codes, scale, zero = quantize_values(values[:, :, qv:values_to], cfg.kv_bits, G, valid[:, qv:values_to])
            self.value_codes[:, :, qv:values_to] = codes
            self.value_scale[:, :, qv:values_to] = scale
            self.value_zero[:, :, qv:values_to] = zero
        ring = self.key_ring.shape[2]
        for buf, src, first in ((self.key_ring, keys, keys_to), (self.value_ring, values, values_to)):
            if length - first > ring:
                raise AssertionError(f"{length - first} full-precision slots do not fit a ring of {ring}")
            slots = torch.arange(first, length, device=self.device)
            buf.index_copy_(2, slots % ring, src[:, :, first:length])
        self.quantized.copy_(torch.tensor([keys_to, values_to], dtype=torch.int32))

    # -- reads -------------------------------------------------------------------------------------
    def _gather(self, slots: torch.Tensor, values: bool) -> torch.Tensor:
        """Keys (or values) ``[b, h, n, d]`` of ``slots [b, h, n]``: the quantized ones dequantized, the
        others from the ring (or from the pending forward's K/V); no host synchronisation."""
        if self._pending is not None:
            full = self._pending[1 if values else 0]
            index = slots.clamp(0, full.shape[2] - 1).unsqueeze(-1).expand(-1, -1, -1, full.shape[-1])
            return full.gather(2, index)
        bits, G = self.config.kv_bits, self.config.kv_group
        slots = slots.clamp(0, self.capacity - 1)  # out-of-range slots read a written one (callers mask them)
        ring = self.value_ring if values else self.key_ring

        def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))

        full = take(ring, slots % ring.shape[2])
        if values:
            deq = dequantize_values(
                take(self.value_codes, slots),
                take(self.value_scale, slots),
                take(self.value_zero, slots),
                bits,
                ring.dtype,
            )
        else:
            group = slots // G
            deq = dequantize_keys(
                take(self.key_codes, slots), take(self.key_scale, group), take(self.key_zero, group), bits, ring.dtype
            )
        first = self.quantized[1 if values else 0].long()
        return torch.where((slots >= first).unsqueeze(-1), full, deq)

    def page_keys(self, pages: torch.Tensor, values: bool = False) -> torch.Tensor:
        slots = self._page_slots(pages)  # [b, h, n, B]
        return self._gather(slots.flatten(2), values).unflatten(2, slots.shape[2:])

    def all_page_keys(self) -> torch.Tensor:
        b, h = self.batch_size, self.num_heads
        return self.page_keys(torch.arange(self.num_pages, device=self.device).expand(b, h, -1))

    # -- the attention function's hooks ------------------------------------------------------------
    def attends_densely(self, query_len: int) -> bool:
        # a decode step's K/V arguments hold no data: every decode step reads the packed storage
        return query_len > 1

    def _prefill(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        done = self.n_complete.clone()  # pages each row had summarized before this forward
        self._read_padding(attention_mask, query_len)
        self._sync_complete()
        self._summarize_new_pages(int(done.min()), done)
        assert self._pending is not None  # set by the update of this forward
        self._flush(int(self.cumulative_length), self._pending)
        self._pending = None
        self._placeholders(self.batch_size, self.capacity)

    def _summarize_new_pages(self, first: int, done: torch.Tensor) -> None:
        """Summarize each row's pages completed by this forward (from ``done[row]`` on) from full-precision
        keys; pages a row had already summarized keep theirs (built before their keys were quantized)."""
        if self.selector is None:
            return
        n = int(self.row_tensors()[1].max())
        if n <= first:
            return
        b, h = self.batch_size, self.num_heads
        pages = torch.arange(first, n, device=self.device)
        new = self.summarize_pages(*self.page_inputs(pages.expand(b, h, -1)))
        fresh = pages[None, :] >= done.long()[:, None]  # [b, n - first]
        for name, tensor in new.items():
            old = self.summary[name][:, :, first:n]
            keep = fresh.view(b, 1, -1, *([1] * (tensor.dim() - 3)))
            self.summary[name][:, :, first:n] = torch.where(keep, tensor, old)

    # -- state --------------------------------------------------------------------------------------
    def reset(self) -> None:
        if not self.is_initialized:
            return
        for t in (*self._kv_tensors(), self.quantized):
            t.zero_()
        self.cumulative_length.zero_()
        self._pending = None
        self.slot_valid.fill_(True)
        self.row_start.zero_()
        self.pad.zero_()
        self.length_t.zero_()
        self.n_complete.zero_()
        self.last_selection.zero_()
        self.reset_stats()
        for summary, _ in self._stored_layouts.values():
            for t in summary.values():
                t.zero_()
        self._stored_layouts = {k: (summary, 0) for k, (summary, _) in self._stored_layouts.items()}

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            keep = max(int(self.cumulative_length) + tokens_to_remove, 0)
            qk, qv = (int(n) for n in self.quantized.tolist())
            if keep < max(qk, qv):
                raise ValueError(
                    f"crop({tokens_to_remove}): the cache holds {int(self.cumulative_length)} tokens, keys quantized "
                    f"up to slot {qk} and values up to {qv}; quantized groups cannot be reopened, so at most "
                    f"{int(self.cumulative_length) - max(qk, qv)} tokens can be cropped"
                )
        super().crop(tokens_to_remove)

    def rewind(self, length: int) -> None:
        held = int(self.cumulative_length) if self.is_initialized else 0
        if length != held:
            raise ValueError(
                f"rewind({length}): a static layer storing quantized KV cannot go back from {held} tokens (its "
                "newest full-precision slots were overwritten and quantized groups cannot be reopened); fork "
                "the prefilled cache for each decode instead"
            )
        super().rewind(length)
