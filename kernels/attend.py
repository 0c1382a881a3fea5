"""Sparse decode attention (kernel 3): split-K flash-decoding over the selected pages.

``_sparse_attn_kernel`` (grid: rows x splits) walks its share of a row's page list ``TP`` pages at a
time: each K/V page is loaded once for all G query heads of the KV head (the group is the M side of
the tensor-core products, padded to 16), online softmax in float32, padding slots and ``SENTINEL``
entries masked. With one split it writes the output; otherwise each split writes its normalised
partial output and base-2 LSE, merged by ``_combine_kernel`` in a second launch (the default: one
program per query head), or, with ``fused_combine``, by the row's last split to finish (`_combine_row`,
a counter per row). ``DENSE`` walks every page up to
the cache's length instead of a list: dense decode for the static cache's ``"full"`` selector, so
that its baseline reads K/V at flash-decoding speed, not through a capacity-wide SDPA mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import LOG2E, arrived_last, as_length, dot_precision, launch, next_pow2, slot_ok, sm_count


@triton.jit
def _sparse_attn_kernel(
    q_ptr,
    q_sb,
    q_sh,
    k_ptr,
    k_sb,
    k_sh,
    k_st,
    v_ptr,
    v_sb,
    v_sh,
    v_st,
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
    sem_ptr,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    TP: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DENSE: tl.constexpr,
    COUNT: tl.constexpr,
    ROW_COUNT: tl.constexpr,
    CONTEXT: tl.constexpr,
    FUSED: tl.constexpr,
    SB: tl.constexpr,
):
    row = tl.program_id(0)
    split = tl.program_id(1)
    bb = (row // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
    hh = row % H
    rs = tl.load(row_start_ptr + bb)
    length = tl.load(len_ptr)
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    q = tl.load(q_ptr + bb * q_sb + (hh * G + g[:, None]) * q_sh + c[None, :], mask=g[:, None] < G, other=0.0)
    kb = k_ptr + bb * k_sb + hh * k_sh
    vb = v_ptr + bb * v_sb + hh * v_sh
    vrow = valid_ptr + bb * valid_sb
    qk_scale = scale * LOG2E

    m = tl.full([GP], float("-inf"), tl.float32)
    l = tl.zeros([GP], dtype=tl.float32)
    acc = tl.zeros([GP, D], dtype=tl.float32)
    start = split * pages_per_split
    end = tl.minimum(start + pages_per_split, W)
    if DENSE:  # every page of the row: page w is list entry w, and the loop stops at the written ones
        end = tl.minimum(end, tl.cdiv(length - rs, B))
    seen = tl.zeros([TP, B], dtype=tl.int32)
    for w0 in range(start, end, TP):
        # the keys' load waits only for the page list; padding is masked in the logits (and in V,
        # whose padding slots may hold anything: 0 * NaN = NaN)
        slot, inside, ok = _page_tile(sel_ptr, row, W, w0, end, rs, length, vrow, TP, B, DENSE)
        seen += ok.to(tl.int32)
        slot = tl.reshape(slot, [TP * B])
        ok = tl.reshape(ok, [TP * B])
        k = tl.load(kb + slot[:, None] * k_st + c[None, :], mask=tl.reshape(inside, [TP * B])[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PREC) * qk_scale  # [GP, TP*B], base 2
        p, alpha, m, l = _softmax_tile(s, ok, m, l)
        v = tl.load(vb + slot[:, None] * v_st + c[None, :], mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)

    record_attended(
        tl.sum(tl.sum(seen, axis=1), axis=0),
        bb,
        hh,
        split,
        length,
        H,
        count_ptr,
        row_count_ptr,
        pad_ptr,
        COUNT,
        ROW_COUNT,
        CONTEXT,
    )
    _store_heads(
        acc, l, m, row, split, n_split, part_o_ptr, part_l_ptr, out_ptr, out_sb, out_sh, bb, hh, G, GP, D, SPLIT
    )
    if SPLIT and FUSED:  # the row's last split to finish merges the partials (no second launch)
        if arrived_last(sem_ptr + row, n_split):
            _combine_row(
                part_o_ptr, part_l_ptr, row, n_split, out_ptr + bb * out_sb + hh * G * out_sh, out_sh, G, GP, D, SB
            )


@triton.jit
def record_attended(
    n_seen,
    bb,
    hh,
    split,
    length,
    H,
    count_ptr,
    row_count_ptr,
    pad_ptr,
    COUNT: tl.constexpr,
    ROW_COUNT: tl.constexpr,
    CONTEXT: tl.constexpr,
):
    """A program's statistics: the ``n_seen`` real tokens it attended into ``counts[0]`` and (``ROW_COUNT``)
    its batch row's ``row_counts[bb, 0]``; with ``CONTEXT`` the real tokens cached, once per batch row,
    into ``row_counts[bb, 1]`` and ``counts[1]``."""
    n_seen = n_seen.to(tl.int64)
    if COUNT:
        tl.atomic_add(count_ptr, n_seen)
    if ROW_COUNT:
        tl.atomic_add(row_count_ptr + bb * 2, n_seen)
    if CONTEXT:
        if (hh == 0) & (split == 0):
            context = ((length - tl.load(pad_ptr + bb)) * H).to(tl.int64)
            tl.atomic_add(row_count_ptr + bb * 2 + 1, context)
            tl.atomic_add(count_ptr + 1, context)


@triton.jit
def _page_tile(sel_ptr, row, W, w0, end, rs, length, vrow, TP: tl.constexpr, B: tl.constexpr, DENSE: tl.constexpr):
    """The slots ``[TP, B]`` of list entries ``w0 ... w0 + TP`` of this (row, KV head) (``DENSE``: entry w
    is page w), which of them lie inside written pages, and which of those hold real tokens."""
    w = w0 + tl.arange(0, TP)
    if DENSE:
        pg = tl.where(w < end, w, -1)
    else:
        pg = tl.load(sel_ptr + row * W + w, mask=w < end, other=-1)
    slot = rs + pg[:, None] * B + tl.arange(0, B)[None, :]
    inside = (pg >= 0)[:, None] & (slot >= 0) & (slot < length)
    return slot, inside, inside & slot_ok(vrow, slot, length)


@triton.jit
def _softmax_tile(s, ok, m, l):
    """One tile of the online softmax over base-2 logits ``s [GP, N]`` (``ok [N]``: real tokens): the
    tile's weights, the factor that rescales what came before, and the new running max and sum."""
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - safe[:, None])
    alpha = tl.exp2(m - safe)
    return p, alpha, m_new, l * alpha + tl.sum(p, axis=1)


