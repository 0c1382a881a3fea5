"""KIVI quantization of the cached K/V (Liu et al., 2024, "KIVI: a tuning-free asymmetric 2bit
quantization for KV cache"): the settings, their validation, the quantizer and its byte counts.

What is quantized, as in KIVI's reference code (github.com/jy-yuan/KIVI):

* keys per channel: each group of ``kv_group`` consecutive tokens gets one scale and one zero point
  per channel (outlier channels keep their own range);
* values per token: each group of ``kv_group`` consecutive channels of one token gets one scale and
  one zero point;
* asymmetric, ``bits`` = 2 or 4: ``zero = min``, ``scale = (max - min) / (2**bits - 1)``,
  ``code = round(clamp((x - zero) / scale, 0, 2**bits - 1))`` with round-half-to-even (torch.round,
  as KIVI's ``round_``), ``x' = code * scale + zero``. Scale and zero are stored in the K/V dtype (KIVI
  keeps them in fp16, the model's dtype); codes are computed from the stored scale and zero, so that
  dequantizing reproduces exactly what the codes were fitted to. The arithmetic runs in float64, so
  the codes are those of the exact formula (no dtype-dependent ties). A constant group (``max ==
  min``, where KIVI would divide by zero) gets scale 0 and codes 0: it dequantizes to its value.
* Codes are packed ``8 // bits`` to a uint8 along the channel axis, element 0 in the low bits (KIVI
  packs int32 words along the token axis for keys; the bytes stored are the same).
* The most recent tokens stay in full precision (KIVI's residual ``R``): keys are quantized ``R``
  tokens at a time once ``R`` full-precision keys have accumulated (so ``len mod R`` stay full),
  values one token at a time as it leaves the window of the last ``R``. See `locks_hf.kv_cache`.
"""

from __future__ import annotations

import re

import torch

#: ``LocksConfig.kv_bits`` values: 16 = the K/V dtype (no quantization).
KV_BITS = (2, 4, 16)
KV_GROUPS = (32, 64, 128)
SUMMARY_FROM = ("post", "pre")
#: Defaults of the quantization fields (those a ``kv_bits=16`` config must keep).
KV_DEFAULTS = {"kv_bits": 16, "kv_group": 32, "kv_residual": 128, "summary_from": "post"}
KV_FIELDS = tuple(KV_DEFAULTS)


def _error(message: str):
    from .errors import LocksConfigError

    return LocksConfigError(message)


def builds_summaries(selector_cls) -> bool:
    """Whether a selector builds per-page summaries from keys (where ``summary_from`` matters)."""
    return not (selector_cls.dense or selector_cls.token_level or selector_cls.reads_keys)


def validate_kv(config) -> None:
    """Raise `LocksConfigError` for quantization settings that cannot run (fields already typed)."""
    bits, group, residual = config.kv_bits, config.kv_group, config.kv_residual
    if bits not in KV_BITS:
        raise _error(f"kv_bits must be one of {KV_BITS} (16 = no KV quantization), got {bits!r}")
    if config.summary_from not in SUMMARY_FROM:
        raise _error(f"summary_from must be one of {SUMMARY_FROM}, got {config.summary_from!r}")
    if bits == 16:
        changed = [f"{n}={getattr(config, n)!r}" for n in KV_FIELDS[1:] if getattr(config, n) != KV_DEFAULTS[n]]
        if changed:  # never ignore a setting silently
            raise _error(
                f"{', '.join(changed)} set with kv_bits=16 (no KV quantization), where it has no effect: "
                "set kv_bits=4 or 2, or leave it at its default"
            )
        return
    if group not in KV_GROUPS:
        raise _error(
            f"kv_group must be one of {KV_GROUPS} (tokens per key group, channels per value group), got {group!r}"
        )
    if residual < group or residual % group:
        raise _error(
            f"kv_residual must be a positive multiple of kv_group={group} (the full-precision keys are "
            f"quantized kv_residual / kv_group groups at a time), got {residual!r}"
        )
    if residual % config.page_size:
        raise _error(
            f"kv_residual={residual} must be a multiple of page_size={config.page_size}: keys are "
            "quantized in whole pages, so that a page's summary is built from one precision; use a "
            f"residual of k * {max(group, config.page_size)} tokens"
        )
    from .selectors.registry import selector_class

    cls = selector_class(config.selector)
    if config.summary_from != "post" and not builds_summaries(cls):
        raise _error(
            f"summary_from={config.summary_from!r}: selector {config.selector!r} builds no page "
            "summaries, so the order of summary and quantization does not apply (leave 'post')"
        )


