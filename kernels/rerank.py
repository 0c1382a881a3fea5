"""Exact re-ranking of a short list of candidate pages (``"locks_rerank"``): two launches between the
selection of ``M`` candidates and the sparse attention, no host sync, fixed widths.

1. ``_candidate_lse_kernel`` (grid: rows x tiles of ``TP`` candidates) computes each candidate's exact
   page LSE per query head from its original keys, with the oracle's scoring rule
   (`score_dot._oracle_logits`, `score_parts.page_lse`) on a page list instead of a page range.
2. ``_rerank_select_kernel`` (grid: rows) replaces the candidates' estimates by their exact values in
   each head's softmax normaliser (the LSE over all candidate pages, folded from the scoring partials as
   the selection kernel folds it) and shifts the rest of it by the head's mean (exact - estimate) over
   the list (`locks_hf.selectors.rerank`), keys every candidate by the share-average of the exact
   scores, keeps the best ``k - 2`` (`_common.top_keys`) and writes ``[sink, recent, winners...,
   SENTINEL...]``.

The short list comes from `select.select_pages` run with ``M + 2`` slots, so its entries 2.. are the
candidates in page order; its sink and recent entries are copied. Pages whose exact score is NaN or
``+inf`` (non-finite keys) take no part in the normalisers and are kept first, as in the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    NO_KEY,
    SENTINEL_C as SENTINEL,
    as_length,
    dot_precision,
    launch,
    next_pow2,
    score_key,
    slot_ok,
    top_keys,
)
from .score_dot import _oracle_logits
from .score_parts import page_lse
from .select import fold_tiles, free_slots, last_page_of, sink_and_lse, write_page_list


@triton.jit
def _candidate_lse_kernel(
    q_ptr,
    q_sb,
    q_sh,
    k_ptr,
    k_sb,
    k_sh,
    k_st,
    list_ptr,
    W,
    M,
    valid_ptr,
    valid_sb,
    row_start_ptr,
    len_ptr,
    H,
    scale,
    out_ptr,
    G: tl.constexpr,
    GG: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    TP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    row = tl.program_id(0)
    bb = (row // H).to(tl.int64)
    hh = row % H
    rs = tl.load(row_start_ptr + bb)
    length = tl.load(len_ptr)
    e = tl.program_id(1) * TP + tl.arange(0, TP)  # candidate positions in the short list
    pg = tl.load(list_ptr + row * W + 2 + e, mask=e < M, other=SENTINEL)
    slot = rs + pg[:, None] * B + tl.arange(0, B)[None, :]
    ok = (pg >= 0)[:, None] & slot_ok(valid_ptr + bb * valid_sb, slot, length)
    x = _oracle_logits(
        q_ptr + bb * q_sb + hh * G * q_sh,
        q_sh,
        k_ptr + bb * k_sb + hh * k_sh,
        k_st,
        slot,
        ok,
        G,
        GG,
        GP,
        D,
        B,
        TP,
        DOT_PREC,
    )
    s = page_lse(x, ok, scale)  # [GG, TP]
    g = tl.arange(0, GG)
    tl.store(out_ptr + (row * G + g[:, None]) * M + e[None, :], s, mask=(g < G)[:, None] & (e < M)[None, :])


@triton.jit
def _rerank_select_kernel(
    list_ptr,
    W_in,
    M,
    exact_ptr,
    score_ptr,
    P,
    part_ptr,
    n_blk,
    row_start_ptr,
    len_ptr,
    H,
    k_ptr,
    K_MAX,
    out_ptr,
    W,
    G: tl.constexpr,
    GG: tl.constexpr,
    B: tl.constexpr,
    MP: tl.constexpr,
    NBP: tl.constexpr,
    NBR: tl.constexpr,
):
    row = tl.program_id(0)
    K = free_slots(k_ptr, K_MAX)
    last_page = last_page_of(row_start_ptr, len_ptr, row, H, B)
    _, lse = sink_and_lse(part_ptr, row, n_blk, last_page, GG, NBP, NBR, True)  # estimated, per head
    e = tl.arange(0, MP)
    pg = tl.load(list_ptr + row * W_in + 2 + e, mask=e < M, other=SENTINEL)
    cand = pg >= 0
    poisoned = e < 0  # all False
    comb = tl.zeros([MP], dtype=tl.float32)
    for g in tl.static_range(G):
        est = tl.load(score_ptr + (row * G + g) * P + pg, mask=cand, other=float("-inf"))
        ex = tl.load(exact_ptr + (row * G + g) * M + e, mask=cand, other=float("-inf"))
        bad = (ex != ex) | (ex == float("inf"))
        poisoned = poisoned | bad
        est = tl.where(bad | (est != est) | (est == float("inf")), float("-inf"), est)
        ex = tl.where(bad, float("-inf"), ex)
        # the tail's shift: the mean (exact - estimate) over the listed pages where both are finite
        known = (ex > float("-inf")) & (est > float("-inf"))
        shift = tl.sum(tl.where(known, ex - est, 0.0), axis=0) / tl.maximum(tl.sum(known.to(tl.float32), axis=0), 1.0)
        # exp(Z') = (exp(Z) - sum exp(est)) * exp(shift) + sum exp(exact) over the list, from a common max
        z = tl.sum(tl.where(tl.arange(0, GG) == g, lse, 0.0), axis=0)
        top = tl.maximum(tl.maximum(z, tl.max(ex, axis=0)), tl.max(est, axis=0))
        top = tl.where(top == float("-inf"), 0.0, top)
        rest = tl.maximum(tl.exp(z - top) - tl.sum(tl.exp(est - top), axis=0), 0.0)
        listed = tl.sum(tl.exp(ex - top), axis=0)
        tail = tl.where(rest > 0, tl.log(tl.where(rest > 0, rest, 1.0)) + shift, float("-inf"))
        head = tl.where(listed > 0, tl.log(tl.where(listed > 0, listed, 1.0)), float("-inf"))
        hi = tl.maximum(tail, head)
        zz = tl.where(hi == float("-inf"), float("inf"), top + hi + tl.log(1.0 + tl.exp(tl.minimum(tail, head) - hi)))
        comb += tl.exp(ex - zz)
    key = tl.where(poisoned, 2147483647, score_key(comb / G))
    keep = top_keys(tl.where(cand, key, NO_KEY), K)
    n = tl.sum(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    sink = tl.load(list_ptr + row * W_in)
    write_page_list(out_ptr, row, W, pg, keep, pos, n, sink, last_page, MP)


def rerank_pages(
    query: torch.Tensor,
    key_buf: torch.Tensor,
    shortlist: torch.Tensor,
    scores: torch.Tensor,
    partials: torch.Tensor,
    *,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: int | torch.Tensor,
    scale: float,
    page_size: int,
    slots: int,
    active_slots: torch.Tensor | None = None,
    exact: torch.Tensor | None = None,
    tile_pages: int = 8,
) -> torch.Tensor:
    """The final page lists ``[b*h, slots]`` (``SENTINEL``-padded) from a short list.

    ``query [b, Hq, 1, d]``; ``key_buf [b, h, cap, d]``; ``shortlist [b*h, M + 2]`` from
    `select.select_pages` (sink, recent, ``M`` candidates); ``scores [b*h, G, P]`` and ``partials``
    from `score.score_pages` (the estimates and their per-head normaliser); ``slots`` the lists' width
    ``k`` (``active_slots``: the ``int32 [1]`` device budget ``<= slots`` to select with). ``exact``
    (optional, ``[b*h, G, M]`` float32) receives the candidates' exact page LSE.
    """
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    q = query.reshape(b, hq, d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    rows, W_in = shortlist.shape
    h = key_buf.shape[1]
    G = hq // h
    GG = next_pow2(G)
    M = W_in - 2
    dev = query.device
    length = as_length(length, dev)
    if exact is None:
        exact = torch.empty((rows, G, max(M, 1)), dtype=torch.float32, device=dev)
    out = torch.empty((rows, slots), dtype=torch.int32, device=dev)
    valid = slot_valid.view(torch.uint8) if slot_valid.dtype == torch.bool else slot_valid
    if M > 0:
        TP = max(min(tile_pages, next_pow2(M)), 16 // page_size)  # tl.dot needs TP * B >= 16
        launch(
            _candidate_lse_kernel,
            (rows, triton.cdiv(M, TP)),
            q,
            q.stride(0),
            q.stride(1),
            key_buf,
            key_buf.stride(0),
            key_buf.stride(1),
            key_buf.stride(2),
            shortlist,
            W_in,
            M,
            valid,
            slot_valid.stride(0),
            row_start,
            length,
            h,
            float(scale),
            exact,
            G=G,
            GG=GG,
            GP=max(16, GG),
            D=d,
            B=page_size,
            TP=TP,
            DOT_PREC=dot_precision(q.dtype),
            num_warps=4,
        )
    k_active = as_length(slots if active_slots is None else active_slots, dev)
    MP = next_pow2(max(M, 1))
    nbp, nbr = fold_tiles(partials.shape[1], 64)
    launch(
        _rerank_select_kernel,
        (rows,),
        shortlist,
        W_in,
        M,
        exact,
        scores,
        scores.shape[-1],
        partials,
        partials.shape[1],
        row_start,
        length,
        h,
        k_active,
        max(slots - 2, 0),
        out,
        slots,
        G=G,
        GG=GG,
        B=page_size,
        MP=MP,
        NBP=nbp,
        NBR=nbr,
        num_warps=4 if MP <= 1024 else 8,
    )
    return out
