"""`QuantizedLocksLayer`: a dynamic Locks layer whose K/V are stored KIVI-quantized (`locks_hf.kv_quant`).

``LocksLayer(config)`` is this class when ``config.kv_bits`` is 2 or 4. Storage, per layer:

* keys of slots ``[0, qk)``: packed codes ``[b, h, capacity, d*bits/8]`` (uint8) and a scale and zero
  point per channel for each group of ``kv_group`` slots, ``[b, h, capacity/kv_group, d]``;
* values of slots ``[0, qv)``: packed codes and a scale and zero point per group of ``kv_group``
  channels of each slot, ``[b, h, capacity, d/kv_group]``;
* the newer slots in full precision (KIVI's residual): keys ``[qk, length)``, values ``[qv, length)``.

No full-precision copy of the quantized slots is kept. When each part is quantized follows KIVI's
reference code: a forward attends what the previous one left (so the tokens of the current forward
are full precision); after a multi-token forward (prefill) every complete ``kv_residual`` chunk of
keys and all values but the last ``kv_residual`` are quantized, and during decode keys are quantized
``kv_residual`` at a time once that many are full precision, values one at a time as they leave the
last ``kv_residual``. Quantization groups are aligned to the cache's slots (as KIVI, which has no
padding); padding slots are left out of a group's range.

Summaries (``summary_from``): ``"post"`` builds a page's summary from its full-precision keys (keys
are never quantized before their page is summarized: with ``kv_residual`` a multiple of ``page_size``
this never delays KIVI's schedule for unpadded rows); ``"pre"`` builds it from the keys as stored, and
rebuilds it when they are quantized, so that it always describes the dequantized keys that attention
reads.

What attention receives: a multi-token forward gets the dequantized slots followed by the full-precision
ones (for a prefill that is the full-precision K/V, as in KIVI); so does a decode step that attends
densely (``"full"``, short contexts, the token-level baselines, which read ``keys`` / ``values``). A
page-selected decode step gets tensors of the right shape that hold no data (a zero expanded over the
slots): the reference path reads and dequantizes only the selected pages (`page_keys`), never the
whole cache.
"""

from __future__ import annotations

import torch

from .buffers import resized_keeping as _resized
from .dynamic_layer import LocksLayer
from .kv_quant import (
    builds_summaries,
    check_kv_head_dim,
    dequantize_keys,
    dequantize_values,
    due_counts,
    full_precision,
    kv_token_bytes,
    quantize_keys,
    quantize_values,
)


