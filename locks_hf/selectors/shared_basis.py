"""The shared-basis controls of the paper's Table 1 (§3): one basis per (row, KV head) fitted on the
prompt and frozen after prefill, with page centroids (``shared_basis``) or a shared one too
(``shared_all``). They show what page-local state buys; they need the whole prompt, so only
`LocksCache` (not the static cache) runs them.
"""

from __future__ import annotations

import re

import torch

from ..quant import pack, quantize, unpack
from ..summaries import estimated_page_lse
from .base import PageSelector


class SharedBasisSelector(PageSelector):
    """Control of the paper's Table 1: page centroids, one rank-r basis per (row, KV head) fitted on
    the prompt's page-centered keys and frozen after prefill. Scored like Locks."""

    name = "shared_basis"
    static_cache = False  # the basis is fitted on the whole prompt
    summary_fields = ("rank", "basis_bits", "coef_bits", "centroid_bits")
    uses_rank = True
    report_order = 30
    family_grammar = "shared_basis-r<rank> (int4 basis; shared_basis-r<rank>i<bits> otherwise)"

    #: Center on the sequence's mean key instead of each page's centroid (the "fully shared" row).
    shared_centroid = False

    @classmethod
    def parse_family(cls, family):
        """``shared_basis-r20`` (int4 basis) or ``shared_basis-r20i8``."""
        match = re.match(rf"^{cls.name}-r(\d+)(?:i(\d+))?$", family)
        return None if match is None else {"rank": int(match[1]), "basis_bits": int(match[2] or 4)}

    @classmethod
    def family(cls, config):
        bits = "" if config.basis_bits == 4 else f"i{config.basis_bits}"
        return f"{cls.name}-r{config.rank}{bits}"

    def fit_sequence(self, keys, valid):
        c = self.config
        real = valid.unsqueeze(-1)
        k, w = torch.where(real, keys.float(), 0.0), real.float()
        if self.shared_centroid:
            mu = k.sum((2, 3)) / w.sum((2, 3)).clamp_min(1.0)  # [b, h, d]
            centered = torch.where(real, k - mu[:, :, None, None], 0.0)
        else:
            mu = None
            centered = torch.where(real, k - k.sum(3, keepdim=True) / w.sum(3, keepdim=True).clamp_min(1.0), 0.0)
        # NaN / Inf keys would make the SVD raise; their pages score NaN through their centroids.
        centered = torch.where(torch.isfinite(centered), centered, 0.0)
        _, _, vh = torch.linalg.svd(centered.flatten(2, 3), full_matrices=False)
        out = {}
        basis = vh[..., : c.rank, :]
        out.update(_quantized("seq_basis", basis, c.basis_bits, packed=True))
        if mu is not None:
            out.update(_quantized("seq_mu", mu, c.centroid_bits))
        return out

    def summarize(self, keys, valid, shared=None):
        c = self.config
        basis = _dequantized(shared, "seq_basis", c.basis_bits)  # [b, h, r, d]
        real = valid.unsqueeze(-1)
        k, w = torch.where(real, keys.float(), 0.0), real.float()
        if self.shared_centroid:
            center = _dequantized(shared, "seq_mu", c.centroid_bits)[:, :, None, None]
            out = {}
        else:
            center = (k.sum(3) / w.sum(3).clamp_min(1.0)).unsqueeze(3)
            out = _quantized("mu", center.squeeze(3), c.centroid_bits)
        coef = torch.where(real, k - center, 0.0) @ basis.transpose(-1, -2)[:, :, None]  # [b, h, n, B, r]
        out.update(_quantized("coef", coef, c.coef_bits))
        return out

    def page_scores(self, summary, keys, valid, query, scale):
        c = self.config
        n = summary["coef"].shape[2]
        basis = _dequantized(summary, "seq_basis", c.basis_bits)[:, :, None].expand(-1, -1, n, -1, -1)
        if self.shared_centroid:
            mu = _dequantized(summary, "seq_mu", c.centroid_bits)[:, :, None].expand(-1, -1, n, -1)
        else:
            mu = _dequantized(summary, "mu", c.centroid_bits)
        coef = _dequantized(summary, "coef", c.coef_bits)
        return estimated_page_lse(mu, basis, coef, valid[:, :, :n], query.float(), scale)


class SharedAllSelector(SharedBasisSelector):
    """Control of the paper's Table 1: centroid and basis both fitted on the prompt (fully shared)."""

    name = "shared_all"
    report_order = 40
    family_grammar = "shared_all-r<rank>"
    shared_centroid = True


def _quantized(name: str, x: torch.Tensor, bits: int, packed: bool = False) -> dict[str, torch.Tensor]:
    """``{name: codes, name_scale: scales}`` (one scale per last-dim row), or ``{name: x}`` at 16 bits."""
    if bits >= 16:
        return {name: x.to(torch.bfloat16)}
    codes, scale = quantize(x, bits, dim=-1)
    return {name: pack(codes, bits) if packed else codes, f"{name}_scale": scale.squeeze(-1)}


def _dequantized(tensors: dict[str, torch.Tensor], name: str, bits: int) -> torch.Tensor:
    x = tensors[name]
    if f"{name}_scale" not in tensors:
        return x.float()
    codes = unpack(x, bits) if name == "seq_basis" else x
    return codes.float() * tensors[f"{name}_scale"].float().unsqueeze(-1)
