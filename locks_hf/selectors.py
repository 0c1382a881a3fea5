"""Page selectors behind one interface: summarize completed pages, score pages for a query, select.

A selector sees one layer's paged cache at a decode step:

* ``keys``   ``[b, h, P, B, d]`` cached post-RoPE keys, split into pages (the last may be partial),
  given only to selectors that set ``reads_keys`` (the oracle); ``None`` for the others;
* ``valid``  ``[b, 1, P, B]`` which slots hold real tokens (False for padding and unwritten slots);
* ``summary`` its own per-page tensors ``[b, h, P, ...]`` built by `summarize` (complete pages only);
* ``query``  ``[b, h, G, d]`` the step's query heads grouped by KV head.

`page_scores` returns ``[b, h, G, P]`` per query head; `select_pages` turns them into the page set
of the paper's §4: sink and most recent page forced, the best ``k - 2`` remaining complete pages added.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from .config import LocksConfig
from .quant import pack, quantize, unpack
from .summaries import build_summary, estimated_page_lse, exact_page_lse, summary_factors

NEG_INF = float("-inf")


class PageSelector(ABC):
    """Base class: a new selector is a `summarize` (optional) and a `page_scores`."""

    #: Each query head picks its own pages and the group attends their union (Quest's GQA port).
    per_head: bool = False
    #: Scoring reads every cached key (the exact oracle) rather than summaries only.
    reads_keys: bool = False
    #: Chooses single tokens through a keep mask (`locks_hf.token_policy`) instead of pages.
    token_level: bool = False

    def __init__(self, config: LocksConfig) -> None:
        self.config = config

    def fit_sequence(self, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequence-level state ``[b, h, ...]`` fitted once on the prompt's pages, then frozen.

        ``keys [b, h, n, B, d]``, ``valid [b, h, n, B]``. Only the shared-basis controls use it.
        """
        return {}

    def summarize(self, keys: torch.Tensor, valid: torch.Tensor,
                  shared: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Per-page state from ``keys [b, h, n, B, d]`` and ``valid [b, h, n, B]`` (complete pages),
        given the sequence-level state ``shared`` from `fit_sequence`."""
        return {}

    @abstractmethod
    def page_scores(self, summary: dict[str, torch.Tensor], keys: torch.Tensor | None, valid: torch.Tensor,
                    query: torch.Tensor, scale: float) -> torch.Tensor:
        """Scores ``[b, h, G, P]``; larger means the page should be kept. ``summary`` holds the
        per-page tensors and the sequence-level ones of `fit_sequence`."""


class LocksSelector(PageSelector):
    """Estimated page LSE from the rank-r summary (the paper's method)."""

    def summarize(self, keys, valid, shared=None):
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

    def summarize(self, keys, valid, shared=None):
        v = valid.unsqueeze(-1)
        upper = keys.masked_fill(~v, NEG_INF).amax(-2)
        lower = keys.masked_fill(~v, float("inf")).amin(-2)
        return {"upper": upper, "lower": lower}

    def page_scores(self, summary, keys, valid, query, scale):
        q = query.unsqueeze(3).to(summary["upper"].dtype)  # [b, h, G, 1, d]
        upper, lower = summary["upper"].unsqueeze(2), summary["lower"].unsqueeze(2)
        return torch.maximum(q * upper, q * lower).sum(-1).float()


class SharedBasisSelector(PageSelector):
    """Control of the paper's Table 1: page centroids, one rank-r basis per (row, KV head) fitted on
    the prompt's page-centered keys and frozen after prefill. Scored like Locks."""

    #: Center on the sequence's mean key instead of each page's centroid (the "fully shared" row).
    shared_centroid = False

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


_SELECTORS: dict[str, type[PageSelector]] = {
    "locks": LocksSelector,
    "oracle": OracleSelector,
    "quest": QuestSelector,
    "shared_basis": SharedBasisSelector,
    "shared_all": SharedAllSelector,
}


def make_selector(config: LocksConfig) -> PageSelector | None:
    """The selector for ``config.selector``; ``None`` for ``"full"`` (dense decode). The paper's
    baselines are token-level policies (`locks_hf.token_policy.TokenPolicy`)."""
    from .baselines import POLICIES

    cls = _SELECTORS.get(config.selector) or POLICIES.get(config.selector)
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
    """Boolean page set ``[b, h, P]`` under the paper's §4 selection rule.

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
