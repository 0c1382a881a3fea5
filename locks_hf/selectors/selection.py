"""The page-set rule shared by every selector (the paper's §2 and §4).

The sink page (first with a real token) and the most recent page are always attended; the other
``k - 2`` slots take the best remaining complete pages, ranked by one score per page for the GQA
group (`combine_group`), or per query head with the group attending the union (``per_head``).
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


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


def select_pages(
    scores: torch.Tensor,
    page_real: torch.Tensor,
    page_complete: torch.Tensor,
    slots: int,
    rule: str,
    per_head: bool,
    eligible: torch.Tensor | None = None,
) -> torch.Tensor:
    """Boolean page set ``[b, h, P]`` (the paper's §4).

    ``scores [b, h, G, P]``; ``page_real [b, P]`` pages holding a real token; ``page_complete``
    ``[b, P]`` or ``[P]`` pages whose last slot is written.
    The sink and the most recent page are always kept; the other ``slots - 2`` slots
    take the best remaining complete pages. With ``per_head`` every query head selects on its own
    and the group attends the union. ``eligible`` (``[b, h, P]``, optional) restricts the pages that
    may take a free slot without changing the group's softmax, which still runs over every
    candidate (exact re-ranking chooses among its short list this way).
    """
    P = scores.shape[-1]
    sink, recent = forced_pages(page_real)
    forced = ((sink | recent) & page_real)[:, None]  # [b, 1, P]
    candidates = (page_real & page_complete)[:, None] & ~forced  # [b, 1, P]
    # NaN / +Inf scores come from pages whose keys are not finite: they are taken first, as dense
    # attention would attend them (and propagate the NaN); they take no part in the group's softmax.
    poisoned = torch.isnan(scores) | torch.isposinf(scores)
    pool = candidates if eligible is None else candidates & eligible  # [b, 1 | h, P]
    if per_head:
        chosen = _top_pages(scores.masked_fill(poisoned, float("inf")), pool.unsqueeze(2), slots - 2).any(2)
    else:
        combined = combine_group(
            scores.masked_fill(poisoned, NEG_INF), candidates.expand(-1, scores.shape[1], -1), rule
        )
        chosen = _top_pages(combined.masked_fill(poisoned.any(2), float("inf")), pool, slots - 2)
    return (chosen | forced).expand(scores.shape[0], scores.shape[1], P)
