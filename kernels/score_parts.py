"""Pieces both page-scoring kernels share (`score_dot`, `score_fma`): a program's row and page block,
the page LSE of token logits, and the per-program partials the selection kernel folds.

Partials per program: the running max and sum of ``exp`` over its candidate pages except its first
real page, that page's scores, and its index (`score` describes the layout).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import BIG_PAGE, LOG2E, prefetch_l2


@triton.jit
def program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B: tl.constexpr):
    """This program's page block and (row, KV head), the row's first slot, complete pages, the cache
    length and the row's most recent page (never a candidate).

    The complete pages are capped at those wholly inside the written slots ``row_start .. length-1``, so a
    kernel reads a complete page's valid flags with no bounds check of its own (``row_start >= 0``, the
    row's first real slot)."""
    row = tl.program_id(1)
    bb = (row // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
    rs = tl.load(row_start_ptr + bb)
    length = tl.load(len_ptr)
    n_done = tl.minimum(tl.load(n_complete_ptr + bb), tl.maximum(length - rs, 0) // B)
    return (tl.program_id(0), row, bb, row % H, rs, n_done, length, (length - 1 - rs) // B)


@triton.jit
def row_summaries(
    bb,
    hh,
    bas,
    bas_sb,
    bas_sh,
    bsc,
    bsc_sb,
    bsc_sh,
    cf,
    cf_sb,
    cf_sh,
    csc,
    csc_sb,
    csc_sh,
    mu,
    mu_sb,
    mu_sh,
    msc,
    msc_sb,
    msc_sh,
):
    """The six Locks summary pointers (basis, its scales, coefficients, theirs, centroid, its scale) at
    batch row ``bb`` and KV head ``hh``."""
    return (
        bas + bb * bas_sb + hh * bas_sh,
        bsc + bb * bsc_sb + hh * bsc_sh,
        cf + bb * cf_sb + hh * cf_sh,
        csc + bb * csc_sb + hh * csc_sh,
        mu + bb * mu_sb + hh * mu_sh,
        msc + bb * msc_sb + hh * msc_sh,
    )


@triton.jit
def prefetch_block(
    bas,
    bsc,
    cf,
    csc,
    mu,
    msc,
    vrow,
    rs,
    p0,
    n_done,
    D: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    BP: tl.constexpr,
    LINES: tl.constexpr,
):
    """Ask the L2 (`prefetch_l2`, at most ``LINES`` lines a range) for all a block reads: the summaries of
    its pages ``p0 .. p0+BP-1`` below ``n_done`` (``bas``/``cf``/``mu`` as int32 words, scales as 16-bit
    floats) and their tokens' valid flags. The block's projections, then its epilogue, load these one after
    the other; asked for at once, they wait on DRAM once."""
    n = tl.minimum(tl.maximum(n_done - p0, 0), BP)
    prefetch_l2(bas + p0 * (R * D * BITS // 32), n * (R * D * BITS // 8), LINES)
    prefetch_l2(mu + p0 * (D // 4), n * D, LINES)
    prefetch_l2(cf + p0 * (B * R // 4), n * (B * R), LINES)
    prefetch_l2(csc + p0 * B, n * (2 * B), LINES)
    prefetch_l2(bsc + p0 * R, n * (2 * R), LINES)
    prefetch_l2(msc + p0, n * 2, LINES)
    prefetch_l2(vrow + rs + p0 * B, n * B, LINES)


@triton.jit
def flag_word(vrow, s0, mask, N: tl.constexpr):
    """The valid flags of slots ``s0 .. s0+N-1`` (``N <= 4``) as the low bytes of one int32, read as the aligned
    int32 words that hold them (`score.valid_as_words`): shifted by ``s0 % 4``, and the second word loaded only
    where a flag lies in it (it then lies inside the row)."""
    sh = s0 & 3
    a = s0 - sh
    w0 = tl.load((vrow + a).to(tl.pointer_type(tl.int32)), mask=mask, other=0)
    w1 = tl.load((vrow + a + 4).to(tl.pointer_type(tl.int32)), mask=mask & (sh + N > 4), other=0)
    return (((w1.to(tl.int64) << 32) | (w0.to(tl.int64) & 0xFFFFFFFF)) >> (8 * sh)).to(tl.int32)


@triton.jit
def empty_partials(GG: tl.constexpr):
    """Running max / sum of the candidate pages' scores, the first real page's scores and its index."""
    return (
        tl.full([GG], float("-inf"), tl.float32),
        tl.zeros([GG], dtype=tl.float32),
        tl.full([GG], float("-inf"), tl.float32),
        tl.full([], BIG_PAGE, tl.int32),
    )


@triton.jit
def page_lse(x, ok, scale):
    """LSE over the real tokens (``ok [BP, B]``) of unscaled logits ``x [GG, BP, B]``: ``[GG, BP]``."""
    x = tl.where(ok[None, :, :], x * (scale * LOG2E), float("-inf"))
    mx = tl.max(x, axis=2)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    sm = tl.sum(tl.exp2(x - mx_safe[:, :, None]), axis=2)
    return (mx_safe + tl.log2(sm)) / LOG2E


@triton.jit
def fold_scores(s, p, real, gi, out_row, P_out, last_page, run_m, run_l, first_s, first, G: tl.constexpr):
    """Store the scores ``s [GG, BP]`` of pages ``p`` (``-inf`` unless ``real``) and fold them into the
    program's partials: its first real page goes aside, the rest (the row's last page excluded) into a
    running LSE. Returns the new ``(run_m, run_l, first_s, first)``."""
    s = tl.where(real[None, :] & (gi < G)[:, None], s, float("-inf"))
    tl.store(out_row + gi[:, None] * P_out + p[None, :], s, mask=(gi < G)[:, None] & (p < P_out)[None, :])
    f_here = tl.min(tl.where(real, p, BIG_PAGE), axis=0)
    is_new = first == BIG_PAGE
    here_s = tl.max(tl.where((p == f_here)[None, :], s, float("-inf")), axis=1)
    first_s = tl.where(is_new, here_s, first_s)
    first = tl.where(is_new, f_here, first)
    keep = real & (p != first) & (p != last_page)
    sc = tl.where(keep[None, :], s, float("-inf"))
    new_m = tl.maximum(run_m, tl.max(sc, axis=1))
    safe = tl.where(new_m == float("-inf"), 0.0, new_m)
    run_l = run_l * tl.exp(run_m - safe) + tl.sum(tl.exp(sc - safe[:, None]), axis=1)
    return new_m, run_l, first_s, first


@triton.jit
def store_partials(part, gi, run_m, run_l, first_s, first, GG: tl.constexpr):
    tl.store(part + gi, run_m)
    tl.store(part + GG + gi, run_l)
    tl.store(part + 2 * GG + gi, first_s)
    tl.store(part + 3 * GG + gi, tl.zeros([GG], dtype=tl.float32) + first.to(tl.float32))
