"""Locks (the paper's method): estimated page LSE from a page-local rank-r key summary (the paper's §4)."""

from __future__ import annotations

import re

import torch

from ..summaries import build_summary, estimated_page_lse, summary_factors
from .base import PageSelector

_FAMILY = re.compile(r"^(?:locks-)?r(?P<rank>\d+)(?:i(?P<bits>\d+)|(?P<bf16>bf16))$")


class LocksSelector(PageSelector):
    """Estimated page LSE from the rank-r summary (the paper's method)."""

    name = "locks"
    kernel_method = "locks"
    summary_fields = ("rank", "basis_bits", "coef_bits", "centroid_bits")
    uses_rank = True
    report_order = 20
    family_grammar = "locks-r<rank>i<bits> (e.g. locks-r8i4) or locks-r<rank>bf16"

    @classmethod
    def validate(cls, config, head_dim=None):
        B = config.page_size
        if config.rank > B:
            from ..errors import LocksConfigError

            raise LocksConfigError(
                f"rank must be in 1..page_size={B} (a page of {B} centered keys spans at most "
                f"{B - 1} directions), got {config.rank!r}"
            )
        super().validate(config, head_dim)

    @classmethod
    def parse_family(cls, family):
        """``r8i4`` / ``r4i2`` / ``r8bf16``, optionally prefixed ``locks-``."""
        match = _FAMILY.match(family)
        if match is None:
            return None
        return {"rank": int(match["rank"]), "basis_bits": 16 if match["bf16"] else int(match["bits"])}

    @classmethod
    def family(cls, config):
        bits = "bf16" if config.basis_bits == 16 else f"i{config.basis_bits}"
        return f"locks-r{config.rank}{bits}"

    def summarize(self, keys, valid, shared=None):
        c = self.config
        return build_summary(keys, valid, c.rank, c.basis_bits, c.coef_bits, c.centroid_bits)

    def page_scores(self, summary, keys, valid, query, scale):
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        factors = summary_factors(summary, self.config.basis_bits, dtype)
        P = factors["mu"].shape[2]
        return estimated_page_lse(valid=valid[:, :, :P], query=query, scale=scale, **factors)
