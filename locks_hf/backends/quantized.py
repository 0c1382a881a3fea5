"""The quantized-KV kernel backend: a layer storing KIVI-packed K/V (`PagedLayer.packed_kv`) attends
its selected pages with `locks_hf.kernels.quantized_attention`, dequantizing them in registers.

Selectors that score from summaries alone (Locks, Quest, and ``"full"``, which attends every page)
choose their pages on the scoring and selection kernels, and the step is one custom op
(``torch.ops.locks_hf.quantized_decode_step``), as on the bf16 kernels: a static layer's bookkeeping
(statistics, selected-page mask) is kept in its launches, so the step can be captured in a CUDA graph.
Selectors that read keys (the oracle, exact re-ranking) select as the reference does
(`reference.select_pages`, whose key reads dequantize through the layer's `all_page_keys` /
`page_keys`) and attend with ``torch.ops.locks_hf.quantized_attention``. A static quantized layer's
per-step write (KIVI's schedule, the token into its ring) is `kernels.kivi` (``kivi_append``).
`locks_hf.backends.choice` picks this backend for CUDA layers whose settings the kernel implements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..selectors import selector_class
from .base import DecodeBackend
from .reference import select_pages
from .triton import (
    KernelPlan,
    kernel_summary,
    kernel_update_newest_page,
    kernels,
    layer_plan,
    recorded,
    update_rank_in_step,
)

if TYPE_CHECKING:
    from ..config import LocksConfig
    from ..paged import PagedLayer


def selects_on_kernels(layer: PagedLayer) -> bool:
    """Whether ``layer``'s pages are chosen on the kernels: its selector scores from summaries (or is
    dense) and the kernels implement its settings for the layer's K/V dtype and head dim."""
    cfg = layer.config
    cls = selector_class(cfg.selector)
    packed = layer.packed_kv()
    if cls.kernel_method not in ("full", "locks", "quest") or cfg.rerank or packed is None:
        return False
    tail = packed["key_tail"]
    return kernels().implements(
        cls.kernel_method,
        dtype=tail.dtype,
        head_dim=tail.shape[-1],
        page_size=cfg.page_size,
        per_head=cls.per_head,
        group_combine=cfg.group_combine,
        basis_bits=cfg.basis_bits,
        coef_bits=cfg.coef_bits,
        centroid_bits=cfg.centroid_bits,
    )


def quantized_kernel_decode(layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `reference.reference_decode` for a layer with packed K/V: ``query [b, Hq, 1, d]``
    -> ``[b, 1, Hq, d]``, the selection and statistics recorded as the reference records them."""
    packed = layer.packed_kv()
    assert packed is not None  # the backend is chosen only for a layer whose storage is packed
    if selects_on_kernels(layer):
        plan, io = layer_plan(layer), layer.step_tensors()
        out, pages = torch.ops.locks_hf.quantized_decode_step(
            plan.method,
            query,
            *[packed[n] for n in kernels().ops.PACKED_TENSORS],
            packed["bits"],
            packed["group"],
            packed.get("ring", 0),
            packed["page_size"],
            io["n_complete"],
            plan.summary_list(io["summary"]),
            io["n_pages"],
            io["width"],
            float(scale),
            layer.config.basis_bits,
            io["counts"],
            io["active"],
            per_head=plan.per_head,
            row_counts=io["row_counts"],
            pad=io["pad"],
            selection=None if plan.dense else io["selection"],
            tickets=plan.tickets(io),
            update_rank=update_rank_in_step(layer),
        )
        return recorded(layer, io, out, pages)
    pages, taken, valid = select_pages(layer, query, scale)
    listed = torch.where(taken, pages, -1)  # [b, h, W]: the fixed width's padding is no page
    out = torch.ops.locks_hf.quantized_attention(
        query.contiguous(),
        listed,
        scale=float(scale),
        counts=layer.count_buffer(),
        row_counts=None,
        pad=None,
        **packed,
    )
    layer.record_step(None, valid.sum() * layer.kv_heads)  # the launch counted the attended tokens
    return out.transpose(1, 2)


def kernel_append_kv(layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """Kernel twin of `reference.reference_append_kv`: KIVI's schedule and the token's write, one launch."""
    s = layer.append_buffers()
    cfg = layer.config
    torch.ops.locks_hf.kivi_append(
        keys,
        values,
        s["key_tail"],
        s["value_tail"],
        s["key_codes"],
        s["key_scale"],
        s["key_zero"],
        s["value_codes"],
        s["value_scale"],
        s["value_zero"],
        s["slot_valid"],
        s["row_start"],
        s["length"],
        s["quantized"],
        s["counter"],
        cfg.kv_bits,
        cfg.kv_group,
        cfg.kv_residual,
        cfg.page_size,
        s["post"],
    )


class QuantizedKernelBackend(DecodeBackend):
    """Attention in `locks_hf.kernels.quantized_attention` over the packed K/V; selection on the kernels
    where the selector scores from summaries, else in PyTorch."""

    name = "quantized_kernel"
    decodes_densely = True
    counts_row_statistics = True
    graph_safe = True

    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        out = quantized_kernel_decode(layer, query, scale)
        layer.record_selection_traffic()
        return out

    def update_newest_page(self, layer: PagedLayer) -> None:
        kernel_update_newest_page(layer)

    def summarizes_in_step(self, layer: PagedLayer) -> bool:
        # only the kernels' page choice writes it; a selection in PyTorch leaves it to the layer's prepare
        return selects_on_kernels(layer) and update_rank_in_step(layer) > 0

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return kernel_summary(layer, keys, valid)

    def append_kv(self, layer: PagedLayer, keys: torch.Tensor, values: torch.Tensor) -> None:
        kernel_append_kv(layer, keys, values)

    def plan(self, config: LocksConfig) -> KernelPlan:
        return KernelPlan.of(config)


QUANTIZED_KERNEL = QuantizedKernelBackend()
