"""Page selection (kernel 2): top-(k-2) pages per row with the forced sink and recent pages.

One launch, ``_select_kernel`` (grid: chunks x rows), no host sync, fixed-width outputs padded with
``SENTINEL``. Each program

1. folds the scoring partials (`sink_and_lse`: the least first page, then each head's max, then its sum) into
   the sink page and, for the shared rule, each query head's LSE over the candidate pages; computes one key per
   page of its chunk (the share-average ``mean_g exp(s_g - LSE_g)``, or a head's own score for Quest) and keeps
   the chunk's best ``k-2`` by a threshold search (``top_keys``), in page order;
2. with a middle stage (`selection_stages`: where long chunks would leave the launch few programs), if it is
   the last of its group of chunks to finish (`_common.arrived_last`), keeps the group's best ``k-2`` the same
   way;
3. if it is the last of its row to finish, takes the best ``k-2`` of the row's lists (in two tiles when their
   count is not a power of two: `merge_tiles`) and writes ``[sink, recent, winners..., SENTINEL...]``; for
   Quest it writes its head's list, and the last head of a KV head to finish merges the G lists (sort, drop
   duplicates). Given a page mask, the program that writes a row's list overwrites the mask's row with it
   too (`mark_row`): a static layer's record of the pages attended costs no launch of its own.

The later stages run in whichever program finishes last, so they add no launch and wait for no other row;
their counters (``tickets``) are left zero for the next launch.

Ties break towards the earlier page, as in the reference (a stable descending sort).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    BIG_PAGE,
    LOG2E,
    NO_KEY,
    SENTINEL_C as SENTINEL,
    arrived_last,
    as_length,
    launch,
    next_pow2,
    score_key,
    top_keys,
    top_keys_of,
)


@triton.jit
def _first_pages(base, i, n_blk, T: tl.constexpr, GG: tl.constexpr):
    """The first pages of partials ``i .. i+T-1`` of a row (``base``): ``BIG_PAGE`` past the last one and for a
    program that saw no real page."""
    a = tl.arange(0, T)
    return tl.load(base + (i + a) * 4 * GG + 3 * GG, mask=(i + a) < n_blk, other=BIG_PAGE).to(tl.int32)


@triton.jit
def _partials(base, i, n_blk, T: tl.constexpr, GG: tl.constexpr):
    """Partials ``i .. i+T-1`` of a row (``base``): each head's running max and sum, the score of the first page
    and the first page (`_first_pages`)."""
    gi = tl.arange(0, GG)
    a = tl.arange(0, T)
    ok = ((i + a) < n_blk)[:, None]
    ptr = base + (i + a)[:, None] * 4 * GG + gi[None, :]
    m = tl.load(ptr, mask=ok, other=float("-inf"))
    l = tl.load(ptr + GG, mask=ok, other=0.0)
    fs = tl.load(ptr + 2 * GG, mask=ok, other=float("-inf"))
    return m, l, fs, _first_pages(base, i, n_blk, T, GG)


@triton.jit
def _least_first_page(base, n_full, n_blk, GG: tl.constexpr, NBP: tl.constexpr, NBR: tl.constexpr):
    """The least first page of a row's partials (``BIG_PAGE`` where none saw a real page): one int a partial."""
    lane_f = tl.full([NBP], BIG_PAGE, tl.int32)
    for i in range(0, n_full, NBP):
        lane_f = tl.minimum(lane_f, _first_pages(base, i, n_blk, NBP, GG))
    least = tl.min(lane_f, axis=0)
    if NBR > 0:
        least = tl.minimum(least, tl.min(_first_pages(base, n_full, n_blk, NBR, GG), axis=0))
    return least


@triton.jit
def _candidate_firsts(base, i, n_blk, least, last_page, T: tl.constexpr, GG: tl.constexpr):
    """Partials ``i .. i+T-1`` (`_partials`) with each first page's scores ``-inf`` where that page is no
    candidate: the sink (``least``), the recent page, or none."""
    m, l, fs, f = _partials(base, i, n_blk, T, GG)
    cand = (f != least) & (f != last_page) & (f != BIG_PAGE)
    return m, l, tl.where(cand[:, None], fs, float("-inf"))


