"""Page scoring (kernel 1): one pass over the page summaries (or keys), per KV head and GQA group.

One kernel, three scoring rules picked at compile time (``METHOD``):

* ``LOCKS``  the estimated page LSE ``scale*q.mu_j + LSE_i(scale*(V_j^T q).c_i)`` read straight from
  the packed summaries (int2/4/8 basis with one bf16 scale per basis row, int8 coefficients with a
  bf16 scale per token row, int8 centroid with one bf16 scale). The query-basis products run on the
  tensor cores: the packed codes are unpacked into ``8/bits`` interleaved sub-vectors and each is
  multiplied with the matching strided slice of the query, so no dequantized basis is stored.
  The per-token logits exist only in registers ([G, pages, B] per block).
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

from ._common import BIG_PAGE, LOG2E, dot_precision, next_pow2, slot_ok, take_rows

LOCKS, ORACLE, QUEST = 0, 1, 2
_METHODS = {"locks": LOCKS, "oracle": ORACLE, "quest": QUEST}


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
def _score_kernel(q_ptr, q_sb, q_sh,
                  x0, x0_sb, x0_sh, x1, x1_sb, x1_sh, x2, x2_sb, x2_sh,
                  x3, x3_sb, x3_sh, x4, x4_sb, x4_sh, x5, x5_sb, x5_sh,
                  valid_ptr, valid_sb, row_start_ptr, n_complete_ptr, length,
                  out_ptr, P_out, part_ptr, n_blk, H, scale,
                  METHOD: tl.constexpr, G: tl.constexpr, GG: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
                  B: tl.constexpr, R: tl.constexpr, BITS: tl.constexpr, BP: tl.constexpr,
                  NSUB: tl.constexpr, BY_TOKEN: tl.constexpr, DOT_PREC: tl.constexpr):
    blk = tl.program_id(0)
    row = tl.program_id(1)
    bb = (row // H).to(tl.int64)  # 64-bit offsets: a batch of long caches passes 2**31 elements
    hh = row % H
    rs = tl.load(row_start_ptr + bb)
    n_done = tl.load(n_complete_ptr + bb)
    last_page = (length - 1 - rs) // B  # the row's most recent page (never a candidate)
    q_base = q_ptr + bb * q_sb + hh * G * q_sh
    vrow = valid_ptr + bb * valid_sb
    t = tl.arange(0, B)
    gi = tl.arange(0, GG)  # query heads of the group, padded to a power of two
    out_row = out_ptr + row * G * P_out

    # partials over this program's pages, its first real page kept aside
    run_m = tl.full([GG], float("-inf"), tl.float32)
    run_l = tl.zeros([GG], dtype=tl.float32)
    first_s = tl.full([GG], float("-inf"), tl.float32)
    first = tl.full([], BIG_PAGE, tl.int32)
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
        s = tl.where(real[None, :] & (gi < G)[:, None], s, float("-inf"))
        tl.store(out_row + gi[:, None] * P_out + p[None, :], s, mask=(gi < G)[:, None] & (p < P_out)[None, :])

        # partials: the program's first real page goes aside, the rest into a running LSE
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
        run_m = new_m

    part = part_ptr + (row * n_blk + blk) * 4 * GG
    tl.store(part + gi, run_m)
    tl.store(part + GG + gi, run_l)
    tl.store(part + 2 * GG + gi, first_s)
    tl.store(part + 3 * GG + gi, tl.zeros([GG], dtype=tl.float32) + first.to(tl.float32))


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


def score_pages(method: str, query: torch.Tensor, *, slot_valid: torch.Tensor, row_start: torch.Tensor,
                n_complete: torch.Tensor, length: int, n_pages: int, scale: float, page_size: int,
                summary: dict[str, torch.Tensor] | None = None, keys: torch.Tensor | None = None,
                basis_bits: int = 4, out: torch.Tensor | None = None, partials: torch.Tensor | None = None,
                block_pages: int | None = None, sub_blocks: int | None = None, num_warps: int | None = None,
                num_stages: int | None = None, by_token: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every page of every row and KV head for one decode query.

    ``query [b, Hq, 1, d]`` (or ``[b, Hq, d]``); ``slot_valid [b, cap]`` real slots; ``row_start [b]``
    and ``n_complete [b]`` int32 tensors (first slot of page 0, pages summarized); ``length`` slots
    written; ``n_pages`` page-axis length ``P``. ``summary`` is the selector's tensors ``[b, h, P', ...]``
    (``"locks"``: basis/basis_scale/coef/coef_scale/mu/mu_scale; ``"quest"``: upper/lower);
    ``keys`` the key buffer ``[b, h, cap, d]`` for ``"oracle"``.

    Returns ``(scores [b*h, G, P] float32, partials [b*h, n_blk, 4, GG] float32)``, ``GG`` the
    group size rounded up to a power of two.
    """
    m = _METHODS[method]
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
        names = ("basis", "basis_scale", "coef", "coef_scale", "mu", "mu_scale")
        xs = [_page_tensor(summary[n]) for n in names]
    elif m == QUEST:
        xs = [_page_tensor(summary["upper"]), _page_tensor(summary["lower"])]
    else:
        if keys.stride(-1) != 1:
            raise ValueError("keys must have a contiguous last dim")
        xs = [keys]
    # default tiles: about 8K fp32 logits per block in registers; Oracle reads whole pages
    if block_pages is None:  # Locks: about 8K products of the [GG, BP, B, R] contraction per block
        block_pages = {LOCKS: min(64, max(16, 8192 // (GG * B * R))), QUEST: 32, ORACLE: 8}[m]
    if sub_blocks is None:
        sub_blocks = 8 if m != ORACLE else 16
    if num_warps is None:
        num_warps = 4 if (m != LOCKS or GG * block_pages * B * R <= 8192) else 8
    if num_stages is None:
        num_stages = 2
    span = block_pages * sub_blocks
    n_blk = max(1, triton.cdiv(n_pages, span))
    rows = b * h
    if out is None:
        out = torch.empty((rows, G, n_pages), dtype=torch.float32, device=q.device)
    if partials is None:
        partials = torch.empty((rows, n_blk, 4, GG), dtype=torch.float32, device=q.device)
    args = []
    for i in range(6):
        x = xs[i] if i < len(xs) else xs[0]
        if m == ORACLE and i == 1:  # token stride of the key buffer
            args += [x, 0, keys.stride(2)]
            continue
        args += [x, x.stride(0), x.stride(1)]
    _score_kernel[(n_blk, rows)](
        q, q.stride(0), q.stride(1), *args,
        _as_u8(slot_valid), slot_valid.stride(0), row_start, n_complete, length,
        out, n_pages, partials, n_blk, h, float(scale),
        METHOD=m, G=G, GG=GG, GP=GP, D=d, B=B, R=R, BITS=bits, BP=block_pages, NSUB=sub_blocks, BY_TOKEN=by_token,
        DOT_PREC=dot_precision(q.dtype), num_warps=num_warps, num_stages=num_stages,
    )
    return out, partials