@triton.jit
def _store_heads(
    acc,
    l,
    m,
    row,
    split,
    n_split,
    part_o_ptr,
    part_l_ptr,
    out_ptr,
    out_sb,
    out_sh,
    bb,
    hh,
    G: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The G query heads' normalised outputs: with ``SPLIT``, this split's partial and its base-2 LSE
    for the merge; otherwise the output rows themselves."""
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    gm = g[:, None] < G
    if SPLIT:
        base = (row * n_split + split) * G
        tl.store(part_o_ptr + (base + g[:, None]) * D + c[None, :], o, mask=gm)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_l_ptr + base + g, lse, mask=g < G)
    else:
        tl.store(
            out_ptr + bb * out_sb + (hh * G + g[:, None]) * out_sh + c[None, :], o.to(out_ptr.dtype.element_ty), mask=gm
        )


@triton.jit
def _combine_row(
    part_o_ptr,
    part_l_ptr,
    row,
    n_split,
    out_ptr,
    out_sh,
    G: tl.constexpr,
    GG: tl.constexpr,
    D: tl.constexpr,
    SB: tl.constexpr,
):
    """Merge the ``n_split`` partial outputs (normalised, with base-2 LSEs) of one (row, KV head) into
    its G output heads: the LSEs' max and sum first (64 splits per load), then ``SB`` partials per
    step, so that the loads of a step do not wait for the previous step's (small tiles: the merge
    shares the attention kernel's registers)."""
    g = tl.arange(0, GG)
    gm = g < G
    c = tl.arange(0, D)
    base = row * n_split
    m = tl.full([GG], float("-inf"), tl.float32)
    l = tl.zeros([GG], dtype=tl.float32)
    for s0 in range(0, n_split, 64):
        sb = s0 + tl.arange(0, 64)
        lse = tl.load(
            part_l_ptr + (base + sb)[:, None] * G + g[None, :],
            mask=(sb < n_split)[:, None] & gm[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        l = l * tl.exp2(m - safe) + tl.sum(tl.exp2(lse - safe[None, :]), axis=0)
        m = m_new
    safe = tl.where(m == float("-inf"), 0.0, m)
    acc = tl.zeros([GG, D], dtype=tl.float32)
    for s0 in range(0, n_split, SB):
        sb = s0 + tl.arange(0, SB)
        ok = (sb < n_split)[:, None] & gm[None, :]
        w = tl.exp2(
            tl.load(
                part_l_ptr + (base + sb)[:, None] * G + g[None, :], mask=ok, other=float("-inf"), cache_modifier=".cg"
            )
            - safe[None, :]
        )
        o = tl.load(
            part_o_ptr + ((base + sb)[:, None, None] * G + g[None, :, None]) * D + c[None, None, :],
            mask=ok[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        acc += tl.sum(w[:, :, None] * o, axis=0)
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(out_ptr + g[:, None] * out_sh + c[None, :], o.to(out_ptr.dtype.element_ty), mask=gm[:, None])


@triton.jit
def _combine_kernel(
    part_o_ptr, part_l_ptr, out_ptr, out_sb, out_sh, H, n_split, G: tl.constexpr, D: tl.constexpr, SBLK: tl.constexpr
):
    """The separate merge: one program per (row, query head), ``SBLK`` splits per load (the LSEs and
    the partials as ``[SBLK, D]`` tiles), folded in one pass with a running max. Per head, not per row:
    the per-row merge (`_combine_row`) walks its few programs through every split serially and took
    28-41 us a layer at 32 splits on the H200. One pass, not a max-and-sum pass then a weighted pass:
    the loads are a dependent chain, and a dense merge at GLM-4-9B 512K (264 splits) took 20 us in 18
    of them (H200, 2026-12-03)."""
    pid = tl.program_id(0)
    row = pid // G
    g = pid % G
    c = tl.arange(0, D)
    base = row * n_split
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.zeros([], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(0, n_split, SBLK):
        sb = s0 + tl.arange(0, SBLK)
        ok = sb < n_split
        lse = tl.load(part_l_ptr + (base + sb) * G + g, mask=ok, other=float("-inf"), cache_modifier=".cg")
        o = tl.load(
            part_o_ptr + ((base + sb) * G + g)[:, None] * D + c[None, :],
            mask=ok[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_new = tl.maximum(m, tl.max(lse, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - safe)  # 0 while nothing was folded (m = -inf)
        w = tl.exp2(lse - safe)
        l = l * alpha + tl.sum(w, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * o, axis=0)
        m = m_new
    o = acc / tl.where(l > 0, l, 1.0)
    tl.store(out_ptr + (row // H) * out_sb + ((row % H) * G + g) * out_sh + c, o.to(out_ptr.dtype.element_ty))


#: Most splits per row.
MAX_SPLITS = 1024


def default_splits(rows: int, width: int, tile_pages: int, dense: bool, sms: int) -> int:
    """Splits per row: dense, enough programs to keep memory busy (~4 per SM) with at least 16 tiles
    each; sparse (latency-bound: ~k pages), about two programs per SM over the rows, at least one
    tile each, at most 32 (the last split merges them)."""
    if dense:
        want = triton.cdiv(4 * sms, rows)
        return max(1, min(want, triton.cdiv(width, tile_pages * 16), MAX_SPLITS))
    return max(1, min(triton.cdiv(2 * sms, rows), triton.cdiv(width, tile_pages), 32))


def tile_pages_for(page_size: int, tile_pages: int | None, who: str) -> int:
    """Pages per attention tile: ``tile_pages`` when given (checked), else 64 slots for pages of up to
    16 (4 pages) and one or more pages of 64+ slots; never under the 16 slots that are the K side of a
    tensor-core product (a 4-slot page gets 4 pages a tile)."""
    if page_size < 1 or page_size & (page_size - 1):
        raise ValueError(f"{who}: page_size must be a power of two, got {page_size}")
    if tile_pages is None:
        tp = 4 if page_size <= 16 else max(1, 64 // page_size)
        return max(tp, 16 // page_size)
    if tile_pages < 1 or tile_pages & (tile_pages - 1):
        raise ValueError(f"{who}: tile_pages must be a power of two, got {tile_pages}")
    if tile_pages * page_size < 16:
        raise ValueError(
            f"{who}: a tile of tile_pages={tile_pages} pages of {page_size} slots is under the 16 slots "
            f"of a product: pass tile_pages >= {16 // page_size}"
        )
    return tile_pages


def sparse_attention(
    query: torch.Tensor,
    key_buf: torch.Tensor,
    value_buf: torch.Tensor,
    pages: torch.Tensor | None,
    *,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: int | torch.Tensor,
    scale: float,
    page_size: int,
    n_pages: int | None = None,
    counts: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
    tile_pages: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    fused_combine: bool = False,
    semaphore: torch.Tensor | None = None,
    row_counts: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one decode query over the listed pages of each (row, KV head).

    ``query [b, Hq, 1, d]``; ``key_buf``/``value_buf`` ``[b, h, cap, d]`` (the cache buffers);
    ``pages [b*h, W]`` int32 page numbers (``SENTINEL`` = none; page ``p`` of row ``i`` holds slots
    ``row_start[i] + p*B ...``). ``pages=None`` attends every written page of the first ``n_pages``
    (dense flash-decoding over the cache's length, read on the device). ``counts`` (int64, optional):
    ``counts[0]`` grows by the number of real tokens attended, summed over rows and KV heads;
    ``row_counts`` (int64 ``[b, 2]``, optional): ``row_counts[i, 0]`` by those of batch row ``i``;
    with ``pad`` (int32 ``[b]``, padding slots per row) also ``row_counts[i, 1]`` and ``counts[1]``
    by the real tokens cached, ``(length - pad[i]) * h`` (a decode step's statistics in the launch).
    Returns ``[b, 1, Hq, d]`` in the query dtype.

    With several splits per row, ``fused_combine`` merges the partials in the row's last split to
    finish (one launch; ``semaphore``, int32 ``[>= b*h]`` zeros that the launch leaves zero, saves a
    memset), else in a second launch with one program per query head (the default). On the H200
    (2026-12-02, b = 2048, 32 splits, 512K) the row's last split walks every split itself: 50 us
    (Llama-3.1-8B shape) and 32 us (GLM-4-9B) of attention a layer fused, against 5.3 / 3.8 us for the
    split loop alone; the per-head merge keeps the second launch under 5 us a layer.
    """
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    q = query.reshape(b, hq, d)
    h = key_buf.shape[1]
    if hq % h:
        raise ValueError(f"sparse_attention: {hq} query heads are not a multiple of {h} KV heads")
    G = hq // h
    dense = pages is None
    if dense and n_pages is None:
        raise ValueError("sparse_attention: pages=None (dense) needs n_pages")
    if pad is not None and (row_counts is None or counts is None):
        raise ValueError("sparse_attention: pad (the cached-token statistics) needs counts and row_counts")
    if pages is not None:
        rows, W = pages.shape
    else:
        assert n_pages is not None  # checked above
        rows, W = b * h, n_pages
    B = page_size
    TP = tile_pages_for(B, tile_pages, "sparse_attention")
    if out is None:
        out = torch.empty((b, 1, hq, d), dtype=query.dtype, device=query.device)
    o3 = out.view(b, hq, d)
    if splits is None:
        splits = default_splits(rows, W, TP, dense, sm_count(query.device))
    pps = triton.cdiv(triton.cdiv(W, max(1, min(splits, MAX_SPLITS))), TP) * TP
    splits = max(1, triton.cdiv(W, pps))
    GP = max(16, next_pow2(G))
    dev = query.device
    if splits > 1:
        part_o = torch.empty((rows, splits, G, d), dtype=torch.float32, device=dev)
        part_l = torch.empty((rows, splits, G), dtype=torch.float32, device=dev)
    else:
        part_o = part_l = o3
    fused = fused_combine and splits > 1
    if semaphore is not None and (semaphore.dtype != torch.int32 or semaphore.numel() < rows):
        raise ValueError(f"sparse_attention: semaphore must be int32 with >= {rows} entries")
    if fused and semaphore is None:
        semaphore = torch.zeros((rows,), dtype=torch.int32, device=dev)
    SB = 4 if G * d < 2048 else 2
    launch(
        _sparse_attn_kernel,
        (rows, splits),
        q,
        q.stride(0),
        q.stride(1),
        key_buf,
        key_buf.stride(0),
        key_buf.stride(1),
        key_buf.stride(2),
        value_buf,
        value_buf.stride(0),
        value_buf.stride(1),
        value_buf.stride(2),
        row_start if dense else pages,
        W,
        slot_valid.view(torch.uint8) if slot_valid.dtype == torch.bool else slot_valid,
        slot_valid.stride(0),
        row_start,
        as_length(length, query.device),
        h,
        float(scale),
        part_o,
        part_l,
        o3,
        o3.stride(0),
        o3.stride(1),
        pps,
        splits,
        row_start if counts is None else counts,
        row_start if row_counts is None else row_counts,
        row_start if pad is None else pad,
        semaphore if fused else row_start,
        G=G,
        GP=GP,
        D=d,
        B=B,
        TP=TP,
        SPLIT=splits > 1,
        DOT_PREC=dot_precision(q.dtype),
        DENSE=dense,
        COUNT=counts is not None,
        ROW_COUNT=row_counts is not None,
        CONTEXT=pad is not None,
        FUSED=fused,
        SB=SB,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if splits > 1 and not fused:
        launch(
            _combine_kernel,
            (rows * G,),
            part_o,
            part_l,
            o3,
            o3.stride(0),
            o3.stride(1),
            h,
            splits,
            G=G,
            D=d,
            SBLK=min(32, max(16, next_pow2(splits))),
            num_warps=4,
        )
    return out
