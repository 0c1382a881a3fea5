"""Summary build on the GPU (kernel 4): top-r page basis from the 16x16 Gram matrix.

For a page's centered keys ``D`` (``B x d``), the top-r right singular vectors are
``V = D^T U / sigma`` where ``U, sigma^2`` are the top-r eigenpairs of the small Gram matrix
``D D^T`` (``B x B``), and the coefficients are ``C = D V = U sigma``. One batched matrix product
builds all Gram matrices, ``eigh.sym_eigh`` diagonalises them in one launch (parallel one-sided
Jacobi in Triton: no host synchronisation, so the per-step build can be captured in a CUDA graph, and
any batch size in one call), and ``_quantize_kernel`` writes the quantized layout of
``locks_hf.summaries`` (int4/int2/int8 basis packed with one bf16 scale per basis row, int8
coefficients with one bf16 scale per token row, int8 centroid with one bf16 scale) in one pass
(`store_summary`, which the fused page update of `page_update` shares).

Directions with ``sigma <= 1e-3 * sigma_max`` (rank-deficient pages, e.g. a page of few real
tokens) get a zero basis row and zero coefficients: they carry no score.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, next_pow2
from .eigh import sym_eigh

_BF16_ROUND_UP = 1.0 + 2.0**-7  # as locks_hf.quant: scales rounded up so |x|/scale <= qmax


def fit_pages_eigh(
    keys: torch.Tensor, valid: torch.Tensor, rank: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 centroid ``[..., d]``, basis rows ``[..., r, d]`` and coefficients ``[..., B, r]``."""
    k = keys.float()
    w = valid.to(k.dtype).unsqueeze(-1)
    mu = (k * w).sum(-2) / w.sum(-2).clamp_min(1.0)
    centered = (k - mu.unsqueeze(-2)) * w
    gram = centered @ centered.transpose(-1, -2)
    evals, evecs = sym_eigh(gram)  # ascending
    B = keys.shape[-2]
    r = min(rank, B)
    lam = evals[..., B - r :].flip(-1).clamp_min(0.0)
    u = evecs[..., B - r :].flip(-1)  # [..., B, r]
    sig = lam.sqrt()
    keep = sig > 1e-3 * sig[..., :1]
    inv = torch.where(keep, 1.0 / torch.where(keep, sig, 1.0), 0.0)
    basis = (u.transpose(-1, -2) @ centered) * inv.unsqueeze(-1)  # [..., r, d]
    coef = u * torch.where(keep, sig, 0.0).unsqueeze(-2)  # [..., B, r]
    if r < rank:
        basis = torch.nn.functional.pad(basis, (0, 0, 0, rank - r))
        coef = torch.nn.functional.pad(coef, (0, rank - r))
    return mu, basis, coef


@triton.jit
def _rint(x):
    """Round half to even (as ``torch.round``)."""
    r = tl.floor(x + 0.5)
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0
    return tl.where(((r - x) == 0.5) & odd, r - 1.0, r)


@triton.jit
def _bf16_value(x):
    """``x`` (finite, >= 0) rounded to the nearest bf16 (ties to even), as float32.

    Written with integer ops so that the interpreter (which truncates on conversion) and the GPU agree.
    """
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax, QMAX: tl.constexpr):
    """bf16 quantization scale for a slice of absmax ``amax`` (as locks_hf.quant), as float32."""
    sc = _bf16_value(amax * 1.0078125 / QMAX)
    return tl.where(sc > 0, sc, 1.0)


@triton.jit
def quantize_rows(x, QMAX: tl.constexpr):
    """Symmetric codes of ``x`` along its last axis (float32 in ``[-QMAX, QMAX]``, rounded half to even)
    and the per-row scales (bf16 values as float32), as ``locks_hf.quant.quantize``."""
    sc = _scale_of(tl.max(tl.abs(x), axis=-1), QMAX)
    q = tl.clamp(_rint(x / tl.expand_dims(sc, -1)), -QMAX * 1.0, QMAX * 1.0)
    return q, sc


