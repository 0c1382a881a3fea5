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
    from ..config import LocksConfig
    from ..paged import PagedLayer


def kernel_decode(layer: PagedLayer, query: torch.Tensor, scale: float, update_rank: int | None = None) -> torch.Tensor:
    """Kernel twin of `reference.reference_decode`: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``.

    A layer whose `PagedLayer.step_tensors` hands over its bookkeeping buffers (the static layer) has
    the launch keep its statistics and selected-page mask too; otherwise the glue records them.
    ``update_rank``: the step's own page update (`update_rank_in_step` where ``None``).
    """
    plan, io, cfg = layer_plan(layer), layer.step_tensors(), layer.config
    out, pages = torch.ops.locks_hf.decode_step(
        plan.method,
        query,
        io["keys"],
        io["values"],
        io["slot_valid"],
        io["row_start"],
        io["n_complete"],
        io["length"],
        plan.summary_list(io["summary"]),
        io["n_pages"],
        io["width"],
        float(scale),
        cfg.page_size,
        cfg.basis_bits,
        io["counts"],
        io["active"],
        per_head=plan.per_head,
        rerank=cfg.rerank or 0,
        row_counts=io["row_counts"],
        pad=io["pad"],
        selection=None if plan.dense else io["selection"],
        tickets=plan.tickets(io),
        update_rank=update_rank_in_step(layer) if update_rank is None else update_rank,
    )
    return recorded(layer, io, out, pages)


def update_rank_in_step(layer: PagedLayer) -> int:
    """The rank at which a kernel decode step of ``layer`` writes its per-step page summary itself
    (`kernels.decode.summarize_newest_page`: the layer's decode is then one custom op a step): a static
    layer whose selector keeps summaries, unless its cache launches it with other layers'
    (``page_update_deferred``, `locks_hf.page_updates`); 0, none, for any other layer."""
    if layer.page_update_deferred:
        return 0
    return layer.config.rank if layer.static_layout and layer_plan(layer).summary_names else 0


def page_update_key(layer: PagedLayer) -> tuple | None:
    """What one launch of several layers' page updates needs equal among them (`TritonBackend.page_update_key`):
    device, scoring mode, page size, rank and bits, and the buffers' shapes, strides and dtypes; ``None``
    for a layer whose update stays its own (not static, keeps no summary, quantized K/V, not allocated)."""
    plan = layer_plan(layer)
    keys = layer.key_buffer()
    if not (layer.static_layout and plan.summary_names) or keys is None or layer.packed_kv() is not None:
        return None
    io, cfg = layer.step_tensors(), layer.config
    valid = io["slot_valid"]
    summary = tuple((tuple(t.shape), t.dtype) for t in plan.summary_list(io["summary"]))
    return (
        keys.device,
        plan.method,
        cfg.page_size,
        cfg.rank,
        cfg.basis_bits,
        keys.dtype,
        tuple(keys.shape),
        keys.stride(),
        tuple(valid.shape),
        valid.stride(),
        summary,
    )


def kernel_update_pages_of_layers(layers: list[PagedLayer]) -> None:
    """`kernel_update_newest_page` of each of ``layers`` (of one `page_update_key`) in one launch."""
    plan, cfg = layer_plan(layers[0]), layers[0].config
    ios = [layer.step_tensors() for layer in layers]
    torch.ops.locks_hf.update_pages_of_layers(
        plan.method,
        [io["keys"] for io in ios],
        [io["slot_valid"] for io in ios],
        [io["row_start"] for io in ios],
        [io["length"] for io in ios],
        [t for io in ios for t in plan.summary_list(io["summary"])],
        cfg.page_size,
        cfg.rank,
        cfg.basis_bits,
        [io["n_complete"] for io in ios],
    )


def recorded(layer: PagedLayer, io: dict, out: torch.Tensor, pages: torch.Tensor) -> torch.Tensor:
    """A kernel step's output, with the bookkeeping its launch did not keep (``io``: the layer's
    `PagedLayer.step_tensors`) recorded by the glue."""
    if io["row_counts"] is not None:  # the launch kept it
        return out
    b, h = out.shape[0], layer.kv_heads
    if pages.shape[1]:  # dense ("full") selects no list: every page
        layer.note_selection(pages.view(b, h, -1))
    layer.record_step(None, layer.real_tokens() * h)
    return out


