"""Symmetric absmax quantization with bf16 scales, and packing of 2/4-bit codes into bytes."""

from __future__ import annotations

import sys

import torch

# The scale is rounded *up* to bf16 so that |x| / scale never exceeds qmax: the round trip error
# then stays within half a step, with no clamping error.
_BF16_ROUND_UP = 1.0 + 2.0**-7


def qmax(bits: int) -> int:
    """Largest code magnitude of a symmetric ``bits``-bit integer (7 for int4)."""
    return 2 ** (bits - 1) - 1


def absmax_scale(x: torch.Tensor, bits: int, dim: int | tuple[int, ...]) -> torch.Tensor:
    """bf16 scale per slice so that ``x / scale`` fits ``[-qmax, qmax]`` (reduced over ``dim``)."""
    amax = x.abs().amax(dim=dim, keepdim=True).float()
    scale = (amax * _BF16_ROUND_UP / qmax(bits)).to(torch.bfloat16)
    # An all-zero slice gets scale 1; a NaN / Inf slice keeps its NaN / Inf scale, so that the
    # dequantized values (and the page's score) stay non-finite instead of becoming codes of 0.
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def quantize(x: torch.Tensor, bits: int, dim: int | tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8 tensor, values in ``[-qmax, qmax]``) and bf16 scales, keepdim over ``dim``."""
    scale = absmax_scale(x, bits, dim)
    codes = torch.round(x.float() / scale.float()).clamp_(-qmax(bits), qmax(bits))
    return codes.to(torch.int8), scale


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed ``bits``-bit codes along the last dim into uint8 (element 0 in the low bits)."""
    if bits == 8:
        return codes.to(torch.int8)
    per_byte = 8 // bits
    if codes.shape[-1] % per_byte:
        raise ValueError(f"last dim {codes.shape[-1]} is not a multiple of {per_byte} for {bits}-bit packing")
    mask = (1 << bits) - 1
    fields = (codes.to(torch.int32) & mask).unflatten(-1, (-1, per_byte))
    shifts = torch.arange(per_byte, device=codes.device, dtype=torch.int32) * bits
    return (fields << shifts).sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: signed codes as int8, last dim multiplied back out."""
    if bits == 8:
        return packed.to(torch.int8)
    if bits == 4 and sys.byteorder == "little":
        # Both fields into one int16 (the low one in its low byte), read back as two bytes: in-place passes
        # over one buffer, where stacking the fields along a new last dim is a strided copy (3x slower on a
        # CPU). Shifting a sign-extended byte left to the top of the int16 and back sign-extends a field.
        word = packed.view(torch.int8).to(torch.int16)
        high = word >> 4
        high <<= 8
        word <<= 12
        word >>= 12
        word &= 0xFF
        word |= high
        return word.contiguous().view(torch.int8)  # (a permuted input gives a permuted word)
    x = packed.view(torch.int8)
    # Shift field i to the top of the byte, then an arithmetic right shift sign-extends it.
    fields = [(x << (8 - bits * (i + 1))) >> (8 - bits) for i in range(8 // bits)]
    return torch.stack(fields, dim=-1).flatten(-2)
