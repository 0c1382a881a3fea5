"""Where a Locks layer's decode work runs, one `DecodeBackend` per layer chosen once (`choose_backend`).

`base` the interface; `reference` PyTorch on any device; `triton` the kernels (`locks_hf.kernels`);
`quantized` the quantized-KV kernel over a layer's packed K/V; `token_policy` the token-level
policies' step; `choice` the rule that picks one for a layer.
"""

from .base import DecodeBackend
from .choice import (
    KERNELS_ENV,
    choose_backend,
    kernels_available,
    kernels_enabled,
    kernels_implement,
    quantized_kernel_applies,
)
from .quantized import QUANTIZED_KERNEL, QuantizedKernelBackend, quantized_kernel_decode
from .reference import REFERENCE, PageSelection, ReferenceBackend, reference_decode, select_pages
from .token_policy import TOKEN_POLICY, TokenPolicyBackend
from .triton import TRITON, TritonBackend, kernel_decode

__all__ = [
    "KERNELS_ENV",
    "QUANTIZED_KERNEL",
    "REFERENCE",
    "TOKEN_POLICY",
    "TRITON",
    "DecodeBackend",
    "PageSelection",
    "QuantizedKernelBackend",
    "ReferenceBackend",
    "TokenPolicyBackend",
    "TritonBackend",
    "choose_backend",
    "kernel_decode",
    "kernels_available",
    "kernels_enabled",
    "kernels_implement",
    "quantized_kernel_applies",
    "quantized_kernel_decode",
    "reference_decode",
    "select_pages",
]
