"""Locks page scoring, variant ``"fma"`` (`_locks_fma_kernel`): one thread per page, CUDA-core FMAs.

Every per-page tensor is [BP, ...] with the page on dim 0 spread over the threads and the rest held
by the thread (the 16-byte vector loads fix that layout; joins, splits and reshapes of in-thread
dims keep it), so reductions over a page never leave the thread and the page loop has no layout
conversion. Codes become float32 without int->float conversions (16/clk/SM on sm_90): a field is
OR-ed into the mantissa of 2**23 and one FMA removes the offset.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import LOG2E
from .score_parts import (
    empty_partials,
    flag_word,
    fold_scores,
    prefetch_block,
    program_row,
    row_summaries,
    store_partials,
)


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
        y = (
            tl.reshape(tl.join(a[0], b[0]), [BP, N]),
            tl.reshape(tl.join(a[1], b[1]), [BP, N]),
            tl.reshape(tl.join(a[2], b[2]), [BP, N]),
            tl.reshape(tl.join(a[3], b[3]), [BP, N]),
        )
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
def _tokens_ok(vrow, s0, mask, STEP: tl.constexpr, N: tl.constexpr):
    """Real slots ``s0 + n*STEP`` (``n < N``) of the complete pages ``mask``: ``[BP, N]`` int8. One byte load
    per token: the slots' alignment is unknown, and an unvectorized ``[BP, N]`` load would be spread over N
    threads. No bounds check: a complete page lies inside the written slots (`score_parts.program_row`)."""
    BP: tl.constexpr = s0.shape[0]
    if N == 1:
        y = tl.reshape((tl.load(vrow + s0, mask=mask, other=0) != 0).to(tl.int8), [BP, 1])
    else:
        y = tl.reshape(
            tl.join(_tokens_ok(vrow, s0, mask, 2 * STEP, N // 2), _tokens_ok(vrow, s0 + STEP, mask, 2 * STEP, N // 2)),
            [BP, N],
        )
    return y


@triton.jit
def _word_flags(word, SHIFT: tl.constexpr, STEP: tl.constexpr, N: tl.constexpr):
    """Flags ``n < N`` of the int32 ``word [BP]`` (byte ``SHIFT/8 + n*STEP``) as ``[BP, N]`` int8 0/1."""
    BP: tl.constexpr = word.shape[0]
    if N == 1:
        y = tl.reshape((((word >> SHIFT) & 0xFF) != 0).to(tl.int8), [BP, 1])
    else:
        y = tl.reshape(
            tl.join(_word_flags(word, SHIFT, 2 * STEP, N // 2), _word_flags(word, SHIFT + 8 * STEP, 2 * STEP, N // 2)),
            [BP, N],
        )
    return y


@triton.jit
def _tokens_ok_words(vrow, s0, mask, N: tl.constexpr):
    """`_tokens_ok` (``STEP`` 1) read as aligned int32 words (`score.valid_as_words`): the four flags from slot
    ``s0`` in one register, from the two aligned words that hold them shifted by ``s0 % 4``; the second word is
    loaded only where a flag lies in it (it then lies inside the row)."""
    BP: tl.constexpr = s0.shape[0]
    if N <= 4:
        y = _word_flags(flag_word(vrow, s0, mask, N), 0, 1, N)
    else:  # the first half, then the second, in slot order
        lo = _tokens_ok_words(vrow, s0, mask, N // 2)
        hi = _tokens_ok_words(vrow, s0 + N // 2, mask, N // 2)
        y = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [BP, N])
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
    return _field(
        tl.reshape(_col(tl.reshape(mus[IDX % 4], [mus[0].shape[0], 1, W // 4]), IDX // 4, W // 4), [mus[0].shape[0]]),
        K % 4,
        8,
        magic,
    )


@triton.jit
def _chunk_words(bas, mu, p, pmask, ch, D: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr):
    """The words of chunk ``ch`` (``4W`` dimensions): 16 bytes of each basis row and the centroid bytes of the
    same dimensions, as `_rows` tuples ``(rows, mus)`` (zero where ``pmask`` is off)."""
    W: tl.constexpr = 32 // BITS
    DW: tl.constexpr = D // W  # words per basis row
    j4 = tl.arange(0, 4)
    rows = _rows(bas, p[:, None] * (R * DW) + ch * 4 + j4[None, :], pmask[:, None], DW, R, BITS)
    mus = _rows(mu, p[:, None] * (D // 4) + ch * W + j4[None, :], pmask[:, None], 4, W // 4, 8)
    return rows, mus


@triton.jit
def _locks_fma_chunk(acc, accm, scr, words, p, magic, ch, GG: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr):
    """`_locks_fma_proj`'s accumulators after chunk ``ch``, whose `_chunk_words` are ``words``."""
    BP: tl.constexpr = p.shape[0]
    W: tl.constexpr = 32 // BITS
    rows, mus = words
    for jj in tl.static_range(4):
        for k in tl.static_range(W):
            qv = _qvec(scr + ((ch * 4 + jj) * W + k) * GG, p * 0, GG)  # q[:, d], d = (4ch + jj)W + k
            acc = tl.fma(tl.reshape(_field(rows[jj], k, BITS, magic), [BP, R, 1]), tl.reshape(qv, [BP, 1, GG]), acc)
            accm = tl.fma(tl.reshape(_mu_code(mus, jj, k, W, magic), [BP, 1]), qv, accm)
    return acc, accm


