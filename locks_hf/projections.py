"""A model's one-token projections on the weight-streaming GEMV kernel (`locks_hf.kernels.gemv`).

At batch 1 a decode step reads every weight once, and cuBLAS's one-row products leave the projections of a
9B model 16-28% over their weights' read time on an H100 or H200 (docs/performance.md). `gemv_projections`
swaps each plain ``nn.Linear`` of a CUDA model for a `GemvLinear` holding the same parameters (no copy):
a forward with one input row and no gradient to record runs the kernel through its custom op (one opaque
node for `torch.compile`, capturable in a CUDA graph); any other forward (a prompt, a batch, training) is
``F.linear``. The kernel compiles for each projection shape in a background thread from the swap on
(`precompile.BackgroundCompile`; ``LOCKS_HF_PRECOMPILE=0``: at the first one-row forward instead), joined by
the first decode-time launch. `linear_projections` swaps them back.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from .precompile import PRECOMPILE_ENV, BackgroundCompile

LinearT = TypeVar("LinearT", bound=nn.Linear)

#: Weight dtypes the kernel runs.
GEMV_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class GemvLinear(nn.Linear):
    """An ``nn.Linear`` whose one-row forwards run `locks_hf.kernels.gemv` (its parameters are the
    original module's: `gemv_projections` builds it with `from_linear`)."""

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> GemvLinear:
        return _sharing_parameters(cls, linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the kernel has no backward: a forward that records gradients stays on F.linear
        records = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        if records or x.numel() != x.shape[-1] or x.dtype != self.weight.dtype or not x.is_cuda:
            return F.linear(x, self.weight, self.bias)
        y = torch.ops.locks_hf.gemv(x.reshape(-1).contiguous(), self.weight, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def gemv_projections(model: nn.Module) -> nn.Module:
    """Run ``model``'s one-token projections (every plain ``nn.Linear``, the LM head included) on the GEMV
    kernel; returns ``model``, changed in place. Subclasses of ``nn.Linear`` (quantized layers, adapters)
    are left as they are.

    Raises ``ValueError`` for a model whose projections the kernel cannot run: weights off CUDA, of another
    dtype than bfloat16 / float16 / float32, without a unit column stride, or under accelerate's hooks
    (offloaded weights live elsewhere between forwards). ``RuntimeError`` without Triton."""
    from . import kernels

    if not kernels.HAVE_TRITON:
        raise RuntimeError("gemv_projections: the GEMV kernel needs Triton, which does not import here")
    found = [(name, m) for name, m in model.named_modules() if name and type(m) is nn.Linear]
    if not found:
        raise ValueError("gemv_projections: the model has no nn.Linear module")
    for name, m in found:
        w = m.weight
        if not w.is_cuda or w.dtype not in GEMV_DTYPES or w.stride(-1) != 1:
            raise ValueError(
                f"gemv_projections: {name} has a {w.dtype} weight on {w.device} (column stride {w.stride(-1)}); "
                "the kernel runs CUDA weights of bfloat16, float16 or float32 with a unit column stride: move "
                "the model with model.to('cuda') first"
            )
        if hasattr(m, "_hf_hook"):
            raise ValueError(
                f"gemv_projections: {name} runs under accelerate's hooks (offloaded or dispatched weights); "
                "load the model onto one GPU (device_map='cuda') to use the kernel"
            )
    for name, m in found:
        _replace(model, name, GemvLinear.from_linear(m))
    if os.environ.get(PRECOMPILE_ENV, "1") != "0":
        # compiled by the first one-row forward otherwise: a second or so a shape, at the first decode step
        BackgroundCompile(
            lambda: compile_projection_kernels(m for _, m in found), "gemv_projections", "the GEMV kernel"
        )
    return model


def linear_projections(model: nn.Module) -> nn.Module:
    """Undo `gemv_projections`: every `GemvLinear` of ``model`` back to a plain ``nn.Linear`` holding the same
    parameters (no copy), so that one process can time or check both; returns ``model``, changed in place.
    Raises ``ValueError`` for a model without a `GemvLinear`."""
    found = [(name, m) for name, m in model.named_modules() if name and isinstance(m, GemvLinear)]
    if not found:
        raise ValueError("linear_projections: the model has no GemvLinear module (gemv_projections puts them in)")
    for name, m in found:
        _replace(model, name, _sharing_parameters(nn.Linear, m))
    return model


def _sharing_parameters(cls: type[LinearT], linear: nn.Linear) -> LinearT:
    """A ``cls`` of ``linear``'s sizes holding its parameters (built on the meta device: nothing allocated)."""
    module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
    module.weight = linear.weight
    module.bias = linear.bias
    return module


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


def compile_projection_kernels(modules: Iterable[nn.Linear]) -> None:
    """Compile, without running it, the GEMV kernel for each distinct projection of ``modules`` (the launch a
    one-row forward makes, under `kernels.compile_only`); nothing is allocated or written: the input and output
    stand-ins are views of the weight, of the dtype and alignment of the real ones. What `gemv_projections`
    runs in the background."""
    from .kernels import compile_only
    from .kernels.gemv import gemv

    seen = set()
    with compile_only():
        for m in modules:
            w, b = m.weight, m.bias
            spec = (tuple(w.shape), w.stride(0), w.dtype, w.device, b is not None)
            if spec in seen:
                continue
            seen.add(spec)
            out = w.as_strided((w.shape[0],), (1,), w.storage_offset())
            gemv(w[0], w, b, out=out)
