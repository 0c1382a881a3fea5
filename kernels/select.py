"""Page selection (kernel 2): top-(k-2) pages per row with the forced sink and recent pages.

Two launches, no host sync, fixed-width outputs padded with ``SENTINEL``:

1. ``_select_chunk_kernel`` (grid: chunks x rows) folds the scoring partials into the sink page and,
   for the shared rule, each query head's LSE over the candidate pages; computes one key per page
   of its chunk (the share-average ``mean_g exp(s_g - LSE_g)``, or a head's own score for Quest)
   and keeps the chunk's best ``k-2`` by a threshold search (``top_keys``), in page order.
2. ``_select_merge_kernel`` (grid: rows) takes the best ``k-2`` of the chunk winners the same way
   and writes ``[sink, recent, winners..., SENTINEL...]``; for Quest it writes each head's list and
   ``_union_kernel`` merges the G lists of a KV head (sort, drop duplicates).

``algorithm="radix"`` replaces steps 1-2 by ``_radix_keys_kernel`` and ``_radix_gather_kernel``
(see `select_pages`); both give the same pages. Ties break towards the earlier page, as in the
reference (a stable descending sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    BIG_PAGE,
    NO_KEY,
    SENTINEL_C as SENTINEL,
    as_length,
    kth_key,
    next_pow2,
    scalar_at,
    score_key,
    sm_count,
    top_keys,
)


@triton.jit
def sink_and_lse(part_ptr, row, n_blk, last_page, GG: tl.constexpr, NBP: tl.constexpr, WITH_LSE: tl.constexpr):
    """Fold the scoring partials of ``row``: the sink page and each head's LSE over the candidates."""
    gi = tl.arange(0, GG)
    a = tl.arange(0, NBP)
    base = part_ptr + row * n_blk * 4 * GG
    sink = tl.full([], BIG_PAGE, tl.int32)
    for i in range(0, n_blk, NBP):
        f = tl.load(base + (i + a) * 4 * GG + 3 * GG, mask=(i + a) < n_blk, other=BIG_PAGE)
        sink = tl.minimum(sink, tl.min(f.to(tl.int32), axis=0))
    sink = tl.where(sink == BIG_PAGE, last_page, sink)
    lse = tl.full([GG], float("-inf"), tl.float32)
    if WITH_LSE:
        run_m = tl.full([GG], float("-inf"), tl.float32)
        run_l = tl.zeros([GG], dtype=tl.float32)
        for i in range(0, n_blk, NBP):
            ok = ((i + a) < n_blk)[:, None]
            ptr = base + (i + a)[:, None] * 4 * GG + gi[None, :]
            m = tl.load(ptr, mask=ok, other=float("-inf"))
            l = tl.load(ptr + GG, mask=ok, other=0.0)
            fs = tl.load(ptr + 2 * GG, mask=ok, other=float("-inf"))
            f = tl.load(ptr + 3 * GG, mask=ok, other=BIG_PAGE).to(tl.int32)
            # a program's first real page is a candidate unless it is the sink or the recent page
            add = (f != sink) & (f != last_page) & (f != BIG_PAGE)
            fs = tl.where(add, fs, float("-inf"))
            new_m = tl.maximum(run_m, tl.maximum(tl.max(m, axis=0), tl.max(fs, axis=0)))
            safe = tl.where(new_m == float("-inf"), 0.0, new_m)
            run_l = run_l * tl.exp(run_m - safe) + tl.sum(l * tl.exp(m - safe[None, :]), axis=0) \
                + tl.sum(tl.exp(fs - safe[None, :]), axis=0)
            run_m = new_m
        lse = tl.where(run_l > 0, run_m + tl.log(run_l), float("-inf"))
    return sink, lse


@triton.jit
def free_slots(k_ptr, K_MAX):
    """Pages to select besides the sink and the recent one: the budget's ``k - 2`` read on the device
    (so that a captured graph serves any budget), at most the ``K_MAX`` the lists were sized for."""
    return tl.minimum(tl.maximum(tl.load(k_ptr) - 2, 0), K_MAX)


