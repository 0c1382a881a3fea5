"""Page scoring, variant ``"dot"`` (`_score_kernel`): three scoring rules picked at compile time
(``METHOD``), the products on the tensor cores.

* ``LOCKS``  the estimated page LSE read straight from the packed summaries: the packed basis codes
  are unpacked into ``8/bits`` interleaved sub-vectors and each is multiplied with the matching
  strided slice of the query, so no dequantized basis is stored; the per-token logits exist only in
  registers ([G, pages, B] per block), reduced per page or per token (``BY_TOKEN``);
* ``ORACLE`` the exact page LSE, reading every key of the page;
* ``QUEST``  ``sum_c max(q_c u_c, q_c l_c) = q+ . u + q- . l`` (two tensor-core products).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LOG2E, slot_ok, take_rows
from .score_parts import empty_partials, fold_scores, page_lse, program_row, store_partials

#: ``METHOD`` of `_score_kernel`.
LOCKS, ORACLE, QUEST = 0, 1, 2


@triton.jit
def _locks_proj(
    q_base,
    q_sh,
    bas_ptr,
    bsc_ptr,
    mu_ptr,
    msc_ptr,
    p,
    pmask,
    G: tl.constexpr,
    GG: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    BP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """``q.mu_j`` ``[GG, BP]`` and the basis projections ``V_j[:, i] . q`` ``[GG, BP, R]`` of pages ``p``.

    The centroids are read as ``[BP, D]`` rows and the basis as ``[BP*R, D*BITS/8]`` packed rows
    (contiguous, vector loads); three tensor-core products per block: the centroid, and the basis
    in ``8/BITS`` interleaved sub-vectors against the matching strided query slices.
    """
    PER: tl.constexpr = 8 // BITS  # codes per byte (1 for int8)
    DP: tl.constexpr = D // PER  # bytes per basis row
    MASK: tl.constexpr = (1 << BITS) - 1
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    j = tl.arange(0, DP)
    i = tl.arange(0, R)
    grow = g[:, None] < G
    qdt = q_base.dtype.element_ty

    q = tl.load(q_base + g[:, None] * q_sh + c[None, :], mask=grow, other=0.0)
    mu = tl.load(mu_ptr + p[:, None] * D + c[None, :], mask=pmask[:, None], other=0)  # [BP, D] int8
    qmu = tl.dot(q, tl.trans(mu.to(qdt)), input_precision=DOT_PREC)
    msc = tl.load(msc_ptr + p, mask=pmask, other=0.0).to(tl.float32)
    qmu = take_rows(qmu, GG, GP) * msc[None, :]

    rows = tl.reshape(p[:, None] * R + i[None, :], [BP * R])
    rmask = tl.reshape(pmask[:, None] & (i < R)[None, :], [BP * R])
    raw = tl.load(bas_ptr + rows[:, None] * DP + j[None, :], mask=rmask[:, None], other=0)
    raw = raw.to(tl.int32) & 0xFF  # [BP*R, DP] packed bytes
    proj = tl.zeros([GP, BP * R], dtype=tl.float32)
    for s in tl.static_range(PER):
        f = (raw >> (BITS * s)) & MASK
        code = f - ((f >> (BITS - 1)) << BITS)  # sign extension
        qs = tl.load(q_base + g[:, None] * q_sh + (j[None, :] * PER + s), mask=grow, other=0.0)
        proj += tl.dot(qs, tl.trans(code.to(qdt)), input_precision=DOT_PREC)
    bsc = tl.load(bsc_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    proj = tl.reshape(take_rows(proj, GG, GP) * bsc[None, :], [GG, BP, R])
    return qmu, proj


@triton.jit
def _locks_logits(qmu, proj, coef_ptr, csc_ptr, p, pmask, B: tl.constexpr, R: tl.constexpr, BP: tl.constexpr):
    """Unscaled logits ``q.mu + (V^T q).c`` of every token of the pages: ``[GG, BP, B]``.

    The rank-r contraction with the coefficients (read as ``[BP, B*R]`` rows) is an in-register sum
    over the last axis of ``[GG, BP, B, R]``.
    """
    t = tl.arange(0, B)
    cf = tl.load(coef_ptr + p[:, None] * (B * R) + tl.arange(0, B * R)[None, :], mask=pmask[:, None], other=0)
    cf = tl.reshape(cf.to(tl.float32), [BP, B, R])
    # (an fma, not a multiply: Triton 3.6 rewrites a broadcast-multiply-sum into tt.dot and fails in 4-D)
    x = tl.sum(tl.fma(proj[:, :, None, :], cf[None, :, :, :], 0.0), axis=3)  # [GG, BP, B]
    csc = tl.load(csc_ptr + p[:, None] * B + t[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
    return x * csc[None, :, :] + qmu[:, :, None]


@triton.jit
def _locks_lse_by_token(
    qmu, proj, coef_ptr, csc_ptr, vrow, rs, length, p, pmask, qk2, B: tl.constexpr, R: tl.constexpr
):
    """Page LSE ``[GG, BP]`` (natural log) walking the B tokens one at a time (two passes:
    max, then sum of exp); every tensor stays ``[GG, BP(, R)]``, one (head, page) per lane."""
    i = tl.arange(0, R)
    m = tl.full(qmu.shape, float("-inf"), tl.float32)
    for t in tl.static_range(B):
        c = tl.load(coef_ptr + p[:, None] * (B * R) + t * R + i[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        cs = tl.load(csc_ptr + p * B + t, mask=pmask, other=0.0).to(tl.float32)
        ok = slot_ok(vrow, rs + p * B + t, length) & pmask
        x = (tl.sum(tl.fma(proj, c[None, :, :], 0.0), axis=2) * cs[None, :] + qmu) * qk2
        m = tl.maximum(m, tl.where(ok[None, :], x, float("-inf")))
    safe = tl.where(m == float("-inf"), 0.0, m)
    l = tl.zeros(qmu.shape, dtype=tl.float32)
    for t in tl.static_range(B):
        c = tl.load(coef_ptr + p[:, None] * (B * R) + t * R + i[None, :], mask=pmask[:, None], other=0).to(tl.float32)
        cs = tl.load(csc_ptr + p * B + t, mask=pmask, other=0.0).to(tl.float32)
        ok = slot_ok(vrow, rs + p * B + t, length) & pmask
        x = (tl.sum(tl.fma(proj, c[None, :, :], 0.0), axis=2) * cs[None, :] + qmu) * qk2
        l += tl.where(ok[None, :], tl.exp2(x - safe), 0.0)
    return tl.where(m == float("-inf"), float("-inf"), (safe + tl.log2(l)) / LOG2E)


@triton.jit
def _oracle_logits(
    q_base,
    q_sh,
    k_ptr,
    k_st,
    slot,
    ok,
    G: tl.constexpr,
    GG: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Unscaled logits ``q.k`` of every key of the pages (``slot``/``ok`` ``[BP, B]``): ``[G, BP, B]``."""
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    q = tl.load(q_base + g[:, None] * q_sh + c[None, :], mask=g[:, None] < G, other=0.0)
    s = tl.reshape(slot, [BP * B])
    m = tl.reshape(ok, [BP * B])
    kt = tl.load(k_ptr + s[None, :] * k_st + c[:, None], mask=m[None, :], other=0.0)  # [D, BP*B]
    logits = take_rows(tl.dot(q, kt, input_precision=DOT_PREC), GG, GP)
    return tl.reshape(logits, [GG, BP, B])