@triton.jit
def _locks_fma_proj(
    scr,
    bas,
    mu,
    p,
    pmask,
    magic,
    GG: tl.constexpr,
    D: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """``(q.V_j[:, i] [BP, R, GG], q.mu_j [BP, GG])`` in code units (scales not applied).

    One 16-byte chunk of every basis row at a time (``W = 32/BITS`` codes a word, ``4W`` a chunk) and
    the centroid bytes of the same ``4W`` dimensions; each dimension's ``GG`` query values (one vector
    load from the scratch) feed ``R + 1`` FMAs per head. ``PREFETCH``: each chunk's words are loaded before
    the previous chunk's FMAs (into registers), so that their load overlaps those FMAs.
    """
    BP: tl.constexpr = p.shape[0]
    NCH: tl.constexpr = D // (32 // BITS) // 4
    acc = tl.zeros([BP, R, GG], dtype=tl.float32)
    accm = tl.zeros([BP, GG], dtype=tl.float32)
    if PREFETCH:
        words_next = _chunk_words(bas, mu, p, pmask, 0, D, R, BITS)
    # A real loop over the chunks, not an unrolled one: unrolled, Triton's coalescing pass (quadratic in the
    # kernel's size) makes r = 4 compile in 22 s instead of 3 s and r = 8 in 42 s instead of 4 s (Triton 3.6,
    # sm_90), and the rolled form is also the faster one on the H200 (r4i4, Llama-3.1-8B shape at 512K:
    # 0.090 ms of scoring against 0.101 unrolled; docs/compile_time.md).
    for ch in tl.range(NCH):
        if PREFETCH:
            words = words_next
            words_next = _chunk_words(bas, mu, p, pmask & (ch + 1 < NCH), ch + 1, D, R, BITS)
        else:
            words = _chunk_words(bas, mu, p, pmask, ch, D, R, BITS)
        acc, accm = _locks_fma_chunk(acc, accm, scr, words, p, magic, ch, GG, R, BITS)
    return acc, accm


@triton.jit
def _locks_fma_lse(
    proj, qmu, cf, csc, vrow, rs, p, pmask, magic, B: tl.constexpr, R: tl.constexpr, VALID_WORDS: tl.constexpr
):
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
        c = tl.reshape(
            tl.join(
                tl.join(_field(w, 0, 8, magic), _field(w, 2, 8, magic)),
                tl.join(_field(w, 1, 8, magic), _field(w, 3, 8, magic)),
            ),
            [BP, TT, R],
        )
        x = tl.zeros([BP, TT, GG], dtype=tl.float32)
        for i in tl.static_range(R):
            x = tl.fma(tl.reshape(_col(c, i, R), [BP, TT, 1]), tl.reshape(_col(proj, i, R), [BP, 1, GG]), x)
        cs = tl.load(csc + p[:, None] * B + n * TT + tt[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        x = tl.fma(x, tl.reshape(cs, [BP, TT, 1]), tl.reshape(qmu, [BP, 1, GG]))
        if VALID_WORDS:
            ok = _tokens_ok_words(vrow, rs + p * B + n * TT, pmask, TT)  # [BP, TT]
        else:
            ok = _tokens_ok(vrow, rs + p * B + n * TT, pmask, 1, TT)
        real = real | tl.max(ok, axis=1)
        x = tl.where(tl.reshape(ok, [BP, TT, 1]) != 0, x, float("-inf"))
        new_m = tl.maximum(m, tl.max(x, axis=1))
        safe = tl.where(new_m == float("-inf"), 0.0, new_m)
        l = l * tl.exp2(m - safe) + tl.sum(tl.exp2(x - tl.reshape(safe, [BP, 1, GG])), axis=1)
        m = new_m
    return m + tl.log2(l), real != 0


@triton.jit
def _locks_fma_kernel(
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
    scr_ptr,
    nsub,
    magic,
    G: tl.constexpr,
    GG: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    BITS: tl.constexpr,
    BP: tl.constexpr,
    PF_LINES: tl.constexpr,
    PREFETCH: tl.constexpr,
    VALID_WORDS: tl.constexpr,
):
    """Locks scores, variant ``"fma"``: the contract of `_score_kernel` (METHOD = LOCKS).

    ``bas``/``mu``/``cf`` are the basis, centroid and coefficient codes viewed as int32 words (page
    strides ``R*D*BITS/32``, ``D/4``, ``B*R/4`` words); ``scr_ptr`` a float32 scratch of ``D*GG`` per program;
    ``nsub`` blocks of ``BP`` pages per program (a run-time value: no recompilation per grid); ``magic``
    is ``0x4B000000`` (see `_field`); ``PF_LINES > 0``: each block first asks the L2 for all it reads
    (`score_parts.prefetch_block`, up to ``PF_LINES`` lines a range); ``PREFETCH``: each chunk of codes is
    loaded ahead (`_locks_fma_proj`); ``VALID_WORDS``: the valid flags are read as aligned int32 words
    (`_tokens_ok_words`), else a byte a token (`_tokens_ok`).
    """
    blk, row, bb, hh, rs, n_done, length, last_page = program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
    vrow = valid_ptr + bb * valid_sb
    scr = scr_ptr + (row * n_blk + blk).to(tl.int64) * (D * GG)
    _stage_query(q_ptr + bb * q_sb + hh * G * q_sh, q_sh, scr, G, GG, D)
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
    out_row = out_ptr + row * G * P_out

    run_m, run_l, first_s, first = empty_partials(GG)
    for it in range(nsub):
        p0 = (blk * nsub + it) * BP
        if PF_LINES > 0:
            prefetch_block(bas, bsc, cf, csc, mu, msc, vrow, rs, p0, n_done, D, B, R, BITS, BP, PF_LINES)
        p = p0 + tl.arange(0, BP)
        pmask = p < n_done
        acc, accm = _locks_fma_proj(scr, bas, mu, p, pmask, magic, GG, D, R, BITS, PREFETCH)
        bs = tl.load(bsc + p[:, None] * R + tl.arange(0, R)[None, :], mask=pmask[:, None], other=0.0).to(tl.float32)
        proj = acc * tl.reshape(bs * qk2, [BP, R, 1])
        qmu = accm * tl.reshape(tl.load(msc + p, mask=pmask, other=0.0).to(tl.float32) * qk2, [BP, 1])
        lse2, real = _locks_fma_lse(proj, qmu, cf, csc, vrow, rs, p, pmask, magic, B, R, VALID_WORDS)
        run_m, run_l, first_s, first = fold_scores(
            tl.trans(lse2 / LOG2E), p, real, gi, out_row, P_out, last_page, run_m, run_l, first_s, first, G
        )
    store_partials(part_ptr + (row * n_blk + blk) * 4 * GG, gi, run_m, run_l, first_s, first, GG)
