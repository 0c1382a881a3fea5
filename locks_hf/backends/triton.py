"""The Triton backend: the same operations as `locks_hf.backends.reference`, on the kernels.

The kernels take and return tensors only; this glue reads a layer through its public accessors, calls
the kernels through their custom ops (``torch.ops.locks_hf.*``, one opaque node each for
`torch.compile`) and keeps the layer's bookkeeping (selection, attended-token statistics) identical to
the reference path. `locks_hf.backends.choice` picks this backend only for CUDA layers whose settings
the kernels implement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from ..selectors import selector_class
from .base import DecodeBackend
from .reference import reference_summary

if TYPE_CHECKING:
    from ..paged import PagedLayer


def kernel_decode(layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `reference.reference_decode`: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``.

    A layer with `PagedLayer.kernel_buffers` (the static layer) has the launches keep its
    bookkeeping too: the statistics and the selected-page mask; no other launch runs here. Otherwise
    the glue records them.
    """
    keys = layer.key_buffer()
    step = StepInputs.of(layer)
    assert keys is not None  # `choose_backend` picks this backend only then
    # Triton launches on the *current* device; with a model split over GPUs (device_map) this layer's
    # tensors may live on another one. The kernels count the tokens they attend into the statistics.
    with on_device(query.device):
        out, pages = torch.ops.locks_hf.decode_step(
            step.method,
            query,
            keys,
            layer.value_buffer(),
            layer.slot_valid,
            step.row_start,
            step.n_complete,
            layer.length_tensor(),
            step.summary,
            layer.num_pages,
            step.width,
            float(scale),
            layer.config.page_size,
            layer.config.basis_bits,
            layer.count_buffer(),
            step.active,
            per_head=step.per_head,
            rerank=layer.config.rerank or 0,
            row_counts=step.row_counts,
            pad=step.pad,
            selection=step.selection,
        )
    return step.finish(layer, out, pages)


class StepInputs(NamedTuple):
    """What a kernel decode step of a layer takes besides its K/V (`of`), and its glue (`finish`)."""

    method: str  #: the selector's scoring mode (``"full"`` for dense)
    per_head: bool
    summary: list[torch.Tensor]
    width: int  #: page-list width
    active: torch.Tensor | None  #: the budget in use, on the device (``None``: the width)
    row_start: torch.Tensor
    n_complete: torch.Tensor
    #: a static layer's buffers the launches write (``None`` where the glue records them)
    row_counts: torch.Tensor | None
    pad: torch.Tensor | None
    selection: torch.Tensor | None  #: the selected-page mask (``None`` for a dense selector)
    in_launch: bool  #: whether the launches keep the layer's bookkeeping

    @classmethod
    def of(cls, layer: PagedLayer) -> StepInputs:
        # A compiled step's trace runs this once a layer, and a static layer's warm first generate() is
        # mostly that trace: fields rather than a dict() with keywords, which dynamo runs through a
        # Python polyfill (about 2 ms a call).
        declared = selector_class(layer.config.selector)  # what the kernels need: scan mode, per-head lists
        method = declared.kernel_method
        assert method is not None  # the kernel backends take only layers whose selector declares one
        width, active = layer.page_slots()
        bufs = layer.kernel_buffers() or {}  # empty: the glue records the bookkeeping (`finish`)
        row_start, n_complete = bufs.get("row_start"), bufs.get("n_complete")
        if row_start is None or n_complete is None:  # counted here (a static layer without summaries, or no buffers)
            row_start, n_complete = layer.row_tensors()
        return cls(
            method, declared.per_head, layer_summary(layer, method), width, active, row_start, n_complete,
            bufs.get("row_counts"), bufs.get("pad"), None if declared.dense else bufs.get("selection"), bool(bufs),
        )  # fmt: skip

    def finish(self, layer: PagedLayer, out: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
        """The step's output, with the bookkeeping the launches did not keep recorded."""
        if self.in_launch:
            return out
        b, h = out.shape[0], layer.kv_heads
        if pages.shape[1]:  # dense ("full") selects no list: every page
            layer.note_selection(pages.view(b, h, -1))
        layer.record_step(None, layer.real_tokens() * h)
        return out


def layer_summary(layer: PagedLayer, method: str) -> list[torch.Tensor]:
    """The layer's summary tensors in the order the kernels of ``method`` take them (none for dense)."""
    names = kernels().SUMMARY_NAMES.get(method, ())
    summary = layer.summary
    return [summary[n] for n in names]


def kernels():
    """`locks_hf.kernels` (imported on first use: Triton loads only where a kernel backend runs)."""
    from .. import kernels

    return kernels


def on_device(device: torch.device):
    return kernels().on_device(device)


def kernel_update_newest_page(layer: PagedLayer) -> None:
    """Kernel twin of `reference.reference_update_newest_page`: one launch that writes the page the
    newest token completed, in place, and does nothing on the other ``B - 1`` steps of a page (and
    writes the layer's complete-page counts, where `PagedLayer.kernel_buffers` keeps them). A layer
    storing packed K/V reads the page's keys from its full-precision ring (`PagedLayer.packed_kv`)."""
    cfg = layer.config
    method = selector_class(cfg.selector).kernel_method
    assert method is not None  # `choose_backend` picks a kernel backend only then
    bufs = layer.kernel_buffers()
    row_start = layer.row_tensors()[0] if bufs is None else bufs["row_start"]
    packed = layer.packed_kv()
    keys, ring = (layer.key_buffer(), 0) if packed is None else (packed["key_tail"], packed.get("ring", 0))
    torch.ops.locks_hf.update_completed_pages(
        method,
        keys,
        layer.slot_valid,
        row_start,
        layer.length_tensor(),
        layer_summary(layer, method),
        cfg.page_size,
        cfg.rank,
        cfg.basis_bits,
        None if bufs is None else bufs["n_complete"],
        ring,
    )


def compile_decode_kernels(layer: PagedLayer, query_heads: int) -> None:
    """Compile, without running them, the kernels of ``layer``'s decode step for queries of ``query_heads``
    heads: its page update and its step, through the same glue and custom ops as a real step, under
    `kernels.compile_only` (every launch compiles and runs nothing; no buffer is written). What
    `locks_hf.precompile` runs while the prefill goes on."""
    keys = layer.key_buffer()
    assert keys is not None  # asked of an initialized layer only
    query = keys.new_empty((keys.shape[0], query_heads, 1, keys.shape[-1]))
    with on_device(keys.device), kernels().compile_only():
        if layer.summary:  # as a static layer's step: the page update only where summaries are kept
            kernel_update_newest_page(layer)
        kernel_decode(layer, query, keys.shape[-1] ** -0.5)


def kernel_summary(layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kernel twin of `reference.reference_summary` for ``keys [b, h, n, B, d]``: the batched GPU build
    where the selector keeps the Locks summary (re-ranking keeps it too), else the reference."""
    method = selector_class(layer.config.selector).kernel_method
    if not keys.is_cuda or method != "locks":
        return reference_summary(layer, keys, valid)
    cfg = layer.config
    with on_device(keys.device):
        parts = torch.ops.locks_hf.build_summary(keys, valid, cfg.rank, cfg.basis_bits)
    return dict(zip(kernels().SUMMARY_NAMES[method], parts))


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