class KernelPlan(NamedTuple):
    """What the kernels need derived from a layer's selector: fixed until its settings change, so a layer
    keeps it (`PagedLayer.refresh_backend`) and a step does not look the selector up again."""

    method: str | None  #: the selector's scoring mode (``"full"`` for dense; ``None``: none on the kernels)
    per_head: bool  #: each query head selects its own pages (Quest's GQA port)
    dense: bool  #: every page attended: no selection to record
    summary_names: tuple[str, ...]  #: the summary tensors the kernels of ``method`` take, in order

    @classmethod
    def of(cls, config: LocksConfig) -> KernelPlan:
        declared = selector_class(config.selector)
        method = declared.kernel_method
        names = tuple(kernels().SUMMARY_NAMES.get(method, ())) if method else ()
        return cls(method, declared.per_head, declared.dense, names)

    def summary_list(self, summary: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """A layer's summary tensors in the order the kernels take them."""
        return [summary[n] for n in self.summary_names]

    def tickets(self, io: dict) -> torch.Tensor | None:
        """The layer's selection counters (``io``: its `PagedLayer.step_tensors`) where they cover this
        selector's lists: sized for one list per row and KV head (`locks_hf.buffers.selection_tickets`), so
        Quest's per-head lists get a new zeroed buffer a step."""
        return None if self.per_head else io["tickets"]


def layer_plan(layer: PagedLayer) -> KernelPlan:
    """``layer``'s `KernelPlan`: the one its kernel backend keeps, else (a kernel step called directly on a
    layer decoding elsewhere, as tests do) derived from its settings."""
    return layer.kernel_plan or KernelPlan.of(layer.config)


def kernels():
    """`locks_hf.kernels` (imported on first use: Triton loads only where a kernel backend runs)."""
    from .. import kernels

    return kernels


def kernel_update_newest_page(layer: PagedLayer) -> None:
    """Kernel twin of `reference.reference_update_newest_page`: one launch that writes the page the
    newest token completed, in place, and does nothing on the other ``B - 1`` steps of a page (and
    writes the layer's complete-page counts where it hands them to the launches, `PagedLayer.step_tensors`). A
    layer storing packed K/V reads the page's keys from its full-precision ring (`PagedLayer.packed_kv`)."""
    plan, io, cfg = layer_plan(layer), layer.step_tensors(), layer.config
    packed = layer.packed_kv()
    keys, ring = (io["keys"], 0) if packed is None else (packed["key_tail"], packed.get("ring", 0))
    # a static layer's complete-page counts are kept by this launch; a dynamic layer derives its own
    in_launch = io["row_counts"] is not None and plan.summary_names
    torch.ops.locks_hf.update_completed_pages(
        plan.method,
        keys,
        io["slot_valid"],
        io["row_start"],
        io["length"],
        plan.summary_list(io["summary"]),
        cfg.page_size,
        cfg.rank,
        cfg.basis_bits,
        io["n_complete"] if in_launch else None,
        ring,
    )


def compile_decode_kernels(layer: PagedLayer, query_heads: int, launch_sizes: tuple[int, ...] = ()) -> None:
    """Compile, without running them, the kernels of ``layer``'s decode step for queries of ``query_heads``
    heads: its page update and its step, through the same glue and custom ops as a real step, under
    `kernels.compile_only` (every launch compiles and runs nothing; no buffer is written). ``launch_sizes``:
    the page update is launched for that many layers like it at once (`locks_hf.page_updates`), and the step
    leaves it out. What `locks_hf.precompile` runs while the prefill goes on."""
    keys = layer.key_buffer()
    assert keys is not None  # asked of an initialized layer only
    query = keys.new_empty((keys.shape[0], query_heads, 1, keys.shape[-1]))
    grouped = bool(launch_sizes) and page_update_key(layer) is not None
    with kernels().compile_only():  # each op makes its tensors' device current
        if grouped:
            for size in sorted(set(launch_sizes)):
                kernel_update_pages_of_layers([layer] * size)
        elif layer.summary and not update_rank_in_step(layer):  # as `LocksStaticLayer.prepare`
            kernel_update_newest_page(layer)
        kernel_decode(layer, query, keys.shape[-1] ** -0.5, update_rank=0 if grouped else None)


def kernel_summary(layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """Kernel twin of `reference.reference_summary` for ``keys [b, h, n, B, d]``: the batched GPU build
    where the selector keeps the Locks summary (re-ranking keeps it too), else the reference."""
    method = selector_class(layer.config.selector).kernel_method
    if not keys.is_cuda or method != "locks":
        return reference_summary(layer, keys, valid)
    cfg = layer.config
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

    def summarizes_in_step(self, layer: PagedLayer) -> bool:
        return update_rank_in_step(layer) > 0

    def page_update_key(self, layer: PagedLayer) -> tuple | None:
        return page_update_key(layer)

    def update_pages_of_layers(self, layers: list[PagedLayer]) -> None:
        kernel_update_pages_of_layers(layers)

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return kernel_summary(layer, keys, valid)

    def plan(self, config: LocksConfig) -> KernelPlan:
        return KernelPlan.of(config)


TRITON = TritonBackend()