@triton.jit
def _tile_max(base, i, n_blk, least, last_page, T: tl.constexpr, GG: tl.constexpr):
    """Each head's largest candidate score in partials ``i .. i+T-1``, elementwise ``[T, GG]``."""
    m, l, fs = _candidate_firsts(base, i, n_blk, least, last_page, T, GG)
    return tl.maximum(m, fs)


@triton.jit
def _tile_sum(base, i, n_blk, least, last_page, safe2, T: tl.constexpr, GG: tl.constexpr):
    """Each head's candidate mass in partials ``i .. i+T-1`` against its max (``safe2 [GG]``, in base 2),
    elementwise."""
    m, l, fs = _candidate_firsts(base, i, n_blk, least, last_page, T, GG)
    return l * tl.exp2(m * LOG2E - safe2[None, :]) + tl.exp2(fs * LOG2E - safe2[None, :])


@triton.jit
def sink_and_lse(
    part_ptr,
    row,
    n_blk,
    last_page,
    GG: tl.constexpr,
    NBP: tl.constexpr,
    NBR: tl.constexpr,
    WITH_LSE: tl.constexpr,
):
    """Fold the scoring partials of ``row`` into the sink page and each head's LSE over the candidates.

    Three passes over the partials, ``NBP`` a step and the last ``n_blk % NBP`` in a tile of their own, ``NBR``
    wide (0: none; `fold_tiles`): a row of 513 partials folds in two steps of 256 and one of 1, not three of 256.
    The sink (the least first page) from one int a partial; then each head's max over the candidates; then their
    sum against it: two exponentials a partial and head, no running rescale. The passes after the first read
    what it brought into the L1."""
    base = part_ptr + row * n_blk * 4 * GG
    n_full = n_blk - n_blk % NBP if NBR > 0 else n_blk  # (without a remainder tile the last step is masked)
    least = _least_first_page(base, n_full, n_blk, GG, NBP, NBR)
    lse = tl.full([GG], float("-inf"), tl.float32)
    if WITH_LSE:
        mx = tl.full([NBP, GG], float("-inf"), tl.float32)
        for i in range(0, n_full, NBP):
            mx = tl.maximum(mx, _tile_max(base, i, n_blk, least, last_page, NBP, GG))
        top = tl.max(mx, axis=0)
        if NBR > 0:
            top = tl.maximum(top, tl.max(_tile_max(base, n_full, n_blk, least, last_page, NBR, GG), axis=0))
        safe2 = tl.where(top == float("-inf"), 0.0, top) * LOG2E
        acc = tl.zeros([NBP, GG], dtype=tl.float32)
        for i in range(0, n_full, NBP):
            acc += _tile_sum(base, i, n_blk, least, last_page, safe2, NBP, GG)
        total = tl.sum(acc, axis=0)
        if NBR > 0:
            total += tl.sum(_tile_sum(base, n_full, n_blk, least, last_page, safe2, NBR, GG), axis=0)
        lse = tl.where(total > 0, top + tl.log(total), float("-inf"))
    return tl.where(least == BIG_PAGE, last_page, least), lse


def fold_tiles(n_blk: int, nbp: int) -> tuple[int, int]:
    """`sink_and_lse`'s tiles ``(NBP, NBR)`` for ``n_blk`` partials a row: ``nbp`` (a power of two) a step, then
    the remainder's own tile (the next power of two of ``n_blk % nbp``; 0 when there is none). A static cache
    of 512K tokens plus headroom leaves 513 partials a row, whose last one would otherwise cost a step of 256.
    A row of at most ``nbp`` partials folds in one step of the next power of two, with no remainder tile (the
    Llama-3.1-8B shape at 512K: 513 partials of 4 heads, steps of 1,024)."""
    if n_blk <= nbp:
        return next_pow2(max(n_blk, 1)), 0
    rest = n_blk % nbp
    return nbp, next_pow2(rest) if rest else 0


