"""Locks page scoring, variant ``"mma"`` (`_locks_mma_kernel`): the query-basis and query-centroid
products on the tensor cores, the per-token epilogue on the CUDA cores.

Projections. The basis rows of ``BP`` pages (``BP*R`` rows) and their centroids are the ``M`` side of
two products with the group's queries (``N = GG`` heads, zero past ``G``). Codes reach bfloat16
without int->float conversions: one LOP3 puts two fields of a word (bits ``EB*k`` and ``EB*k + 16``)
into the mantissas of a bf16 pair ``128 + field`` and one packed subtraction removes the offset
(`_word_codes`). int8 codes (the centroid, an int8 basis) are split into their two nibbles, the
high one signed, and the query entry of a high nibble is scaled by 16, so every code is a 4-bit
(or 2-bit) field. A word's codes come out in the order of that trick, not the natural one; the
query is loaded in the same order (`_perm_query`), a permutation of the contraction axis. The
products run over chunks of ``KCW`` words per row so that a chunk of unpacked codes stays small
(registers and the shared-memory tile the tensor-core operand is staged in).

Epilogue. Each thread owns whole (page, head-group) pairs: the ``GG`` heads of a page are split
into ``HS`` groups of ``GG/HS`` heads, one per thread, so a thread holds ``R x GG/HS`` projections and
walks the page's ``B`` tokens with no cross-lane reduction (`score_fma._locks_fma_lse`, shared with
variant ``"fma"``). ``HS > 1`` keeps the registers of large groups (GLM-4: 16 heads) in check.
Scores and partials follow the contract of `score_dot._score_kernel`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LOG2E
from .score_fma import _locks_fma_lse
from .score_parts import empty_partials, fold_scores, prefetch_block, program_row, row_summaries, store_partials

#: Bits of a pair of 16-bit floats ``(BASE, BASE)`` whose mantissa takes a field in its low bits:
#: bf16 128 (7 mantissa bits), fp16 1024 (10).
PAIR_BASE = {"bf16": 0x43004300, "fp16": 0x64006400}


@triton.jit
def _pair(w, K: tl.constexpr, EB: tl.constexpr, SIGNED: tl.constexpr, magic, DT: tl.constexpr):
    """Fields ``K`` and ``K + 16/EB`` (``EB`` bits each) of the words ``w`` as the two halves ``(lo, hi)`` of
    a 16-bit float pair ``BASE + field`` (bf16 128, fp16 1024; see `PAIR_BASE`).

    ``magic`` is the `PAIR_BASE` of ``DT`` as a run-time value (a register operand: the mask and the OR
    become one LOP3; an instruction takes a single 32-bit immediate). A signed field gets its sign
    bit flipped on the way (two's complement -> offset binary), so it reads ``BASE + 2**(EB-1) + code``.
    """
    FM: tl.constexpr = ((1 << EB) - 1) * 0x10001
    SB: tl.constexpr = (1 << (EB - 1)) * 0x10001 if SIGNED else 0
    x = ((w >> (EB * K)) & FM) ^ (magic | SB)
    return x.to(tl.int16).to(DT, bitcast=True), (x >> 16).to(tl.int16).to(DT, bitcast=True)


@triton.jit
def _stack4(a, b, c, d):
    """``[..., 4]`` with ``a, b, c, d`` in that order along the new last axis."""
    return tl.join(tl.join(a, c), tl.join(b, d))


@triton.jit
def _word_codes(w, BITS: tl.constexpr, magic, F16: tl.constexpr):
    """The codes of int32 words ``w [M, KW]`` as 16-bit floats ``[M, KW * 32/EB]`` (fp16 if ``F16``, else
    bf16), ``EB = min(BITS, 4)``.

    Position ``e = 2k + h`` of a word holds its field ``t = k + h*NP`` (``NP = 16/EB`` pairs per word);
    int8 codes are read as nibble fields (``t`` even: low nibble, unsigned; odd: high nibble,
    signed), see `_perm_query` for the matching query entries. The offsets are removed at the end,
    in float32 rounded back (exact: small integers), which the compiler narrows to one packed 16-bit
    subtraction per pair; Triton's interpreter has no 16-bit float arithmetic.
    """
    EB: tl.constexpr = 4 if BITS >= 4 else BITS
    NF: tl.constexpr = 32 // EB
    M: tl.constexpr = w.shape[0]
    KW: tl.constexpr = w.shape[1]
    S8: tl.constexpr = BITS == 8
    DT: tl.constexpr = tl.float16 if F16 else tl.bfloat16
    BASE: tl.constexpr = 1024.0 if F16 else 128.0
    if EB == 4:
        a0, a1 = _pair(w, 0, 4, not S8, magic, DT)
        b0, b1 = _pair(w, 1, 4, True, magic, DT)
        c0, c1 = _pair(w, 2, 4, not S8, magic, DT)
        d0, d1 = _pair(w, 3, 4, True, magic, DT)
        x = tl.join(_stack4(a0, b0, c0, d0), _stack4(a1, b1, c1, d1))  # [M, KW, 4 pairs, 2 halves]
    else:
        a0, a1 = _pair(w, 0, 2, True, magic, DT)
        b0, b1 = _pair(w, 1, 2, True, magic, DT)
        c0, c1 = _pair(w, 2, 2, True, magic, DT)
        d0, d1 = _pair(w, 3, 2, True, magic, DT)
        e0, e1 = _pair(w, 4, 2, True, magic, DT)
        f0, f1 = _pair(w, 5, 2, True, magic, DT)
        g0, g1 = _pair(w, 6, 2, True, magic, DT)
        h0, h1 = _pair(w, 7, 2, True, magic, DT)
        lo = tl.join(_stack4(a0, c0, e0, g0), _stack4(b0, d0, f0, h0))
        hi = tl.join(_stack4(a1, c1, e1, g1), _stack4(b1, d1, f1, h1))
        x = tl.join(tl.reshape(lo, [M, KW, 8]), tl.reshape(hi, [M, KW, 8]))  # [M, KW, 8 pairs, 2 halves]
    e = tl.arange(0, KW * NF) % NF
    signed = (not S8) | ((e // 2) % 2 == 1)
    off = tl.where(signed, BASE + (1 << (EB - 1)), BASE)
    return (tl.reshape(x, [M, KW * NF]).to(tl.float32) - off[None, :]).to(DT)


@triton.jit
def _perm_query(q_base, q_sh, w0, KW: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, BITS: tl.constexpr):
    """The query entries ``[KW * 32/EB, GG]`` matching `_word_codes` of the words ``w0 .. w0+KW-1`` of a row
    (zero heads past ``G``), in the query's dtype (exact: a power-of-two factor)."""
    EB: tl.constexpr = 4 if BITS >= 4 else BITS
    NF: tl.constexpr = 32 // EB  # fields per word
    NP: tl.constexpr = NF // 2
    pos = tl.arange(0, KW * NF)
    e = pos % NF
    t = e // 2 + (e % 2) * NP  # field of the word
    gi = tl.arange(0, GG)
    if BITS == 8:
        dim = (w0 + pos // NF) * 4 + t // 2
        wt = tl.where(t % 2 == 1, 16.0, 1.0)
    else:
        dim = (w0 + pos // NF) * NF + t
        wt = tl.full([KW * NF], 1.0, tl.float32)
    q = tl.load(q_base + gi[None, :] * q_sh + dim[:, None], mask=(gi < G)[None, :], other=0.0)
    return (q.to(tl.float32) * wt[:, None]).to(q_base.dtype.element_ty)


@triton.jit
def _mma_project(
    ptr,
    q_base,
    q_sh,
    rows,
    rmask,
    RW: tl.constexpr,
    KCW: tl.constexpr,
    G: tl.constexpr,
    GG: tl.constexpr,
    BITS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    magic,
    PREFETCH: tl.constexpr,
):
    """``sum_d code[row, d] * q[g, d]`` ``[M, GG]`` for the packed rows ``rows [M]`` of ``RW`` int32 words
    each, ``KCW`` words at a time.

    ``PREFETCH``: the next chunk's words are loaded before this one's product (into registers, not
    through shared memory as Triton's pipelining does), so that its load overlaps the product: the
    kernel runs few warps per SM (its registers) and a third of their stall cycles are waits on global
    loads (ncu, H200, GLM-4-9B shape at 512K). Measured there: level at r4i4 (with the register cap of
    `score_tiles.mma_registers`), 4% faster at r8i4; ``num_stages > 1`` (shared-memory pipelining) was slower.
    """
    M: tl.constexpr = rows.shape[0]
    NCH: tl.constexpr = RW // KCW
    acc = tl.zeros([M, GG], dtype=tl.float32)
    kw = tl.arange(0, KCW)
    F16: tl.constexpr = q_base.dtype.element_ty == tl.float16
    at = ptr + rows[:, None] * RW + kw[None, :]
    if PREFETCH:
        w_next = tl.load(at, mask=rmask[:, None], other=0)
    for ch in tl.range(NCH):
        if PREFETCH:
            w = w_next
            w_next = tl.load(at + (ch + 1) * KCW, mask=rmask[:, None] & (ch + 1 < NCH), other=0)
        else:
            w = tl.load(at + ch * KCW, mask=rmask[:, None], other=0)
        qs = _perm_query(q_base, q_sh, ch * KCW, KCW, G, GG, BITS)
        acc = tl.dot(_word_codes(w, BITS, magic, F16).to(qs.dtype), qs, acc, input_precision=DOT_PREC)
    return acc


@triton.jit
def _locks_mma_kernel(
    q_ptr,
    q_sb,
    q_sh,
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
    nsub,
    magic,
    bmagic,
    G: tl.constexpr,
    GG: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    BP: tl.constexpr,
    HS: tl.constexpr,
    KCW: tl.constexpr,
    KCWM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    PREFETCH: tl.constexpr,
    PF_LINES: tl.constexpr,
    VALID_WORDS: tl.constexpr,
):
    """Locks scores, variant ``"mma"``: the contract of `score_dot._score_kernel` (METHOD = LOCKS).

    ``bas``/``mu``/``cf`` are the basis, centroid and coefficient codes as int32 words (page strides
    ``R*D*BITS/32``, ``D/4``, ``B*R/4`` words); ``nsub`` blocks of ``BP`` pages per program (run time);
    ``magic`` is ``0x4B000000`` (float32 code trick of the epilogue), ``bmagic`` the `PAIR_BASE` of the
    query's 16-bit type (bf16 for a float32 query).
    ``HS`` threads share a page, each with ``GG/HS`` of its heads; ``KCW`` words per basis row per product,
    ``KCWM`` per centroid row (a centroid product has ``BP`` rows to the basis's ``BP*R``: wider chunks, fewer
    dependent steps);
    ``PREFETCH``: each product loads its next chunk ahead (`_mma_project`); ``PF_LINES > 0``: each block
    first asks the L2 for all it reads (`score_parts.prefetch_block`, up to ``PF_LINES`` lines a range);
    ``VALID_WORDS``: the valid flags are read as aligned int32 words (`score_fma._tokens_ok_words`).
    """
    blk, row, bb, hh, rs, n_done, length, last_page = program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
    vrow = valid_ptr + bb * valid_sb
    q_base = q_ptr + bb * q_sb + hh * G * q_sh
    bas, bsc, cf, csc, mu, msc = row_summaries(
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
    )
    qk2 = scale * LOG2E
    gi = tl.arange(0, GG)
    i = tl.arange(0, R)
    out_row = out_ptr + row * G * P_out
    GT: tl.constexpr = GG // HS  # heads per thread in the epilogue
    BV: tl.constexpr = BP * HS  # (page, head group) pairs per block

    run_m, run_l, first_s, first = empty_partials(GG)
    for it in range(nsub):
        p0 = (blk * nsub + it) * BP
        if PF_LINES > 0:
            prefetch_block(bas, bsc, cf, csc, mu, msc, vrow, rs, p0, n_done, D, B, R, BITS, BP, PF_LINES)
        p = p0 + tl.arange(0, BP)
        pmask = p < n_done
        rows = tl.reshape(p[:, None] * R + i[None, :], [BP * R])
        rmask = tl.reshape(pmask[:, None] & (i < R)[None, :], [BP * R])
        acc = _mma_project(bas, q_base, q_sh, rows, rmask, D * BITS // 32, KCW, G, GG, BITS, DOT_PREC, bmagic, PREFETCH)
        accm = _mma_project(mu, q_base, q_sh, p, pmask, D // 4, KCWM, G, GG, 8, DOT_PREC, bmagic, PREFETCH)
        bs = tl.load(bsc + rows, mask=rmask, other=0.0).to(tl.float32) * qk2
        ms = tl.load(msc + p, mask=pmask, other=0.0).to(tl.float32) * qk2
        # (page, head group) pairs: [BV, R, GT] and [BV, GT]
        proj = tl.reshape(tl.permute(tl.reshape(acc * bs[:, None], [BP, R, HS, GT]), (0, 2, 1, 3)), [BV, R, GT])
        qmu = tl.reshape(accm * ms[:, None], [BV, GT])
        pv = (blk * nsub + it) * BP + tl.arange(0, BV) // HS
        lse2, real = _locks_fma_lse(proj, qmu, cf, csc, vrow, rs, pv, pv < n_done, magic, B, R, VALID_WORDS)
        s = tl.reshape(lse2, [BP, GG]) / LOG2E
        real = tl.max(tl.reshape(real.to(tl.int32), [BP, HS]), axis=1) > 0
        run_m, run_l, first_s, first = fold_scores(
            tl.trans(s), p, real, gi, out_row, P_out, last_page, run_m, run_l, first_s, first, G
        )
    store_partials(part_ptr + (row * n_blk + blk) * 4 * GG, gi, run_m, run_l, first_s, first, GG)