@triton.jit
def store_summary(
    pg, pm, mu, basis, coef, o_basis, o_bscale, o_coef, o_cscale, o_mu, o_mscale, R: tl.constexpr, BITS: tl.constexpr
):
    """Quantize float32 page parts and store them at pages ``pg [N]`` (mask ``pm``) of the contiguous
    layout of `summary_shapes`: ``mu [N, D]``, ``basis [N, RP, D]`` (rows ``>= R`` not stored),
    ``coef [N, B, RP]`` (columns ``>= R`` not stored)."""
    D: tl.constexpr = mu.shape[1]
    RP: tl.constexpr = basis.shape[1]
    B: tl.constexpr = coef.shape[1]
    PER: tl.constexpr = 8 // BITS
    DP: tl.constexpr = D // PER
    r = tl.arange(0, RP)
    c = tl.arange(0, D)
    t = tl.arange(0, B)
    j = tl.arange(0, DP)
    rm = pm[:, None] & (r < R)[None, :]

    # centroid: int8, one scale per page
    mq, ms = quantize_rows(mu, 127)
    tl.store(o_mu + pg[:, None] * D + c[None, :], mq.to(tl.int8), mask=pm[:, None])
    tl.store(o_mscale + pg, ms.to(tl.bfloat16), mask=pm)

    # coefficients: int8, one scale per token row
    cq, cs = quantize_rows(coef, 127)
    tl.store(
        o_coef + pg[:, None, None] * (B * R) + t[None, :, None] * R + r[None, None, :],
        cq.to(tl.int8),
        mask=rm[:, None, :],
    )
    tl.store(o_cscale + pg[:, None] * B + t[None, :], cs.to(tl.bfloat16), mask=pm[:, None])

    # basis rows: BITS-bit codes packed PER to a byte (element 0 in the low bits), one scale per row
    bq, bs = quantize_rows(basis, (1 << (BITS - 1)) - 1)
    fields = (tl.reshape(bq.to(tl.int32), [bq.shape[0], RP, DP, PER]) & ((1 << BITS) - 1)) << (tl.arange(0, PER) * BITS)
    packed = tl.sum(fields, axis=3)  # disjoint bit fields: the sum is their OR
    tl.store(
        o_basis + pg[:, None, None] * (R * DP) + r[None, :, None] * DP + j[None, None, :],
        packed.to(tl.int8 if BITS == 8 else tl.uint8),
        mask=rm[:, :, None],
    )
    tl.store(o_bscale + pg[:, None] * R + r[None, :], bs.to(tl.bfloat16), mask=rm)


@triton.jit
def _quantize_kernel(
    mu_ptr,
    basis_ptr,
    coef_ptr,
    o_basis,
    o_bscale,
    o_coef,
    o_cscale,
    o_mu,
    o_mscale,
    n_pages,
    D: tl.constexpr,
    B: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BITS: tl.constexpr,
    BPG: tl.constexpr,
):
    """Quantize ``BPG`` pages per program: rows of ``basis [n, R, D]``, ``coef [n, B, R]``, ``mu [n, D]``."""
    pg = tl.program_id(0) * BPG + tl.arange(0, BPG)
    pm = pg < n_pages
    r = tl.arange(0, RP)
    rm = pm[:, None] & (r < R)[None, :]
    c = tl.arange(0, D)
    t = tl.arange(0, B)
    mu = tl.load(mu_ptr + pg[:, None] * D + c[None, :], mask=pm[:, None], other=0.0)
    coef = tl.load(
        coef_ptr + pg[:, None, None] * (B * R) + t[None, :, None] * R + r[None, None, :], mask=rm[:, None, :], other=0.0
    )
    basis = tl.load(
        basis_ptr + pg[:, None, None] * (R * D) + r[None, :, None] * D + c[None, None, :],
        mask=rm[:, :, None],
        other=0.0,
    )
    store_summary(pg, pm, mu, basis, coef, o_basis, o_bscale, o_coef, o_cscale, o_mu, o_mscale, R, BITS)


def summary_shapes(
    lead: tuple, page_size: int, d: int, rank: int, basis_bits: int
) -> dict[str, tuple[tuple, torch.dtype]]:
    """Shape and dtype of each quantized summary tensor for pages ``lead`` (the layout of
    ``locks_hf.summaries``)."""
    lead = tuple(lead)
    return {
        "basis": ((*lead, rank, d // (8 // basis_bits)), torch.int8 if basis_bits == 8 else torch.uint8),
        "basis_scale": ((*lead, rank), torch.bfloat16),
        "coef": ((*lead, page_size, rank), torch.int8),
        "coef_scale": ((*lead, page_size), torch.bfloat16),
        "mu": ((*lead, d), torch.int8),
        "mu_scale": ((*lead, 1), torch.bfloat16),
    }


def quantize_summary(
    mu: torch.Tensor, basis: torch.Tensor, coef: torch.Tensor, basis_bits: int = 4
) -> dict[str, torch.Tensor]:
    """The quantized summary layout of ``locks_hf.summaries`` from float32 parts (one Triton pass)."""
    lead = mu.shape[:-1]
    d = mu.shape[-1]
    R, B = basis.shape[-2], coef.shape[-2]
    n = mu.numel() // d
    out = {
        name: torch.empty(shape, dtype=dtype, device=mu.device)
        for name, (shape, dtype) in summary_shapes(lead, B, d, R, basis_bits).items()
    }
    if n == 0:
        return out
    BPG = 8
    launch(
        _quantize_kernel,
        (triton.cdiv(n, BPG),),
        mu.float().contiguous(),
        basis.float().contiguous(),
        coef.float().contiguous(),
        out["basis"],
        out["basis_scale"],
        out["coef"],
        out["coef_scale"],
        out["mu"],
        out["mu_scale"],
        n,
        D=d,
        B=B,
        R=R,
        RP=next_pow2(R),
        BITS=basis_bits,
        BPG=BPG,
        num_warps=4,
    )
    return out


def build_summary(keys: torch.Tensor, valid: torch.Tensor, rank: int, basis_bits: int = 4) -> dict[str, torch.Tensor]:
    """Page summaries of ``keys [..., B, d]`` (``valid [..., B]``), quantized (i2/i4/i8 basis)."""
    mu, basis, coef = fit_pages_eigh(keys, valid, rank)
    return quantize_summary(mu, basis, coef, basis_bits)
