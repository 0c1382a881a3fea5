"""Buffer helpers shared by the layers: fixed-address static buffers and resized copies."""

from __future__ import annotations

import torch


def mark_static(*tensors: torch.Tensor) -> None:
    """Fixed addresses (CUDA graphs) and fixed shapes (a new size recompiles, never goes symbolic)."""
    for t in tensors:
        torch._dynamo.mark_static_address(t)
        torch._dynamo.mark_static(t)


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
