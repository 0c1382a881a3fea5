"""Quest (Tang et al., 2024): per-dimension key max / min per page, an upper bound of ``q . k``."""

from __future__ import annotations

import torch

from .base import PageSelector
from .selection import NEG_INF


class QuestSelector(PageSelector):
    """Quest: per-dimension key max/min per page, score ``sum_c max(q_c u_c, q_c l_c)``."""

    name = "quest"
    per_head = True
    kernel_method = "quest"
    report_order = 50

    def summarize(self, keys, valid, shared=None):
        v = valid.unsqueeze(-1)
        upper = keys.masked_fill(~v, NEG_INF).amax(-2)
        lower = keys.masked_fill(~v, float("inf")).amin(-2)
        return {"upper": upper, "lower": lower}

    def page_scores(self, summary, keys, valid, query, scale):
        q = query.unsqueeze(3).to(summary["upper"].dtype)  # [b, h, G, 1, d]
        upper, lower = summary["upper"].unsqueeze(2), summary["lower"].unsqueeze(2)
        return torch.maximum(q * upper, q * lower).sum(-1).float()
