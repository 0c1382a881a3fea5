"""Page scoring (kernel 1): one pass over the page summaries (or keys), per KV head and GQA group.

`score_pages` launches one of two kernels: `score_dot._score_kernel`, three scoring rules picked at
compile time (``METHOD``), or `score_fma._locks_fma_kernel`, a second Locks kernel (variant ``"fma"``)
with the same outputs; `score_tiles` holds the variant choice and the default tiles of each:

* ``LOCKS``  the estimated page LSE ``scale*q.mu_j + LSE_i(scale*(V_j^T q).c_i)`` read straight from
  the packed summaries (int2/4/8 basis with one bf16 scale per basis row, int8 coefficients with a
  bf16 scale per token row, int8 centroid with one bf16 scale). Variant ``"dot"``: the query-basis
  products run on the tensor cores: the packed codes are unpacked into ``8/bits`` interleaved
  sub-vectors and each is multiplied with the matching strided slice of the query, so no dequantized
  basis is stored. The per-token logits exist only in registers ([G, pages, B] per block).
  Variant ``"fma"`` (`_locks_fma_kernel`): one thread per page, CUDA-core FMAs, no layout conversion
  in the page loop (see that module).
  Variants ``"mma"`` (`score_mma`) and ``"wgmma"`` (`score_wgmma`, Triton's Gluon dialect, H100/H200):
  the query-basis and query-centroid products on the tensor cores; ``"wgmma"`` takes the unpacked codes
  into the warpgroup product's register operand without a round trip through shared memory.
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

from ._common import as_length, dot_precision, launch, next_pow2
from .score_dot import LOCKS, ORACLE, QUEST, _score_kernel
from .score_fma import _locks_fma_kernel
from .score_mma import PAIR_BASE, _locks_mma_kernel
from .score_tiles import (
    BY_TOKEN_MIN_PAGE_ROWS,
    FMA_PREFETCH,
    L2_PREFETCH,
    VARIANTS,
    default_variant,
    dot_tiles,
    fma_supported,
    fma_tiles,
    l2_prefetch_lines,
    l2_prefetch_runs,
    mma_centroid_words,
    mma_registers,
    mma_supported,
    mma_tiles,
    wgmma_registers,
    wgmma_runs,
    wgmma_supported,
)
from .score_wgmma import BP as WGMMA_BLOCK_PAGES, _locks_wgmma_kernel

__all__ = [
    "BY_TOKEN_MIN_PAGE_ROWS",
    "LOCKS",
    "METHODS",
    "ORACLE",
    "QUEST",
    "VARIANTS",
    "fma_supported",
    "mma_supported",
    "score_pages",
]

#: Scoring method names -> ``METHOD`` codes of `_score_kernel`.
METHODS = {"locks": LOCKS, "oracle": ORACLE, "quest": QUEST}
#: Per-page summary tensors each scoring method reads, in the order the custom ops (`ops`) take them.
SUMMARY_NAMES = {
    "locks": ("basis", "basis_scale", "coef", "coef_scale", "mu", "mu_scale"),
    "quest": ("upper", "lower"),
    "oracle": (),
}
#: Basis bits the Locks scoring kernels unpack (coefficients and centroids are int8).
_QUANTIZED = (2, 4, 8)


def scores(method: str, *, head_dim: int, basis_bits: int = 4, coef_bits: int = 8, centroid_bits: int = 8) -> bool:
    """Whether `score_pages` scores with ``method`` for this head dim and summary quantization: Locks
    summaries must be int4/int2/int8-packed bases with int8 coefficients and centroids; the tiles need
    a power-of-two head dim of at least 16 (packed) entries."""
    if method not in METHODS:
        return False
    locks = METHODS[method] == LOCKS
    if locks and (basis_bits not in _QUANTIZED or coef_bits != 8 or centroid_bits != 8):
        return False
    per = 8 // basis_bits if locks else 1
    return not (head_dim & (head_dim - 1)) and head_dim // per >= 16


def valid_as_words(slot_valid: torch.Tensor) -> bool:
    """Whether a kernel may read ``slot_valid [b, cap]`` (one byte a slot) as aligned int32 words: contiguous
    rows, a 4-byte aligned start and row length, so that every aligned word that starts in a row ends in it."""
    return (
        slot_valid.element_size() == 1
        and slot_valid.stride(1) == 1
        and slot_valid.data_ptr() % 4 == 0
        and slot_valid.stride(0) % 4 == 0
        and slot_valid.shape[1] % 4 == 0
    )


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


def _check_wgmma(q, d, B, R, bits, G, block_pages, num_warps, num_stages, by_token, head_split) -> int:
    """Refuse what variant ``"wgmma"`` cannot run, saying what to change; returns its head split."""
    if not wgmma_runs(q.device):
        raise ValueError(
            f"variant 'wgmma' runs on a compute capability 9.0 GPU (H100/H200) with Triton's Gluon, outside "
            f"the interpreter; the query is on {q.device}: pass variant='mma' (or leave the variant to the default)"
        )
    if not wgmma_supported(d, B, R, bits, G, q.dtype):
        raise ValueError(
            "variant 'wgmma' needs a 4-bit basis, d in (32, 64, 128, 256), rank 1, 2, 4 or 8, a page size "
            f"divisible by 4, 5-16 query heads per KV head and a float16/bfloat16 query (d={d}, page_size={B}, "
            f"rank={R}, bits={bits}, G={G}, query {q.dtype}): pass variant='mma'"
        )
    fixed = dict(block_pages=(block_pages, WGMMA_BLOCK_PAGES), num_warps=(num_warps, 4), num_stages=(num_stages, 1))
    bad = [f"{k}={v}" for k, (v, want) in fixed.items() if v is not None and v != want]
    bad += [f"by_token={by_token}"] if by_token is not None else []
    if bad:
        raise ValueError(
            f"{', '.join(bad)}: variant 'wgmma' runs 64-page blocks on one warpgroup (block_pages=64, "
            "num_warps=4, num_stages=1): drop them"
        )
    GG = next_pow2(G)
    head_split = 1 if head_split is None else head_split
    if head_split not in (1, 2, 4) or GG % head_split or GG // head_split < 8:
        raise ValueError(
            f"variant 'wgmma': head_split (programs sharing a group's {GG} padded heads, at least 8 heads each) "
            f"must be {' or '.join(str(h) for h in (1, 2, 4) if GG % h == 0 and GG // h >= 8)}, got {head_split}"
        )
    return head_split


def score_pages(
    method: str,
    query: torch.Tensor,
    *,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    n_complete: torch.Tensor,
    length: int | torch.Tensor,
    n_pages: int,
    scale: float,
    page_size: int,
    summary: dict[str, torch.Tensor] | None = None,
    keys: torch.Tensor | None = None,
    basis_bits: int = 4,
    out: torch.Tensor | None = None,
    partials: torch.Tensor | None = None,
    block_pages: int | None = None,
    sub_blocks: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    by_token: bool | None = None,
    variant: str | None = None,
    maxnreg: int | None = None,
    head_split: int | None = None,
    words_per_chunk: int | None = None,
    centroid_words_per_chunk: int | None = None,
    prefetch: bool | None = None,
    l2_prefetch: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Score every page of every row and KV head for one decode query.

    ``query [b, Hq, 1, d]`` (or ``[b, Hq, d]``); ``slot_valid [b, cap]`` real slots; ``row_start [b]``
    and ``n_complete [b]`` int32 tensors (first slot of page 0, at least 0; pages summarized: only those
    wholly inside the written slots are scored); ``length`` slots
    written (an int, or the cache's ``int32 [1]`` device tensor); ``n_pages`` page-axis length ``P``.
    ``summary`` is the selector's tensors ``[b, h, P', ...]``
    (``"locks"``: basis/basis_scale/coef/coef_scale/mu/mu_scale; ``"quest"``: upper/lower);
    ``keys`` the key buffer ``[b, h, cap, d]`` for ``"oracle"``.

    ``variant`` (Locks only): ``"dot"`` (tensor-core projections; ``by_token`` picks its epilogue,
    by default per token for groups of 16+ heads over many pages, see `score_tiles.dot_tiles`) or
    ``"fma"`` (one thread per page, CUDA-core FMAs; ``block_pages`` must be a multiple of
    ``32*num_warps``, the pages a thread scores per step being the quotient; see `fma_supported`) or
    ``"mma"`` (tensor-core projections, one (page, head group) pair per thread in the epilogue:
    ``head_split`` threads per page, ``words_per_chunk`` int32 words of each packed row per product
    (``centroid_words_per_chunk`` of each centroid row, default `score_tiles.mma_centroid_words`); see
    `score_tiles.mma_tiles`, `mma_supported`) or ``"wgmma"`` (the ``"mma"`` products in Gluon on a compute
    capability 9.0 GPU, 64-page blocks, ``head_split`` programs sharing a group's heads; see
    `score_tiles.wgmma_supported`); default (``None``): `score_tiles.default_variant`.
    Tiles (``block_pages``, ``sub_blocks``, ``num_warps``, ``num_stages``) default per method/variant
    (`score_tiles`);
    ``maxnreg`` caps the registers per thread (more programs per SM; ``"fma"``, ``"mma"`` and ``"wgmma"``;
    ``"mma"`` defaults to `score_tiles.mma_registers`, ``"wgmma"`` to `score_tiles.wgmma_registers`).
    ``prefetch`` (``"fma"``, ``"mma"``): each chunk of codes is loaded before the previous chunk's products; ``False`` is the plain loop, kept to time one against the
    other; default on for ``"mma"``, `score_tiles.FMA_PREFETCH` for ``"fma"``. ``l2_prefetch``
    (``"fma"``, ``"mma"``): each block first asks the L2 for every byte it reads (`score_parts.prefetch_block`);
    default `score_tiles.L2_PREFETCH` where the device can (`score_tiles.l2_prefetch_runs`: CUDA, not the
    interpreter); ``True`` elsewhere is an error.

    Returns ``(scores [b*h, G, P] float32, partials [b*h, n_blk, 4, GG] float32)``, ``GG`` the
    group size rounded up to a power of two.
    """
    m = METHODS[method]
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
        variant = default_variant(m, G, d, B, R, bits, device=q.device, query_dtype=q.dtype)
    fma = m == LOCKS and variant == "fma"
    mma = m == LOCKS and variant == "mma"
    wgmma = m == LOCKS and variant == "wgmma"
    if wgmma:
        head_split = _check_wgmma(q, d, B, R, bits, G, block_pages, num_warps, num_stages, by_token, head_split)
        block_pages, sub_blocks = WGMMA_BLOCK_PAGES, 1 if sub_blocks is None else sub_blocks
        if maxnreg is None:
            maxnreg = wgmma_registers(R)
    if not mma:
        mma_only = (
            ("head_split", None if wgmma else head_split),
            ("words_per_chunk", words_per_chunk),
            ("centroid_words_per_chunk", centroid_words_per_chunk),
        )
        given = [n for n, v in mma_only if v is not None]
        given += [] if prefetch is None or fma else [f"prefetch={prefetch}"]
        if given:
            raise ValueError(
                f"{', '.join(given)}: settings of Locks variant 'mma' only (prefetch: 'fma' and 'mma'); "
                "this call scores with "
                f"{'variant ' + repr(variant) if m == LOCKS else repr(method)}: pass variant='mma' or drop them"
            )
    if l2_prefetch and not (fma or mma):
        raise ValueError(
            f"l2_prefetch: a setting of the Locks variants 'fma' and 'mma' only; this call scores with "
            f"{'variant ' + repr(variant) if m == LOCKS else repr(method)}: pass variant='fma' or 'mma', or drop it"
        )
    if l2_prefetch and not l2_prefetch_runs(q.device):
        raise ValueError(
            f"l2_prefetch=True needs a CUDA device outside Triton's interpreter (the query is on {q.device}): "
            "drop it or pass False"
        )
    if l2_prefetch is None:
        l2_prefetch = (fma or mma) and L2_PREFETCH and l2_prefetch_runs(q.device)
    if prefetch is None:
        prefetch = FMA_PREFETCH if fma else True
    if fma and not fma_supported(d, B, R, bits):
        raise ValueError(
            f"variant 'fma' needs d*bits % 128 == 0, page_size*rank % 16 == 0 and a power-of-two "
            f"rank <= 16 (d={d}, page_size={B}, rank={R}, bits={bits})"
        )
    if mma:
        block_pages, head_split, words_per_chunk, num_warps, num_stages = mma_tiles(
            GG,
            block_pages,
            head_split,
            words_per_chunk,
            num_warps,
            num_stages,
            rank=R,
            basis_bits=bits,
            query_bytes=q.element_size(),
        )
        if centroid_words_per_chunk is None:
            centroid_words_per_chunk = mma_centroid_words(block_pages, d, q.element_size())
        if centroid_words_per_chunk < 2 or (d // 4) % centroid_words_per_chunk:
            raise ValueError(
                f"variant 'mma': centroid_words_per_chunk must be at least 2 and divide the centroid's {d // 4} "
                f"int32 words (d={d}), got {centroid_words_per_chunk}"
            )
        if not mma_supported(d, B, R, bits, words_per_chunk):
            raise ValueError(
                f"variant 'mma' needs d*bits % (32*words_per_chunk) == 0, d % (4*words_per_chunk) "
                f"== 0, page_size*rank % 16 == 0 and a power-of-two rank <= 16 (d={d}, "
                f"page_size={B}, rank={R}, bits={bits}, words_per_chunk={words_per_chunk})"
            )
        sub_blocks = 1 if sub_blocks is None else sub_blocks
        if maxnreg is None:
            maxnreg = mma_registers(GG, head_split, rank=R, basis_bits=bits, query_bytes=q.element_size())
    rows = b * h
    if fma:
        block_pages, sub_blocks, num_warps, num_stages = fma_tiles(block_pages, sub_blocks, num_warps, num_stages)
    if m == LOCKS and not (fma or mma or wgmma):
        names = ("basis", "basis_scale", "coef", "coef_scale", "mu", "mu_scale")
        xs = [_page_tensor(summary[n]) for n in names]
    elif m == QUEST:
        xs = [_page_tensor(summary["upper"]), _page_tensor(summary["lower"])]
    elif m == ORACLE:
        if keys.stride(-1) != 1:
            raise ValueError("keys must have a contiguous last dim")
        xs = [keys]
    if not (fma or mma or wgmma):
        by_token, block_pages, sub_blocks, num_warps, num_stages = dot_tiles(
            m, GG, B, R, rows * n_pages, by_token, block_pages, sub_blocks, num_warps, num_stages
        )
    span = block_pages * sub_blocks
    pf_lines = l2_prefetch_lines(block_pages, d, B, R, bits) if l2_prefetch else 0  # "fma" / "mma" only
    n_blk = max(1, triton.cdiv(n_pages, span))
    if out is None:
        out = torch.empty((rows, G, n_pages), dtype=torch.float32, device=q.device)
    if partials is None:
        partials = torch.empty((rows, n_blk, 4, GG), dtype=torch.float32, device=q.device)
    len_t = as_length(length, q.device)
    if fma or mma or wgmma:
        # the packed summaries as int32 words, and the arguments the three kernels share
        xs = [
            _words(summary["basis"]),
            _page_tensor(summary["basis_scale"]),
            _words(summary["coef"]),
            _page_tensor(summary["coef_scale"]),
            _words(summary["mu"]),
            _page_tensor(summary["mu_scale"]),
        ]
        common = (
            q,
            q.stride(0),
            q.stride(1),
            *[a for x in xs for a in (x, x.stride(0), x.stride(1))],
            _as_u8(slot_valid),
            slot_valid.stride(0),
            row_start,
            n_complete,
            len_t,
            out,
            n_pages,
            partials,
            n_blk,
            h,
            float(scale),
        )
    regs = {} if maxnreg is None else {"maxnreg": maxnreg}
    pair_base = PAIR_BASE["fp16" if q.dtype == torch.float16 else "bf16"]
    if fma:
        scratch = torch.empty((rows * n_blk * d * GG,), dtype=torch.float32, device=q.device)
        launch(
            _locks_fma_kernel,
            (n_blk, rows),
            *common,
            scratch,
            sub_blocks,
            0x4B000000,
            G=G,
            GG=GG,
            D=d,
            B=B,
            R=R,
            BITS=bits,
            BP=block_pages,
            PF_LINES=pf_lines,
            PREFETCH=prefetch,
            VALID_WORDS=valid_as_words(slot_valid),
            num_warps=num_warps,
            num_stages=num_stages,
            **regs,
        )
        return out, partials
    if wgmma:
        launch(
            _locks_wgmma_kernel,
            (n_blk, rows, head_split),
            *common,
            sub_blocks,
            pair_base,
            G=G,
            GG=GG,
            HS=head_split,
            D=d,
            B=B,
            R=R,
            F16=q.dtype == torch.float16,
            VALID_WORDS=valid_as_words(slot_valid),
            num_warps=4,
            **regs,
        )
        return out, partials
    if mma:
        launch(
            _locks_mma_kernel,
            (n_blk, rows),
            *common,
            sub_blocks,
            0x4B000000,
            pair_base,
            G=G,
            GG=GG,
            D=d,
            B=B,
            R=R,
            BITS=bits,
            BP=block_pages,
            HS=head_split,
            KCW=words_per_chunk,
            KCWM=centroid_words_per_chunk,
            DOT_PREC=dot_precision(q.dtype),
            PREFETCH=prefetch,
            PF_LINES=pf_lines,
            VALID_WORDS=valid_as_words(slot_valid),
            num_warps=num_warps,
            num_stages=num_stages,
            **regs,
        )
        return out, partials
    args = []
    for i in range(6):
        x = xs[i] if i < len(xs) else xs[0]
        if m == ORACLE and i == 1:  # token stride of the key buffer
            args += [x, 0, keys.stride(2)]
            continue
        args += [x, x.stride(0), x.stride(1)]
    launch(
        _score_kernel,
        (n_blk, rows),
        q,
        q.stride(0),
        q.stride(1),
        *args,
        _as_u8(slot_valid),
        slot_valid.stride(0),
        row_start,
        n_complete,
        len_t,
        out,
        n_pages,
        partials,
        n_blk,
        h,
        float(scale),
        METHOD=m,
        G=G,
        GG=GG,
        GP=GP,
        D=d,
        B=B,
        R=R,
        BITS=bits,
        BP=block_pages,
        NSUB=sub_blocks,
        BY_TOKEN=by_token,
        DOT_PREC=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, partials
