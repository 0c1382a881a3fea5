"""Page-local key summaries (the paper's §4): centroid, top-r basis of the centered keys, coefficients.

A summary is a dict of tensors whose leading dims are the pages' (e.g. ``[batch, kv_heads, pages]``):

============  ======================================  ======================================
name          quantized layout (i4 default)           unquantized (16 bits)
============  ======================================  ======================================
basis         uint8 ``[r, d*bits/8]`` (packed codes)  K/V dtype ``[r, d]``
basis_scale   bf16 ``[r]``, one per basis column       (absent)
coef          int8 ``[B, r]``                           K/V dtype ``[B, r]``
coef_scale    bf16 ``[B]``, one per token row           (absent)
mu            int8 ``[d]``                              K/V dtype ``[d]``
mu_scale      bf16 ``[1]``                              (absent)
============  ======================================  ======================================

Basis vectors are stored as rows (``V_j^T``), so scoring reads each one contiguously.
"""

from __future__ import annotations

import torch

from .quant import pack, quantize, unpack


def summary_bytes(
    head_dim: int, page_size: int, rank: int, basis_bits: int = 4, coef_bits: int = 8, centroid_bits: int = 8
) -> int:
    """Bytes of one page's summary for one KV head: ``d*r/2 + B*r + d + 2*(r + B + 1)`` at i4.

    Unquantized (16-bit) parts count 2 bytes per entry and carry no scale.
    """
    d, B, r = head_dim, page_size, rank
    basis = d * r * basis_bits // 8 + (2 * r if basis_bits < 16 else 0)
    coef = B * r * coef_bits // 8 + (2 * B if coef_bits < 16 else 0)
    mu = d * centroid_bits // 8 + (2 if centroid_bits < 16 else 0)
    return basis + coef + mu


def _compute_dtype(keys: torch.Tensor) -> torch.dtype:
    return torch.float64 if keys.dtype == torch.float64 else torch.float32


