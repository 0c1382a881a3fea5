"""Where a Locks layer's decode work runs, one `DecodeBackend` per layer chosen once (`choose_backend`).

`base` the interface; `reference` PyTorch on any device; `triton` the kernels (`locks_hf.kernels`);
`token_policy` the token-level policies' step; `choice` the rule that picks one for a layer.
"""

from .base import DecodeBackend
from .choice import KERNELS_ENV, choose_backend, kernels_available, kernels_enabled, kernels_implement
from .reference import REFERENCE, ReferenceBackend, reference_decode
from .token_policy import TOKEN_POLICY, TokenPolicyBackend
from .triton import TRITON, TritonBackend, kernel_decode

__all__ = ["KERNELS_ENV", "REFERENCE", "TOKEN_POLICY", "TRITON", "DecodeBackend", "ReferenceBackend",
           "TokenPolicyBackend", "TritonBackend", "choose_backend", "kernel_decode", "kernels_available",
           "kernels_enabled", "kernels_implement", "reference_decode"]
