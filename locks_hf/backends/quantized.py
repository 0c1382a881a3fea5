"""The quantized-KV kernel backend: a layer storing KIVI-packed K/V (`PagedLayer.packed_kv`) attends
its selected pages with `locks_hf.kernels.quantized_attention`, dequantizing them in registers.

Steps 1-2 (score and select) are the reference's (`reference.select_pages`, in PyTorch: the oracle's
and the re-rank's key reads dequantize through the layer's `all_page_keys` / `page_keys`); step 3 is
one launch of the custom op ``torch.ops.locks_hf.quantized_attention`` over the packed codes, their
scales and zero points and the full-precision tail, which counts the tokens it attends into the
layer's statistics. The bookkeeping (selection, statistics, traffic) is the reference path's. Summaries
are the reference's: a quantized layer is dynamic and builds them in ``prepare``.
`locks_hf.backends.choice` picks this backend for CUDA layers whose settings the kernel implements.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .base import DecodeBackend
from .reference import reference_summary, reference_update_newest_page, select_pages

if TYPE_CHECKING:
    from ..paged import PagedLayer


def quantized_kernel_decode(layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `reference.reference_decode` for a layer with packed K/V: ``query [b, Hq, 1, d]``
    -> ``[b, 1, Hq, d]``, the selection and statistics recorded as the reference records them."""
    from .. import kernels

    packed = layer.packed_kv()
    assert packed is not None  # the backend is chosen only for a layer whose storage is packed
    pages, taken, valid = select_pages(layer, query, scale)
    listed = torch.where(taken, pages, -1)  # [b, h, W]: the fixed width's padding is no page
    with kernels.on_device(query.device):
        out = torch.ops.locks_hf.quantized_attention(
            query.contiguous(), listed, scale=float(scale), counts=layer.count_buffer(), **packed
        )
    layer.record_step(None, valid.sum() * layer.kv_heads)  # the launch counted the attended tokens
    return out.transpose(1, 2)


class QuantizedKernelBackend(DecodeBackend):
    """Selection in PyTorch, attention in `locks_hf.kernels.quantized_attention` over the packed K/V."""

    name = "quantized_kernel"

    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        out = quantized_kernel_decode(layer, query, scale)
        layer.record_selection_traffic()
        return out

    def update_newest_page(self, layer: PagedLayer) -> None:
        reference_update_newest_page(layer)

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return reference_summary(layer, keys, valid)


QUANTIZED_KERNEL = QuantizedKernelBackend()