def fit_pages(keys: torch.Tensor, valid: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unquantized page fit: centroid ``[..., d]``, basis rows ``[..., r, d]``, coefficients ``[..., B, r]``.

    ``keys`` is ``[..., B, d]``, ``valid`` ``[..., B]``; invalid (padding) slots take no part in the
    centroid or the basis, and get zero coefficients. A page whose real keys hold NaN or Inf gets a
    NaN centroid (its score is then NaN, and selection always keeps it, as dense attention would
    attend it) and is otherwise fitted as all zeros: an SVD of non-finite values raises.
    """
    # torch.where, not a multiply by the mask: unwritten slots may hold NaN, and NaN * 0 is NaN.
    real = valid.unsqueeze(-1)
    k = torch.where(real, keys.to(_compute_dtype(keys)), 0.0)
    finite = torch.isfinite(k).flatten(-2).all(-1, keepdim=True)  # [..., 1]
    k = torch.where(finite.unsqueeze(-1), k, 0.0)
    w = real.to(k.dtype)
    mu = k.sum(-2) / w.sum(-2).clamp_min(1.0)
    centered = torch.where(real, k - mu.unsqueeze(-2), 0.0)
    # The top-r right singular vectors; any orthonormal basis of that subspace is equivalent.
    _, _, vh = torch.linalg.svd(centered, full_matrices=False)
    basis = vh[..., :rank, :]
    if basis.shape[-2] < rank:  # rank > head_dim cannot happen (validated), but d < B can
        basis = torch.nn.functional.pad(basis, (0, 0, 0, rank - basis.shape[-2]))
    coef = centered @ basis.transpose(-1, -2)
    return torch.where(finite, mu, float("nan")), basis, coef


def build_summary(
    keys: torch.Tensor, valid: torch.Tensor, rank: int, basis_bits: int = 4, coef_bits: int = 8, centroid_bits: int = 8
) -> dict[str, torch.Tensor]:
    """Fit and store page summaries in the layout of the module docstring."""
    mu, basis, coef = fit_pages(keys, valid, rank)
    store = keys.dtype
    out: dict[str, torch.Tensor] = {}
    if basis_bits < 16:
        codes, scale = quantize(basis, basis_bits, dim=-1)  # one scale per basis column of V_j
        out["basis"], out["basis_scale"] = pack(codes, basis_bits), scale.squeeze(-1)
    else:
        out["basis"] = basis.to(store)
    if coef_bits < 16:
        codes, scale = quantize(coef, coef_bits, dim=-1)  # one scale per token row
        out["coef"], out["coef_scale"] = codes, scale.squeeze(-1)
    else:
        out["coef"] = coef.to(store)
    if centroid_bits < 16:
        codes, scale = quantize(mu, centroid_bits, dim=-1)
        out["mu"], out["mu_scale"] = codes, scale
    else:
        out["mu"] = mu.to(store)
    return out


def summary_factors(
    summary: dict[str, torch.Tensor], basis_bits: int, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor | None]:
    """Codes (or raw values) of ``mu``, ``basis``, ``coef`` in ``dtype`` and their scales (``None``
    when unquantized): the arguments of `estimated_page_lse`, with no dequantized copy made."""
    basis = summary["basis"]
    if "basis_scale" in summary:
        basis = unpack(basis, basis_bits)
    out: dict[str, torch.Tensor | None] = {}
    for name, tensor in (("mu", summary["mu"]), ("basis", basis), ("coef", summary["coef"])):
        out[name] = tensor.to(dtype)
        scale = summary.get(f"{name}_scale")
        out[f"{name}_scale"] = None if scale is None else scale.to(dtype)
    return out


def dequantize_summary(
    summary: dict[str, torch.Tensor], basis_bits: int, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Centroid ``[..., d]``, basis rows ``[..., r, d]``, coefficients ``[..., B, r]`` in ``dtype``."""
    f = summary_factors(summary, basis_bits, dtype)
    mu, basis, coef, mu_scale, basis_scale, coef_scale = (
        f["mu"],
        f["basis"],
        f["coef"],
        f["mu_scale"],
        f["basis_scale"],
        f["coef_scale"],
    )
    assert mu is not None and basis is not None and coef is not None  # only the scales may be None
    # basis and coef carry one scale per row ([..., r] / [..., B]); mu one per page ([..., 1]).
    mu = mu if mu_scale is None else mu * mu_scale
    basis = basis if basis_scale is None else basis * basis_scale.unsqueeze(-1)
    coef = coef if coef_scale is None else coef * coef_scale.unsqueeze(-1)
    return mu, basis, coef


def masked_lse(logits: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp over the last dim, ignoring invalid entries (``-inf`` when none is valid)."""
    return torch.logsumexp(logits.masked_fill(~valid, float("-inf")), dim=-1)


def estimated_page_lse(
    mu: torch.Tensor,
    basis: torch.Tensor,
    coef: torch.Tensor,
    valid: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    mu_scale: torch.Tensor | None = None,
    basis_scale: torch.Tensor | None = None,
    coef_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``s_hat_j(q) = scale * q.mu_j + LSE_i(scale * (V_j^T q) . c_i)`` over each page's real tokens.

    Shapes: ``mu [b, h, P, d]``, ``basis [b, h, P, r, d]``, ``coef [b, h, P, B, r]``,
    ``valid [b, 1|h, P, B]``, ``query [b, h, G, d]`` -> ``[b, h, G, P]``. Quantized summaries pass
    their codes with the scales (``mu_scale [b, h, P, 1]``, ``basis_scale [b, h, P, r]``,
    ``coef_scale [b, h, P, B]``), which are applied to the small projected tensors, not the codes.
    """
    q = query.to(mu.dtype)
    proj = torch.einsum("bhgd,bhprd->bhgpr", q, basis)  # V_j^T q
    if basis_scale is not None:
        proj = proj * basis_scale.unsqueeze(2)
    logits = torch.einsum("bhgpr,bhpir->bhgpi", proj, coef)
    if coef_scale is not None:
        logits = logits * coef_scale.unsqueeze(2)
    centroid = torch.einsum("bhgd,bhpd->bhgp", q, mu)
    if mu_scale is not None:
        centroid = centroid * mu_scale.squeeze(-1).unsqueeze(2)
    return scale * centroid + masked_lse(scale * logits, valid.unsqueeze(2))


def exact_page_lse(keys: torch.Tensor, valid: torch.Tensor, query: torch.Tensor, scale: float) -> torch.Tensor:
    """``s_j(q) = LSE_i(scale * q.k_i)`` reading every key: ``keys [b, h, P, B, d]`` -> ``[b, h, G, P]``."""
    dtype = _compute_dtype(keys)
    logits = scale * torch.einsum("bhgd,bhpid->bhgpi", query.to(dtype), keys.to(dtype))
    return masked_lse(logits, valid.unsqueeze(2))
