"""Locks with exact re-ranking (``"locks_rerank"``): the summaries shortlist, the keys decide.

At a tight budget (``k = 4`` page slots: sink, recent and two free pages) the estimated page LSE of
a rank-r int4 summary often ranks the pages that carry the most attention mass just below the cut.
Re-ranking keeps the summaries' scan of every page and adds one exact step on a short list:

1. every page is scored from its summary (`LocksSelector`) and the shared rule picks the best
   ``m * k`` candidates (besides the forced sink and recent pages);
2. the candidates' exact page LSE ``LSE_i(scale * q.k_i)`` is computed from their original keys;
3. the shared rule runs again on the scores with the candidates' estimates replaced by their exact
   values, each head's softmax still over every candidate page, and the free slots may only go to
   the short list. The pages off the list keep their estimates, shifted by the mean gap between
   exact and estimated scores over the list (per head): a rank-r estimate misses the keys' residual
   and so underestimates a page's LSE (on Gemma 3 270M by 0.6-0.9 nats on average), and an
   uncorrected tail would weigh each head's softmax by how much of its mass is off the list.

The extra read is ``m * k`` pages of keys per KV head and step (`candidate_key_pages`), counted in
`LocksCache.decode_traffic`. The summaries are the paper's, so a cache forks between ``"locks"``
and ``"locks_rerank"`` without a rebuild of anything but the selector.
"""

from __future__ import annotations

import re

import torch

from ..summaries import exact_page_lse
from .locks import LocksSelector
from .selection import forced_pages, select_pages

_FAMILY = re.compile(r"^(?:locks-)?r(?P<rank>\d+)(?:i(?P<bits>\d+)|(?P<bf16>bf16))-rr(?P<m>\d+)$")


def candidate_lists(selected: torch.Tensor, forced: torch.Tensor, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Page numbers ``[b, h, width]`` of the selected, non-forced pages (ascending), and which
    entries hold one (the list is padded when fewer pages are selected)."""
    shortlisted = selected & ~forced
    width = min(width, shortlisted.shape[-1])
    pages = torch.sort(shortlisted.to(torch.int8), dim=-1, descending=True, stable=True).indices[..., :width]
    return pages, shortlisted.gather(-1, pages)


def rerank_pages(
    scores: torch.Tensor,
    keys: torch.Tensor,
    valid: torch.Tensor,
    query: torch.Tensor,
    scale: float,
    page_complete: torch.Tensor,
    slots: int,
    candidates: int,
    rule: str,
) -> torch.Tensor:
    """The re-ranked page set ``[b, h, P]`` (module docstring).

    ``scores [b, h, G, P]`` the estimated page scores; ``keys [b, h, P, B, d]`` (only the candidates'
    are read); ``valid [b, 1, P, B]``; ``query [b, h, G, d]``; ``page_complete [b, P]``; ``slots`` the
    budget's ``k``; ``candidates`` the short list's length.
    """
    page_real = valid[:, 0].any(-1)
    shortlist = select_pages(scores, page_real, page_complete, candidates + 2, rule, per_head=False)
    sink, recent = forced_pages(page_real)
    pages, taken = candidate_lists(shortlist, (sink | recent)[:, None], candidates)  # [b, h, M]
    b, h, P, B, d = keys.shape
    cand_keys = keys.gather(2, pages[..., None, None].expand(-1, -1, -1, B, d))
    cand_valid = valid.expand(-1, h, -1, -1).gather(2, pages[..., None].expand(-1, -1, -1, B))
    exact = exact_page_lse(cand_keys, cand_valid, query, scale).to(scores.dtype)  # [b, h, G, M]
    index = pages[:, :, None].expand_as(exact)
    listed = scores.gather(-1, index)
    gap = exact - listed
    known = taken[:, :, None] & torch.isfinite(gap)
    shift = torch.where(known, gap, 0.0).sum(-1, keepdim=True) / known.sum(-1, keepdim=True).clamp_min(1)
    rescored = (scores + shift).scatter(-1, index, torch.where(taken[:, :, None], exact, listed + shift))
    return select_pages(rescored, page_real, page_complete, slots, rule, per_head=False, eligible=shortlist)


class LocksRerankSelector(LocksSelector):
    """Locks summaries shortlist ``m * k`` pages; their exact page LSE picks the ``k - 2`` free pages."""

    name = "locks_rerank"
    own_settings = {"rerank": 8}  # 8k candidates unless set
    reads_candidate_keys = True
    summary_of = "locks"
    report_order = 22
    family_grammar = "locks-r<rank>i<bits>-rr<m> (exact re-ranking of m*k candidates, e.g. locks-r4i4-rr4)"

    @classmethod
    def parse_family(cls, family):
        """``r4i4-rr4`` / ``locks-r8bf16-rr2``: a Locks label and the candidate multiple ``m``."""
        match = _FAMILY.match(family)
        if match is None:
            return None
        bits = 16 if match["bf16"] else int(match["bits"])
        return {"rank": int(match["rank"]), "basis_bits": bits, "rerank": int(match["m"])}

    @classmethod
    def family(cls, config):
        return f"{LocksSelector.family(config)}-rr{config.rerank}"

    @classmethod
    def family_sort_key(cls, fields):
        return (*super().family_sort_key(fields), -fields.get("rerank", 0))

    def candidates(self, config=None) -> int:
        """Length ``m * k`` of the short list (at the budget of ``config``, default the selector's)."""
        config = config or self.config
        return config.rerank * config.page_slots

    def candidate_key_pages(self, pages):
        return min(self.candidates(), max(pages, 0))

    def choose_pages(self, summary, keys, valid, query, scale, page_complete, config):
        return rerank_pages(
            self.all_page_scores(summary, None, valid, query, scale),
            keys,
            valid,
            query,
            scale,
            page_complete,
            config.page_slots,
            self.candidates(config),
            config.group_combine,
        )
