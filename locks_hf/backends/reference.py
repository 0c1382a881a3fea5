"""The PyTorch reference backend: every operation in plain tensor code, on any device.

Each operation here has its kernel twin under the same name in `locks_hf.backends.triton`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..kv_quant import due_counts, quantize_keys, quantize_values
from .base import DecodeBackend

if TYPE_CHECKING:
    from ..paged import PagedLayer


class PageSelection(NamedTuple):
    """What a page-selected decode step attends (`select_pages`)."""

    #: ``[b, h, W]`` int64 page numbers, the selected ones first (ascending), then pages not taken.
    pages: torch.Tensor
    #: ``[b, h, W]`` bool: False for the padding of the fixed width.
    taken: torch.Tensor
    #: ``[b, 1, P, B]``: the layer's `page_validity` (real slots of every page).
    valid: torch.Tensor


def select_pages(layer: PagedLayer, query: torch.Tensor, scale: float) -> PageSelection:
    """Steps 1-2 of a decode step, in PyTorch: score every page from its summary (the oracle and the
    re-rank read the keys through `PagedLayer.all_page_keys`) and select, for ``query [b, Hq, 1, d]``;
    the selection is noted (`PagedLayer.note_selection`). With no selector (``"full"``): every page
    with a real token."""
    cfg, selector = layer.config, layer.selector
    b, hq, _, d = query.shape
    h = layer.kv_heads
    G = hq // h
    q = query.reshape(b, h, G, d)

    valid = layer.page_validity()  # [b, 1, P, B]
    P = valid.shape[2]
    if selector is None:  # "full" (a static cache's dense decode): every page with a real token
        selected = valid[:, 0].any(-1)[:, None].expand(b, h, P)
        width = P
    else:
        # 1-2. Score every page from its summary (the oracle reads the keys instead) and select: sink +
        # most recent + best k - 2 complete pages, one set per KV head.
        keys = layer.all_page_keys() if selector.reads_keys or selector.reads_candidate_keys else None
        selected = selector.choose_pages(layer.summary_view(), keys, valid, q, scale, layer.complete_pages(), cfg)
        width = min(P, cfg.page_slots * (G if selector.per_head else 1))

    pages = torch.sort(selected.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    taken = selected.gather(-1, pages)  # [b, h, W]: False for padding of the fixed width
    if selector is not None:
        layer.note_selection(torch.where(taken, pages, -1))
    return PageSelection(pages, taken, valid)


def reference_decode(layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """One decode step attending only the selected pages: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``
    (the layer's selection and attended-token statistics recorded)."""
    b, hq, _, d = query.shape
    h = layer.kv_heads
    q = query.reshape(b, h, hq // h, d)
    pages, taken, valid = select_pages(layer, query, scale)

    # 3. Attend the selected pages with the original K/V, softmax renormalised over them.
    acc = torch.promote_types(query.dtype, torch.float32)  # fp32 accumulation (fp64 stays fp64)
    k_sel = layer.page_keys(pages).flatten(2, 3).to(acc)  # [b, h, W*B, d]
    v_sel = layer.page_keys(pages, values=True).flatten(2, 3).to(acc)
    tok_ok = (layer.page_validity_of(pages) & taken[..., None]).flatten(2)  # [b, h, W*B]

    # Unwritten slots of the last page may hold anything, NaN included (0 * NaN = NaN): mask V too.
    v_sel = v_sel.masked_fill(~tok_ok[..., None], 0.0)
    logits = scale * torch.einsum("bhgd,bhnd->bhgn", q.to(acc), k_sel)
    probs = torch.softmax(logits.masked_fill(~tok_ok[:, :, None], float("-inf")), dim=-1)
    out = torch.einsum("bhgn,bhnd->bhgd", probs, v_sel)
    layer.record_step(tok_ok.sum(), valid.sum() * h)
    return out.reshape(b, 1, hq, -1).to(query.dtype)


def reference_update_newest_page(layer: PagedLayer) -> None:
    """Re-summarize the page holding each row's newest token, every step: a static graph cannot branch
    on whether it just completed (an incomplete page is masked until it is, so writing it early is
    harmless)."""
    b, h = layer.kv_batch, layer.kv_heads
    row_start = layer.row_tensors()[0]
    newest = torch.div(
        layer.length_tensor().long() - 1 - row_start.long(), layer.config.page_size, rounding_mode="floor"
    ).clamp_min(0)  # [b]
    pages = newest.view(b, 1, 1).expand(b, h, 1)
    new = layer.summarize_pages(*layer.page_inputs(pages))
    for name, tensor in new.items():
        index = pages.view(b, h, 1, *([1] * (tensor.dim() - 3))).expand_as(tensor)
        layer.summary[name].scatter_(2, index, tensor)


def reference_summary(layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The selector's own `summarize` (with the layer's sequence-level state)."""
    assert layer.selector is not None  # a dense layer builds no summaries
    return layer.selector.summarize(keys, valid, layer.shared)


def reference_append_kv(layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A static quantized layer's decode-step write (`static_kv_layer.QuantizedStaticLayer`), the twin of
    `kernels.kivi.kivi_append` on the buffers of its `append_buffers`: quantize what is due from the
    rings, then write the token ``keys`` / ``values [b, h, 1, d]`` at slot ``length`` of the rings. Fixed
    shapes and device tensors only (a captured graph may hold it): a ring's worth of slots from ``qk``
    (``qv``) is quantized and only the due ones are written (the storage has spare slots for it)."""
    cfg = layer.config
    G, R, B, bits = cfg.kv_group, cfg.kv_residual, cfg.page_size, cfg.kv_bits
    s = layer.append_buffers()
    key_ring, value_ring = s["key_tail"], s["value_tail"]
    ring, cap = key_ring.shape[2], s["slot_valid"].shape[1]
    b, h = key_ring.shape[:2]
    T = s["length"].long()  # [1]
    qk, qv = s["quantized"].long().unbind()
    rs = s["row_start"].long()
    bound = (rs + (T - rs).clamp_min(0) // B * B).min() if s["post"] else None  # the first incomplete page
    keys_to, values_to = due_counts(T[0], (qk, qv), residual=R, group=G, first_unsummarized=bound)

    def write(buf: torch.Tensor, at: torch.Tensor, due: torch.Tensor, new: torch.Tensor) -> None:
        index = at.view(1, 1, -1, 1).expand(b, h, -1, buf.shape[-1])
        buf.scatter_(2, index, torch.where(due.view(1, 1, -1, 1), new, buf.gather(2, index)))

    # keys: a ring's worth of slots from qk (whole groups), written where due
    slots = qk + torch.arange(ring, device=T.device)
    due = slots < keys_to
    valid = s["slot_valid"][:, slots.clamp(max=cap - 1)] & due
    codes, scale, zero = quantize_keys(key_ring[:, :, slots % ring], bits, G, valid)
    write(s["key_codes"], slots, due, codes)
    write(s["key_scale"], slots[::G] // G, due[::G], scale)
    write(s["key_zero"], slots[::G] // G, due[::G], zero)

    # values: a ring's worth of slots from qv, written where due
    slots = qv + torch.arange(ring, device=T.device)
    due = slots < values_to
    valid = s["slot_valid"][:, slots.clamp(max=cap - 1)] & due
    codes, scale, zero = quantize_values(value_ring[:, :, slots % ring], bits, G, valid)
    write(s["value_codes"], slots, due, codes)
    write(s["value_scale"], slots, due, scale)
    write(s["value_zero"], slots, due, zero)

    # the token into the rings, then the new counts
    key_ring.index_copy_(2, T % ring, keys)
    value_ring.index_copy_(2, T % ring, values)
    s["quantized"].copy_(torch.stack([keys_to, values_to]).to(torch.int32))


class ReferenceBackend(DecodeBackend):
    """PyTorch on any device: the CPU path, and the GPU path for settings the kernels do not implement."""

    name = "reference"

    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        out = reference_decode(layer, query, scale)
        layer.record_selection_traffic()
        return out

    def update_newest_page(self, layer: PagedLayer) -> None:
        reference_update_newest_page(layer)

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return reference_summary(layer, keys, valid)

    def append_kv(self, layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        reference_append_kv(layer, keys, values)


REFERENCE = ReferenceBackend()
