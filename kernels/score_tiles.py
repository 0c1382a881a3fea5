"""Tile configuration of the page-scoring kernels: which variant runs, and the default tiles of each
(pages per block, blocks per program, warps, pipeline stages) for whatever a caller leaves ``None``.
The defaults and the H200 figures that chose them are kept together here.
"""

from __future__ import annotations

import functools
import os

import torch

from ._common import next_pow2
from .score_dot import LOCKS, ORACLE, QUEST
from .score_wgmma import wgmma_available

#: Locks scoring variants (`score.score_pages`' ``variant``).
VARIANTS = ("dot", "fma", "mma", "wgmma")


def fma_supported(d: int, page_size: int, rank: int, basis_bits: int) -> bool:
    """Whether variant ``"fma"`` handles these summaries: whole 16-byte chunks of each basis row and of the
    coefficients, power-of-two rank, int2/4/8 basis."""
    return (
        basis_bits in (2, 4, 8)
        and d * basis_bits % 128 == 0
        and rank & (rank - 1) == 0
        and page_size * rank % 16 == 0
        and rank <= 16
    )


def mma_supported(d: int, page_size: int, rank: int, basis_bits: int, words_per_chunk: int = 4) -> bool:
    """Whether variant ``"mma"`` handles these summaries: whole chunks of ``words_per_chunk`` int32 words
    in each basis row and centroid, 16-byte chunks of coefficients, power-of-two rank, int2/4/8 basis."""
    return (
        basis_bits in (2, 4, 8)
        and d * basis_bits % (32 * words_per_chunk) == 0
        and d % (4 * words_per_chunk) == 0
        and rank & (rank - 1) == 0
        and page_size * rank % 16 == 0
        and rank <= 16
    )


def wgmma_supported(d: int, page_size: int, rank: int, basis_bits: int, G: int, query_dtype: torch.dtype) -> bool:
    """Whether variant ``"wgmma"`` (`score_wgmma`) handles these summaries: a 4-bit basis, whole 32-dim chunks
    in a power-of-two head dim (32-256), whole coefficient words, rank 1-8, 5-16 heads a group, 16-bit
    queries. The device must also run it (`wgmma_runs`)."""
    return (
        basis_bits == 4
        and d in (32, 64, 128, 256)
        and rank in (1, 2, 4, 8)
        and page_size % 4 == 0
        and 4 < G <= 16
        and query_dtype in (torch.float16, torch.bfloat16)
    )


def wgmma_runs(device: torch.device) -> bool:
    """Whether variant ``"wgmma"`` runs on ``device``: a compute capability 9.0 GPU (the warpgroup MMA of
    sm_90a), outside Triton's interpreter (which has no Gluon), with a Triton that has Gluon."""
    return (
        wgmma_available()
        and device.type == "cuda"
        and os.environ.get("TRITON_INTERPRET") != "1"
        and _capability(device.index if device.index is not None else torch.cuda.current_device()) == (9, 0)
    )


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    # asked at every default-variant choice of an eager step: once per device is enough
    return torch.cuda.get_device_capability(index)


#: Register caps of variant ``"wgmma"`` by rank where it is the default (`default_variant`): 4 programs an SM at
#: rank 4 (a few spilled bytes, still the faster), 3 at rank 8. H100, GLM-4-9B shape at 512K, batch 1, two runs
#: (``scripts/dev/bench_score.py --cfgs``): r4i4 0.0403-0.0407 ms against "mma"'s 0.0412-0.0418 (168 registers:
#: 0.0433-0.0435), r8i4 0.0638-0.0642 against 0.0681-0.0685 (128 registers: 0.0796).
WGMMA_REGISTERS = {4: 128, 8: 168}


def wgmma_registers(rank: int) -> int | None:
    """The default register cap of variant ``"wgmma"`` at ``rank`` (``None``: the compiler's choice)."""
    return WGMMA_REGISTERS.get(rank)