def check_kv_head_dim(config, head_dim: int, value_dim: int | None = None) -> None:
    """Raise `LocksConfigError` when value groups of ``kv_group`` channels do not tile the head dims."""
    if config.kv_bits == 16:
        return
    for what, d in (("head_dim", head_dim), ("value head_dim", value_dim)):
        if d is not None and d % config.kv_group:
            raise _error(
                f"kv_group={config.kv_group} does not divide the model's {what}={d}: values are quantized "
                f"in groups of kv_group channels; choose kv_group in "
                f"{tuple(g for g in KV_GROUPS if d % g == 0) or KV_GROUPS} (or kv_bits=16)"
            )


def due_counts(length, quantized, *, residual: int, group: int, first_unsummarized=None):
    """KIVI's schedule: ``(keys_to, values_to)``, the slots below which keys and values are quantized once
    ``length`` tokens have been attended, given the counts ``quantized = (qk, qv)`` so far. Keys go in
    whole chunks of ``residual`` (``length // residual * residual``), held (for summaries built from the
    full-precision keys) at ``first_unsummarized``, the first slot of a page some row has not summarized
    yet, rounded down to a group; values all but the last ``residual``. Never below what is quantized.
    Host ints, or device tensors (a static layer's: no synchronisation)."""
    qk, qv = quantized
    keys_to = length // residual * residual
    if torch.is_tensor(length):
        if first_unsummarized is not None:
            keys_to = torch.minimum(keys_to, first_unsummarized // group * group)
        return torch.maximum(keys_to, qk), torch.maximum(length - residual, qv)
    if first_unsummarized is not None:
        keys_to = min(keys_to, first_unsummarized // group * group)
    return max(keys_to, qk), max(length - residual, qv)


def full_precision(config):
    """``config`` with the quantization fields at their defaults (the K/V kept in their dtype)."""
    return config.replace(**KV_DEFAULTS)


def same_kv(a, b) -> bool:
    return all(getattr(a, n) == getattr(b, n) for n in KV_FIELDS)


# -- arm labels: "<family>+kv4", "<family>+kv2g64r256-pre" --------------------------------------------------
_SUFFIX = re.compile(
    r"^(?P<family>.+?)\+kv(?P<bits>\d+)(?:g(?P<group>\d+))?(?:r(?P<res>\d+))?"
    r"(?:-(?P<order>post|pre))?$"
)
LABEL_GRAMMAR = "+kv<bits>[g<group>][r<residual>][-post|-pre] (KIVI-quantized KV, e.g. locks-r8i4+kv4-post)"


def split_kv_label(family: str) -> tuple[str, dict]:
    """An arm family label without its KV suffix, and the `LocksConfig` fields the suffix sets."""
    match = _SUFFIX.match(family)
    if match is None:
        return family, {}
    fields: dict[str, int | str] = {"kv_bits": int(match["bits"])}
    if match["group"]:
        fields["kv_group"] = int(match["group"])
    if match["res"]:
        fields["kv_residual"] = int(match["res"])
    if match["order"]:
        fields["summary_from"] = match["order"]
    return match["family"], fields


def kv_label(config, selector_cls) -> str:
    """The KV suffix of ``config``'s arm label (``""`` at 16 bits); `split_kv_label`'s inverse."""
    if config.kv_bits == 16:
        return ""
    out = f"+kv{config.kv_bits}"
    if config.kv_group != KV_DEFAULTS["kv_group"]:
        out += f"g{config.kv_group}"
    if config.kv_residual != KV_DEFAULTS["kv_residual"]:
        out += f"r{config.kv_residual}"
    return out + (f"-{config.summary_from}" if builds_summaries(selector_cls) else "")


# -- bytes ---------------------------------------------------------------------------------------------------
def kv_token_bytes(config, key_dim: int, value_dim: int, element_size: int) -> tuple[float, float]:
    """Bytes one token's key and value occupy in one KV head: codes plus their share of the scales and
    zero points (``element_size`` bytes each, the K/V dtype's); the K/V dtype's size at 16 bits."""
    if config.kv_bits == 16:
        return key_dim * element_size, value_dim * element_size
    bits, G = config.kv_bits, config.kv_group
    key = key_dim * bits / 8 + 2 * key_dim * element_size / G  # a (scale, zero) per channel per G tokens
    value = value_dim * bits / 8 + 2 * (value_dim // G) * element_size  # a (scale, zero) per G channels
    return key, value


# -- the quantizer ---------------------------------------------------------------------------------------------
def quantize(
    x: torch.Tensor, bits: int, dim: int, valid: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KIVI's asymmetric quantization of ``x`` with one (scale, zero) per slice reduced over ``dim``.

    ``valid`` (broadcastable to ``x``): elements that count; others (padding slots) neither widen the
    range nor hold a meaningful code (they get code 0). Returns codes (uint8, unpacked, in
    ``0 .. 2**bits - 1``) and scale and zero in ``x.dtype`` (keepdim over ``dim``).
    """
    qmax = 2**bits - 1
    x64 = x.double()
    if valid is not None:
        valid = valid.expand_as(x64)
        x64 = torch.where(valid, x64, 0.0)
        lo = torch.where(valid, x64, float("inf")).amin(dim, keepdim=True)
        hi = torch.where(valid, x64, float("-inf")).amax(dim, keepdim=True)
        empty = torch.isinf(lo)  # no valid element: a constant-zero group
        lo, hi = torch.where(empty, 0.0, lo), torch.where(empty, 0.0, hi)
    else:
        lo, hi = x64.amin(dim, keepdim=True), x64.amax(dim, keepdim=True)
    scale = ((hi - lo) / qmax).to(x.dtype)
    zero = lo.to(x.dtype)
    s, z = scale.double(), zero.double()
    codes = ((x64 - z) / torch.where(s == 0, 1.0, s)).clamp(0, qmax).round()
    codes = torch.where(s == 0, 0.0, codes)
    if valid is not None:
        codes = torch.where(valid, codes, 0.0)
    return codes.to(torch.uint8), scale, zero


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``code * scale + zero`` (float64, then rounded once to ``dtype``); shapes broadcast."""
    return (codes.double() * scale.double() + zero.double()).to(dtype)


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned ``bits``-bit codes, packed ``8 // bits`` per uint8 along the last dim (element 0 low)."""
    per = 8 // bits
    shifts = torch.arange(per, device=codes.device, dtype=torch.int32) * bits
    fields = codes.to(torch.int32).unflatten(-1, (-1, per)) << shifts
    return fields.sum(-1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `pack`: codes as uint8, the last dim multiplied by ``8 // bits``."""
    per = 8 // bits
    shifts = torch.arange(per, device=packed.device, dtype=torch.int32) * bits
    return ((packed.to(torch.int32).unsqueeze(-1) >> shifts) & (2**bits - 1)).flatten(-2).to(torch.uint8)


def quantize_keys(keys: torch.Tensor, bits: int, group: int, valid: torch.Tensor | None = None):
    """Keys ``[b, h, n, d]`` (``n`` a multiple of ``group``; ``valid [b, n]``) quantized per channel over
    groups of ``group`` tokens: packed codes ``[b, h, n, d*bits/8]``, scale and zero ``[b, h, n/group, d]``."""
    b, h, n, d = keys.shape
    grouped = keys.reshape(b, h, n // group, group, d)
    mask = None if valid is None else valid.reshape(b, 1, n // group, group, 1)
    codes, scale, zero = quantize(grouped, bits, dim=3, valid=mask)
    return pack(codes.reshape(b, h, n, d), bits), scale.squeeze(3), zero.squeeze(3)


def quantize_values(values: torch.Tensor, bits: int, group: int, valid: torch.Tensor | None = None):
    """Values ``[b, h, n, d]`` (``valid [b, n]``) quantized per token over groups of ``group`` channels:
    packed codes ``[b, h, n, d*bits/8]``, scale and zero ``[b, h, n, d/group]``."""
    b, h, n, d = values.shape
    grouped = values.reshape(b, h, n, d // group, group)
    mask = None if valid is None else valid.reshape(b, 1, n, 1, 1)
    codes, scale, zero = quantize(grouped, bits, dim=4, valid=mask)
    return pack(codes.reshape(b, h, n, d), bits), scale.squeeze(4), zero.squeeze(4)


def dequantize_keys(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Keys ``[..., n, d]`` from packed codes ``[..., n, d*bits/8]`` and the scale and zero of each
    token's group, ``[..., n, d]`` (already gathered per token)."""
    return dequantize(unpack(packed, bits), scale, zero, dtype)


def dequantize_values(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, dtype: torch.dtype
) -> torch.Tensor:
    """Values ``[..., n, d]`` from packed codes and per-token group scales ``[..., n, d/group]``."""
    codes = unpack(packed, bits)
    groups = scale.shape[-1]
    out = dequantize(codes.unflatten(-1, (groups, -1)), scale.unsqueeze(-1), zero.unsqueeze(-1), dtype)
    return out.flatten(-2)


def check_same_kv(old, new) -> None:
    """Raise `LocksConfigError` when ``new`` changes the KV storage settings of a layer holding K/V
    stored under ``old`` (what is quantized cannot be re-stored at another precision)."""
    if not same_kv(old, new):

        def describe(c):
            return ", ".join(f"{n}={getattr(c, n)!r}" for n in KV_FIELDS)

        raise _error(
            f"cannot switch a cache layer's KV storage from ({describe(old)}) to ({describe(new)}): its K/V "
            "are stored at the former settings; fork a full-precision (kv_bits=16) cache to quantize it"
        )
