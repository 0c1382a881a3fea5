"""Page scoring (kernel 1): one pass over the page summaries (or keys), per KV head and GQA group.

`_score_kernel`, three scoring rules picked at compile time (``METHOD``), and `_locks_fma_kernel`,
a second Locks kernel (variant ``"fma"``) with the same outputs:

* ``LOCKS``  the estimated page LSE ``scale*q.mu_j + LSE_i(scale*(V_j^T q).c_i)`` read straight from
  the packed summaries (int2/4/8 basis with one bf16 scale per basis row, int8 coefficients with a
  bf16 scale per token row, int8 centroid with one bf16 scale). Variant ``"dot"``: the query-basis
  products run on the tensor cores: the packed codes are unpacked into ``8/bits`` interleaved
  sub-vectors and each is multiplied with the matching strided slice of the query, so no dequantized
  basis is stored. The per-token logits exist only in registers ([G, pages, B] per block).
  Variant ``"fma"`` (`_locks_fma_kernel`): one thread per page, CUDA-core FMAs, no layout conversion
  in the page loop (see that kernel).
* ``ORACLE`` the exact page LSE, reading every key of the page.
* ``QUEST``  ``sum_c max(q_c u_c, q_c l_c) = q+ . u + q- . l`` (two tensor-core products).

Output: scores ``[b*h, G, P]`` (float32, ``-inf`` for pages that are not complete or hold no real
token) and, for the group softmax of the selection step, per-program partials ``[b*h, n_blk, 4, G]``:
the running max and sum of ``exp`` over the candidate pages of the program except its first real
page, that page's scores, and its index. The selection kernel folds them into the per-head LSE over
the candidates (sink excluded) without a second pass over the scores.

Pages are numbered per row from ``row_start[b]`` (the row's first real slot): page ``p`` holds
slots ``row_start[b] + p*B ... + B-1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import BIG_PAGE, LOG2E, as_length, dot_precision, next_pow2, slot_ok, take_rows

LOCKS, ORACLE, QUEST = 0, 1, 2
_METHODS = {"locks": LOCKS, "oracle": ORACLE, "quest": QUEST}
VARIANTS = ("dot", "fma")  # Locks scoring variants (`score_pages`' ``variant``)
# "fma" loops over basis chunks instead of unrolling them from this rank on (compile time; see
# `_locks_fma_proj`). Ranks below keep the unrolled form measured on the H200.
ROLL_CHUNKS_FROM_RANK: tl.constexpr = tl.constexpr(8)


@triton.jit
def _locks_proj(q_base, q_sh, bas_ptr, bsc_ptr, mu_ptr, msc_ptr, p, pmask,
                G: tl.constexpr, GG: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                BITS: tl.constexpr, BP: tl.constexpr, DOT_PREC: tl.constexpr):
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
def _locks_lse_by_token(qmu, proj, coef_ptr, csc_ptr, vrow, rs, length, p, pmask, qk2,
                        B: tl.constexpr, R: tl.constexpr):
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
def _oracle_logits(q_base, q_sh, k_ptr, k_st, slot, ok, G: tl.constexpr, GG: tl.constexpr, GP: tl.constexpr,
                   D: tl.constexpr, B: tl.constexpr, BP: tl.constexpr, DOT_PREC: tl.constexpr):
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
def _quest_scores(q_base, q_sh, up_ptr, lo_ptr, p, pmask, G: tl.constexpr, GG: tl.constexpr, GP: tl.constexpr,
                  D: tl.constexpr, DOT_PREC: tl.constexpr):
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
def _page_lse(x, ok, scale):
    """LSE over the real tokens (``ok [BP, B]``) of unscaled logits ``x [GG, BP, B]``: ``[GG, BP]``."""
    x = tl.where(ok[None, :, :], x * (scale * LOG2E), float("-inf"))
    mx = tl.max(x, axis=2)
    mx_safe = tl.where(mx == float("-inf"), 0.0, mx)
    sm = tl.sum(tl.exp2(x - mx_safe[:, :, None]), axis=2)
    return (mx_safe + tl.log2(sm)) / LOG2E


@triton.jit
def _fold_scores(s, p, real, gi, out_row, P_out, last_page, run_m, run_l, first_s, first, G: tl.constexpr):
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
def _store_partials(part, gi, run_m, run_l, first_s, first, GG: tl.constexpr):
    tl.store(part + gi, run_m)
    tl.store(part + GG + gi, run_l)
    tl.store(part + 2 * GG + gi, first_s)
    tl.store(part + 3 * GG + gi, tl.zeros([GG], dtype=tl.float32) + first.to(tl.float32))


# ---- variant "fma": one thread per page, CUDA-core FMAs -------------------------------------------
# Every per-page tensor is [BP, ...] with the page on dim 0 spread over the threads and the rest held
# by the thread (the 16-byte vector loads fix that layout; joins, splits and reshapes of in-thread
# dims keep it), so reductions over a page never leave the thread and the page loop has no layout
# conversion. Codes become float32 without int->float conversions (16/clk/SM on sm_90): a field is
# OR-ed into the mantissa of 2**23 and one FMA removes the offset.


@triton.jit
def _flip(w, BITS: tl.constexpr):
    """int32 words with the sign bit of every ``BITS``-bit field flipped (two's complement -> offset binary)."""
    SIGNS: tl.constexpr = (0xFFFFFFFF // ((1 << BITS) - 1)) * (1 << (BITS - 1)) - (1 << 32)  # as int32
    return w ^ SIGNS


@triton.jit
def _field(w, K: tl.constexpr, BITS: tl.constexpr, magic):
    """Signed value of field ``K`` (``K=0``: lowest bits) of `_flip`-ed words ``w``, as exact float32.

    ``magic`` is ``0x4B000000`` (the bits of 2**23) passed at run time: a register operand lets ptxas
    fuse the mask and the OR into one LOP3 (an instruction takes a single 32-bit immediate).
    """
    PRE: tl.constexpr = 16 if BITS * K + BITS > 23 else 0  # the field must sit below bit 23
    SH: tl.constexpr = BITS * K - PRE
    f = ((w >> PRE) & (((1 << BITS) - 1) << SH)) | magic  # 2**23 + (code + 2**(BITS-1)) * 2**SH
    return tl.fma(f.to(tl.float32, bitcast=True), 1.0 / (1 << SH), -(8388608.0 / (1 << SH) + (1 << (BITS - 1))))


@triton.jit
def _split4(x):
    """The 4 columns of ``x [BP, 4]`` held by the thread (no data movement)."""
    a, b = tl.split(tl.reshape(x, [x.shape[0], 2, 2]))
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _rows(ptr, off, mask, STEP: tl.constexpr, N: tl.constexpr, BITS: tl.constexpr):
    """16 bytes (4 int32 words at ``off [BP, 4]``) of each of ``N`` rows ``STEP`` words apart, `_flip`-ed:
    a 4-tuple (one per word) of ``[BP, N]`` tensors (row ``n`` in column ``n``)."""
    BP: tl.constexpr = off.shape[0]
    if N == 1:
        w = _split4(_flip(tl.load(ptr + off, mask=mask, other=0), BITS))
        y = (tl.reshape(w[0], [BP, 1]), tl.reshape(w[1], [BP, 1]), tl.reshape(w[2], [BP, 1]), tl.reshape(w[3], [BP, 1]))
    else:
        # even rows, odd rows: the join's new last dim is the row's lowest bit, so the order is natural
        a = _rows(ptr, off, mask, 2 * STEP, N // 2, BITS)
        b = _rows(ptr, off + STEP, mask, 2 * STEP, N // 2, BITS)
        y = (tl.reshape(tl.join(a[0], b[0]), [BP, N]), tl.reshape(tl.join(a[1], b[1]), [BP, N]),
             tl.reshape(tl.join(a[2], b[2]), [BP, N]), tl.reshape(tl.join(a[3], b[3]), [BP, N]))
    return y


@triton.jit
def _col(x, K: tl.constexpr, N: tl.constexpr):
    """Column ``K`` of ``x [BP, M, N]`` (``N`` a power of two held by the thread): ``[BP, M]``."""
    if N == 1:
        y = tl.reshape(x, [x.shape[0], x.shape[1]])
    else:
        lo, hi = tl.split(tl.reshape(x, [x.shape[0], x.shape[1], N // 2, 2]))
        if K % 2 == 1:
            y = _col(hi, K // 2, N // 2)
        else:
            y = _col(lo, K // 2, N // 2)
    return y


@triton.jit
def _tokens_ok(vrow, s0, length, STEP: tl.constexpr, N: tl.constexpr):
    """Real slots ``s0 + n*STEP`` (``n < N``) of every page: ``[BP, N]``. One byte load per token: the
    slots' alignment is unknown, and an unvectorized ``[BP, N]`` load would be spread over N threads."""
    BP: tl.constexpr = s0.shape[0]
    if N == 1:
        y = tl.reshape(slot_ok(vrow, s0, length).to(tl.int8), [BP, 1])
    else:
        y = tl.reshape(tl.join(_tokens_ok(vrow, s0, length, 2 * STEP, N // 2),
                               _tokens_ok(vrow, s0 + STEP, length, 2 * STEP, N // 2)), [BP, N])
    return y


@triton.jit
def _stage_query(q_base, q_sh, scr, G: tl.constexpr, GG: tl.constexpr, D: tl.constexpr):
    """The group's queries as float32 ``[D, GG]`` (zero heads past ``G``) in the program's scratch, the
    heads of a dimension in the order that `_qvec` reads back as ``0..GG-1`` (no conversion in the loop)."""
    g = tl.arange(0, GG)
    c = tl.arange(0, D)
    q = tl.load(q_base + g[:, None] * q_sh + c[None, :], mask=(g < G)[:, None], other=0.0).to(tl.float32)
    tl.store(scr + c[None, :] * GG + _qslot(g, GG)[:, None], q)
    tl.debug_barrier()  # the page loop reads what other threads of the program wrote


@triton.jit
def _qslot(g, N: tl.constexpr):
    """Scratch slot of head ``g`` among ``N``: the inverse of `_qvec`'s interleaving joins."""
    if N <= 4:
        y = g
    else:
        y = (g % 2) * (N // 2) + _qslot(g // 2, N // 2)
    return y


@triton.jit
def _qvec(ptr, zero, N: tl.constexpr):
    """``N`` staged query values of one dimension in every thread: ``[BP, N]``. One load per page-row (the
    same address for all pages) keeps them in contiguous registers; above 4 values (16 bytes) the coalescer
    would spread them over threads, so halves are loaded apart and joined (interleaved, see `_stage_query`)."""
    if N <= 4:
        y = tl.load(ptr + zero[:, None] + tl.arange(0, N)[None, :])
    else:
        y = tl.reshape(tl.join(_qvec(ptr, zero, N // 2), _qvec(ptr + N // 2, zero, N // 2)), [zero.shape[0], N])
    return y


@triton.jit
def _mu_code(mus, JJ: tl.constexpr, K: tl.constexpr, W: tl.constexpr, magic):
    """Centroid code of dimension ``JJ*W + K`` of the chunk (``mus``: `_rows` of its ``W`` words): ``[BP]``."""
    IDX: tl.constexpr = JJ * (W // 4) + K // 4  # word of the chunk (4 int8 codes per word)
    return _field(tl.reshape(_col(tl.reshape(mus[IDX % 4], [mus[0].shape[0], 1, W // 4]), IDX // 4, W // 4),
                             [mus[0].shape[0]]), K % 4, 8, magic)


@triton.jit
def _locks_fma_chunk(acc, accm, scr, bas, mu, p, pmask, magic, ch, GG: tl.constexpr, D: tl.constexpr,
                     R: tl.constexpr, BITS: tl.constexpr):
    """`_locks_fma_proj`'s accumulators after chunk ``ch`` (``4W`` dimensions)."""
    BP: tl.constexpr = p.shape[0]
    W: tl.constexpr = 32 // BITS
    DW: tl.constexpr = D // W  # words per basis row
    j4 = tl.arange(0, 4)
    rows = _rows(bas, p[:, None] * (R * DW) + ch * 4 + j4[None, :], pmask[:, None], DW, R, BITS)
    mus = _rows(mu, p[:, None] * (D // 4) + ch * W + j4[None, :], pmask[:, None], 4, W // 4, 8)
    for jj in tl.static_range(4):
        for k in tl.static_range(W):
            qv = _qvec(scr + ((ch * 4 + jj) * W + k) * GG, p * 0, GG)  # q[:, d], d = (4ch + jj)W + k
            acc = tl.fma(tl.reshape(_field(rows[jj], k, BITS, magic), [BP, R, 1]), tl.reshape(qv, [BP, 1, GG]), acc)
            accm = tl.fma(tl.reshape(_mu_code(mus, jj, k, W, magic), [BP, 1]), qv, accm)
    return acc, accm


@triton.jit
def _locks_fma_proj(scr, bas, mu, p, pmask, magic, GG: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
                    BITS: tl.constexpr):
    """``(q.V_j[:, i] [BP, R, GG], q.mu_j [BP, GG])`` in code units (scales not applied).

    One 16-byte chunk of every basis row at a time (``W = 32/BITS`` codes a word, ``4W`` a chunk) and
    the centroid bytes of the same ``4W`` dimensions; each dimension's ``GG`` query values (one vector
    load from the scratch) feed ``R + 1`` FMAs per head.
    """
    BP: tl.constexpr = p.shape[0]
    DW: tl.constexpr = D // (32 // BITS)
    acc = tl.zeros([BP, R, GG], dtype=tl.float32)
    accm = tl.zeros([BP, GG], dtype=tl.float32)
    if R >= ROLL_CHUNKS_FROM_RANK:
        # A real loop over the chunks: unrolled, Triton's coalescing pass (quadratic in the kernel's
        # size) makes r = 8 compile in 42 s instead of 4 s (Triton 3.6, sm_90 AOT; docs/compile_time.md),
        # and it needs 148 instead of 119 registers. Same FMAs and loads.
        for ch in tl.range(DW // 4):
            acc, accm = _locks_fma_chunk(acc, accm, scr, bas, mu, p, pmask, magic, ch, GG, D, R, BITS)
    else:  # the unrolled form timed on the H200 (r = 4: 0.100 ms at 512K); compiles in ~22 s
        for ch in tl.static_range(DW // 4):
            acc, accm = _locks_fma_chunk(acc, accm, scr, bas, mu, p, pmask, magic, ch, GG, D, R, BITS)
    return acc, accm


@triton.jit
def _locks_fma_lse(proj, qmu, cf, csc, vrow, rs, length, p, pmask, magic, B: tl.constexpr, R: tl.constexpr):
    """Page LSE (base 2) of the logits ``qmu + csc_t * proj.c_t`` over the real tokens ``t``, and whether
    the page has one: ``([BP, GG], [BP])``. ``proj [BP, R, GG]``, ``qmu [BP, GG]`` are pre-scaled.

    The coefficients come 16 bytes (``16/R`` tokens) at a time; an online max/sum over those chunks.
    """
    BP: tl.constexpr = p.shape[0]
    GG: tl.constexpr = qmu.shape[1]
    TT: tl.constexpr = 16 // R  # tokens per 16-byte chunk of coefficients
    j4 = tl.arange(0, 4)
    tt = tl.arange(0, TT)
    m = tl.full([BP, GG], float("-inf"), tl.float32)
    l = tl.zeros([BP, GG], dtype=tl.float32)
    real = tl.zeros([BP], dtype=tl.int8)
    proj = tl.permute(proj, (0, 2, 1))  # [BP, GG, R]: rows on the last dim for _col
    for n in tl.static_range(B * R // 16):
        w = _flip(tl.load(cf + p[:, None] * (B * R // 4) + n * 4 + j4[None, :], mask=pmask[:, None], other=0), 8)
        # the 16 coefficient bytes in memory order (even/odd joins keep it): [BP, TT tokens, R]
        c = tl.reshape(tl.join(tl.join(_field(w, 0, 8, magic), _field(w, 2, 8, magic)),
                               tl.join(_field(w, 1, 8, magic), _field(w, 3, 8, magic))), [BP, TT, R])
        x = tl.zeros([BP, TT, GG], dtype=tl.float32)
        for i in tl.static_range(R):
            x = tl.fma(tl.reshape(_col(c, i, R), [BP, TT, 1]), tl.reshape(_col(proj, i, R), [BP, 1, GG]), x)
        cs = tl.load(csc + p[:, None] * B + n * TT + tt[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        x = tl.fma(x, tl.reshape(cs, [BP, TT, 1]), tl.reshape(qmu, [BP, 1, GG]))
        ok = _tokens_ok(vrow, rs + p * B + n * TT, length, 1, TT) & pmask[:, None].to(tl.int8)  # [BP, TT]
        real = real | tl.max(ok, axis=1)
        x = tl.where(tl.reshape(ok, [BP, TT, 1]) != 0, x, float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=1))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        l = l * tl.exp2(m - safe) + tl.sum(tl.exp2(x - tl.reshape(safe, [BP, 1, GG])), axis=1)
        m = new_m
    return m + tl.log2(l), real != 0


@triton.jit
def _program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B: tl.constexpr):
    """This program's page block and (row, KV head), the row's first slot, complete pages, the cache
    length and the row's most recent page (never a candidate)."""
    row = tl.program_id(1)
    bb = (row // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
    rs = tl.load(row_start_ptr + bb)
    length = tl.load(len_ptr)
    return (tl.program_id(0), row, bb, row % H, rs, tl.load(n_complete_ptr + bb), length,
            (length - 1 - rs) // B)


@triton.jit
def _empty_partials(GG: tl.constexpr):
    """Running max / sum of the candidate pages' scores, the first real page's scores and its index."""
    return (tl.full([GG], float("-inf"), tl.float32), tl.zeros([GG], dtype=tl.float32),
            tl.full([GG], float("-inf"), tl.float32), tl.full([], BIG_PAGE, tl.int32))


@triton.jit
def _locks_fma_kernel(q_ptr, q_sb, q_sh, bas, bas_sb, bas_sh, bsc, bsc_sb, bsc_sh, cf, cf_sb, cf_sh,
                      csc, csc_sb, csc_sh, mu, mu_sb, mu_sh, msc, msc_sb, msc_sh,
                      valid_ptr, valid_sb, row_start_ptr, n_complete_ptr, len_ptr,
                      out_ptr, P_out, part_ptr, n_blk, H, scale, scr_ptr, nsub, magic,
                      G: tl.constexpr, GG: tl.constexpr, D: tl.constexpr, B: tl.constexpr, R: tl.constexpr,
                      BITS: tl.constexpr, BP: tl.constexpr):
    """Locks scores, variant ``"fma"``: the contract of `_score_kernel` (METHOD = LOCKS).

    ``bas``/``mu``/``cf`` are the basis, centroid and coefficient codes viewed as int32 words (page
    strides ``R*D*BITS/32``, ``D/4``, ``B*R/4`` words); ``scr_ptr`` a float32 scratch of ``D*GG`` per program;
    ``nsub`` blocks of ``BP`` pages per program (a run-time value: no recompilation per grid); ``magic``
    is ``0x4B000000`` (see `_field`).
    """
    blk, row, bb, hh, rs, n_done, length, last_page = _program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
    vrow = valid_ptr + bb * valid_sb
    scr = scr_ptr + (row * n_blk + blk).to(tl.int64) * (D * GG)
    _stage_query(q_ptr + bb * q_sb + hh * G * q_sh, q_sh, scr, G, GG, D)
    bas += bb * bas_sb + hh * bas_sh
    bsc += bb * bsc_sb + hh * bsc_sh
    cf += bb * cf_sb + hh * cf_sh
    csc += bb * csc_sb + hh * csc_sh
    mu += bb * mu_sb + hh * mu_sh
    msc += bb * msc_sb + hh * msc_sh
    qk2 = scale * LOG2E
    gi = tl.arange(0, GG)
    out_row = out_ptr + row * G * P_out

    run_m, run_l, first_s, first = _empty_partials(GG)
    for it in range(nsub):
        p = (blk * nsub + it) * BP + tl.arange(0, BP)
        pmask = p < n_done
        acc, accm = _locks_fma_proj(scr, bas, mu, p, pmask, magic, GG, D, R, BITS)
        bs = tl.load(bsc + p[:, None] * R + tl.arange(0, R)[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        proj = acc * tl.reshape(bs * qk2, [BP, R, 1])
        qmu = accm * tl.reshape(tl.load(msc + p, mask=pmask, other=0.0).to(tl.float32) * qk2, [BP, 1])
        lse2, real = _locks_fma_lse(proj, qmu, cf, csc, vrow, rs, length, p, pmask, magic, B, R)
        run_m, run_l, first_s, first = _fold_scores(tl.trans(lse2 / LOG2E), p, real, gi, out_row, P_out,
                                                    last_page, run_m, run_l, first_s, first, G)
    _store_partials(part_ptr + (row * n_blk + blk) * 4 * GG, gi, run_m, run_l, first_s, first, GG)


@triton.jit
def _score_kernel(q_ptr, q_sb, q_sh,
                  x0, x0_sb, x0_sh, x1, x1_sb, x1_sh, x2, x2_sb, x2_sh,
                  x3, x3_sb, x3_sh, x4, x4_sb, x4_sh, x5, x5_sb, x5_sh,
                  valid_ptr, valid_sb, row_start_ptr, n_complete_ptr, len_ptr,
                  out_ptr, P_out, part_ptr, n_blk, H, scale,
                  METHOD: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, BP: tl.constexpr,
                  NSUB: tl.constexpr, BY_TOKEN: tl.constexpr, DOT_PREC: tl.constexpr):
    blk, row, bb, hh, rs, n_done, length, last_page = _program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
    q_base = q_ptr + bb * q_sb + hh * G * q_sh
    vrow = valid_ptr + bb * valid_sb
    t = tl.arange(0, B)
    gi = tl.arange(0, GG)  # query heads of the group, padded to a power of two
    out_row = out_ptr + row * G * P_out

    # partials over this program's pages, its first real page kept aside
    run_m, run_l, first_s, first = _empty_partials(GG)
    for it in range(NSUB):
        p = (blk * NSUB + it) * BP + tl.arange(0, BP)
        pmask = p < n_done
        slot = rs + p[:, None] * B + t[None, :]
        ok = slot_ok(vrow, slot, length) & pmask[:, None]  # [BP, B]
        real = tl.max(ok.to(tl.int32), axis=1) > 0  # complete pages holding a real token
        if METHOD == 2:
            s = _quest_scores(q_base, q_sh, x0 + (bb * x0_sb + hh * x0_sh), x1 + (bb * x1_sb + hh * x1_sh),
                              p, pmask, G, GG, GP, D, DOT_PREC)
        else:
            if METHOD == 0:
                qmu, proj = _locks_proj(q_base, q_sh, x0 + (bb * x0_sb + hh * x0_sh), x1 + (bb * x1_sb + hh * x1_sh),
                                        x4 + (bb * x4_sb + hh * x4_sh), x5 + (bb * x5_sb + hh * x5_sh),
                                        p, pmask, G, GG, GP, D, R, BITS, BP, DOT_PREC)
                if BY_TOKEN:
                    s = _locks_lse_by_token(qmu, proj, x2 + (bb * x2_sb + hh * x2_sh), x3 + (bb * x3_sb + hh * x3_sh),
                                            vrow, rs, length, p, pmask, scale * LOG2E, B, R)
                else:
                    x = _locks_logits(qmu, proj, x2 + (bb * x2_sb + hh * x2_sh), x3 + (bb * x3_sb + hh * x3_sh),
                                      p, pmask, B, R, BP)
                    s = _page_lse(x, ok, scale)
            else:
                x = _oracle_logits(q_base, q_sh, x0 + (bb * x0_sb + hh * x0_sh), x1_sh, slot, ok,
                                   G, GG, GP, D, B, BP, DOT_PREC)
                s = _page_lse(x, ok, scale)
        run_m, run_l, first_s, first = _fold_scores(s, p, real, gi, out_row, P_out, last_page,
                                                    run_m, run_l, first_s, first, G)
    _store_partials(part_ptr + (row * n_blk + blk) * 4 * GG, gi, run_m, run_l, first_s, first, GG)


def _as_u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _page_tensor(t: torch.Tensor) -> torch.Tensor:
    """A ``[b, h, P, ...]`` summary tensor whose page and inner dims are contiguous."""
    inner = 1
    for n in t.shape[3:]:
        inner *= n
    if t.stride(2) != inner or (t.dim() > 3 and not t[0, 0].is_contiguous()):
        t = t.contiguous()
    return t


def _words(t: torch.Tensor) -> torch.Tensor:
    """The inner bytes of a ``[b, h, P, ...]`` int8/uint8 summary tensor as int32 words ``[b, h, P, n/4]``."""
    t = _page_tensor(t)
    t = t.reshape(t.shape[0], t.shape[1], t.shape[2], -1)
    try:
        return t.view(torch.int32)
    except RuntimeError:  # batch/head strides or offset not a multiple of 4 bytes
        return t.contiguous().view(torch.int32)


def fma_supported(d: int, page_size: int, rank: int, basis_bits: int) -> bool:
    """Whether variant ``"fma"`` handles these summaries: whole 16-byte chunks of each basis row and of the
    coefficients, power-of-two rank, int2/4/8 basis."""
    return (basis_bits in (2, 4, 8) and d * basis_bits % 128 == 0 and rank & (rank - 1) == 0
            and page_size * rank % 16 == 0 and rank <= 16)


# Page-rows (batch x KV heads x pages) from which a group of 16+ heads scores faster per token.
BY_TOKEN_MIN_PAGE_ROWS = 1 << 16


def _dot_tiles(m: int, GG: int, B: int, R: int, page_rows: int, by_token, block_pages, sub_blocks, num_warps,
               num_stages):
    """Default epilogue and tiles of `_score_kernel` for whatever the caller left ``None``."""
    if by_token is None:
        # H200, GLM-4-9B shape (G = 16, 2 KV heads), r4i4, batch 1: the per-token epilogue with 32-page
        # blocks and 4 warps scores 512K in 0.112 ms against 0.147 ms per page (1M: 0.221 vs 0.287), but
        # has a ~0.08 ms floor, so it loses up to 256K (0.096 vs 0.075 ms; 16K: 0.083 vs 0.049).
        # For G = 4 it is 2x slower at 512K (0.435 vs 0.215 ms).
        by_token = m == LOCKS and GG >= 16 and page_rows >= BY_TOKEN_MIN_PAGE_ROWS
    if by_token:
        defaults = (32, 8, 4, 2)
    else:  # about 8K fp32 products of the [GG, BP, B, R] contraction per block; Oracle reads whole pages
        bp = {LOCKS: min(64, max(16, 8192 // (GG * B * R))), QUEST: 32, ORACLE: 8}[m]
        bp = bp if block_pages is None else block_pages
        defaults = (bp, 8 if m != ORACLE else 16, 4 if (m != LOCKS or GG * bp * B * R <= 8192) else 8, 2)
    given = (block_pages, sub_blocks, num_warps, num_stages)
    return (by_token, *[d if g is None else g for g, d in zip(given, defaults)])


def score_pages(method: str, query: torch.Tensor, *, slot_valid: torch.Tensor, row_start: torch.Tensor,
                n_complete: torch.Tensor, length: int | torch.Tensor, n_pages: int, scale: float, page_size: int,
                summary: dict[str, torch.Tensor] | None = None, keys: torch.Tensor | None = None,
                basis_bits: int = 4, out: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                block_pages: int | None = None, sub_blocks: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, by_token: bool | None = None, variant: str | None = None,
                maxnreg: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every page of every row and KV head for one decode query.

    ``query [b, Hq, 1, d]`` (or ``[b, Hq, d]``); ``slot_valid [b, cap]`` real slots; ``row_start [b]``
    and ``n_complete [b]`` int32 tensors (first slot of page 0, pages summarized); ``length`` slots
    written (an int, or the cache's ``int32 [1]`` device tensor); ``n_pages`` page-axis length ``P``.
    ``summary`` is the selector's tensors ``[b, h, P', ...]``
    (``"locks"``: basis/basis_scale/coef/coef_scale/mu/mu_scale; ``"quest"``: upper/lower);
    ``keys`` the key buffer ``[b, h, cap, d]`` for ``"oracle"``.

    ``variant`` (Locks only): ``"dot"`` (tensor-core projections; ``by_token`` picks its epilogue,
    by default per token for groups of 16+ heads over many pages, see `_dot_tiles`) or
    ``"fma"`` (one thread per page, CUDA-core FMAs; ``block_pages`` must be a multiple of
    ``32*num_warps``, the pages a thread scores per step being the quotient; see `fma_supported`);
    default (``None``): ``"fma"`` where it applies and the GQA group has at most 8 heads (H200, 512K,
    Llama shape G=4: 0.097 vs 0.213 ms), else ``"dot"`` (G=16 spills registers in ``"fma"``).
    Tiles (``block_pages``, ``sub_blocks``, ``num_warps``, ``num_stages``) default per method/variant;
    ``maxnreg`` caps the registers per thread (more programs per SM; ``"fma"`` only).

    Returns ``(scores [b*h, G, P] float32, partials [b*h, n_blk, 4, GG] float32)``, ``GG`` the
    group size rounded up to a power of two.
    """
    m = _METHODS[method]
    if variant is not None and variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    q = query.reshape(b, hq, d)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if m == ORACLE:
        h = keys.shape[1]
    else:
        h = next(iter(summary.values())).shape[1]
    G = hq // h
    GG = next_pow2(G)
    GP = max(16, GG)
    B = page_size
    R, bits = 1, 8
    if m == LOCKS:
        R = summary["basis"].shape[-2]
        bits = basis_bits
    if variant is None:
        variant = "fma" if m == LOCKS and G <= 8 and fma_supported(d, B, R, bits) else "dot"
    fma = m == LOCKS and variant == "fma"
    if fma and not fma_supported(d, B, R, bits):
        raise ValueError(f"variant 'fma' needs d*bits % 128 == 0, page_size*rank % 16 == 0 and a power-of-two "
                         f"rank <= 16 (d={d}, page_size={B}, rank={R}, bits={bits})")
    rows = b * h
    if fma:
        if num_warps is None:
            num_warps = 4
        if block_pages is None:
            block_pages = 32 * num_warps
        if block_pages % (32 * num_warps):
            raise ValueError("variant 'fma': block_pages must be a multiple of 32*num_warps")
        if sub_blocks is None:  # short programs: many waves, so no long partial last wave (H200: best)
            sub_blocks = 1
        if num_stages is None:
            num_stages = 1
    if m == LOCKS and not fma:
        names = ("basis", "basis_scale", "coef", "coef_scale", "mu", "mu_scale")
        xs = [_page_tensor(summary[n]) for n in names]
    elif m == QUEST:
        xs = [_page_tensor(summary["upper"]), _page_tensor(summary["lower"])]
    elif m == ORACLE:
        if keys.stride(-1) != 1:
            raise ValueError("keys must have a contiguous last dim")
        xs = [keys]
    if not fma:
        by_token, block_pages, sub_blocks, num_warps, num_stages = _dot_tiles(
            m, GG, B, R, rows * n_pages, by_token, block_pages, sub_blocks, num_warps, num_stages)
    span = block_pages * sub_blocks
    n_blk = max(1, triton.cdiv(n_pages, span))
    if out is None:
        out = torch.empty((rows, G, n_pages), dtype=torch.float32, device=q.device)
    if partials is None:
        partials = torch.empty((rows, n_blk, 4, GG), dtype=torch.float32, device=q.device)
    len_t = as_length(length, q.device)
    if fma:
        xs = [_words(summary["basis"]), _page_tensor(summary["basis_scale"]), _words(summary["coef"]),
              _page_tensor(summary["coef_scale"]), _words(summary["mu"]), _page_tensor(summary["mu_scale"])]
        scratch = torch.empty((rows * n_blk * d * GG,), dtype=torch.float32, device=q.device)
        _locks_fma_kernel[(n_blk, rows)](
            q, q.stride(0), q.stride(1), *[a for x in xs for a in (x, x.stride(0), x.stride(1))],
            _as_u8(slot_valid), slot_valid.stride(0), row_start, n_complete, len_t,
            out, n_pages, partials, n_blk, h, float(scale), scratch, sub_blocks, 0x4B000000,
            G=G, GG=GG, D=d, B=B, R=R, BITS=bits, BP=block_pages,
            num_warps=num_warps, num_stages=num_stages, **({} if maxnreg is None else {"maxnreg": maxnreg}),
        )
        return out, partials
    args = []
    for i in range(6):
        x = xs[i] if i < len(xs) else xs[0]
        if m == ORACLE and i == 1:  # token stride of the key buffer
            args += [x, 0, keys.stride(2)]
            continue
        args += [x, x.stride(0), x.stride(1)]
    _score_kernel[(n_blk, rows)](
        q, q.stride(0), q.stride(1), *args,
        _as_u8(slot_valid), slot_valid.stride(0), row_start, n_complete, len_t,
        out, n_pages, partials, n_blk, h, float(scale),
        METHOD=m, G=G, GG=GG, GP=GP, D=d, B=B, R=R, BITS=bits, BP=block_pages, NSUB=sub_blocks, BY_TOKEN=by_token,
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out, partials
