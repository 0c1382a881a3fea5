"""Tile configuration of the page-scoring kernels: which variant runs, and the default tiles of each
(pages per block, blocks per program, warps, pipeline stages) for whatever a caller leaves ``None``.
The defaults and the H200 figures that chose them are kept together here.
"""

from __future__ import annotations

from .score_dot import LOCKS, ORACLE, QUEST

#: Locks scoring variants (`score.score_pages`' ``variant``).
VARIANTS = ("dot", "fma")


def fma_supported(d: int, page_size: int, rank: int, basis_bits: int) -> bool:
    """Whether variant ``"fma"`` handles these summaries: whole 16-byte chunks of each basis row and of the
    coefficients, power-of-two rank, int2/4/8 basis."""
    return (basis_bits in (2, 4, 8) and d * basis_bits % 128 == 0 and rank & (rank - 1) == 0
            and page_size * rank % 16 == 0 and rank <= 16)


def default_variant(method: int, G: int, d: int, page_size: int, rank: int, basis_bits: int) -> str:
    """``"fma"`` where it applies and the GQA group has at most 8 heads (H200, 512K, Llama shape G=4:
    0.097 vs 0.213 ms), else ``"dot"`` (G=16 spills registers in ``"fma"``)."""
    return "fma" if method == LOCKS and G <= 8 and fma_supported(d, page_size, rank, basis_bits) else "dot"


def fma_tiles(block_pages, sub_blocks, num_warps, num_stages) -> tuple[int, int, int, int]:
    """``(block_pages, sub_blocks, num_warps, num_stages)`` of variant ``"fma"``: one page per thread
    per step, short programs (many waves, so no long partial last wave: best on the H200)."""
    if num_warps is None:
        num_warps = 4
    if block_pages is None:
        block_pages = 32 * num_warps
    if block_pages % (32 * num_warps):
        raise ValueError("variant 'fma': block_pages must be a multiple of 32*num_warps")
    return block_pages, 1 if sub_blocks is None else sub_blocks, num_warps, 1 if num_stages is None else num_stages


# Page-rows (batch x KV heads x pages) from which a group of 16+ heads scores faster per token.
BY_TOKEN_MIN_PAGE_ROWS = 1 << 16


def dot_tiles(m: int, GG: int, B: int, R: int, page_rows: int, by_token, block_pages, sub_blocks, num_warps,
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
