"""The one rule that picks a layer's `DecodeBackend`.

CUDA buffers of a configuration the kernels implement go to the Triton kernels, and a layer storing
KIVI-packed K/V (`PagedLayer.packed_kv`) to the quantized-KV kernel backend where that kernel runs its
settings (`quantized_kernel_applies`); CPU tensors, other settings, a missing Triton, or
``LOCKS_HF_KERNELS=0`` in the environment keep the PyTorch reference; token-level policies have their
own step. A layer asks once, whenever its buffers, device or settings
change (`PagedLayer.choose_backend`), and keeps the answer as a plain attribute: a decode step never
asks again, so a compiled step sees a fixed Python value between re-allocations.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from ..selectors import selector_class
from .base import DecodeBackend
from .quantized import QUANTIZED_KERNEL, selects_on_kernels
from .reference import REFERENCE
from .token_policy import TOKEN_POLICY
from .triton import TRITON

if TYPE_CHECKING:
    from ..config import LocksConfig
    from ..paged import PagedLayer

#: Set to ``0`` to keep the PyTorch reference path on the GPU too.
KERNELS_ENV = "LOCKS_HF_KERNELS"


def kernels_enabled() -> bool:
    """False when the environment turns the kernels off (``LOCKS_HF_KERNELS=0``)."""
    return os.environ.get(KERNELS_ENV, "1") != "0"


def kernels_available() -> bool:
    """Whether `locks_hf.kernels` imports with Triton (the environment not consulted)."""
    try:
        from .. import kernels
    except ImportError:
        return False
    return kernels.HAVE_TRITON


def kernels_implement(config: LocksConfig, key_buffer: torch.Tensor | None) -> bool:
    """Whether the kernels implement ``config`` on this key buffer (CUDA, Triton available); the
    environment not consulted."""
    cls = selector_class(config.selector)
    if cls.kernel_method is None or key_buffer is None or not key_buffer.is_cuda or not kernels_available():
        return False
    from .. import kernels

    return kernels.implements(
        cls.kernel_method,
        dtype=key_buffer.dtype,
        head_dim=key_buffer.shape[-1],
        page_size=config.page_size,
        per_head=cls.per_head,
        group_combine=config.group_combine,
        basis_bits=config.basis_bits,
        coef_bits=config.coef_bits,
        centroid_bits=config.centroid_bits,
    )


def quantized_kernel_applies(
    device_type: str,
    config: LocksConfig,
    *,
    dtype: torch.dtype,
    head_dim: int,
    value_head_dim: int,
    enabled: bool,
    available: bool,
) -> bool:
    """Whether a layer storing packed K/V of ``config``'s ``kv_bits`` / ``kv_group`` (tails of ``dtype``,
    ``head_dim`` / ``value_head_dim`` channels) on a ``device_type`` device attends through
    `locks_hf.kernels.quantized_attention`: on CUDA, with the kernels ``enabled`` (`kernels_enabled`) and
    ``available`` (`kernels_available`), for settings the kernel implements (`kernels.implements_quantized`)."""
    if device_type != "cuda" or not enabled or not available or config.kv_bits == 16:
        return False
    from .. import kernels

    return kernels.implements_quantized(
        bits=config.kv_bits,
        group=config.kv_group,
        head_dim=head_dim,
        value_head_dim=value_head_dim,
        dtype=dtype,
        page_size=config.page_size,
    )


def choose_backend(layer: PagedLayer) -> DecodeBackend:
    """The backend of ``layer`` for its current settings and buffers."""
    if layer.selector is not None and layer.selector.token_level:
        return TOKEN_POLICY
    packed = layer.packed_kv()
    if packed is not None:
        keys, values = packed["key_tail"], packed["value_tail"]
        if quantized_kernel_applies(
            keys.device.type,
            layer.config,
            dtype=keys.dtype,
            head_dim=keys.shape[-1],
            value_head_dim=values.shape[-1],
            enabled=kernels_enabled(),
            available=kernels_available(),
        ) and (not layer.static_layout or selects_on_kernels(layer)):
            # (a static layer's step keeps its bookkeeping in the launches: all of it on the kernels)
            return QUANTIZED_KERNEL
        return REFERENCE
    if kernels_enabled() and kernels_implement(layer.config, layer.key_buffer()):
        return TRITON
    return REFERENCE