@triton.jit
def free_slots(k_ptr, K_MAX):
    """Pages to select besides the sink and the recent one: the budget's ``k - 2`` read on the device
    (so that a captured graph serves any budget), at most the ``K_MAX`` the lists were sized for."""
    return tl.minimum(tl.maximum(tl.load(k_ptr) - 2, 0), K_MAX)


@triton.jit
def _row_keys(
    score_ptr,
    part_ptr,
    n_blk,
    row_start_ptr,
    len_ptr,
    H,
    P,
    p,
    vrow,
    PER_HEAD: tl.constexpr,
    G: tl.constexpr,
    GG: tl.constexpr,
    B: tl.constexpr,
    NBP: tl.constexpr,
    NBR: tl.constexpr,
):
    """Selection keys of pages ``p`` of virtual row ``vrow`` (a (row, KV head), or a (row, KV head,
    query head) for Quest): the share-average ``mean_g exp(s_g - LSE_g)`` (a head's own score for
    Quest) as `score_key` ints, ``NO_KEY`` for pages that are not candidates (not real, the sink or
    the recent page); with the row's sink page and most recent page."""
    if PER_HEAD:
        row = vrow // G
        head = vrow % G
    else:
        row = vrow
        head = 0
    last_page = last_page_of(row_start_ptr, len_ptr, row, H, B)
    srow = score_ptr + row * G * P
    if not PER_HEAD:
        # loaded before the partials are folded: their wait overlaps the fold, on which only their use waits
        gi = tl.arange(0, GG)
        s_all = tl.load(
            srow + gi[:, None] * P + p[None, :], mask=(gi < G)[:, None] & (p < P)[None, :], other=float("-inf")
        )
    sink, lse = sink_and_lse(part_ptr, row, n_blk, last_page, GG, NBP, NBR, not PER_HEAD)
    if PER_HEAD:
        s = tl.load(srow + head * P + p, mask=p < P, other=float("-inf"))
        real = s > float("-inf")
        key = score_key(s)
    else:
        real = tl.max(tl.where(gi[:, None] == 0, s_all, float("-inf")), axis=0) > float("-inf")
        lse2 = tl.where(lse == float("-inf"), 0.0, lse) * LOG2E  # base 2: one fused multiply-add a score
        key = score_key(tl.sum(tl.exp2(s_all * LOG2E - lse2[:, None]), axis=0) / G)
    cand = real & (p != sink) & (p != last_page)
    return tl.where(cand, key, NO_KEY), sink, last_page


