"""Sparse decode attention over KIVI-quantized K/V (`locks_hf.kv_quant`), dequantized in registers.

The layout read is `locks_hf.kv_cache.QuantizedLocksLayer`'s (see `QuantizedLocksLayer.packed_kv`),
per batch row ``i`` and KV head ``j``, for cache slots ``s`` (page ``p`` of row ``i`` holds slots
``row_start[i] + p*B ... + B-1``):

* keys of slots ``s < qk`` (``qk`` a multiple of ``group``): ``key_codes [b, h, cap, d*bits/8]``
  uint8, ``8 // bits`` codes a byte along the channel axis, channel ``0`` in the low bits; one scale
  and zero point per channel for each group of ``group`` slots, ``key_scale`` / ``key_zero``
  ``[b, h, >= qk/group, d]`` (slot ``s`` reads row ``s // group``: groups are aligned to slots, not
  to pages, so a page may straddle two groups or the quantized/full-precision boundary);
* values of slots ``s < qv``: ``value_codes [b, h, cap, d*bits/8]`` packed the same way; one scale and
  zero point per group of ``group`` channels of each slot, ``value_scale`` / ``value_zero``
  ``[b, h, cap, d/group]``;
* the newer slots in the K/V dtype (KIVI's residual): ``key_tail [b, h, >= length-qk, d]`` holds slot
  ``s >= qk`` at index ``s - qk``, ``value_tail`` slot ``s >= qv`` at ``s - qv``.

``x = code * scale + zero`` (asymmetric, codes in ``0 .. 2**bits - 1``) is computed in float32 and
rounded to the query dtype before the products; scores, softmax and the output are accumulated in
float32. ``_quant_attn_kernel`` (grid: rows ``b*h`` x splits) walks its share of a row's page list
``TP`` pages at a time, once for all G query heads of the KV head, online softmax in base 2, padding
slots and ``SENTINEL`` entries masked, exactly as `attend._sparse_attn_kernel` does for the bf16
cache; with several splits the partials are merged by `attend._combine_kernel`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from ._common import LOG2E, as_length, dot_precision, launch, next_pow2, sm_count
from .attend import (
    MAX_SPLITS,
    _combine_kernel,
    _page_tile,
    _softmax_tile,
    _store_heads,
    default_splits,
    record_attended,
    tile_pages_for,
)

#: Code widths and group sizes the kernel reads (those of `locks_hf.kv_quant`).
QUANT_BITS = (2, 4)
QUANT_GROUPS = (32, 64, 128)


#: Query / K/V dtypes the decode path sends it (those of the other kernels).
QUANT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def implements_quantized(
    *, bits: int, group: int, head_dim: int, value_head_dim: int, dtype: torch.dtype, page_size: int
) -> bool:
    """Whether `quantized_attention` runs a layer's settings: ``bits`` / ``group`` among `QUANT_BITS` /
    `QUANT_GROUPS`, one head_dim for keys and values (a power of two >= 16 that ``group`` divides), a
    K/V ``dtype`` in `QUANT_DTYPES` and a power-of-two ``page_size``."""
    d, B = head_dim, page_size
    return (
        bits in QUANT_BITS
        and group in QUANT_GROUPS
        and dtype in QUANT_DTYPES
        and value_head_dim == d
        and d >= 16
        and not d & (d - 1)
        and not d % group
        and B >= 1
        and not B & (B - 1)
    )


@triton.jit
def _unpack(packed, BITS: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    """Codes ``[N, D]`` (int32) of the bytes ``packed [N, D*BITS/8]``, element 0 in the low bits."""
    x = packed.to(tl.int32)
    if BITS == 4:
        y = tl.join(x & 15, x >> 4)  # [N, D/2, 2]: channel 2c in the low nibble, 2c + 1 in the high one
    else:  # [N, D/4, 2, 2] flattened: (c0, c2), (c1, c3) joined -> c0, c1, c2, c3
        y = tl.join(tl.join(x & 3, (x >> 4) & 3), tl.join((x >> 2) & 3, x >> 6))
    return tl.reshape(y, [N, D])


@triton.jit
def _tail_index(slot, first, RING: tl.constexpr):
    """Where slot ``slot`` of the full-precision tail lies: at ``slot - first`` in a tail that starts at
    the first slot not quantized (a dynamic layer's), or at ``slot % RING`` in a ring (a static one's)."""
    if RING:
        idx = slot % RING
    else:
        idx = slot - first
    return idx


@triton.jit
def _key_scales(
    ks_ptr, kz_ptr, base, ks_st, slot, quant, c, QG: tl.constexpr, TP: tl.constexpr, B: tl.constexpr, D: tl.constexpr
):
    """The per-channel key scale and zero point of each slot of a tile ``slot [TP, B]`` (``quant``: its
    quantized slots), as ``[TP*B, D]`` float32. A page of ``B <= QG`` slots lies in at most two key
    groups: two ``[TP, D]`` loads a tile, chosen per slot, instead of one row per slot."""
    if B <= QG:
        first = tl.min(slot, axis=1)  # [TP]: the page's first slot (slots ascend along a page)
        lo = first // QG
        hi = (first + B - 1) // QG
        any_q = tl.max(quant.to(tl.int32), axis=1) > 0
        at_lo = base + lo[:, None] * ks_st + c[None, :]
        at_hi = base + hi[:, None] * ks_st + c[None, :]
        on_hi = ((slot // QG) != lo[:, None])[:, :, None]  # [TP, B, 1]
        sc = tl.where(
            on_hi,
            tl.load(ks_ptr + at_hi, mask=any_q[:, None] & (hi != lo)[:, None], other=0.0).to(tl.float32)[:, None, :],
            tl.load(ks_ptr + at_lo, mask=any_q[:, None], other=0.0).to(tl.float32)[:, None, :],
        )
        ze = tl.where(
            on_hi,
            tl.load(kz_ptr + at_hi, mask=any_q[:, None] & (hi != lo)[:, None], other=0.0).to(tl.float32)[:, None, :],
            tl.load(kz_ptr + at_lo, mask=any_q[:, None], other=0.0).to(tl.float32)[:, None, :],
        )
        sc = tl.reshape(sc, [TP * B, D])
        ze = tl.reshape(ze, [TP * B, D])
    else:
        flat = tl.reshape(slot, [TP * B])
        at = base + (flat // QG)[:, None] * ks_st + c[None, :]
        q = tl.reshape(quant, [TP * B])[:, None]
        sc = tl.load(ks_ptr + at, mask=q, other=0.0).to(tl.float32)
        ze = tl.load(kz_ptr + at, mask=q, other=0.0).to(tl.float32)
    return sc, ze


@triton.jit
def _quant_attn_kernel(
    q_ptr,
    q_sb,
    q_sh,
    kc_ptr,
    kc_sb,
    kc_sh,
    kc_st,
    ks_ptr,
    kz_ptr,
    ks_sb,
    ks_sh,
    ks_st,
    vc_ptr,
    vc_sb,
    vc_sh,
    vc_st,
    vs_ptr,
    vz_ptr,
    vs_sb,
    vs_sh,
    vs_st,
    kt_ptr,
    kt_sb,
    kt_sh,
    kt_st,
    vt_ptr,
    vt_sb,
    vt_sh,
    vt_st,
    quant_ptr,
    sel_ptr,
    W,
    valid_ptr,
    valid_sb,
    row_start_ptr,
    len_ptr,
    H,
    scale,
    part_o_ptr,
    part_l_ptr,
    out_ptr,
    out_sb,
    out_sh,
    pages_per_split,
    n_split,
    count_ptr,
    row_count_ptr,
    pad_ptr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    TP: tl.constexpr,
    BITS: tl.constexpr,
    QG: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DENSE: tl.constexpr,
    COUNT: tl.constexpr,
    ROW_COUNT: tl.constexpr,
    CONTEXT: tl.constexpr,
    RING: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    bb = (row // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
    hh = row % H
    rs = tl.load(row_start_ptr + bb)
    length = tl.load(len_ptr)
    qk = tl.load(quant_ptr)  # keys of slots < qk are quantized, values of slots < qv
    qv = tl.load(quant_ptr + 1)
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    cp = tl.arange(0, D * BITS // 8)
    q = tl.load(q_ptr + bb * q_sb + (hh * G + g[:, None]) * q_sh + c[None, :], mask=g[:, None] < G, other=0.0)
    kcb = kc_ptr + bb * kc_sb + hh * kc_sh
    ksb = bb * ks_sb + hh * ks_sh
    vcb = vc_ptr + bb * vc_sb + hh * vc_sh
    vsb = bb * vs_sb + hh * vs_sh
    ktb = kt_ptr + bb * kt_sb + hh * kt_sh
    vtb = vt_ptr + bb * vt_sb + hh * vt_sh
    vrow = valid_ptr + bb * valid_sb
    qk_scale = scale * LOG2E

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    start = split * pages_per_split
    end = tl.minimum(start + pages_per_split, W)
    if DENSE:  # every page of the row: page w is list entry w, and the loop stops at the written ones
        end = tl.minimum(end, tl.cdiv(length - rs, B))
    seen = tl.zeros([TP * B], dtype=tl.int32)
    for w0 in range(start, end, TP):
        slot2, inside2, ok2 = _page_tile(sel_ptr, row, W, w0, end, rs, length, vrow, TP, B, DENSE)  # [TP, B]
        ok = tl.reshape(ok2, [TP * B])
        slot = tl.reshape(slot2, [TP * B])
        inside = tl.reshape(inside2, [TP * B])
        seen += ok.to(tl.int32)

        # keys: codes times their group's per-channel scale plus its zero below qk, the tail from qk on
        kq = inside & (slot < qk)
        kf = inside & (slot >= qk)
        codes = tl.load(kcb + slot[:, None] * kc_st + cp[None, :], mask=kq[:, None], other=0)
        ksc, kze = _key_scales(ks_ptr, kz_ptr, ksb, ks_st, slot2, inside2 & (slot2 < qk), c, QG, TP, B, D)
        k_deq = _unpack(codes, BITS, TP * B, D).to(tl.float32) * ksc + kze
        k_full = tl.load(ktb + _tail_index(slot, qk, RING)[:, None] * kt_st + c[None, :], mask=kf[:, None], other=0.0)
        k = tl.where(kq[:, None], k_deq.to(q.dtype), k_full.to(q.dtype))
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [GP, TP*B], base 2
        p, alpha, m, l = _softmax_tile(s, ok, m, l)

        # values: codes times the per-slot scale plus the zero of each channel group below qv, the tail
        # from qv on; padding and unwritten slots read as 0 (their p is 0, but 0 * NaN = NaN)
        vq = ok & (slot < qv)
        vf = ok & (slot >= qv)
        codes = tl.load(vcb + slot[:, None] * vc_st + cp[None, :], mask=vq[:, None], other=0)
        NG: tl.constexpr = D // QG
        grp = vsb + slot[:, None] * vs_st + tl.arange(0, NG)[None, :]  # [TP*B, NG]: one load a group
        vsc = tl.load(vs_ptr + grp, mask=vq[:, None], other=0.0).to(tl.float32)
        vze = tl.load(vz_ptr + grp, mask=vq[:, None], other=0.0).to(tl.float32)
        v_deq = tl.reshape(_unpack(codes, BITS, TP * B, D).to(tl.float32), [TP * B, NG, QG])
        v_deq = tl.reshape(v_deq * vsc[:, :, None] + vze[:, :, None], [TP * B, D])
        v_full = tl.load(vtb + _tail_index(slot, qv, RING)[:, None] * vt_st + c[None, :], mask=vf[:, None], other=0.0)
        v = tl.where(vq[:, None], v_deq.to(q.dtype), v_full.to(q.dtype))
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)

    record_attended(
        tl.sum(seen, axis=0), bb, hh, split, length, H, count_ptr, row_count_ptr, pad_ptr, COUNT, ROW_COUNT, CONTEXT
    )
    _store_heads(
        acc, l, m, row, split, n_split, part_o_ptr, part_l_ptr, out_ptr, out_sb, out_sh, bb, hh, G, GP, D, SPLIT
    )


#: Largest tile (slots x head_dim) whose loads are software-pipelined (``num_stages=2``) by default, by
#: the (query, K/V storage) element sizes in bytes. Each pipeline stage holds the tile's dequantization
#: inputs (codes, per-slot key scales and zero points, the full-precision tails) in shared memory, so
#: 4-byte storage needs about twice bf16's: AOT compiles for sm_90 (Triton 3.6.0) at head_dim 64-256 use
#: at most ~190 KB within these bounds, while e.g. float32 at 64 slots x 128 channels needs 250 KB, over
#: an H100/H200's 227 KB a block (``scripts/dev/check_quant_attention_compile.py``).
STAGED_ELEMS = {(2, 2): 16384, (4, 2): 8192, (2, 4): 4096, (4, 4): 4096}


def launch_tiles(
    page_size: int,
    head_dim: int,
    query_dtype: torch.dtype,
    storage_dtype: torch.dtype,
    tile_pages: int | None = None,
    num_stages: int | None = None,
) -> tuple[int, int]:
    """``(tile_pages, num_stages)`` of a launch: those given, else `attend.sparse_attention`'s tile (the
    bf16 default: 64 slots at pages <= 64, two stages), halved down to 16 slots until it is within
    `STAGED_ELEMS`, and one stage for a tile still past it (large pages)."""
    limit = STAGED_ELEMS.get(
        (torch.empty((), dtype=query_dtype).element_size(), torch.empty((), dtype=storage_dtype).element_size()),
        min(STAGED_ELEMS.values()),
    )
    tp = tile_pages_for(page_size, tile_pages, "quantized_attention")
    if not tile_pages:
        while tp > 1 and tp * page_size * head_dim > limit and tp * page_size > 16:
            tp //= 2
    if num_stages is None:
        num_stages = 2 if tp * page_size * head_dim <= limit else 1
    return tp, num_stages


def _quantized_counts(quantized, device) -> torch.Tensor:
    """``(qk, qv)`` as the ``int32 [2]`` device tensor the kernel reads (a tensor is used as is)."""
    if torch.is_tensor(quantized):
        return quantized
    return torch.tensor([int(quantized[0]), int(quantized[1])], dtype=torch.int32, device=device)


def quantized_attention(
    query: torch.Tensor,
    pages: torch.Tensor | None,
    *,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    quantized,
    bits: int,
    group: int,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: int | torch.Tensor,
    scale: float,
    page_size: int,
    n_pages: int | None = None,
    counts: torch.Tensor | None = None,
    row_counts: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
    ring: int = 0,
    splits: int | None = None,
    tile_pages: int | None = None,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> torch.Tensor:
    """Attention of one decode query over the listed pages of KIVI-quantized K/V (module docstring).

    ``query [b, Hq, d]`` (or ``[b, Hq, 1, d]``), ``Hq = G * h``; ``pages`` int32 ``[b, h, W]`` or
    ``[b*h, W]`` page numbers (``< 0`` = none), or ``None`` for every written page of the first
    ``n_pages``; ``quantized``: ``(qk, qv)`` as ints or an ``int32 [2]`` device tensor; ``slot_valid
    [b, cap]`` (False = padding), ``row_start`` int32 ``[b]``, ``length`` the slots written (int or
    ``int32 [1]``). ``counts`` (int64, optional): ``counts[0]`` grows by the real tokens attended, summed
    over rows and KV heads; ``row_counts`` (int64 ``[b, 2]``) and ``pad`` (int32 ``[b]``): a static layer's
    per-row statistics, as `attend.sparse_attention` keeps them. ``ring`` > 0: the tails are rings of
    that many slots (slot ``s`` at ``s % ring``, a static layer's), else they start at slots ``qk`` / ``qv``.
    ``tile_pages`` / ``num_stages``: pages a tile
    and software-pipeline stages, by default `launch_tiles`'s for the dtypes and head_dim. Returns the
    output in the query's shape and dtype.
    """
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    q = query.reshape(b, hq, d)
    h = key_codes.shape[1]
    if bits not in QUANT_BITS or group not in QUANT_GROUPS:
        raise ValueError(
            f"quantized_attention: bits must be in {QUANT_BITS} and group in {QUANT_GROUPS}, "
            f"got bits={bits}, group={group}"
        )
    if hq % h:
        raise ValueError(f"quantized_attention: {hq} query heads are not a multiple of {h} KV heads")
    if d & (d - 1) or d % group or d < 16:
        raise ValueError(f"quantized_attention: head_dim {d} must be a power of two >= 16 divisible by group={group}")
    dp = d * bits // 8
    if key_codes.shape[-1] != dp or value_codes.shape[-1] != dp or value_scale.shape[-1] != d // group:
        raise ValueError(
            f"quantized_attention: packed codes must have {dp} bytes a slot and value scales "
            f"{d // group} groups (d={d}, bits={bits}, group={group}); got keys "
            f"{tuple(key_codes.shape)}, values {tuple(value_codes.shape)}, "
            f"value scales {tuple(value_scale.shape)}"
        )
    if key_zero.stride() != key_scale.stride() or value_zero.stride() != value_scale.stride():
        raise ValueError("quantized_attention: each zero-point tensor must have its scale tensor's strides")
    for name, t in (
        ("key_codes", key_codes),
        ("value_codes", value_codes),
        ("key_scale", key_scale),
        ("value_scale", value_scale),
        ("key_tail", key_tail),
        ("value_tail", value_tail),
    ):
        if t.shape[-1] > 1 and t.stride(-1) != 1:
            raise ValueError(f"quantized_attention: {name} must be contiguous in its last dim")
    G = hq // h
    if pad is not None and (row_counts is None or counts is None):
        raise ValueError("quantized_attention: pad (the cached-token statistics) needs counts and row_counts")
    if ring < 0 or ring & (ring - 1) or (ring and (key_tail.shape[2] != ring or value_tail.shape[2] != ring)):
        raise ValueError(
            f"quantized_attention: ring must be 0 or a power of two, the tails' slots; got ring={ring} with "
            f"tails of {key_tail.shape[2]} / {value_tail.shape[2]} slots"
        )
    dense = pages is None
    if pages is None:
        if n_pages is None:
            raise ValueError("quantized_attention: pages=None (dense) needs n_pages")
        rows, W = b * h, n_pages
    else:
        pages = pages.reshape(b * h, -1)
        if pages.dtype != torch.int32 or not pages.is_contiguous():
            pages = pages.to(torch.int32).contiguous()
        rows, W = pages.shape
    dev = query.device
    B = page_size
    if num_stages is not None and num_stages < 1:
        raise ValueError(f"quantized_attention: num_stages must be >= 1, got {num_stages}")
    storage = max((key_scale, value_scale, key_tail, value_tail), key=lambda t: t.element_size()).dtype
    TP, stages = launch_tiles(B, d, q.dtype, storage, tile_pages, num_stages)
    out = torch.empty((b, hq, d), dtype=query.dtype, device=dev)
    if splits is None:
        splits = default_splits(rows, W, TP, dense, sm_count(dev))
    pps = triton.cdiv(triton.cdiv(max(W, 1), max(1, min(splits, MAX_SPLITS))), TP) * TP
    splits = max(1, triton.cdiv(W, pps))
    if splits > 1:
        part_o = torch.empty((rows, splits, G, d), dtype=torch.float32, device=dev)
        part_l = torch.empty((rows, splits, G), dtype=torch.float32, device=dev)
    else:
        part_o = part_l = out
    # an empty full-precision tail (every slot quantized) is never read: its scale tensor stands in
    kt = key_tail if key_tail.numel() else key_scale
    vt = value_tail if value_tail.numel() else value_scale
    valid = slot_valid.view(torch.uint8) if slot_valid.dtype == torch.bool else slot_valid
    try:
        launch(
            _quant_attn_kernel,
            (rows, splits),
            q,
            q.stride(0),
            q.stride(1),
            key_codes,
            key_codes.stride(0),
            key_codes.stride(1),
            key_codes.stride(2),
            key_scale,
            key_zero,
            key_scale.stride(0),
            key_scale.stride(1),
            key_scale.stride(2),
            value_codes,
            value_codes.stride(0),
            value_codes.stride(1),
            value_codes.stride(2),
            value_scale,
            value_zero,
            value_scale.stride(0),
            value_scale.stride(1),
            value_scale.stride(2),
            kt,
            kt.stride(0),
            kt.stride(1),
            kt.stride(2),
            vt,
            vt.stride(0),
            vt.stride(1),
            vt.stride(2),
            _quantized_counts(quantized, dev),
            row_start if dense else pages,
            W,
            valid,
            slot_valid.stride(0),
            row_start,
            as_length(length, dev),
            h,
            float(scale),
            part_o,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            pps,
            splits,
            row_start if counts is None else counts,
            row_start if row_counts is None else row_counts,
            row_start if pad is None else pad,
            G=G,
            GP=max(16, next_pow2(G)),
            D=d,
            B=B,
            TP=TP,
            BITS=bits,
            QG=group,
            SPLIT=splits > 1,
            DOT_PREC=dot_precision(q.dtype),
            DENSE=dense,
            COUNT=counts is not None,
            ROW_COUNT=row_counts is not None,
            CONTEXT=pad is not None,
            RING=ring,
            num_warps=num_warps,
            num_stages=stages,
        )
    except OutOfResources as e:  # raised when the compiled kernel is loaded, before it runs
        raise ValueError(
            f"quantized_attention: the kernel for a {q.dtype} query over {storage} K/V, head_dim {d}, "
            f"tiles of tile_pages={TP} pages of {B} slots and num_stages={stages} needs more {e.name} than this "
            f"GPU has ({e.required} > {e.limit}): pass a smaller tile_pages (>= {max(1, 16 // B)}) or "
            "num_stages=1"
        ) from e
    if splits > 1:
        launch(
            _combine_kernel,
            (rows * G,),
            part_o,
            part_l,
            out,
            out.stride(0),
            out.stride(1),
            h,
            splits,
            G=G,
            D=d,
            SBLK=min(32, max(16, next_pow2(splits))),
            num_warps=4,
        )
    return out.view(query.shape)
