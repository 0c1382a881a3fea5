"""Page selectors behind one interface: summarize completed pages, score pages for a query, select.

A selector sees one layer's paged cache at a decode step:

* ``keys``   ``[b, h, P, B, d]`` cached post-RoPE keys, split into pages (the last may be partial),
  given only to selectors that set ``reads_keys`` (the oracle); ``None`` for the others;
* ``valid``  ``[b, 1, P, B]`` which slots hold real tokens (False for padding and unwritten slots);
* ``summary`` its own per-page tensors ``[b, h, P, ...]`` built by `summarize` (complete pages only);
* ``query``  ``[b, h, G, d]`` the step's query heads grouped by KV head.

`page_scores` returns ``[b, h, G, P]`` per query head; `select_pages` turns them into the page set
of SPEC §1: sink and most recent page forced, the best ``k - 2`` remaining complete pages added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .config import LocksConfig
from .summaries import build_summary, estimated_page_lse, exact_page_lse, summary_factors

NEG_INF = float("-inf")


class PageSelector(ABC):
    """Base class: a new selector is a `summarize` (optional) and a `page_scores`."""

    #: Each query head picks its own pages and the group attends their union (Quest's GQA port).
    per_head: bool = False
    #: Scoring reads every cached key (the exact oracle) rather than summaries only.
    reads_keys: bool = False

    def __init__(self, config: LocksConfig) -> None:
        self.config = config

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-page state from ``keys [..., B, d]`` and ``valid [..., B]`` (complete pages only)."""
        return {}

    @abstractmethod
    def page_scores(self, summary: dict[str, torch.Tensor], keys: torch.Tensor, valid: torch.Tensor,
                    query: torch.Tensor, scale: float) -> torch.Tensor:
        """Scores ``[b, h, G, P]``; larger means the page should be kept."""


class LocksSelector(PageSelector):
    """Estimated page LSE from the rank-r summary (the paper's method)."""

    def summarize(self, keys, valid):
        c = self.config
        return build_summary(keys, valid, c.rank, c.basis_bits, c.coef_bits, c.centroid_bits)

    def page_scores(self, summary, keys, valid, query, scale):
        dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        factors = summary_factors(summary, self.config.basis_bits, dtype)
        P = factors["mu"].shape[2]
        return estimated_page_lse(valid=valid[:, :, :P], query=query, scale=scale, **factors)


class OracleSelector(PageSelector):
    """Exact page LSE, reading every key (an upper reference, not a fast method)."""

    reads_keys = True

    def page_scores(self, summary, keys, valid, query, scale):
        return exact_page_lse(keys, valid, query, scale)


class QuestSelector(PageSelector):
    """Quest: per-dimension key max/min per page, score ``sum_c max(q_c u_c, q_c l_c)``."""

    per_head = True

    def summarize(self, keys, valid):
        v = valid.unsqueeze(-1)
        upper = keys.masked_fill(~v, NEG_INF).amax(-2)
        lower = keys.masked_fill(~v, float("inf")).amin(-2)
        return {"upper": upper, "lower": lower}

    def page_scores(self, summary, keys, valid, query, scale):
        q = query.unsqueeze(3).to(summary["upper"].dtype)  # [b, h, G, 1, d]
        upper, lower = summary["upper"].unsqueeze(2), summary["lower"].unsqueeze(2)
        return torch.maximum(q * upper, q * lower).sum(-1).float()


_SELECTORS: dict[str, type[PageSelector]] = {
    "locks": LocksSelector,
    "oracle": OracleSelector,
    "quest": QuestSelector,
}


def make_selector(config: LocksConfig) -> PageSelector | None:
    """The selector for ``config.selector``; ``None`` for ``"full"`` (dense decode)."""
    cls = _SELECTORS.get(config.selector)
    return None if cls is None else cls(config)


def combine_group(scores: torch.Tensor, candidates: torch.Tensor, rule: str) -> torch.Tensor:
    """One score per page for the whole GQA group: ``[b, h, G, P]`` -> ``[b, h, P]``.

    ``share_average`` (paper): mean over heads of each head's softmax over the candidate pages.
    ``group_max``: max over heads of the page score. ``group_mass``: log of the summed page mass.
    Non-candidates score ``-inf``.
    """
    s = scores.masked_fill(~candidates.unsqueeze(2), NEG_INF)
    if rule == "share_average":
        shares = torch.softmax(s, dim=-1).nan_to_num(0.0)  # no candidate at all -> all zero
        combined = shares.mean(2)
    elif rule == "group_max":
        combined = s.amax(2)
    elif rule == "group_mass":
        combined = torch.logsumexp(s, dim=2)
    else:
        raise ValueError(f"unknown group combine rule {rule!r}")
    return combined.masked_fill(~candidates, NEG_INF)


def _top_pages(scores: torch.Tensor, candidates: torch.Tensor, slots: int) -> torch.Tensor:
    """Mask of the ``slots`` best candidates on the last dim; ties go to the earlier page."""
    P = scores.shape[-1]
    if slots <= 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    s = scores.masked_fill(~candidates, NEG_INF)
    order = torch.sort(s, dim=-1, descending=True, stable=True).indices[..., : min(slots, P)]
    chosen = torch.zeros(s.shape, dtype=torch.bool, device=s.device).scatter_(-1, order, True)
    return chosen & candidates


def forced_pages(page_real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks ``[b, P]`` of the sink page (first page with a real token) and the most recent page
    (the last one with a real token: decode tokens are real, so it holds the newest token)."""
    P = page_real.shape[-1]
    idx = torch.arange(P, device=page_real.device)
    first = torch.where(page_real, idx, P).amin(-1, keepdim=True)
    last = torch.where(page_real, idx, -1).amax(-1, keepdim=True)
    return idx == first, idx == last


def select_pages(scores: torch.Tensor, page_real: torch.Tensor, page_complete: torch.Tensor,
                 slots: int, rule: str, per_head: bool) -> torch.Tensor:
    """Boolean page set ``[b, h, P]`` under SPEC §1.

    ``scores [b, h, G, P]``; ``page_real [b, P]`` pages holding a real token; ``page_complete``
    ``[b, P]`` or ``[P]`` pages whose last slot is written.
    The sink and the most recent page are always kept; the other ``slots - 2`` slots
    take the best remaining complete pages. With ``per_head`` every query head selects on its own
    and the group attends the union.
    """
    P = scores.shape[-1]
    sink, recent = forced_pages(page_real)
    forced = ((sink | recent) & page_real)[:, None]  # [b, 1, P]
    candidates = (page_real & page_complete)[:, None] & ~forced  # [b, 1, P]
    if per_head:
        chosen = _top_pages(scores, candidates.unsqueeze(2), slots - 2).any(2)
    else:
        combined = combine_group(scores, candidates.expand(-1, scores.shape[1], -1), rule)
        chosen = _top_pages(combined, candidates, slots - 2)
    return (chosen | forced).expand(scores.shape[0], scores.shape[1], P)
