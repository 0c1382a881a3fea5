"""The Triton backend: the same operations as `locks_hf.backends.reference`, on the kernels.

The kernels take and return tensors only; this glue reads a layer through its public accessors, calls
the kernels through their custom ops (``torch.ops.locks_hf.*``, one opaque node each for
`torch.compile`) and keeps the layer's bookkeeping (selection, attended-token statistics) identical to
the reference path. `locks_hf.backends.choice` picks this backend only for CUDA layers whose settings
the kernels implement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..selectors import selector_class
from .base import DecodeBackend
from .reference import reference_summary

if TYPE_CHECKING:
    from ..paged import PagedLayer


def _summary_list(layer: PagedLayer, method: str) -> list[torch.Tensor]:
    """The summaries the scoring kernel of ``method`` reads, in the order the custom ops take them."""
    from .. import kernels

    return [layer.summary[n] for n in kernels.SUMMARY_NAMES.get(method, ())]


def kernel_decode(layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `reference.reference_decode`: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``.

    A layer with `PagedLayer.kernel_buffers` (the static layer) has the launches keep its
    bookkeeping too: the statistics and the selected-page mask; no other launch runs here. Otherwise
    the glue records them.
    """
    from .. import kernels

    cfg = layer.config
    keys = layer.key_buffer()
    declared = selector_class(cfg.selector)  # what the kernels need: scan mode, per-head lists
    method = declared.kernel_method
    assert keys is not None and method is not None  # `choose_backend` picks this backend only then
    b, h = query.shape[0], keys.shape[1]
    width, active = layer.page_slots()  # page-list width, and the budget as a device tensor (or None)
    bufs = layer.kernel_buffers()
    if bufs is not None:
        n_complete = bufs["n_complete"]
        row_start = bufs["row_start"]
        if n_complete is None:
            row_start, n_complete = layer.row_tensors()
        extra = dict(
            row_counts=bufs["row_counts"], pad=bufs["pad"], selection=None if declared.dense else bufs["selection"]
        )
    else:
        row_start, n_complete = layer.row_tensors()
        extra = dict(row_counts=None, pad=None, selection=None)
    # Triton launches on the *current* device; with a model split over GPUs (device_map) this layer's
    # tensors may live on another one. The kernels count the tokens they attend into the statistics.
    with kernels.on_device(query.device):
        out, pages = torch.ops.locks_hf.decode_step(
            method,
            query,
            keys,
            layer.value_buffer(),
            layer.slot_valid,
            row_start,
            n_complete,
            layer.length_tensor(),
            _summary_list(layer, method),
            layer.num_pages,
            width,
            float(scale),
            cfg.page_size,
            cfg.basis_bits,
            layer.count_buffer(),
            active,
            per_head=declared.per_head,
            rerank=cfg.rerank or 0,
            **extra,
        )
    if bufs is not None:
        return out
    if pages.shape[1]:  # dense ("full") selects no list: every page
        layer.note_selection(pages.view(b, h, -1))
    layer.record_step(None, layer.real_tokens() * h)
    return out


def kernel_update_newest_page(layer: PagedLayer) -> None:
    """Kernel twin of `reference.reference_update_newest_page`: one launch that writes the page the
    newest token completed, in place, and does nothing on the other ``B - 1`` steps of a page (and
    writes the layer's complete-page counts, where `PagedLayer.kernel_buffers` keeps them)."""
    cfg = layer.config
    method = selector_class(cfg.selector).kernel_method
    assert method is not None  # `choose_backend` picks this backend only then
    bufs = layer.kernel_buffers()
    row_start = layer.row_tensors()[0] if bufs is None else bufs["row_start"]
    torch.ops.locks_hf.update_completed_pages(
        method,
        layer.key_buffer(),
        layer.slot_valid,
        row_start,
        layer.length_tensor(),
        _summary_list(layer, method),
        cfg.page_size,
        cfg.rank,
        cfg.basis_bits,
        None if bufs is None else bufs["n_complete"],
    )


def kernel_summary(layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kernel twin of `reference.reference_summary` for ``keys [b, h, n, B, d]``: the batched GPU build
    where the selector keeps the Locks summary (re-ranking keeps it too), else the reference."""
    from .. import kernels

    method = selector_class(layer.config.selector).kernel_method
    if not keys.is_cuda or method != "locks":
        return reference_summary(layer, keys, valid)
    cfg = layer.config
    with kernels.on_device(keys.device):
        parts = torch.ops.locks_hf.build_summary(keys, valid, cfg.rank, cfg.basis_bits)
    return dict(zip(kernels.SUMMARY_NAMES[method], parts))


class TritonBackend(DecodeBackend):
    """The Triton kernels (`locks_hf.kernels`) on a CUDA layer whose settings they implement."""

    name = "triton"
    decodes_densely = True
    counts_row_statistics = True
    graph_safe = True

    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        out = kernel_decode(layer, query, scale)
        layer.record_selection_traffic()
        return out

    def update_newest_page(self, layer: PagedLayer) -> None:
        kernel_update_newest_page(layer)

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return kernel_summary(layer, keys, valid)


TRITON = TritonBackend()