def default_variant(
    method: int,
    G: int,
    d: int,
    page_size: int,
    rank: int,
    basis_bits: int,
    *,
    device: torch.device | None = None,
    query_dtype: torch.dtype | None = None,
) -> str:
    """Locks: ``"fma"`` where it applies and the GQA group has at most 8 heads (H200, 512K, Llama shape
    G=4: 0.097 vs 0.213 ms for ``"dot"``); for larger groups ``"wgmma"`` on an H100/H200 (``device``) at the
    timed shapes (9-16 heads, d = 128, 16-token pages, rank 4 or 8, int4 basis, 16-bit ``query_dtype``: see
    `WGMMA_REGISTERS`), else ``"mma"`` where it applies (groups of 16+: ``"fma"`` spills registers, and
    ``"dot"``'s per-token layout costs ~0.11 ms at GLM-4 512K against a 0.008 ms byte floor), else ``"dot"``."""
    if method != LOCKS:
        return "dot"
    if G <= 8 and fma_supported(d, page_size, rank, basis_bits):
        return "fma"
    if (
        device is not None
        and query_dtype is not None
        and 8 < G <= 16
        and d == 128
        and page_size == 16
        and rank in WGMMA_REGISTERS
        and wgmma_supported(d, page_size, rank, basis_bits, G, query_dtype)
        and wgmma_runs(device)
    ):
        return "wgmma"
    return "mma" if mma_supported(d, page_size, rank, basis_bits) else "dot"


#: Whether variant ``"fma"`` loads each chunk of a block's codes before the previous chunk's FMAs by default
#: (`score_fma._locks_fma_proj`). H100, Llama-3.1-8B shape at 512K, batch 1, one run
#: (``scripts/dev/bench_score.py --grid prefetch``): r8i4 scores in 0.1670 ms against 0.1746, r4i4 in 0.0951 either
#: way.
FMA_PREFETCH = True


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


#: Bytes the default ``words_per_chunk`` keeps the basis product's code tile within: ``block_pages * rank``
#: rows of one chunk's codes (``words_per_chunk * 32/min(bits, 4)`` of them) in the query's dtype, the
#: tensor-core operand staged in shared memory. sm_90 AOT with Triton 3.6 (scripts/dev/check_score_mma_compile.py,
#: d = 128, page 16): a block's shared memory is this tile plus at most ~1 KB (less where the compiler keeps
#: the operand in registers), so 4-word chunks of a 2-bit basis at rank 8 in 128-page blocks need 256.3 KB
#: with a float32 query (over the H200's 227 KB), 128.3 KB at 4 bits; 64 KB for the bf16 r8i4 G=4 tiles
#: the H200 timings were taken with (below 128 KiB: unchanged).
MMA_CODE_TILE_BYTES = 1 << 17


def mma_chunk_words(block_pages: int, rank: int, basis_bits: int, query_bytes: int) -> int:
    """Default ``words_per_chunk`` of variant ``"mma"``: 4, halved (down to 2: the int8 centroids' chunk then
    holds 16 codes, the products' smallest K) while the code tile of a chunk exceeds `MMA_CODE_TILE_BYTES`."""
    codes = 32 // min(basis_bits, 4)  # codes a word unpacks to (int8: two nibbles a byte)
    kcw = 4
    while kcw > 2 and block_pages * rank * kcw * codes * query_bytes > MMA_CODE_TILE_BYTES:
        kcw //= 2
    return kcw


#: Words of each int8 centroid row a "mma" product takes by default, fewer where they do not divide the row or
#: their codes would not fit `MMA_CODE_TILE_BYTES`. A centroid product has ``block_pages`` rows to the basis
#: product's ``block_pages * rank``, so at d = 128 one product of the whole row replaces 8 dependent ones of 4
#: words (H100, GLM-4-9B shape at 512K: r4i4 scored in 0.0417 ms against 0.0442, r8i4 in 0.0690 against 0.0715).
MMA_CENTROID_WORDS = 16


