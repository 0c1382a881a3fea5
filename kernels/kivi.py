"""KIVI's per-step schedule for a static quantized layer (`locks_hf.static_kv_layer`), in one launch.

A static layer keeps the full-precision K/V of its newest slots in a ring of ``RING`` slots (slot ``s``
at ``s % RING``) beside the capacity-wide packed storage of `attend_quant` (codes, per-group scales
and zero points). Before the token of a decode step is written, KIVI quantizes what the previous
forward left due (`locks_hf.kv_quant.due_counts`): keys in whole groups of ``group`` slots up to
``length // residual * residual`` (for summaries built before quantization, "post", no further than
the first page some row has not completed, hence not summarized, yet), values up to ``length - residual``.
``_kivi_append_kernel`` (grid: rows ``b*h``) does that from the ring for its (row, KV head), writes the
new token into the ring, and the last program to finish stores the new ``(qk, qv)``: every program
reads the old counts first, so they all quantize the same slots (a counter orders them, as the
attention kernel's fused merge does). The codes are those of `locks_hf.kv_quant.quantize`: float64
arithmetic, scale and zero point rounded to the storage dtype through float32 as torch rounds them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, next_pow2, on_device
from .build import _bf16_value, _rint


@triton.jit
def _stored(x, DTYPE: tl.constexpr):
    """Float64 ``x`` rounded to the storage dtype (through float32, as torch converts a double); the
    bf16 rounding in integer ops, so that the interpreter and the GPU agree."""
    y = x.to(tl.float32)
    if DTYPE == tl.bfloat16:
        y = _bf16_value(y)
    return y.to(DTYPE)


@triton.jit
def _pack(codes, BITS: tl.constexpr):
    """``codes [N, D]`` (int32 in ``0 .. 2**BITS - 1``) packed ``8 // BITS`` to a byte along the last
    axis, element 0 in the low bits: ``[N, D * BITS / 8]`` uint8."""
    N: tl.constexpr = codes.shape[0]
    D: tl.constexpr = codes.shape[1]
    if BITS == 4:
        lo, hi = tl.split(tl.reshape(codes, [N, D // 2, 2]))
        packed = lo | (hi << 4)
    else:
        x0, x1 = tl.split(tl.reshape(codes, [N, D // 4, 2, 2]))  # channels 4j + 2u (x0) and 4j + 2u + 1 (x1)
        c0, c2 = tl.split(x0)
        c1, c3 = tl.split(x1)
        packed = c0 | (c1 << 2) | (c2 << 4) | (c3 << 6)
    return packed.to(tl.uint8)


@triton.jit
def _quantize(x, ok, axis: tl.constexpr, QMAX: tl.constexpr, DTYPE: tl.constexpr):
    """KIVI's asymmetric quantization of ``x`` (float64) reduced over ``axis``, elements ``ok`` only:
    codes (int32), scale and zero point in the storage dtype (keepdims over ``axis``)."""
    lo = tl.min(tl.where(ok, x, float("inf")), axis=axis, keep_dims=True)
    hi = tl.max(tl.where(ok, x, float("-inf")), axis=axis, keep_dims=True)
    empty = lo == float("inf")  # no real element: a constant-zero group
    lo = tl.where(empty, 0.0, lo)
    hi = tl.where(empty, 0.0, hi)
    scale = _stored((hi - lo) / QMAX, DTYPE)
    zero = _stored(lo, DTYPE)
    s = scale.to(tl.float64)
    q = (x - zero.to(tl.float64)) / tl.where(s == 0, 1.0, s)
    q = _rint(tl.minimum(tl.maximum(q, 0.0), QMAX * 1.0))
    q = tl.where((s == 0) | ~ok, 0.0, q)
    return q.to(tl.int32), scale, zero


@triton.jit
def _kivi_append_kernel(
    new_k_ptr,
    new_v_ptr,
    nk_sb,
    nk_sh,
    nv_sb,
    nv_sh,
    rk_ptr,
    rv_ptr,
    kc_ptr,
    ks_ptr,
    kz_ptr,
    vc_ptr,
    vs_ptr,
    vz_ptr,
    valid_ptr,
    valid_sb,
    row_start_ptr,
    n_rows,
    len_ptr,
    quant_ptr,
    counter_ptr,
    H,
    CAP,
    KG_ROWS,
    D: tl.constexpr,
    BITS: tl.constexpr,
    QG: tl.constexpr,
    R: tl.constexpr,
    RING: tl.constexpr,
    B: tl.constexpr,
    POST: tl.constexpr,
    NB: tl.constexpr,
    VT: tl.constexpr,
    DTYPE: tl.constexpr,
):
    prog = tl.program_id(0)
    bb = (prog // H).to(tl.int64)
    hh = prog % H
    T = tl.load(len_ptr)  # slots written before this step's token
    qk = tl.load(quant_ptr)
    qv = tl.load(quant_ptr + 1)
    QMAX: tl.constexpr = (1 << BITS) - 1
    DP: tl.constexpr = D * BITS // 8
    c = tl.arange(0, D)
    cp = tl.arange(0, DP)
    vrow = valid_ptr + bb * valid_sb
    ring = prog.to(tl.int64) * RING  # this (row, head)'s ring, [RING, D] contiguous
    store = prog.to(tl.int64) * CAP  # its codes and value scales, [CAP, ...] contiguous

    keys_to = T // R * R
    if POST:  # never past the first page a row has not summarized (its incomplete page)
        r = tl.arange(0, NB)
        rs = tl.load(row_start_ptr + r, mask=r < n_rows, other=2**30)
        first = tl.where(r < n_rows, rs + tl.maximum(T - rs, 0) // B * B, 2**30)
        keys_to = tl.minimum(keys_to, tl.min(first, axis=0) // QG * QG)
    keys_to = tl.maximum(keys_to, qk)
    values_to = tl.maximum(T - R, qv)

    t = tl.arange(0, QG)
    for g0 in range(qk, keys_to, QG):  # key groups: per channel over QG slots
        slot = g0 + t
        ok = tl.load(vrow + slot) != 0
        x = tl.load(rk_ptr + (ring + slot % RING)[:, None] * D + c[None, :]).to(tl.float64)
        codes, scale, zero = _quantize(x, ok[:, None], 0, QMAX, DTYPE)
        tl.store(kc_ptr + (store + slot)[:, None] * DP + cp[None, :], _pack(codes, BITS))
        grp = prog.to(tl.int64) * KG_ROWS + g0 // QG
        tl.store(ks_ptr + grp * D + c[None, :], scale)
        tl.store(kz_ptr + grp * D + c[None, :], zero)

    NG: tl.constexpr = D // QG
    u = tl.arange(0, VT)
    gi = tl.arange(0, NG)
    for s0 in range(qv, values_to, VT):  # values: per slot over groups of QG channels
        slot = s0 + u
        due = slot < values_to
        ok = due & (tl.load(vrow + slot, mask=due, other=0) != 0)
        x = tl.load(rv_ptr + (ring + slot % RING)[:, None] * D + c[None, :], mask=due[:, None], other=0.0)
        x = tl.reshape(x.to(tl.float64), [VT, NG, QG])
        codes, scale, zero = _quantize(x, ok[:, None, None], 2, QMAX, DTYPE)
        tl.store(
            vc_ptr + (store + slot)[:, None] * DP + cp[None, :],
            _pack(tl.reshape(codes, [VT, D]), BITS),
            mask=due[:, None],
        )
        at = (store + slot)[:, None] * NG + gi[None, :]
        tl.store(vs_ptr + at, tl.reshape(scale, [VT, NG]), mask=due[:, None])
        tl.store(vz_ptr + at, tl.reshape(zero, [VT, NG]), mask=due[:, None])

    # the new token goes into the ring once its slot's previous occupant is quantized (it is: the ring
    # holds more slots than the residual plus the slack of a page and a group)
    at = (ring + T % RING) * D + c
    tl.store(rk_ptr + at, tl.load(new_k_ptr + bb * nk_sb + hh * nk_sh + c))
    tl.store(rv_ptr + at, tl.load(new_v_ptr + bb * nv_sb + hh * nv_sh + c))

    # the last program to finish publishes the new counts (all of them read the old ones first)
    done = tl.atomic_add(counter_ptr, 1 + 0 * (qk + qv))
    if done == tl.num_programs(0) - 1:
        tl.store(quant_ptr, keys_to)
        tl.store(quant_ptr + 1, values_to)
        tl.store(counter_ptr, 0)


def ring_slots(residual: int, page_size: int, group: int) -> int:
    """Slots of a static quantized layer's full-precision ring: the residual, the token written before
    the due slots are quantized, and the slack of a page and a group by which "post" summaries may
    hold key quantization back in a padded batch, rounded up to a power of two."""
    return next_pow2(residual + page_size + group + 1)


_TORCH_TO_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def kivi_append(
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    *,
    key_ring: torch.Tensor,
    value_ring: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    quantized: torch.Tensor,
    counter: torch.Tensor,
    bits: int,
    group: int,
    residual: int,
    page_size: int,
    post: bool,
) -> None:
    """One decode step of KIVI's schedule on a static quantized layer's buffers, in place (module
    docstring): quantize what is due from the rings, then write ``new_keys`` / ``new_values``
    ``[b, h, 1, d]`` at slot ``length`` of the rings. ``quantized`` is the ``int32 [2]`` device tensor
    ``(qk, qv)``, updated; ``counter`` an ``int32 [1]`` zero that the launch leaves zero; ``length``
    the ``int32 [1]`` slots written before this token; ``post``: hold key quantization at the first
    page a row has not summarized, its incomplete page (summaries built from full-precision keys)."""
    b, h, RING, d = key_ring.shape
    cap = key_codes.shape[2]
    if new_keys.shape != (b, h, 1, d) or new_values.shape != (b, h, 1, d):
        raise ValueError(f"kivi_append: one new token [b, h, 1, d] = {(b, h, 1, d)} expected, got {new_keys.shape}")
    if RING & (RING - 1) or RING < residual + page_size + group + 1:
        raise ValueError(
            f"kivi_append: the rings must hold a power of two >= {residual + page_size + group + 1} slots "
            f"(ring_slots), got {RING}"
        )
    if key_ring.dtype not in _TORCH_TO_TL or key_scale.dtype != key_ring.dtype:
        raise ValueError(f"kivi_append: rings and scales share a dtype in {tuple(_TORCH_TO_TL)}, got {key_ring.dtype}")
    parts = (key_ring, value_ring, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero)
    if not all(t.is_contiguous() for t in parts) or new_keys.stride(-1) != 1 or new_values.stride(-1) != 1:
        raise ValueError("kivi_append: the rings and the packed storage must be contiguous")
    if b * h == 0:
        return
    with on_device(key_ring.device):
        launch(
            _kivi_append_kernel,
            (b * h,),
            new_keys,
            new_values,
            new_keys.stride(0),
            new_keys.stride(1),
            new_values.stride(0),
            new_values.stride(1),
            key_ring,
            value_ring,
            key_codes,
            key_scale,
            key_zero,
            value_codes,
            value_scale,
            value_zero,
            slot_valid.view(torch.uint8) if slot_valid.dtype == torch.bool else slot_valid,
            slot_valid.stride(0),
            row_start,
            b,
            length,
            quantized,
            counter,
            h,
            cap,
            key_scale.shape[2],
            D=d,
            BITS=bits,
            QG=group,
            R=residual,
            RING=RING,
            B=page_size,
            POST=post,
            NB=next_pow2(b),
            VT=4,
            DTYPE=_TORCH_TO_TL[key_ring.dtype],
            num_warps=8 if group * d > 4096 else 4,  # a key group's float64 tile (sm_90: no spills)
        )