@triton.jit
def _quest_scores(
    q_base,
    q_sh,
    up_ptr,
    lo_ptr,
    p,
    pmask,
    G: tl.constexpr,
    GG: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """Quest's bound ``q+ . u + q- . l`` per page ``[G, BP]`` (u, l: per-dimension key max/min)."""
    g = tl.arange(0, GP)
    c = tl.arange(0, D)
    q = tl.load(q_base + g[:, None] * q_sh + c[None, :], mask=g[:, None] < G, other=0.0)
    up = tl.load(up_ptr + p[None, :] * D + c[:, None], mask=pmask[None, :], other=0.0)  # [D, BP]
    lo = tl.load(lo_ptr + p[None, :] * D + c[:, None], mask=pmask[None, :], other=0.0)
    zero = tl.zeros_like(q)
    s = tl.dot(tl.where(q > 0, q, zero), up, input_precision=DOT_PREC)  # where keeps the dtype
    s += tl.dot(tl.where(q < 0, q, zero), lo, input_precision=DOT_PREC)
    return take_rows(s, GG, GP)


@triton.jit
def _score_kernel(
    q_ptr,
    q_sb,
    q_sh,
    x0,
    x0_sb,
    x0_sh,
    x1,
    x1_sb,
    x1_sh,
    x2,
    x2_sb,
    x2_sh,
    x3,
    x3_sb,
    x3_sh,
    x4,
    x4_sb,
    x4_sh,
    x5,
    x5_sb,
    x5_sh,
    valid_ptr,
    valid_sb,
    row_start_ptr,
    n_complete_ptr,
    len_ptr,
    out_ptr,
    P_out,
    part_ptr,
    n_blk,
    H,
    scale,
    METHOD: tl.constexpr,
    G: tl.constexpr,
    GG: tl.constexpr,
    GP: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    BP: tl.constexpr,
    NSUB: tl.constexpr,
    BY_TOKEN: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    blk, row, bb, hh, rs, n_done, length, last_page = program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
    q_base = q_ptr + bb * q_sb + hh * G * q_sh
    vrow = valid_ptr + bb * valid_sb
    t = tl.arange(0, B)
    gi = tl.arange(0, GG)  # query heads of the group, padded to a power of two
    out_row = out_ptr + row * G * P_out

    # partials over this program's pages, its first real page kept aside
    run_m, run_l, first_s, first = empty_partials(GG)
    for it in range(NSUB):
        p = (blk * NSUB + it) * BP + tl.arange(0, BP)
        pmask = p < n_done
        slot = rs + p[:, None] * B + t[None, :]
        ok = slot_ok(vrow, slot, length) & pmask[:, None]  # [BP, B]
        real = tl.max(ok.to(tl.int32), axis=1) > 0  # complete pages holding a real token
        if METHOD == 2:
            s = _quest_scores(
                q_base,
                q_sh,
                x0 + (bb * x0_sb + hh * x0_sh),
                x1 + (bb * x1_sb + hh * x1_sh),
                p,
                pmask,
                G,
                GG,
                GP,
                D,
                DOT_PREC,
            )
        else:
            if METHOD == 0:
                qmu, proj = _locks_proj(
                    q_base,
                    q_sh,
                    x0 + (bb * x0_sb + hh * x0_sh),
                    x1 + (bb * x1_sb + hh * x1_sh),
                    x4 + (bb * x4_sb + hh * x4_sh),
                    x5 + (bb * x5_sb + hh * x5_sh),
                    p,
                    pmask,
                    G,
                    GG,
                    GP,
                    D,
                    R,
                    BITS,
                    BP,
                    DOT_PREC,
                )
                if BY_TOKEN:
                    s = _locks_lse_by_token(
                        qmu,
                        proj,
                        x2 + (bb * x2_sb + hh * x2_sh),
                        x3 + (bb * x3_sb + hh * x3_sh),
                        vrow,
                        rs,
                        length,
                        p,
                        pmask,
                        scale * LOG2E,
                        B,
                        R,
                    )
                else:
                    x = _locks_logits(
                        qmu, proj, x2 + (bb * x2_sb + hh * x2_sh), x3 + (bb * x3_sb + hh * x3_sh), p, pmask, B, R, BP
                    )
                    s = page_lse(x, ok, scale)
            else:
                x = _oracle_logits(
                    q_base, q_sh, x0 + (bb * x0_sb + hh * x0_sh), x1_sh, slot, ok, G, GG, GP, D, B, BP, DOT_PREC
                )
                s = page_lse(x, ok, scale)
        run_m, run_l, first_s, first = fold_scores(
            s, p, real, gi, out_row, P_out, last_page, run_m, run_l, first_s, first, G
        )
    store_partials(part_ptr + (row * n_blk + blk) * 4 * GG, gi, run_m, run_l, first_s, first, GG)