@triton.jit
def _select_kernel(
    score_ptr,
    part_ptr,
    n_blk,
    row_start_ptr,
    len_ptr,
    H,
    P,
    k_ptr,
    K_MAX,
    key_ptr,
    page_ptr,
    n_chunk,
    key2_ptr,
    page2_ptr,
    n_group,
    tick_ptr,
    out_ptr,
    W,
    mask_ptr,
    list_ptr,
    PER_HEAD: tl.constexpr,
    G: tl.constexpr,
    GG: tl.constexpr,
    B: tl.constexpr,
    CH: tl.constexpr,
    KP: tl.constexpr,
    NBP: tl.constexpr,
    NBR: tl.constexpr,
    GRP: tl.constexpr,
    M: tl.constexpr,
    MT: tl.constexpr,
    MARK: tl.constexpr,
    MB: tl.constexpr,
    N: tl.constexpr,
):
    """Program (chunk, vrow): its ``CH`` pages' keys and their best ``k-2`` (a chunk list); then, if it is the
    last of its group of ``GRP`` chunks to finish (``GRP > 0``), the group's list; then, if it is the last list
    of its row, the row's merge (`_finish_row`). Counters at ``tick_ptr``: a group's, then a row's, then (Quest)
    a KV head's."""
    chunk = tl.program_id(0)
    vrow = tl.program_id(1)
    n_vrow = tl.num_programs(1)
    p = chunk * CH + tl.arange(0, CH)
    key, sink, last_page = _row_keys(
        score_ptr, part_ptr, n_blk, row_start_ptr, len_ptr, H, P, p, vrow, PER_HEAD, G, GG, B, NBP, NBR
    )
    K = free_slots(k_ptr, K_MAX)
    keep_winners(key_ptr, page_ptr, (vrow * n_chunk + chunk) * KP, key, p, top_keys(key, K), KP)
    row_tick = tick_ptr + n_vrow * n_group + vrow
    union_tick = tick_ptr + n_vrow * (n_group + 1) + vrow // G
    if GRP > 0:
        grp = chunk // GRP
        if arrived_last(tick_ptr + vrow * n_group + grp, tl.minimum(GRP, n_chunk - grp * GRP)):
            e = grp * GRP * KP + tl.arange(0, GRP * KP)
            ok = e < n_chunk * KP
            base = vrow * n_chunk * KP
            gkey = tl.load(key_ptr + base + e, mask=ok, other=NO_KEY, cache_modifier=".cg")
            gpage = tl.load(page_ptr + base + e, mask=ok, other=SENTINEL, cache_modifier=".cg")
            keep_winners(key2_ptr, page2_ptr, (vrow * n_group + grp) * KP, gkey, gpage, top_keys(gkey, K), KP)
            if arrived_last(row_tick, n_group):
                _finish_row(
                    key2_ptr, page2_ptr, n_group, vrow, K, sink, last_page, out_ptr, W, mask_ptr, list_ptr, P,
                    union_tick, PER_HEAD, G, KP, M, MT, MARK, MB, N,
                )  # fmt: skip
    else:
        if arrived_last(row_tick, n_chunk):
            _finish_row(
                key_ptr, page_ptr, n_chunk, vrow, K, sink, last_page, out_ptr, W, mask_ptr, list_ptr, P,
                union_tick, PER_HEAD, G, KP, M, MT, MARK, MB, N,
            )  # fmt: skip