class QuantizedLocksLayer(LocksLayer):
    """A `LocksLayer` storing its K/V KIVI-quantized (see the module docstring)."""

    stored_kv_bits = (2, 4)
    _STORAGE = ("_kcodes", "_kscale", "_kzero", "_vcodes", "_vscale", "_vzero", "_kres", "_vres")

    def _clear(self) -> None:
        for name in self._STORAGE:  # first: `LocksLayer._clear` chooses the backend (`packed_kv`)
            setattr(self, name, None)
        super()._clear()
        self._qk = self._qv = 0  # keys of slots < _qk and values of slots < _qv are quantized
        self._cap = 0
        self._step_pages = None  # pages noted by this decode step's selection (traffic accounting)

    def reset_stats(self) -> None:
        super().reset_stats()
        # attended tokens whose key / value was read from the full-precision tail: kept on the device
        # (created at the first step), so that a decode step's accounting never waits for the GPU
        self._tail: torch.Tensor | None = None

    # -- storage ---------------------------------------------------------------------------------
    def kv_buffers(self) -> tuple[None, None]:
        # No full-precision buffers exist: the full-precision kernels never take this layer; its pages
        # are read through `page_keys` (dequantized) or `packed_kv` (the quantized-KV kernel).
        return None, None

    def packed_kv(self) -> dict | None:
        """The stored K/V as `locks_hf.kernels.quantized_attention` reads them (its keyword arguments but
        the query, pages, scale, ``n_pages`` and ``counts``): packed codes, scales and zero points
        (capacity-wide, written up to ``quantized = (qk, qv)``), the full-precision tails (``key_tail``
        holds slots ``qk ..``, ``value_tail`` slots ``qv ..``; ``quantized`` is ``(qk, qv)`` as an ``int32
        [2]`` device tensor, a new one when they change), ``bits``, ``group``, ``page_size`` and the page
        bookkeeping (``slot_valid``, ``row_start``, ``length`` as device tensors). ``None`` before the
        storage is allocated."""
        if self._kres is None:
            return None
        cfg = self.config
        if getattr(self, "_quantized_cache", (None,))[0] != (self._qk, self._qv):
            # two fills, not a copy from the host: a pageable host-to-device copy waits for the stream,
            # and values are quantized one token a step
            counts = torch.empty(2, dtype=torch.int32, device=self.device)
            counts[0].fill_(self._qk)
            counts[1].fill_(self._qv)
            self._quantized_cache = ((self._qk, self._qv), counts)
        return dict(
            key_codes=self._kcodes,
            key_scale=self._kscale,
            key_zero=self._kzero,
            value_codes=self._vcodes,
            value_scale=self._vscale,
            value_zero=self._vzero,
            key_tail=self._kres,
            value_tail=self._vres,
            quantized=self._quantized_cache[1],
            bits=cfg.kv_bits,
            group=cfg.kv_group,
            page_size=cfg.page_size,
            slot_valid=self.slot_valid,
            row_start=self.row_tensors()[0],
            length=self.length_tensor(),
        )

    @property
    def capacity(self) -> int:
        return self._cap

    @property
    def _dims(self) -> tuple[int, int, int, int]:
        """``(b, h, key head_dim, value head_dim)``."""
        b, h, _, d = self._kres.shape
        return b, h, d, self._vres.shape[-1]

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        check_kv_head_dim(self.config, key_states.shape[-1], value_states.shape[-1])
        super().lazy_initialization(key_states, value_states)
        self._init_storage(key_states, value_states)

    def _init_storage(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cfg = self.config
        b, h, _, d = key_states.shape
        dv = value_states.shape[-1]
        per = 8 // cfg.kv_bits
        self._kbuf = self._vbuf = None
        self._kres = key_states.new_empty((b, h, 0, d))
        self._vres = value_states.new_empty((b, h, 0, dv))
        self._kcodes = key_states.new_empty((b, h, 0, d // per), dtype=torch.uint8)
        self._kscale, self._kzero = key_states.new_empty((b, h, 0, d)), key_states.new_empty((b, h, 0, d))
        self._vcodes = value_states.new_empty((b, h, 0, dv // per), dtype=torch.uint8)
        groups = dv // cfg.kv_group
        self._vscale, self._vzero = (
            value_states.new_empty((b, h, 0, groups)),
            value_states.new_empty((b, h, 0, groups)),
        )
        self._qk = self._qv = self._cap = 0
        self.refresh_backend()  # the storage's device, dtype and head dims are known

    def _resize_kv(self, capacity: int, length: int) -> None:
        G, qk, qv = self.config.kv_group, self._qk, self._qv
        self._kcodes = _resized(self._kcodes, 2, capacity, qk)
        self._kscale = _resized(self._kscale, 2, -(-capacity // G), qk // G)
        self._kzero = _resized(self._kzero, 2, -(-capacity // G), qk // G)
        self._vcodes = _resized(self._vcodes, 2, capacity, qv)
        self._vscale = _resized(self._vscale, 2, capacity, qv)
        self._vzero = _resized(self._vzero, 2, capacity, qv)
        self._cap = capacity

    def storage_bytes(self) -> dict[str, int]:
        """Bytes the written slots occupy: ``quantized`` (codes, scales and zero points of the quantized
        slots), ``full_precision`` (the residual), ``quantized_tokens`` (slot-heads: keys and values
        counted apart, so ``quantized / quantized_tokens`` is the mean size of one token's key or value)."""
        G = self.config.kv_group

        def nbytes(t: torch.Tensor, n: int) -> int:
            return t[:, :, :n].numel() * t.element_size()

        quantized = (
            nbytes(self._kcodes, self._qk)
            + nbytes(self._kscale, self._qk // G)
            + nbytes(self._kzero, self._qk // G)
            + nbytes(self._vcodes, self._qv)
            + nbytes(self._vscale, self._qv)
            + nbytes(self._vzero, self._qv)
        )
        b, h = self._dims[:2]
        return {
            "quantized": quantized,
            "quantized_tokens": b * h * (self._qk + self._qv),
            "full_precision": nbytes(self._kres, self._kres.shape[2]) + nbytes(self._vres, self._vres.shape[2]),
        }

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._check_batch(key_states)
        T, t = self.length, key_states.shape[2]
        self._flush(T)  # what KIVI quantizes after the previous forward's attention
        if T + t > self.capacity:
            self._grow(T + t)
        self._kres = torch.cat([self._kres, key_states.to(self._kres.dtype)], dim=2)
        self._vres = torch.cat([self._vres, value_states.to(self._vres.dtype)], dim=2)
        self.slot_valid[:, T : T + t] = True
        self.length = T + t
        if t != 1 or self.attends_densely(1) or self.selector.token_level:
            # attention reads every slot: a full-precision copy, held until `release_forward_kv`
            self.keys, self.values = self._dequantized(values=False), self._dequantized(values=True)
        else:  # a page-selected decode step: attention reads the selected pages only (`page_keys`)
            self._refresh_views()
        return self.keys, self.values

    def _refresh_views(self) -> None:
        # Between forwards the layer holds no full-precision copy: zeros expanded over the written
        # slots (no memory), so that the K/V's shape is known but a dequantized cache is never kept.
        if self._kres is None:
            return
        b, h, d, dv = self._dims
        self.keys = self._kres.new_zeros((b, h, 1, d)).expand(b, h, self.length, d)
        self.values = self._vres.new_zeros((b, h, 1, dv)).expand(b, h, self.length, dv)

    def release_forward_kv(self) -> None:
        self._refresh_views()

    def _dequantized(self, values: bool) -> torch.Tensor:
        """Every written slot's key (or value): the quantized ones dequantized, then the full-precision tail."""
        bits, G = self.config.kv_bits, self.config.kv_group
        if values:
            n, tail = self._qv, self._vres
            head = dequantize_values(
                self._vcodes[:, :, :n], self._vscale[:, :, :n], self._vzero[:, :, :n], bits, tail.dtype
            )
        else:
            n, tail = self._qk, self._kres
            head = dequantize_keys(
                self._kcodes[:, :, :n],
                self._kscale[:, :, : n // G].repeat_interleave(G, 2),
                self._kzero[:, :, : n // G].repeat_interleave(G, 2),
                bits,
                tail.dtype,
            )
        return torch.cat([head, tail], dim=2)

    def _gather(self, slots: torch.Tensor, values: bool) -> torch.Tensor:
        """Keys (or values) ``[b, h, n, d]`` of ``slots [b, h, n]``, dequantizing only those slots;
        slots outside the written range read a written one (callers mask them)."""
        bits, G = self.config.kv_bits, self.config.kv_group
        slots = slots.clamp(0, max(self.length - 1, 0))
        q, tail = (self._qv, self._vres) if values else (self._qk, self._kres)

        def take(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return t.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, t.shape[-1]))

        full = take(tail, (slots - q).clamp(0, max(tail.shape[2] - 1, 0))) if tail.shape[2] else None
        if q == 0:
            return full
        index = slots.clamp(max=q - 1)
        if values:
            deq = dequantize_values(
                take(self._vcodes, index), take(self._vscale, index), take(self._vzero, index), bits, tail.dtype
            )
        else:
            group = index // G
            deq = dequantize_keys(
                take(self._kcodes, index), take(self._kscale, group), take(self._kzero, group), bits, tail.dtype
            )
        return deq if full is None else torch.where((slots >= q).unsqueeze(-1), full, deq)

    def page_keys(self, pages: torch.Tensor, values: bool = False) -> torch.Tensor:
        slots = self._page_slots(pages)  # [b, h, n, B]
        return self._gather(slots.flatten(2), values).unflatten(2, slots.shape[2:])

    def all_page_keys(self) -> torch.Tensor:
        b, h = self._dims[:2]
        return self.page_keys(torch.arange(self.num_pages, device=self.device).expand(b, h, -1))

    # -- quantization schedule ------------------------------------------------------------------------
    def _summaries_from_keys(self) -> bool:
        return self.selector is not None and builds_summaries(type(self.selector))

    def _flush(self, done: int) -> None:
        """Quantize what KIVI holds quantized once ``done`` tokens have been attended: keys in whole
        chunks of ``kv_residual``, values all but the last ``kv_residual``."""
        cfg = self.config
        bound = None
        if cfg.summary_from == "post" and self._summaries_from_keys():
            # never before the page is summarized from its full-precision keys (binds for padded rows only)
            B = cfg.page_size
            bound = min((s + n * B for s, n in zip(self.row_start, self.n_summarized)), default=0)
        keys_to, values_to = due_counts(
            done, (self._qk, self._qv), residual=cfg.kv_residual, group=cfg.kv_group, first_unsummarized=bound
        )
        if keys_to > self._qk:
            self._quantize_keys(keys_to)
        if values_to > self._qv:
            self._quantize_values(values_to)

    def _quantize_keys(self, upto: int) -> None:
        cfg, qk = self.config, self._qk
        n = upto - qk
        codes, scale, zero = quantize_keys(self._kres[:, :, :n], cfg.kv_bits, cfg.kv_group, self.slot_valid[:, qk:upto])
        G = cfg.kv_group
        self._kcodes[:, :, qk:upto] = codes
        self._kscale[:, :, qk // G : upto // G] = scale
        self._kzero[:, :, qk // G : upto // G] = zero
        self._kres = self._kres[:, :, n:].clone()  # a copy: the full-precision keys are released
        self._qk = upto
        if cfg.summary_from == "pre" and self._summaries_from_keys():
            # pages holding newly quantized keys are summarized again, from the dequantized keys
            B = cfg.page_size
            self.n_summarized = [
                min(n_done, max(qk - s, 0) // B) for n_done, s in zip(self.n_summarized, self.row_start)
            ]

    def _quantize_values(self, upto: int) -> None:
        cfg, qv = self.config, self._qv
        n = upto - qv
        codes, scale, zero = quantize_values(
            self._vres[:, :, :n], cfg.kv_bits, cfg.kv_group, self.slot_valid[:, qv:upto]
        )
        self._vcodes[:, :, qv:upto] = codes
        self._vscale[:, :, qv:upto] = scale
        self._vzero[:, :, qv:upto] = zero
        self._vres = self._vres[:, :, n:].clone()
        self._qv = upto

    def prepare(self, attention_mask: torch.Tensor | None, query_len: int) -> None:
        if query_len == 1:
            return super().prepare(attention_mask, query_len)
        # After a multi-token forward (which attends the full-precision K/V it was handed) KIVI quantizes
        # at once; here after the padding is known, so that it stays out of the groups' ranges. "pre"
        # summarizes the quantized keys, "post" the full-precision ones before quantizing them.
        self.mark_padding(attention_mask, query_len)
        pre = self.config.summary_from == "pre"
        if pre:
            self._flush(self.length)
        self.summarize_completed()
        if not pre:
            self._flush(self.length)

    # -- state hooks ------------------------------------------------------------------------------------
    def _apply(self, fn, rows: list[int]) -> None:
        if self.is_initialized:
            for name in self._STORAGE:
                setattr(self, name, fn(getattr(self, name)))
        super()._apply(fn, rows)

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove < 0 and self.is_initialized:
            keep = max(self.length + tokens_to_remove, 0)
            if keep < max(self._qk, self._qv):
                raise ValueError(
                    f"crop({tokens_to_remove}): the cache holds {self.length} tokens, keys quantized up to slot "
                    f"{self._qk} and values up to {self._qv}; quantized groups cannot be reopened, so at most "
                    f"{self.length - max(self._qk, self._qv)} tokens can be cropped"
                )
            self._kres = self._kres[:, :, : keep - self._qk]
            self._vres = self._vres[:, :, : keep - self._qv]
        super().crop(tokens_to_remove)

    # -- accounting -------------------------------------------------------------------------------------
    def _token_bytes(self) -> tuple[float, float, int]:
        b, h, d, dv = self._dims
        size = self._kres.element_size()
        key, value = kv_token_bytes(self.config, d, dv, size)
        return key, value, size

    def key_read_bytes(self, tokens: int, every: bool = False) -> int:
        b, h, d, _ = self._dims
        key, _, size = self._token_bytes()
        if every:  # the quantized keys at their packed size, the full-precision tail at its own
            return round(b * h * (self._qk * key + (self.length - self._qk) * d * size))
        # keys of shortlisted pages: at the packed size (the full-precision tail is the last few pages)
        return round(b * h * tokens * key)

    def note_selection(self, pages: torch.Tensor) -> None:
        super().note_selection(pages)
        self._step_pages = pages

    def record_step(self, attended: torch.Tensor | None, context: torch.Tensor) -> None:
        super().record_step(attended, context)
        pages, self._step_pages = self._step_pages, None
        if pages is None:
            # A dense step reads every real full-precision slot; a token-level policy's step (which keeps
            # its own mask) is counted as reading as many of them as it attended tokens, at most.
            h = self._dims[1]
            real = self.slot_valid[:, : self.length]
            tail = torch.stack([real[:, self._qk :].sum(), real[:, self._qv :].sum()]) * h
            if attended is not None:
                tail = tail.clamp(max=attended)
        else:
            chosen = pages.clamp(min=0)
            ok = self.page_validity_of(chosen) & (pages >= 0).unsqueeze(-1)
            slots = self._page_slots(chosen)
            tail = torch.stack([(ok & (slots >= self._qk)).sum(), (ok & (slots >= self._qv)).sum()])
        self._tail = tail if self._tail is None else self._tail + tail

    def attended_kv_bytes(self) -> int:
        """The attended K/V at their stored size: packed codes plus their share of the scales and zero
        points, and the full-precision tail at its dtype's size."""
        b, h, d, dv = self._dims
        key, value, size = self._token_bytes()
        tokens = int(self.attended)
        tail = [0, 0] if self._tail is None else self._tail.tolist()
        return round(tokens * (key + value) + tail[0] * (d * size - key) + tail[1] * (dv * size - value))


def to_quantized(layer: LocksLayer, config) -> QuantizedLocksLayer:
    """A quantized layer holding what the full-precision ``layer`` (which it takes over) holds, as
    a cache with ``config`` would hold it after the same forwards: "post" summaries are built from the
    full-precision keys first, "pre" ones rebuilt from the stored keys at the next forward."""
    layer.set_config(full_precision(config))
    if config.summary_from == "post":
        layer.summarize_completed()
    new = QuantizedLocksLayer(config)
    new.__dict__.update(
        {
            name: value
            for name, value in vars(layer).items()
            if name not in ("config", "selector", "backend", "keys", "values", "_kbuf", "_vbuf")
        }
    )
    new.reset_stats()
    if not layer.is_initialized:
        return new
    T = layer.length
    new._init_storage(layer._kbuf, layer._vbuf)
    new._resize_kv(layer.capacity, 0)
    new._kres, new._vres = layer._kbuf[:, :, :T].clone(), layer._vbuf[:, :, :T].clone()
    new._flush(T)
    if config.summary_from == "pre" and new._summaries_from_keys():
        new.summary, new.shared, new.n_summarized = {}, {}, [0] * len(new.row_start)
    new._refresh_views()
    return new


def adopt_config(layer: LocksLayer, config) -> LocksLayer:
    """``layer`` (a copy the caller owns) set to decode with ``config``; a full-precision layer asked for
    quantized KV becomes a `QuantizedLocksLayer` (`to_quantized`). Other changes of the KV settings raise."""
    if config.kv_bits == 16 or isinstance(layer, QuantizedLocksLayer):
        layer.set_config(config)  # refuses a change of the KV settings
        return layer
    return to_quantized(layer, config)