@triton.jit
def _row_keys(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, p, sink_ptr, first_prog, vrow,
              PER_HEAD: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, B: tl.constexpr, NBP: tl.constexpr):
    """Selection keys of pages ``p`` of virtual row ``vrow`` (a (row, KV head), or a (row, KV head,
    query head) for Quest): the share-average ``mean_g exp(s_g - LSE_g)`` (a head's own score for
    Quest) as `score_key` ints, ``NO_KEY`` for pages that are not candidates (not real, the sink or
    the recent page). ``first_prog`` stores the row's sink page."""
    if PER_HEAD:
        row = vrow // G
        head = vrow % G
    else:
        row = vrow
        head = 0
    rs = tl.load(row_start_ptr + row // H)
    last_page = (tl.load(len_ptr) - 1 - rs) // B
    sink, lse = sink_and_lse(part_ptr, row, n_blk, last_page, GG, NBP, not PER_HEAD)
    if first_prog:
        tl.store(sink_ptr + row, sink)
    srow = score_ptr + row * G * P
    if PER_HEAD:
        s = tl.load(srow + head * P + p, mask=p < P, other=float("-inf"))
        real = s > float("-inf")
        key = score_key(s)
    else:
        real = tl.load(srow + p, mask=p < P, other=float("-inf")) > float("-inf")
        comb = tl.zeros(p.shape, dtype=tl.float32)
        for g in tl.static_range(G):
            s = tl.load(srow + g * P + p, mask=p < P, other=float("-inf"))
            lg = scalar_at(tl.where(lse == float("-inf"), 0.0, lse), g, GG)
            comb += tl.exp(s - lg)
        key = score_key(comb / G)
    cand = real & (p != sink) & (p != last_page)
    return tl.where(cand, key, NO_KEY)


@triton.jit
def _chunk_keys(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, sink_ptr, PER_HEAD: tl.constexpr,
                G: tl.constexpr, GG: tl.constexpr, B: tl.constexpr, CH: tl.constexpr, NBP: tl.constexpr):
    """Program (chunk, vrow) of a first-stage kernel: its ``CH`` pages and their `_row_keys`."""
    chunk = tl.program_id(0)
    vrow = tl.program_id(1)
    if PER_HEAD:
        first_prog = (chunk == 0) & (vrow % G == 0)
    else:
        first_prog = chunk == 0
    p = chunk * CH + tl.arange(0, CH)
    key = _row_keys(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, p, sink_ptr, first_prog, vrow,
                    PER_HEAD, G, GG, B, NBP)
    return chunk, vrow, p, key


@triton.jit
def _select_chunk_kernel(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, k_ptr, K_MAX,
                         key_ptr, page_ptr, sink_ptr, n_chunk,
                         PER_HEAD: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                         KP: tl.constexpr, NBP: tl.constexpr):
    chunk, vrow, p, key = _chunk_keys(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, sink_ptr,
                                      PER_HEAD, G, GG, B, CH, NBP)
    K = free_slots(k_ptr, K_MAX)
    keep = top_keys(key, K)

    n = tl.sum(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    out = (vrow * n_chunk + chunk) * KP
    tl.store(key_ptr + out + pos, key, mask=keep)
    tl.store(page_ptr + out + pos, p, mask=keep)
    e = tl.arange(0, KP)
    tl.store(key_ptr + out + e, tl.full([KP], NO_KEY, tl.int32), mask=e >= n)


#: Bins of the radix pass: the top 12 bits of a key (sign, exponent, 3 mantissa bits: 1/8 octave for
#: the positive share-average); bin 0 holds the non-candidates.
NB = tl.constexpr(4096)
#: Per-row counters after the histogram in the radix state: pages above the threshold bin, pages in
#: it, programs arrived.
N_COUNTERS = tl.constexpr(4)
#: int32 entries per row of the radix state (`radix_state`).
STATE_WIDTH = NB.value + N_COUNTERS.value


@triton.jit
def _key_bin(key):
    return tl.where(key == NO_KEY, 0, tl.maximum((key >> 20) + 2048, 1))


@triton.jit
def _radix_keys_kernel(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, sink_ptr, state_ptr,
                       key_ptr, key_stride, mask_ptr,
                       PER_HEAD: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                       NBP: tl.constexpr, MARK: tl.constexpr):
    """Program (chunk, vrow): the keys of ``CH`` pages into the row's key buffer and their bins into
    the row's histogram (one atomic per occupied bin); with ``MARK`` it clears its pages in the
    row's page mask (the gather kernel, launched after, marks the selection)."""
    chunk, vrow, p, key = _chunk_keys(score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, sink_ptr,
                                      PER_HEAD, G, GG, B, CH, NBP)
    tl.store(key_ptr + vrow * key_stride + p, key, mask=p < P)
    if MARK:
        if PER_HEAD:  # the row's first head clears
            if vrow % G == 0:
                tl.store(mask_ptr + (vrow // G) * P + p, tl.zeros([CH], dtype=tl.int8), mask=p < P)
        else:
            tl.store(mask_ptr + vrow * P + p, tl.zeros([CH], dtype=tl.int8), mask=p < P)
    hist = tl.histogram(_key_bin(key), NB)
    bins = tl.arange(0, NB)
    tl.atomic_add(state_ptr + vrow * (NB + N_COUNTERS) + bins, hist, mask=(hist > 0) & (bins > 0))


@triton.jit
def _threshold_bin(hist_ptr, K):
    """From a row's histogram: the bin ``b`` holding the ``K``-th largest key, the number ``A < K`` of
    keys in higher bins, and the keys in ``b``. With at most ``K`` candidates: ``b = 0`` (every
    candidate above it)."""
    bins = tl.arange(0, NB)
    h = tl.load(hist_ptr + bins, mask=bins > 0, other=0)
    total = tl.sum(h, axis=0)
    suffix = total - tl.cumsum(h, axis=0) + h  # keys in bins >= j
    b = tl.max(tl.where((suffix >= K) & (bins > 0), bins, 0), axis=0)
    b = tl.where(total <= K, 0, b)
    in_b = tl.sum(tl.where(bins == b, h, 0), axis=0)
    above = tl.where(total <= K, total, tl.sum(tl.where(bins > b, h, 0), axis=0))
    return b, above, tl.where(b == 0, 0, in_b)


@triton.jit
def _radix_gather_kernel(state_ptr, key_ptr, key_stride, P, k_ptr, K_MAX, n_chunk, list_ptr, tie_key_ptr,
                         tie_page_ptr, sink_ptr, row_start_ptr, len_ptr, H, out_ptr, W, mask_ptr,
                         PER_HEAD: tl.constexpr, G: tl.constexpr, B: tl.constexpr, CH: tl.constexpr,
                         KP: tl.constexpr, TC: tl.constexpr, TILE: tl.constexpr, MARK: tl.constexpr):
    """Program (chunk, vrow): its pages above the threshold bin into the row's list, those in it into
    the row's tie buffer (positions reserved by atomics); the row's last program to arrive resolves
    the ties, writes the row's output in page order and leaves the histogram and counters zero."""
    chunk = tl.program_id(0)
    vrow = tl.program_id(1)
    K = free_slots(k_ptr, K_MAX)
    hist_ptr = state_ptr + vrow * (NB + N_COUNTERS)
    cnt_ptr = hist_ptr + NB
    b, n_above, n_tie = _threshold_bin(hist_ptr, K)
    p = chunk * CH + tl.arange(0, CH)
    key = tl.load(key_ptr + vrow * key_stride + p, mask=p < P, other=NO_KEY)
    kb = _key_bin(key)
    above = kb > b
    tie = (kb == b) & (kb > 0)
    na = tl.sum(above.to(tl.int32), axis=0)
    nt = tl.sum(tie.to(tl.int32), axis=0)
    # most programs keep nothing: no atomic for them (the row's programs would queue on one address)
    base_a = na * 0
    if na > 0:
        base_a = tl.atomic_add(cnt_ptr, na)
    tl.store(list_ptr + vrow * KP + base_a + tl.cumsum(above.to(tl.int32), axis=0) - 1, p, mask=above)
    if (n_tie <= TC) & (nt > 0):
        base_t = tl.atomic_add(cnt_ptr + 1, nt)
        at = vrow * TC + base_t + tl.cumsum(tie.to(tl.int32), axis=0) - 1
        tl.store(tie_key_ptr + at, key, mask=tie)
        tl.store(tie_page_ptr + at, p, mask=tie)
    tl.debug_barrier()  # every thread's stores before the arrival (released by the atomic)
    if tl.atomic_add(cnt_ptr + 2, 1) == n_chunk - 1:
        room = tl.minimum(K, n_above + n_tie) - n_above
        if room > 0:
            if n_tie <= TC:
                _resolve_ties(tie_key_ptr + vrow * TC, tie_page_ptr + vrow * TC, n_tie, room,
                              list_ptr + vrow * KP + n_above, TC)
            else:
                _resolve_ties_in_order(key_ptr + vrow * key_stride, P, b, room, list_ptr + vrow * KP + n_above, TILE)
        tl.debug_barrier()  # the ties' stores before the list is read back
        n = n_above + tl.maximum(room, 0)
        e = tl.arange(0, KP)
        keep = e < n
        pages = tl.load(list_ptr + vrow * KP + e, mask=keep, other=BIG_PAGE, cache_modifier=".cg")
        if MARK:
            row = vrow
            if PER_HEAD:
                row = vrow // G
            _mark_pages(mask_ptr, row, P, pages, keep, sink_ptr, row_start_ptr, len_ptr, H, B)
        if PER_HEAD:  # the union kernel sorts
            tl.store(out_ptr + vrow * KP + e, tl.where(keep, pages, SENTINEL))
        else:  # page order: the positions reserved by the atomics vary from run to run
            write_page_list(out_ptr, vrow, W, tl.sort(pages), keep, e, n, tl.load(sink_ptr + vrow),
                            last_page_of(row_start_ptr, len_ptr, vrow, H, B), KP)
        bins = tl.arange(0, NB)
        tl.store(hist_ptr + bins, tl.zeros([NB], dtype=tl.int32))
        c = tl.arange(0, N_COUNTERS)
        tl.store(cnt_ptr + c, tl.zeros([N_COUNTERS], dtype=tl.int32))


@triton.jit
def _mark_pages(mask_ptr, row, P, pages, keep, sink_ptr, row_start_ptr, len_ptr, H, B: tl.constexpr):
    """Set the row's page mask (``int8 [rows, P]``) at the kept ``pages``, the sink and the recent page."""
    tl.store(mask_ptr + row * P + pages, tl.full(pages.shape, 1, tl.int8), mask=keep & (pages < P))
    last_page = last_page_of(row_start_ptr, len_ptr, row, H, B)
    two = tl.arange(0, 2)
    forced = tl.where(two == 0, tl.load(sink_ptr + row), last_page)
    tl.store(mask_ptr + row * P + forced, tl.full([2], 1, tl.int8), mask=(forced >= 0) & (forced < P))


@triton.jit
def _resolve_ties(tkey_ptr, tpage_ptr, n, room, dst_ptr, TC: tl.constexpr):
    """The ``room`` best of ``n`` (key, page) ties in any order (larger key, then earlier page) to
    ``dst_ptr``."""
    e = tl.arange(0, TC)
    ok = e < n
    key = tl.load(tkey_ptr + e, mask=ok, other=NO_KEY, cache_modifier=".cg")
    page = tl.load(tpage_ptr + e, mask=ok, other=BIG_PAGE, cache_modifier=".cg")
    thr = kth_key(key, room)
    gt = ok & (key.to(tl.int64) > thr)
    eq = ok & (key.to(tl.int64) == thr)
    # among the keys at the threshold, the earliest pages: the largest of -page
    m = room - tl.sum(gt.to(tl.int32), axis=0)
    neg = tl.where(eq, -page, NO_KEY)
    take = gt | (eq & (neg.to(tl.int64) >= kth_key(neg, m)))
    tl.store(dst_ptr + tl.cumsum(take.to(tl.int32), axis=0) - 1, page, mask=take)


@triton.jit
def _resolve_ties_in_order(key_ptr, P, b, room, dst_ptr, TILE: tl.constexpr):
    """`_resolve_ties` for ties too many for the tie buffer: the keys of bin ``b`` read from the row's
    key buffer in page order, ``TILE`` at a time (a 16-way search over the tiles, then the pages in
    order with the ties at the threshold by prefix count)."""
    e = tl.arange(0, TILE)
    lo = tl.full([], 2147483647, tl.int64)
    hi = tl.full([], -2147483648, tl.int64)
    for t0 in range(0, P, TILE):
        key = tl.load(key_ptr + t0 + e, mask=t0 + e < P, other=NO_KEY)
        mine = _key_bin(key) == b
        lo = tl.minimum(lo, tl.min(tl.where(mine, key, 2147483647), axis=0).to(tl.int64))
        hi = tl.maximum(hi, tl.max(tl.where(mine, key, -2147483648), axis=0).to(tl.int64))
    k16 = tl.arange(0, 16).to(tl.int64)
    while lo < hi:  # count(key >= lo) >= room; the answer lies in [lo, hi]
        step = (hi - lo + 16) >> 4
        th = tl.minimum(lo + k16 * step, hi)
        cnt = tl.zeros([16], dtype=tl.int32)
        for t0 in range(0, P, TILE):
            key = tl.load(key_ptr + t0 + e, mask=t0 + e < P, other=NO_KEY)
            mine = _key_bin(key) == b
            cnt += tl.sum(((key[:, None] >= th.to(tl.int32)[None, :]) & mine[:, None]).to(tl.int32), axis=0)
        best = tl.max(tl.where(cnt >= room, th, lo), axis=0)
        hi = tl.minimum(hi, best + step - 1)
        lo = best
    n_gt = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, P, TILE):
        key = tl.load(key_ptr + t0 + e, mask=t0 + e < P, other=NO_KEY)
        n_gt += tl.sum(((_key_bin(key) == b) & (key.to(tl.int64) > lo)).to(tl.int32), axis=0)
    m = room - n_gt
    n_eq = tl.zeros([], dtype=tl.int32)
    n_out = tl.zeros([], dtype=tl.int32)
    for t0 in range(0, P, TILE):
        key = tl.load(key_ptr + t0 + e, mask=t0 + e < P, other=NO_KEY)
        mine = _key_bin(key) == b
        eq = mine & (key.to(tl.int64) == lo)
        take = (mine & (key.to(tl.int64) > lo)) | (eq & (n_eq + tl.cumsum(eq.to(tl.int32), axis=0) <= m))
        tl.store(dst_ptr + n_out + tl.cumsum(take.to(tl.int32), axis=0) - 1, t0 + e, mask=take)
        n_eq += tl.sum(eq.to(tl.int32), axis=0)
        n_out += tl.sum(take.to(tl.int32), axis=0)


@triton.jit
def _select_merge_kernel(key_ptr, page_ptr, sink_ptr, row_start_ptr, len_ptr, H, k_ptr, K_MAX, n_chunk,
                         out_ptr, W, PER_HEAD: tl.constexpr, G: tl.constexpr, B: tl.constexpr,
                         KP: tl.constexpr, M: tl.constexpr):
    vrow = tl.program_id(0)
    K = free_slots(k_ptr, K_MAX)
    e = tl.arange(0, M)
    inb = e < n_chunk * KP
    key = tl.load(key_ptr + vrow * n_chunk * KP + e, mask=inb, other=NO_KEY)
    page = tl.load(page_ptr + vrow * n_chunk * KP + e, mask=inb, other=SENTINEL)
    keep = top_keys(key, K)
    n = tl.sum(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    if PER_HEAD:
        tl.store(out_ptr + vrow * KP + pos, page, mask=keep)
        w = tl.arange(0, KP)
        tl.store(out_ptr + vrow * KP + w, tl.full([KP], SENTINEL, tl.int32), mask=w >= n)
    else:
        write_page_list(out_ptr, vrow, W, page, keep, pos, n, tl.load(sink_ptr + vrow),
                        last_page_of(row_start_ptr, len_ptr, vrow, H, B), KP)


@triton.jit
def last_page_of(row_start_ptr, len_ptr, row, H, B: tl.constexpr):
    """The most recent page of (row, KV head) ``row``: the one holding the newest token."""
    return (tl.load(len_ptr) - 1 - tl.load(row_start_ptr + row // H)) // B


@triton.jit
def write_page_list(out_ptr, row, W, pages, keep, pos, n, sink, last_page, N: tl.constexpr):
    """Row ``row`` of the output: sink page, most recent page (``SENTINEL`` when it is the sink),
    the ``n`` kept ``pages`` (at ``pos``), then ``SENTINEL`` up to width ``W``."""
    base = out_ptr + row * W
    tl.store(base, sink)
    tl.store(base + 1, tl.where(last_page != sink, last_page, SENTINEL))
    tl.store(base + 2 + pos, pages, mask=keep)
    for w0 in range(0, W, N):
        w = w0 + tl.arange(0, N)
        tl.store(base + w, tl.full([N], SENTINEL, tl.int32), mask=(w >= 2 + n) & (w < W))


@triton.jit
def _union_kernel(list_ptr, n_list, sink_ptr, row_start_ptr, len_ptr, H, out_ptr, W,
                  B: tl.constexpr, N: tl.constexpr):
    """Union of the G per-head lists of a KV head (``n_list = G*KP <= N`` entries): sort, drop repeats."""
    row = tl.program_id(0)
    e = tl.arange(0, N)
    x = tl.load(list_ptr + row * n_list + e, mask=e < n_list, other=SENTINEL)
    x = tl.where(x == SENTINEL, BIG_PAGE, x)
    x = tl.sort(x)
    prev = tl.gather(x, tl.maximum(e - 1, 0), 0)
    uniq = (x != BIG_PAGE) & ((e == 0) | (x != prev))
    n = tl.sum(uniq.to(tl.int32), axis=0)
    pos = tl.cumsum(uniq.to(tl.int32), axis=0) - 1
    write_page_list(out_ptr, row, W, x, uniq, pos, n, tl.load(sink_ptr + row),
                    last_page_of(row_start_ptr, len_ptr, row, H, B), N)


@triton.jit
def _list_mask_kernel(list_ptr, W, mask_ptr, P, BLOCK: tl.constexpr, WB: tl.constexpr):
    """Pages ``[BLOCK * j, BLOCK * (j + 1))`` of row ``i`` of the mask: zeros, then (after a barrier, so
    that the program's own zeros land first) a one at each listed page of the block."""
    row = tl.program_id(0).to(tl.int64)
    p0 = tl.program_id(1) * BLOCK
    p = p0 + tl.arange(0, BLOCK)
    tl.store(mask_ptr + row * P + p, tl.zeros([BLOCK], dtype=tl.int8), mask=p < P)
    tl.debug_barrier()
    for w0 in range(0, W, WB):
        w = w0 + tl.arange(0, WB)
        pg = tl.load(list_ptr + row * W + w, mask=w < W, other=SENTINEL)
        mine = (pg >= p0) & (pg < p0 + BLOCK) & (pg < P)
        tl.store(mask_ptr + row * P + pg, tl.full([WB], 1, tl.int8), mask=mine)


def mark_lists(mask: torch.Tensor, pages: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Overwrite ``mask`` (contiguous bool or int8 ``[rows, P]``) with the pages of the lists ``pages
    [rows, W]`` (int32; ``SENTINEL`` and pages ``>= P`` mark nothing): one launch, no scratch, what
    ``locks_hf.paged.pages_to_mask`` gives."""
    rows, P = mask.shape
    if mask.dtype not in (torch.bool, torch.int8) or not mask.is_contiguous():
        raise ValueError(f"mark_lists: mask must be a contiguous bool/int8 [rows, P] tensor, got {mask.dtype}")
    if pages.dim() != 2 or pages.shape[0] != rows or pages.dtype != torch.int32 or not pages.is_contiguous():
        raise ValueError(f"mark_lists: pages must be contiguous int32 [{rows}, W], got {pages.dtype} "
                         f"{tuple(pages.shape)}")
    W = pages.shape[1]
    if rows and P:
        _list_mask_kernel[(rows, triton.cdiv(P, block))](pages, W, mask.view(torch.int8), P, BLOCK=block,
                                                         WB=128, num_warps=4)
    return mask


def radix_state(vrows: int, device) -> torch.Tensor:
    """A zeroed radix-selection state for ``vrows`` rows (``int32 [vrows, STATE_WIDTH]``): histogram and
    counters. Every radix selection leaves it zero again, so one state can be passed to every call
    on a stream (saving a memset per call); calls that may overlap need their own."""
    return torch.zeros((vrows, STATE_WIDTH), dtype=torch.int32, device=device)


def radix_chunk(n_pages: int, vrows: int, programs: int) -> int:
    """Pages per radix program: ``programs`` in all over the rows (fewer for few pages), 256 to 8192."""
    want = max(1, triton.cdiv(programs, max(vrows, 1)))
    return min(8192, max(256, next_pow2(triton.cdiv(n_pages, want))))


def chunk_size(n_pages: int, kp: int, max_chunks: int = 16) -> int:
    """Pages per first-stage program: at most ``max_chunks`` chunks per row, at least ``kp`` pages."""
    return max(256, kp, next_pow2(triton.cdiv(n_pages, max_chunks)))


def page_list_width(method: str, slots: int, group: int) -> int:
    """Width ``W`` of `select_pages`' lists: ``k``, or ``G*(k-2) + 2`` for Quest's per-head union."""
    return group * max(slots - 2, 0) + 2 if method == "quest" else slots


#: Selection algorithms of `select_pages`.
ALGORITHMS = ("radix", "chunks")


def select_pages(scores: torch.Tensor, partials: torch.Tensor, *, slots: int, per_head: bool,
                 row_start: torch.Tensor, length: int | torch.Tensor, heads: int, page_size: int,
                 out: torch.Tensor | None = None, chunk: int | None = None,
                 active_slots: torch.Tensor | None = None, algorithm: str = "chunks",
                 state: torch.Tensor | None = None, tie_capacity: int = 512, num_warps: int | None = None,
                 mask_out: torch.Tensor | None = None) -> torch.Tensor:
    """Page lists ``[b*h, W]`` int32 (``SENTINEL``-padded) from ``score_pages``' outputs.

    ``slots`` is ``k = ceil(b / B)``; ``W = k`` for the shared rule and ``G*(k-2) + 2`` for Quest's
    per-head union. Entry 0 is the sink page, entry 1 the most recent page (``SENTINEL`` when it
    is the sink), then the selected pages in ascending page order.
    ``length``: slots written (an int, or the cache's ``int32 [1]`` device tensor).
    ``active_slots``: optional ``int32 [1]`` device tensor, the ``k <= slots`` to select with (the
    lists keep width ``W`` of ``slots``, padded); read by the kernels, so a captured graph serves
    every budget up to ``slots``.

    ``algorithm``: ``"chunks"`` (default: per-chunk top-k, then a merge per row) or ``"radix"``
    (the page axis spread over many programs, a histogram of the keys' top bits, then each program
    keeps its pages above the threshold bin and the row's last program resolves the threshold bin's
    ties; ``state`` from `radix_state` saves its memset, ``tie_capacity`` ties are resolved in one
    tile, more in a slower pass over the row; ``num_warps`` of its first launch); ``chunk`` pages per
    program for either. Both select the same pages. Radix is not the default because on the H200 it
    was slower in the complete decode step (Llama-3.1-8B shape, 512K, b = 2048: 2.1 ms of key passes
    a step over 32 layers plus the gather, against 1.3 ms for the chunked selection in an earlier
    profile).

    ``mask_out`` (``"radix"`` only): a contiguous bool or int8 ``[b*h, P]`` page mask overwritten with
    the listed pages (what the lists hold, as `locks_hf.paged.pages_to_mask` would give it).
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"select_pages: algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if scores.dim() != 3 or scores.dtype != torch.float32 or partials.dtype != torch.float32 or partials.dim() != 4:
        raise ValueError("select_pages: scores float32 [b*h, G, P] and partials float32 [b*h, n_blk, 4, GG] "
                         f"expected, got {scores.dtype} {tuple(scores.shape)} and {partials.dtype} "
                         f"{tuple(partials.shape)}")
    if slots < 0:
        raise ValueError(f"select_pages: slots must be >= 0, got {slots}")
    rows, G, P = scores.shape
    marks = scores
    if mask_out is not None:
        if algorithm != "radix":
            raise ValueError("select_pages: mask_out needs algorithm='radix'")
        if mask_out.dtype not in (torch.bool, torch.int8) or mask_out.numel() != rows * P \
                or not mask_out.is_contiguous():
            raise ValueError(f"select_pages: mask_out must be a contiguous bool/int8 tensor of {rows} x {P} pages, "
                             f"got {mask_out.dtype} {tuple(mask_out.shape)}")
        marks = mask_out.view(torch.int8)
    length = as_length(length, scores.device)
    K = max(slots - 2, 0)
    k_active = as_length(slots if active_slots is None else active_slots, scores.device)
    KP = next_pow2(max(K, 1))
    vrows = rows * G if per_head else rows
    dev = scores.device
    sink = torch.empty((rows,), dtype=torch.int32, device=dev)
    n_blk = partials.shape[1]
    GG = partials.shape[-1]
    W = page_list_width("quest" if per_head else "shared", slots, G)
    if out is None:
        out = torch.empty((rows, W), dtype=torch.int32, device=dev)
    lists = torch.empty((vrows, KP), dtype=torch.int32, device=dev) if per_head else None
    if algorithm == "radix":
        if state is None:
            state = radix_state(vrows, dev)
        elif state.dtype != torch.int32 or state.shape[0] < vrows or state.shape[-1] != STATE_WIDTH \
                or not state.is_contiguous():
            raise ValueError(f"select_pages: state must be a contiguous int32 [>= {vrows}, {STATE_WIDTH}] tensor "
                             f"(radix_state), got {state.dtype} {tuple(state.shape)}")
        CH = chunk or radix_chunk(P, vrows, 4 * sm_count(dev))
        n_chunk = max(1, triton.cdiv(P, CH))
        TC = next_pow2(max(tie_capacity, 16))
        keys = torch.empty((vrows, P), dtype=torch.int32, device=dev)
        lst = torch.empty((vrows, KP), dtype=torch.int32, device=dev)
        tie_key = torch.empty((vrows, TC), dtype=torch.int32, device=dev)
        tie_page = torch.empty((vrows, TC), dtype=torch.int32, device=dev)
        _radix_keys_kernel[(n_chunk, vrows)](
            scores, partials, n_blk, row_start, length, heads, P, sink, state, keys, P, marks,
            PER_HEAD=per_head, G=G, GG=GG, B=page_size, CH=CH, NBP=64, MARK=mask_out is not None,
            num_warps=num_warps or (4 if CH <= 1024 else 8))
        # 8 warps: the histogram's suffix sums and the tie search's [TC, 16] counts fit without spills
        _radix_gather_kernel[(n_chunk, vrows)](
            state, keys, P, P, k_active, K, n_chunk, lst, tie_key, tie_page, sink, row_start, length, heads,
            lists if per_head else out, KP if per_head else W, marks,
            PER_HEAD=per_head, G=G, B=page_size, CH=CH, KP=KP, TC=TC, TILE=512, MARK=mask_out is not None,
            num_warps=8)
    else:
        CH = chunk or chunk_size(P, KP)
        n_chunk = max(1, triton.cdiv(P, CH))
        M = next_pow2(n_chunk) * KP
        keys = torch.empty((vrows, n_chunk, KP), dtype=torch.int32, device=dev)
        pages = torch.empty((vrows, n_chunk, KP), dtype=torch.int32, device=dev)
        _select_chunk_kernel[(n_chunk, vrows)](
            scores, partials, n_blk, row_start, length, heads, P, k_active, K, keys, pages, sink, n_chunk,
            PER_HEAD=per_head, G=G, GG=GG, B=page_size, CH=CH, KP=KP, NBP=64,
            num_warps=num_warps or (4 if CH <= 1024 else 8))
        _select_merge_kernel[(vrows,)](keys, pages, sink, row_start, length, heads, k_active, K, n_chunk,
                                       lists if per_head else out, KP if per_head else W,
                                       PER_HEAD=per_head, G=G, B=page_size, KP=KP, M=M,
                                       num_warps=4 if M <= 1024 else 8)
    if per_head:
        N = next_pow2(G * KP)
        _union_kernel[(rows,)](lists, G * KP, sink, row_start, length, heads, out, W, B=page_size, N=N,
                               num_warps=4 if N <= 1024 else 8)
    return out
