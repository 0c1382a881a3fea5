"""Buffer helpers shared by the layers: fixed-address static buffers and resized copies."""

from __future__ import annotations

import torch


def mark_static(*tensors: torch.Tensor) -> None:
    """Fixed addresses (CUDA graphs) and fixed shapes (a new size recompiles, never goes symbolic)."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_static(t)


#: Pages of the shortest chunk a selection program takes (`locks_hf.kernels.select.MIN_CHUNK`).
SELECTION_MIN_CHUNK = 256


def selection_tickets(lists: int, n_pages: int) -> int:
    """Counters enough for a selection launch over ``lists`` page lists of ``n_pages`` pages each (a static
    layer's rows x KV heads, the shared rule): one per chunk list at most and one per list (see the
    ``tickets`` of `locks_hf.kernels.select.select_pages`). The launch leaves them zero."""
    return lists * (-(-n_pages // SELECTION_MIN_CHUNK) + 1)


def resized(t: torch.Tensor, dim: int, size: int, fill=0) -> torch.Tensor:
    """A new tensor: ``t`` with axis ``dim`` cut or extended (with ``fill``) to ``size``."""
    keep = min(size, t.shape[dim])
    shape = list(t.shape)
    shape[dim] = size
    out = t.new_full(shape, fill)
    out.narrow(dim, 0, keep).copy_(t.narrow(dim, 0, keep))
    return out


def resized_keeping(buf: torch.Tensor, dim: int, size: int, keep: int, fill=None) -> torch.Tensor:
    """A copy of ``buf`` with ``dim`` resized to ``size``, keeping the first ``keep`` entries."""
    shape = list(buf.shape)
    shape[dim] = size
    out = buf.new_full(shape, fill) if fill is not None else buf.new_empty(shape)
    out.narrow(dim, 0, keep).copy_(buf.narrow(dim, 0, keep))
    return out