@triton.jit
def keep_winners(key_ptr, page_ptr, out, key, page, keep, KP: tl.constexpr):
    """The kept entries of ``key``/``page`` in their order at ``out``, a list of ``KP``; ``NO_KEY`` past them
    (their pages are left as they were: nothing reads a page whose key is ``NO_KEY``)."""
    n = tl.sum(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    tl.store(key_ptr + out + pos, key, mask=keep)
    tl.store(page_ptr + out + pos, page, mask=keep)
    e = tl.arange(0, KP)
    tl.store(key_ptr + out + e, tl.full([KP], NO_KEY, tl.int32), mask=e >= n)


@triton.jit
def _finish_row(
    key_ptr,
    page_ptr,
    n_lists,
    vrow,
    K,
    sink,
    last_page,
    out_ptr,
    W,
    mask_ptr,
    list_ptr,
    P,
    union_tick,
    PER_HEAD: tl.constexpr,
    G: tl.constexpr,
    KP: tl.constexpr,
    M: tl.constexpr,
    MT: tl.constexpr,
    MARK: tl.constexpr,
    MB: tl.constexpr,
    N: tl.constexpr,
):
    """The merge of row ``vrow``'s ``n_lists`` winner lists (in page order) into its best ``k-2``: the row's
    page list (and its page mask with ``MARK``); for Quest, the head's list, and for the last head of a KV head
    to get there (`arrived_last` at ``union_tick``), the union of the group's lists (`_union_row`). The lists
    in two tiles where their count is not a power of two (``M`` entries, then ``MT``; see `merge_tiles`)."""
    n_in = n_lists * KP
    base = vrow * n_in
    e = tl.arange(0, M)
    key = tl.load(key_ptr + base + e, mask=e < n_in, other=NO_KEY, cache_modifier=".cg")
    page = tl.load(page_ptr + base + e, mask=e < n_in, other=SENTINEL, cache_modifier=".cg")
    key2 = key
    page2 = page
    if MT > 0:  # the lists past the first M entries, in a tile of their own (see `merge_tiles`)
        t = M + tl.arange(0, MT)
        key2 = tl.load(key_ptr + base + t, mask=t < n_in, other=NO_KEY, cache_modifier=".cg")
        page2 = tl.load(page_ptr + base + t, mask=t < n_in, other=SENTINEL, cache_modifier=".cg")
    keep, keep2 = top_keys_of(key, key2, K, MT > 0)
    n = tl.sum(keep.to(tl.int32), axis=0)
    pos = tl.cumsum(keep.to(tl.int32), axis=0) - 1
    n_all = n
    pos2 = pos
    if MT > 0:  # after the first tile's pages: the lists stay in page order
        n_all += tl.sum(keep2.to(tl.int32), axis=0)
        pos2 = n + tl.cumsum(keep2.to(tl.int32), axis=0) - 1
    if PER_HEAD:
        tl.store(list_ptr + vrow * KP + pos, page, mask=keep)
        if MT > 0:
            tl.store(list_ptr + vrow * KP + pos2, page2, mask=keep2)
        w = tl.arange(0, KP)
        tl.store(list_ptr + vrow * KP + w, tl.full([KP], SENTINEL, tl.int32), mask=w >= n_all)
        if arrived_last(union_tick, G):
            _union_row(list_ptr, vrow // G, G * KP, sink, last_page, out_ptr, W, mask_ptr, P, N, MARK, MB)
    else:
        write_page_list(out_ptr, vrow, W, page, keep, pos, n_all, sink, last_page, KP)
        if MT > 0:
            tl.store(out_ptr + vrow * W + 2 + pos2, page2, mask=keep2)
        if MARK:
            mark_row(mask_ptr, vrow, P, page, keep, sink, last_page, MB)
            if MT > 0:  # after mark_row's barrier, as its own ones
                row_mask = mask_ptr + vrow.to(tl.int64) * P
                tl.store(row_mask + page2, tl.full([MT], 1, tl.int8), mask=keep2 & (page2 >= 0) & (page2 < P))


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
def mark_row(mask_ptr, row, P, pages, keep, sink, last_page, MB: tl.constexpr):
    """Row ``row`` of the attended-page mask (int8 ``[rows, P]``): zeros, then (after a barrier, so that every
    thread's zeros land first) a one at the sink, the most recent page and each kept page: what
    `mark_lists` writes for the row's list, in the launch that writes the list (one launch a step fewer)."""
    base = mask_ptr + row.to(tl.int64) * P
    for p0 in range(0, P, MB):
        p = p0 + tl.arange(0, MB)
        tl.store(base + p, tl.zeros([MB], dtype=tl.int8), mask=p < P)
    tl.debug_barrier()
    tl.store(base + pages, tl.full(pages.shape, 1, tl.int8), mask=keep & (pages >= 0) & (pages < P))
    one = tl.full([], 1, tl.int8)
    tl.store(base + sink, one, mask=(sink >= 0) & (sink < P))
    tl.store(base + last_page, one, mask=(last_page >= 0) & (last_page < P))


@triton.jit
def _union_row(
    list_ptr,
    row,
    n_list,
    sink,
    last_page,
    out_ptr,
    W,
    mask_ptr,
    P,
    N: tl.constexpr,
    MARK: tl.constexpr,
    MB: tl.constexpr,
):
    """Union of the G per-head lists of KV head ``row`` (``n_list = G*KP <= N`` entries): sort, drop repeats."""
    e = tl.arange(0, N)
    x = tl.load(list_ptr + row * n_list + e, mask=e < n_list, other=SENTINEL, cache_modifier=".cg")
    x = tl.where(x == SENTINEL, BIG_PAGE, x)
    x = tl.sort(x)
    prev = tl.gather(x, tl.maximum(e - 1, 0), 0)
    uniq = (x != BIG_PAGE) & ((e == 0) | (x != prev))
    n = tl.sum(uniq.to(tl.int32), axis=0)
    pos = tl.cumsum(uniq.to(tl.int32), axis=0) - 1
    write_page_list(out_ptr, row, W, x, uniq, pos, n, sink, last_page, N)
    if MARK:
        mark_row(mask_ptr, row, P, x, uniq, sink, last_page, MB)


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


def mask_fits(mask: torch.Tensor, rows: int, P: int) -> bool:
    """Whether the kernels can write ``mask`` as a page mask of ``rows`` lists over ``P`` pages: contiguous
    bool or int8 ``[rows, P]``."""
    return mask.dtype in (torch.bool, torch.int8) and mask.is_contiguous() and tuple(mask.shape) == (rows, P)


def _mask_bytes(mask: torch.Tensor, rows: int, P: int, caller: str) -> torch.Tensor:
    """``mask`` (a page mask ``[rows, P]``) as the int8 tensor the kernels write, or a ValueError that says
    what it must be."""
    if not mask_fits(mask, rows, P):
        raise ValueError(
            f"{caller}: mask must be a contiguous bool/int8 [{rows}, {P}] tensor, got {mask.dtype} "
            f"{tuple(mask.shape)}{'' if mask.is_contiguous() else ' (not contiguous)'}"
        )
    return mask.view(torch.int8)


def mark_lists(mask: torch.Tensor, pages: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Overwrite ``mask`` (contiguous bool or int8 ``[rows, P]``) with the pages of the lists ``pages
    [rows, W]`` (int32; ``SENTINEL`` and pages ``>= P`` mark nothing): one launch, no scratch, what
    ``locks_hf.paged.pages_to_mask`` gives."""
    rows, P = mask.shape
    _mask_bytes(mask, rows, P, "mark_lists")
    if pages.dim() != 2 or pages.shape[0] != rows or pages.dtype != torch.int32 or not pages.is_contiguous():
        raise ValueError(
            f"mark_lists: pages must be contiguous int32 [{rows}, W], got {pages.dtype} {tuple(pages.shape)}"
        )
    W = pages.shape[1]
    if rows and P:
        launch(
            _list_mask_kernel,
            (rows, triton.cdiv(P, block)),
            pages,
            W,
            mask.view(torch.int8),
            P,
            BLOCK=block,
            WB=128,
            num_warps=4,
        )
    return mask


#: Mask bytes a selection program zeroes per store when it marks its row (`mark_row`).
MARK_BLOCK = 2048


#: Fewest pages a first-stage program takes by default (`chunk_size`); a buffer of counters sized for it
#: (`locks_hf.buffers.selection_tickets`) serves every budget.
MIN_CHUNK = 256


def chunk_size(n_pages: int, kp: int, chunks: int = 16) -> int:
    """Pages per first-stage program: the power of two at or below ``n_pages / chunks`` (so about
    ``chunks`` to ``2 * chunks`` chunks a row), at least 256 and ``kp`` pages.

    Rounded down, not up: a cache a few pages past a power of two (a prompt plus headroom) would
    otherwise get chunks twice as long and half as many programs (32,773 pages: 4,096-page chunks
    and 9 programs a row, against 2,048 and 16 at 32,768)."""
    per = max(1, n_pages // chunks)
    return max(MIN_CHUNK, kp, 1 << (per.bit_length() - 1))


def chunks_of(n_pages: int, kp: int, chunk: int | None = None) -> tuple[int, int]:
    """The first stage's pages a program (``chunk``, else `chunk_size`) and its programs a row."""
    per = chunk or chunk_size(n_pages, kp)
    return per, max(1, triton.cdiv(n_pages, per))


#: A first stage of fewer programs than this (chunks x rows) and chunks of at least `SHORT_CHUNK_FROM` pages
#: gets chunks half as long and a middle stage that merges their lists `MIDDLE_GROUP` at a time: more programs
#: read the scores at once, and the merge gets no more lists. H100, GLM-4-9B shape at 512K (32,774 pages, two KV
#: heads: 34 programs of 2,048 pages): 1,024-page chunks of 8 warps in groups of 8 select in 0.0272 ms against
#: 0.0299 (groups of 4: 0.0273; without the middle stage 0.0313).
FEW_PROGRAMS = 64
SHORT_CHUNK_FROM = 2048
MIDDLE_GROUP = 8


def selection_stages(
    n_pages: int, kp: int, vrows: int, chunk: int | None = None, group: int | None = None
) -> tuple[int, int, int | None]:
    """The first stage's pages a program and programs a row, and the middle stage's group (``None``: no middle
    stage). With neither ``chunk`` nor ``group`` given: `chunks_of`'s chunks, or where they leave the first stage
    fewer than `FEW_PROGRAMS` programs, half as long with a middle stage of `MIDDLE_GROUP`."""
    per, n_chunk = chunks_of(n_pages, kp, chunk)
    short = per >= SHORT_CHUNK_FROM and per // 2 >= kp  # a half chunk still holds a whole list
    if chunk is None and group is None and short and vrows * n_chunk < FEW_PROGRAMS:
        per, n_chunk = chunks_of(n_pages, kp, per // 2)
        group = MIDDLE_GROUP
    if group is not None and (group < 2 or group & (group - 1)):
        raise ValueError(
            f"select_pages: group must be a power of two >= 2 (chunk lists a middle program merges), got {group}"
        )
    return per, n_chunk, group if n_chunk > 1 else None


def merge_tiles(n_chunk: int, kp: int) -> tuple[int, int]:
    """The merge's two tiles of chunk winners ``(M, MT)``: the first ``M`` entries (the largest power of two of
    chunks), then the rest, ``MT`` wide (0: none). One tile of the next power of two would be up to twice the
    entries: a static cache a few pages past a power of two (512K tokens plus headroom: 32,774 pages, 17 chunks of
    2,048) would have its merge count 4,096 entries a round for 2,176."""
    first = 1 << (max(n_chunk, 1).bit_length() - 1)
    rest = (n_chunk - first) * kp
    return first * kp, next_pow2(rest) if rest else 0


def default_partial_block(GG: int) -> int:
    """Scoring partials a selection program folds per step: ``[NBP, GG]`` tiles of about 4096 entries.
    The fold is a dependent loop that every first-stage program runs over all of a row's partials, so
    its step count, not its bytes, sets its time (GLM-4-9B at 512K: 512 partials a row, 2 steps of 256)."""
    return max(64, 4096 // max(GG, 1))


def _winner_lists(rows: int, lists: int, kp: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and pages of ``lists`` lists of ``kp`` winners a row (int32 ``[rows, lists, kp]`` each)."""
    keys = torch.empty((rows, lists, kp), dtype=torch.int32, device=device)
    return keys, torch.empty_like(keys)


def page_list_width(per_head: bool, slots: int, group: int) -> int:
    """Width ``W`` of `select_pages`' lists: ``k``, or ``G*(k-2) + 2`` for a per-head union."""
    return group * max(slots - 2, 0) + 2 if per_head else slots


def select_pages(
    scores: torch.Tensor,
    partials: torch.Tensor,
    *,
    slots: int,
    per_head: bool,
    row_start: torch.Tensor,
    length: int | torch.Tensor,
    heads: int,
    page_size: int,
    out: torch.Tensor | None = None,
    chunk: int | None = None,
    active_slots: torch.Tensor | None = None,
    num_warps: int | None = None,
    partial_block: int | None = None,
    mask: torch.Tensor | None = None,
    group: int | None = None,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor:
    """Page lists ``[b*h, W]`` int32 (``SENTINEL``-padded) from ``score_pages``' outputs.

    ``slots`` is ``k = ceil(b / B)``; ``W = k`` for the shared rule and ``G*(k-2) + 2`` for Quest's
    per-head union. Entry 0 is the sink page, entry 1 the most recent page (``SENTINEL`` when it
    is the sink), then the selected pages in ascending page order.
    ``length``: slots written (an int, or the cache's ``int32 [1]`` device tensor).
    ``active_slots``: optional ``int32 [1]`` device tensor, the ``k <= slots`` to select with (the
    lists keep width ``W`` of ``slots``, padded); read by the kernels, so a captured graph serves
    every budget up to ``slots``.

    ``chunk``: pages per first-stage program; ``num_warps`` of that launch; ``partial_block``: scoring
    partials each of its programs folds per step (a power of two; default `default_partial_block`).
    ``mask`` (optional, contiguous bool or int8 ``[b*h, P]``): overwritten with the listed pages, as
    `mark_lists` would, by the launch that writes the lists.
    ``group`` (a power of two): a middle stage between the chunks and the merge, each of its programs
    merging ``group`` consecutive chunk lists into one, so that many short chunks (more programs a row) leave
    the merge as few lists as long chunks would. With neither ``chunk`` nor ``group`` given, `selection_stages`
    chooses (a middle stage where long chunks would leave the first stage few programs).
    ``tickets`` (optional, contiguous int32 zeros, ``vrows * (groups + 1)`` entries and one per row for Quest):
    the counters by which the last program of a group and of a row finds itself (`_common.arrived_last`), left
    zero by the launch, so a caller can keep one buffer for every step; by default a new zeroed one.
    """
    if scores.dim() != 3 or scores.dtype != torch.float32 or partials.dtype != torch.float32 or partials.dim() != 4:
        raise ValueError(
            "select_pages: scores float32 [b*h, G, P] and partials float32 [b*h, n_blk, 4, GG] "
            f"expected, got {scores.dtype} {tuple(scores.shape)} and {partials.dtype} "
            f"{tuple(partials.shape)}"
        )
    if slots < 0:
        raise ValueError(f"select_pages: slots must be >= 0, got {slots}")
    rows, G, P = scores.shape
    length = as_length(length, scores.device)
    K = max(slots - 2, 0)
    k_active = as_length(slots if active_slots is None else active_slots, scores.device)
    KP = next_pow2(max(K, 1))
    vrows = rows * G if per_head else rows
    dev = scores.device
    n_blk = partials.shape[1]
    GG = partials.shape[-1]
    W = page_list_width(per_head, slots, G)
    marks = None if mask is None else _mask_bytes(mask, rows, P, "select_pages")
    if out is None:
        out = torch.empty((rows, W), dtype=torch.int32, device=dev)
    lists = torch.empty((vrows, KP), dtype=torch.int32, device=dev) if per_head else out
    CH, n_chunk, group = selection_stages(P, KP, vrows, chunk, group)
    n_group = triton.cdiv(n_chunk, group) if group is not None else 0
    n_tick = vrows * (n_group + 1) + (rows if per_head else 0)
    if tickets is None:
        tickets = torch.zeros((n_tick,), dtype=torch.int32, device=dev)
    elif (
        tickets.dtype != torch.int32 or tickets.device != dev or not tickets.is_contiguous() or tickets.numel() < n_tick
    ):
        raise ValueError(
            f"select_pages: tickets must be a contiguous int32 tensor of at least {n_tick} zeros on {dev}, got "
            f"{tickets.dtype} {tuple(tickets.shape)} on {tickets.device}"
        )
    nbp, nbr = fold_tiles(n_blk, partial_block or default_partial_block(GG))
    keys, pages = _winner_lists(vrows, n_chunk, KP, dev)
    keys2, pages2 = _winner_lists(vrows, n_group, KP, dev) if n_group else (keys, pages)
    M, MT = merge_tiles(n_group or n_chunk, KP)
    N = next_pow2(G * KP) if per_head else KP
    if num_warps is None:
        # 8 with a middle stage: 1,024-page chunks took 0.0271 ms against 0.0296 with 4 (GLM-4-9B, 512K)
        wide = CH > 1024 or n_group or M + MT > 1024 or (per_head and N > 1024)
        num_warps = 8 if wide else 4
    launch(
        _select_kernel,
        (n_chunk, vrows),
        scores,
        partials,
        n_blk,
        row_start,
        length,
        heads,
        P,
        k_active,
        K,
        keys,
        pages,
        n_chunk,
        keys2,
        pages2,
        n_group,
        tickets,
        out,
        W,
        out if marks is None else marks,
        lists,
        PER_HEAD=per_head,
        G=G,
        GG=GG,
        B=page_size,
        CH=CH,
        KP=KP,
        NBP=nbp,
        NBR=nbr,
        GRP=group or 0,
        M=M,
        MT=MT,
        MARK=marks is not None,
        MB=MARK_BLOCK,
        N=N,
        num_warps=num_warps,
    )
    return out
