"""LazyEviction (Zhang et al., ACL 2026): lagged eviction from observed attention recurrence.

Every decode step records, per query head and resident token, the last step at which the token
received attention probability at least ``alpha`` and the longest interval between two such
steps (its recurrence period). Every ``W`` steps, once more than ``b`` tokens are resident, the
cache is cut back to ``b``: the ``W`` newest tokens stay and the other ``b - W`` places go to the
tokens of highest importance ``2 / (1 + exp(1 + (t - last) / (period + 1e-5))) + s``, with
``s = 2 / (1 + exp(period - 1))`` for tokens that have recurred (0 otherwise). Each query head keeps
its own cache (a GQA group may read up to ``G b`` distinct tokens; the accounting reports the
union). ``W = round(0.243 b)`` (the published 363-token window at 1492 capacity, scaled to the
budget). ``alpha`` follows the model family (`family_alpha`: the published 1e-4 for Qwen, 5e-4 for
Llama, 1e-4 for any other family) unless ``LocksConfig.lazy_alpha`` sets it (arm label
``lazy_eviction-a<alpha>``, e.g. ``lazy_eviction-a0.0005``).
"""

from __future__ import annotations

import math

import torch

from ..errors import LocksConfigError
from ..token_policy import PolicyState, TokenPolicy

#: The published attention threshold per model family (``model_type`` prefix): Qwen3 1e-4, Llama 5e-4.
ALPHA_BY_FAMILY = {"qwen": 1e-4, "llama": 5e-4}
#: Families without a published value (Gemma, ...) take the Qwen3 setting, the method's main one.
DEFAULT_ALPHA = 1e-4
WINDOW_FRACTION = 363 / 1492


def family_alpha(text_config) -> float:
    """LazyEviction's ``alpha`` for the model ``text_config`` describes (`ALPHA_BY_FAMILY` by the
    prefix of its ``model_type``, else `DEFAULT_ALPHA`; ``None``: `DEFAULT_ALPHA`)."""
    model_type = str(getattr(text_config, "model_type", "") or "")
    return next((a for prefix, a in ALPHA_BY_FAMILY.items() if model_type.startswith(prefix)), DEFAULT_ALPHA)


def window_size(budget: int) -> int:
    return max(1, round(WINDOW_FRACTION * budget))


def importance(step: int, last: torch.Tensor, period: torch.Tensor) -> torch.Tensor:
    """LazyEviction's importance of tokens last attended at ``last`` with recurrence ``period``."""
    recurred = torch.where(period == 0, 0.0, 2 / (1 + torch.exp(period - 1)))
    return 2 / (1 + torch.exp(1 + (step - last) / (period + 1e-5))) + recurred


def record_recurrence(state: PolicyState, step: int, probs: torch.Tensor, alpha: float) -> None:
    """Update the last-attended steps and recurrence periods from one step's ``probs [b, h, G, L]``
    (a token counts as attended when its probability reaches ``alpha``)."""
    last = state.slot["last"]
    new_last = torch.where(probs >= alpha, float(step), last)
    state.slot["period"] = torch.maximum(state.slot["period"], new_last - last)
    state.slot["last"] = new_last


def evicted(keep: torch.Tensor, score: torch.Tensor, budget: int, window: int) -> torch.Tensor:
    """The keep mask ``[..., L]`` cut to ``budget``: the ``window`` newest kept tokens and the
    ``budget - window`` best-scoring older ones (ties to the earlier token); masks holding at most
    ``budget`` tokens are unchanged."""
    from_end = keep.flip(-1).cumsum(-1).flip(-1)  # kept tokens at or after each slot
    newest = keep & (from_end <= window)
    candidates = keep & ~newest
    order = torch.sort(score.masked_fill(~candidates, -math.inf), dim=-1, descending=True, stable=True).indices
    best = torch.zeros_like(keep).scatter_(-1, order[..., : budget - window], True) & candidates
    return torch.where((keep.sum(-1) > budget).unsqueeze(-1), best | newest, keep)


class LazyEvictionPolicy(TokenPolicy):
    """LazyEviction at per-query-head capacity ``b`` with window ``W = 0.243 b``."""

    name = "lazy_eviction"
    report_order = 66
    own_settings = {"lazy_alpha": None}  # None: the model family's published value, chosen at decode
    per_query_head = True
    family_grammar = "lazy_eviction or lazy_eviction-a<alpha> (e.g. lazy_eviction-a0.0005)"

    @classmethod
    def parse_family(cls, family):
        """``lazy_eviction`` (alpha of the model family) or ``lazy_eviction-a<alpha>``."""
        if family == cls.name:
            return {}
        prefix = f"{cls.name}-a"
        if not family.startswith(prefix):
            return None
        try:
            alpha = float(family[len(prefix) :])
        except ValueError:
            return None
        return {"lazy_alpha": alpha}

    @classmethod
    def family(cls, config):
        return cls.name if config.lazy_alpha is None else f"{cls.name}-a{config.lazy_alpha:g}"

    @classmethod
    def validate(cls, config, head_dim=None):
        super().validate(config, head_dim)
        alpha = config.lazy_alpha
        if alpha is not None and not 0 < alpha < 1:
            raise LocksConfigError(f"lazy_alpha is an attention probability threshold in (0, 1), got {alpha!r}")

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        alpha = self.config.lazy_alpha
        state.info["alpha"] = family_alpha(layer.text_config) if alpha is None else alpha
        zeros = torch.zeros(state.keep.shape, dtype=torch.float64, device=state.keep.device)
        state.add_slot_tensor("last", zeros, 0.0)  # a token written at step t starts at t - 1
        state.add_slot_tensor("period", zeros.clone(), 0.0)
        return state

    def observe(self, layer, state, query, probs):
        step = state.steps + 1
        record_recurrence(state, step, probs, state.info["alpha"])
        W = window_size(self.config.budget)
        if step % W == 0:
            score = importance(step, state.slot["last"], state.slot["period"])
            state.keep = evicted(state.keep, score, self.config.budget, W)
        state.set_fill("last", float(step))
