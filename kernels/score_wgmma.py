"""Locks page scoring, variant ``"wgmma"`` (`_locks_wgmma_kernel`, Triton's Gluon dialect; sm_90): the
products of the ``"mma"`` variant with the unpacked codes taken into the tensor-core instruction's
register operand where they are unpacked, and the query staged in shared memory once per program.

Why Gluon: `score_mma` unpacks each chunk of code words in Triton's row-per-thread layout, stores it
to shared memory and reads it back in the layout of the warpgroup product; ncu puts about a fifth of
that kernel's warp time on the round trip. Here every tensor has an explicit layout. A thread loads,
for each of its two rows of a 64-row tile (``16w + g`` and ``16w + g + 8``: warp ``w``, lane ``4g + c``),
the ``WPT`` consecutive words ``c*WPT ...`` of the row, and word ``c*WPT + ch`` becomes its part of the
register operand (``DotOperandLayout``, two 16-bit values a register) of contraction chunk ``ch``: a
word's eight 4-bit fields are its four pairs, one LOP3 each (`score_mma._pair`'s trick), at contraction
positions ``16s + 8h + 2c + lo`` for field ``2s + h + 4lo``. The query is staged in that permuted order.
The conversion into the operand layout is asserted trivial (no data movement) at compile time.

Products: one 64-page tile of basis row ``j`` (``j < R``) per accumulator, so a thread holds the same
pages' ``R`` projections and the centroid's in the accumulator layout and the epilogue (token logits, page
LSE, the partials of `score_parts`) needs no cross-lane data. int8 centroids are split into nibbles as in
`score_mma` (the high one signed, its query entry scaled by 16).

Measured (H100, GLM-4-9B shape, 512K): 2% faster than ``"mma"`` at r4i4 with 128 registers a thread, 6% at r8i4
with 168 (`score_tiles.WGMMA_REGISTERS`), slower without a cap (two programs an SM). The token epilogue, not the
products, is most of the instructions (docs/performance.md).
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

from .score_mma import _pair
from .score_parts import flag_word, program_row, row_summaries

#: The oldest Triton the kernel was compiled and checked with: Gluon's API changes between releases.
MIN_TRITON = (3, 6)
try:
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < MIN_TRITON:
        raise ImportError(f"Triton {triton.__version__} < {MIN_TRITON}")
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma
except (ImportError, ValueError):  # pragma: no cover - older Triton: the variant is unavailable (`wgmma_available`)
    gluon = None

BIG_PAGE = tl.constexpr(2**30)
LOG2E = tl.constexpr(1.4426950408889634)
#: Pages a program scores per step: one 64-row warpgroup tile.
BP = 64


def wgmma_available() -> bool:
    """Whether this Triton has the Gluon dialect the kernel is written in (Triton >= `MIN_TRITON`)."""
    return gluon is not None


if gluon is not None:

    @gluon.constexpr_function
    def _acc_layout(GG):
        """The warpgroup product's accumulator ``[64, GG]``: rows over the 4 warps, ``GG`` heads a row."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, GG, 16])

    @gluon.constexpr_function
    def _words_layout(WPT):
        """``[64, 4, WPT]`` words: thread (warp ``w``, lane ``4g + c``) holds rows ``16w + g`` and ``+ 8``, words
        ``c*WPT .. c*WPT + WPT - 1`` (dims 1 and 2)."""
        regs = [[0, 0, 1 << i] for i in range(int(math.log2(WPT)))] + [[8, 0, 0]]
        lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[16, 0, 0], [32, 0, 0]], [], [64, 4, WPT])

    @gluon.constexpr_function
    def _rows_layout(N):
        """``[64, N]`` of the accumulator's rows: a thread holds whole rows ``16w + g`` and ``+ 8`` (its lanes
        ``4g + c`` hold the same), so each row's ``N`` values come in vector loads."""
        regs = [[0, 1 << i] for i in range(int(math.log2(N)))] + [[8, 0]]
        lanes = [[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]]
        return gl.DistributedLinearLayout(regs, lanes, [[16, 0], [32, 0]], [], [64, N])

    @gluon.jit
    def _load_rows(ptr, p, n_done, STRIDE: gl.constexpr, N: gl.constexpr):
        """The first ``N`` of the ``STRIDE`` values of each of the 64 pages ``p`` at ``ptr`` (zero past ``n_done``),
        `_rows_layout`."""
        L: gl.constexpr = _rows_layout(N)
        pr = gl.convert_layout(p, gl.SliceLayout(1, L), assert_trivial=True)
        col = gl.arange(0, N, layout=gl.SliceLayout(0, L))
        return gl.load(
            ptr + gl.expand_dims(pr, 1) * STRIDE + gl.expand_dims(col, 0), mask=gl.expand_dims(pr < n_done, 1), other=0
        )

    @gluon.jit
    def _column(x, n: gl.constexpr, zero, ROWS: gl.constexpr):
        """Column ``n`` of ``x [64, N]`` (`_rows_layout`): a pick among the thread's registers (the masked
        sum folds; ``zero`` is the sum's identity: 0, or -0.0 for floats)."""
        col = gl.arange(0, x.shape[1], layout=gl.SliceLayout(0, _rows_layout(x.shape[1])))
        return gl.convert_layout(
            gl.sum(gl.where(gl.expand_dims(col, 0) == n, x, zero), axis=1), ROWS, assert_trivial=True
        )

    @gluon.constexpr_function
    def _query_layout(GG):
        """``[K, GG]`` query entries as they are gathered before being stored to shared memory."""
        return gl.BlockedLayout([1, max(1, GG // 4)], [32 // min(4, GG), min(4, GG)], [4, 1], [1, 0])

    @gluon.jit
    def _coef_at(cw, I: gl.constexpr, ROWS: gl.constexpr):
        """Signed coefficient byte ``I`` of each page's coefficient words ``cw [64, NCW]``, float32 ``[64]`` (ptxas makes
        it one byte-selecting int8 -> float conversion)."""
        w = _column(cw, I // 4, 0, ROWS)
        return ((((w >> (8 * (I % 4))) & 0xFF) ^ 0x80) - 0x80).to(gl.float32)

    @gluon.jit
    def _codes(w, S8: gl.constexpr, magic, DT: gl.constexpr, BASE: gl.constexpr, A_L: gl.constexpr):
        """The 32 codes of the words ``w [64, 4]`` (one a thread and row) as the register operand ``[64, 32]``
        of one contraction chunk: field ``2s + h + 4lo`` of lane ``c``'s word at position ``16s + 8h + 2c + lo``.
        ``S8``: int8 codes as nibbles (even fields unsigned low nibbles, odd ones signed high nibbles)."""
        a0, a1 = _pair(w, 0, 4, not S8, magic, DT)
        b0, b1 = _pair(w, 1, 4, True, magic, DT)
        c0, c1 = _pair(w, 2, 4, not S8, magic, DT)
        d0, d1 = _pair(w, 3, 4, True, magic, DT)
        ua: gl.constexpr = BASE + (0 if S8 else 8)
        ub: gl.constexpr = BASE + 8
        a0 = (a0.to(gl.float32) - ua).to(DT)
        a1 = (a1.to(gl.float32) - ua).to(DT)
        c0 = (c0.to(gl.float32) - ua).to(DT)
        c1 = (c1.to(gl.float32) - ua).to(DT)
        b0 = (b0.to(gl.float32) - ub).to(DT)
        b1 = (b1.to(gl.float32) - ub).to(DT)
        d0 = (d0.to(gl.float32) - ub).to(DT)
        d1 = (d1.to(gl.float32) - ub).to(DT)
        # fields K = 2s + h: [64, c, lo, h, s]
        x = gl.join(gl.join(gl.join(a0, a1), gl.join(b0, b1)), gl.join(gl.join(c0, c1), gl.join(d0, d1)))
        x = gl.reshape(gl.permute(x, (0, 4, 3, 1, 2)), [64, 32])
        return gl.convert_layout(x, A_L, assert_trivial=True)

    @gluon.jit
    def _project(
        ptr,
        RW: gl.constexpr,
        rows,
        rmask,
        q_smem,
        acc,
        S8: gl.constexpr,
        magic,
        DT: gl.constexpr,
        BASE: gl.constexpr,
        A_L: gl.constexpr,
    ):
        """``acc + codes(rows) @ query``: the ``RW`` packed words of each of the 64 ``rows`` against the staged
        query ``q_smem [RW*8, GG]``."""
        WPT: gl.constexpr = RW // 4
        W_L: gl.constexpr = _words_layout(WPT)
        c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, W_L)))
        k = gl.arange(0, WPT, layout=gl.SliceLayout(0, gl.SliceLayout(1, W_L)))
        c3 = gl.expand_dims(gl.expand_dims(c, 0), 2)
        k3 = gl.expand_dims(gl.expand_dims(k, 0), 1)
        rm3 = gl.expand_dims(gl.expand_dims(rmask, 1), 2)
        w = gl.load(
            ptr + gl.expand_dims(gl.expand_dims(rows, 1), 2) * RW + c3 * WPT + k3, mask=rm3 & (k3 < WPT), other=0
        )
        for ch in gl.static_range(WPT):
            wc = gl.sum(gl.where(k3 == ch, w, 0), axis=2)
            acc = warpgroup_mma(_codes(wc, S8, magic, DT, BASE, A_L), q_smem.slice(32 * ch, 32), acc)
        return acc

    @gluon.jit
    def _stage_query(q_base, q_sh, n_heads, GG: gl.constexpr, WPT: gl.constexpr, S8: gl.constexpr, DT: gl.constexpr):
        """``GG`` heads' query ``[WPT*32, GG]`` in the contraction order of `_codes` (zero past ``n_heads``), in shared
        memory for the products: row ``32ch + 16s + 8h + 2c + lo`` reads field ``2s + h + 4lo`` of word
        ``c*WPT + ch`` (4-bit: dim ``8*word + field``; int8 nibbles: dim ``4*word + field/2``, times 16 for an
        odd field)."""
        Q_L: gl.constexpr = _query_layout(GG)
        k = gl.arange(0, WPT * 32, layout=gl.SliceLayout(1, Q_L))
        gi = gl.arange(0, GG, layout=gl.SliceLayout(0, Q_L))
        field = 2 * ((k // 16) % 2) + (k // 8) % 2 + 4 * (k % 2)
        word = ((k // 2) % 4) * WPT + k // 32
        if S8:
            dim = word * 4 + field // 2
            wt = gl.where(field % 2 == 1, 16.0, 1.0)
        else:
            dim = word * 8 + field
            wt = gl.full([WPT * 32], 1.0, gl.float32, layout=gl.SliceLayout(1, Q_L))
        g2 = gl.expand_dims(gi, 0)
        q = gl.load(q_base + g2 * q_sh + gl.expand_dims(dim, 1), mask=g2 < n_heads, other=0.0)
        q = (q.to(gl.float32) * gl.expand_dims(wt, 1)).to(DT)
        S_L: gl.constexpr = gl.NVMMASharedLayout.get_default_for([32, GG], DT)
        return gl.allocate_shared_memory(DT, [WPT * 32, GG], S_L, q)

    @gluon.jit
    def _locks_wgmma_kernel(
        q_ptr, q_sb, q_sh,
        bas, bas_sb, bas_sh,
        bsc, bsc_sb, bsc_sh,
        cf, cf_sb, cf_sh,
        csc, csc_sb, csc_sh,
        mu, mu_sb, mu_sh,
        msc, msc_sb, msc_sh,
        valid_ptr, valid_sb,
        row_start_ptr, n_complete_ptr, len_ptr,
        out_ptr, P_out, part_ptr, n_blk, H, scale, nsub, magic,
        G: gl.constexpr, GG: gl.constexpr, HS: gl.constexpr, D: gl.constexpr, B: gl.constexpr, R: gl.constexpr,
        F16: gl.constexpr,
        VALID_WORDS: gl.constexpr,
    ):  # fmt: skip
        """Locks scores, variant ``"wgmma"``: the contract of `score_dot._score_kernel` (METHOD = LOCKS) for
        4-bit bases, int8 centroids and coefficients, 16-bit queries; 64-page blocks, ``nsub`` per program.
        ``magic`` is the `score_mma.PAIR_BASE` of the query's type (`score_mma._pair`). ``VALID_WORDS``: the valid
        flags are read as aligned int32 words (`score.valid_as_words`), four tokens a load and no bounds check (a
        complete page lies inside the written slots, `score_parts.program_row`); else one byte a token."""
        GP: gl.constexpr = GG // HS  # heads of this program
        ACC: gl.constexpr = _acc_layout(GP)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=ACC, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, ACC)
        COLS: gl.constexpr = gl.SliceLayout(0, ACC)
        DT: gl.constexpr = gl.float16 if F16 else gl.bfloat16
        BASE: gl.constexpr = 1024.0 if F16 else 128.0
        RW: gl.constexpr = D // 8  # words of a 4-bit basis row
        RWM: gl.constexpr = D // 4  # words of an int8 centroid
        NCW: gl.constexpr = B * R // 4  # coefficient words of a page

        # the row and summary pointers as the Triton kernels take them (Gluon calls their scalar helpers)
        blk, row, bb, hh, rs, n_done, length, last_page = program_row(row_start_ptr, n_complete_ptr, len_ptr, H, B)
        vrow = valid_ptr + bb * valid_sb
        g0 = gl.program_id(2) * GP
        q_base = q_ptr + bb * q_sb + (hh * G + g0) * q_sh
        bas, bsc, cf, csc, mu, msc = row_summaries(
            bb, hh, bas, bas_sb, bas_sh, bsc, bsc_sb, bsc_sh, cf, cf_sb, cf_sh, csc, csc_sb, csc_sh, mu, mu_sb, mu_sh,
            msc, msc_sb, msc_sh,
        )  # fmt: skip

        qb = _stage_query(q_base, q_sh, G - g0, GP, RW // 4, False, DT)
        qm = _stage_query(q_base, q_sh, G - g0, GP, RWM // 4, True, DT)
        fence_async_shared()
        qk2 = scale * LOG2E
        gi = g0 + gl.arange(0, GP, layout=COLS)
        out_row = out_ptr + row * G * P_out
        W_ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _words_layout(RW // 4)))
        WM_ROWS: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, _words_layout(RWM // 4)))

        run_m = gl.full([GP], float("-inf"), gl.float32, layout=COLS)
        run_l = gl.zeros([GP], gl.float32, layout=COLS)
        first_s = gl.full([GP], float("-inf"), gl.float32, layout=COLS)
        first = gl.to_tensor(BIG_PAGE)
        for it in range(nsub):
            p0 = (blk * nsub + it) * 64
            p = p0 + gl.arange(0, 64, layout=ROWS)
            pmask = p < n_done
            pw = p0 + gl.arange(0, 64, layout=W_ROWS)
            pwm = p0 + gl.arange(0, 64, layout=WM_ROWS)
            accm = _project(
                mu, RWM, pwm, pwm < n_done, qm, gl.zeros([64, GP], gl.float32, layout=ACC), True, magic, DT, BASE, A_L
            )
            qmu = accm * gl.expand_dims(gl.load(msc + p, mask=pmask, other=0.0).to(gl.float32) * qk2, 1)
            m = gl.full([64, GP], float("-inf"), gl.float32, layout=ACC)
            l = gl.zeros([64, GP], gl.float32, layout=ACC)
            real = gl.zeros([64], gl.int1, layout=ROWS)
            # projections of basis rows j, kept per j; then each token's logits
            proj = ()
            for j in gl.static_range(R):
                acc = _project(
                    bas,
                    RW,
                    pw * R + j,
                    pw < n_done,
                    qb,
                    gl.zeros([64, GP], gl.float32, layout=ACC),
                    False,
                    magic,
                    DT,
                    BASE,
                    A_L,
                )
                bs = gl.load(bsc + p * R + j, mask=pmask, other=0.0).to(gl.float32) * qk2
                proj = proj + (acc * gl.expand_dims(bs, 1),)  # type: ignore[assignment]
            TT: gl.constexpr = 4  # tokens per step of the online LSE
            for t0 in gl.static_range(0, B, TT):
                cw = _load_rows(cf + t0 * R // 4, p, n_done, NCW, TT * R // 4)
                cs_all = _load_rows(csc + t0, p, n_done, B, TT).to(gl.float32)
                xs = ()
                mx = gl.full([64, GP], float("-inf"), gl.float32, layout=ACC)
                if VALID_WORDS:
                    # the TT flags of each page in one register: the two aligned words that hold them, shifted
                    # by the row's misalignment (one load where the row start is aligned)
                    flags = flag_word(vrow, rs + p * B + t0, pmask, TT)
                for tt in gl.static_range(TT):
                    x = gl.zeros([64, GP], gl.float32, layout=ACC)
                    for j in gl.static_range(R):
                        x = gl.fma(gl.expand_dims(_coef_at(cw, tt * R + j, ROWS), 1), proj[j], x)
                    x = gl.fma(x, gl.expand_dims(_column(cs_all, tt, -0.0, ROWS), 1), qmu)
                    if VALID_WORDS:
                        ok = pmask & (((flags >> (8 * tt)) & 0xFF) != 0)
                    else:
                        slot = rs + p * B + (t0 + tt)
                        inside = pmask & (slot >= 0) & (slot < length)
                        ok = inside & (gl.load(vrow + slot, mask=inside, other=0) != 0)
                    real = real | ok
                    x = gl.where(gl.expand_dims(ok, 1), x, float("-inf"))
                    mx = gl.maximum(mx, x)
                    xs = xs + (x,)  # type: ignore[assignment]
                new_m = gl.maximum(m, mx)
                safe = gl.where(new_m == float("-inf"), 0.0, new_m)
                l = l * gl.exp2(m - safe)
                for tt in gl.static_range(TT):
                    l = l + gl.exp2(xs[tt] - safe)
                m = new_m
            s = (m + gl.log2(l)) / LOG2E
            # fold_scores of `score_parts`, in the accumulator layout: s is [pages, heads]
            s = gl.where(gl.expand_dims(real, 1) & gl.expand_dims(gi < G, 0), s, float("-inf"))
            gl.store(
                out_row + gl.expand_dims(gi, 0) * P_out + gl.expand_dims(p, 1),
                s,
                mask=gl.expand_dims(gi < G, 0) & gl.expand_dims(p < P_out, 1),
            )
            f_here = gl.min(gl.where(real, p, BIG_PAGE), axis=0)
            is_new = first == BIG_PAGE
            here_s = gl.max(gl.where(gl.expand_dims(p == f_here, 1), s, float("-inf")), axis=0)
            first_s = gl.where(is_new, here_s, first_s)
            first = gl.where(is_new, f_here, first)
            keep = real & (p != first) & (p != last_page)
            sc = gl.where(gl.expand_dims(keep, 1), s, float("-inf"))
            new_rm = gl.maximum(run_m, gl.max(sc, axis=0))
            safe_r = gl.where(new_rm == float("-inf"), 0.0, new_rm)
            run_l = run_l * gl.exp(run_m - safe_r) + gl.sum(gl.exp(sc - gl.expand_dims(safe_r, 0)), axis=0)
            run_m = new_rm
        part = part_ptr + (row * n_blk + blk) * 4 * GG
        gl.store(part + gi, run_m)
        gl.store(part + GG + gi, run_l)
        gl.store(part + 2 * GG + gi, first_s)
        gl.store(part + 3 * GG + gi, gl.zeros([GP], gl.float32, layout=COLS) + first.to(gl.float32))
else:  # pragma: no cover - without Gluon `score_pages` refuses the variant before it would launch
    _locks_wgmma_kernel = None