def mma_centroid_words(block_pages: int, d: int, query_bytes: int) -> int:
    """Default ``centroid_words_per_chunk`` of variant ``"mma"``: `MMA_CENTROID_WORDS`, halved (down to 2) until
    it divides the ``d/4`` words of a centroid row and the chunk's codes fit `MMA_CODE_TILE_BYTES`."""
    cw = MMA_CENTROID_WORDS
    # 8 codes a word, as `mma_chunk_words` counts an int8 row (two nibbles a byte)
    while cw > 2 and ((d // 4) % cw or block_pages * cw * 8 * query_bytes > MMA_CODE_TILE_BYTES):
        cw //= 2
    return cw


def mma_tiles(
    GG: int,
    block_pages,
    head_split,
    words_per_chunk,
    num_warps,
    num_stages,
    *,
    rank: int,
    basis_bits: int,
    query_bytes: int,
) -> tuple[int, int, int, int, int]:
    """``(block_pages, head_split, words_per_chunk, num_warps, num_stages)`` of variant ``"mma"``.

    One (page, head group) pair per thread: ``head_split`` threads per page with ``GG/head_split`` heads
    each (at most 8 heads a thread by default), so ``block_pages * head_split`` is a multiple of
    ``32 * num_warps``; chunks of 4 words (16 bytes) of each packed row per tensor-core product, fewer
    where the chunk's codes would not fit in shared memory (`mma_chunk_words`; ``query_bytes``: 4 for a
    float32 query, 2 for bf16/fp16), and half the warps and pages where even 2-word chunks would not.
    """
    warps_default = num_warps is None
    if num_warps is None:
        num_warps = 4
    if head_split is None:
        # H200, GLM-4-9B shape (G = 16), 512K, batch 1: 8 heads a thread in 64-page blocks scores r4i4 in
        # 0.047 ms against 0.051 ms with 4 heads in 32-page blocks (r8i4 0.073 vs 0.075; 1M and batch 8
        # alike), and half the blocks leave half the partials to the selection (0.042 vs 0.060 ms)
        head_split = max(1, GG // 8)
    if GG % head_split:
        raise ValueError(f"variant 'mma': head_split must divide the padded group size {GG}, got {head_split}")
    if block_pages is None:
        block_pages = max(1, 32 * num_warps // head_split)
        if warps_default and words_per_chunk is None:  # rank 16 at 2 bits, float32 query: halve the block too
            while num_warps > 1 and block_pages * rank * 64 // min(basis_bits, 4) * query_bytes > MMA_CODE_TILE_BYTES:
                num_warps, block_pages = num_warps // 2, block_pages // 2
    if (block_pages * head_split) % (32 * num_warps) or block_pages & (block_pages - 1):
        raise ValueError(
            "variant 'mma': block_pages must be a power of two and block_pages * head_split a "
            "multiple of 32 * num_warps"
        )
    if words_per_chunk is None:
        words_per_chunk = mma_chunk_words(block_pages, rank, basis_bits, query_bytes)
    return block_pages, head_split, words_per_chunk, num_warps, 1 if num_stages is None else num_stages


def mma_registers(GG: int, head_split: int, *, rank: int, basis_bits: int, query_bytes: int) -> int | None:
    """Default register cap (``maxnreg``) of variant ``"mma"``, where one was measured to pay: a group of 16
    heads, 8 a thread, a 16-bit query on an int4 basis of rank <= 4 (H200, GLM-4-9B shape, 512K, batch
    1: 168 registers leave 3 programs of 4 warps an SM; capped at 128, 4 fit and r4i4 scores in 0.043 ms
    against 0.047). ``None`` elsewhere: the compiler's own choice."""
    if GG == 16 and head_split == 2 and rank <= 4 and basis_bits == 4 and query_bytes == 2:
        return 128
    return None


# Page-rows (batch x KV heads x pages) from which a group of 16+ heads scores faster per token.
BY_TOKEN_MIN_PAGE_ROWS = 1 << 16


def dot_tiles(
    m: int, GG: int, B: int, R: int, page_rows: int, by_token, block_pages, sub_blocks, num_warps, num_stages
):
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


#: Whether the Locks variants ``"fma"`` and ``"mma"`` ask the L2 for a block's bytes at its start by default
#: (`score_parts.prefetch_block`), where `l2_prefetch_runs`. Off: it scored slower on an H100 at 512K, batch 1
#: (GLM-4-9B shape r4i4 0.0477 ms against 0.0452 without, r8i4 0.0751 / 0.0732; Llama-3.1-8B shape "fma"
#: r4i4 0.1011 / 0.0930, r8i4 0.1879 / 0.1717): its requests cost more than the latency they hide.
L2_PREFETCH = False


def l2_prefetch_runs(device: torch.device) -> bool:
    """Whether the kernels can ask the L2 for lines on ``device``: compiled for an NVIDIA GPU (inline PTX),
    not run by Triton's interpreter."""
    return device.type == "cuda" and torch.version.hip is None and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def l2_prefetch_lines(block_pages: int, d: int, page_size: int, rank: int, basis_bits: int) -> int:
    """``PF_LINES`` of the Locks scoring kernels: 128-byte lines (a power of two) that cover the largest of a
    block's ranges (basis codes, centroid codes, coefficients, coefficient scales) at ``block_pages`` pages."""
    largest = block_pages * max(rank * d * basis_bits // 8, d, page_size * rank, 2 * page_size)
    return next_pow2(-(-largest // 128))
