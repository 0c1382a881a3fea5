"""The token-level policies' backend: eviction and per-token selection (`locks_hf.token_policy`).

A policy keeps its own per-slot state and attends through its reference PyTorch step on any device;
it has no page summaries and no static layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..token_policy import policy_decode
from .base import DecodeBackend

if TYPE_CHECKING:
    from ..paged import PagedLayer


class TokenPolicyBackend(DecodeBackend):
    """`token_policy.policy_decode` (its statistics and estimation bytes recorded there)."""

    name = "token_policy"

    def decode(self, layer: PagedLayer, query: torch.Tensor, scale: float) -> torch.Tensor:
        return policy_decode(layer, query, scale)

    def update_newest_page(self, layer: PagedLayer) -> None:
        raise TypeError("a token-level policy keeps no page summaries (it is not usable by the static layout)")

    def build_summary(self, layer: PagedLayer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        return {}


TOKEN_POLICY = TokenPolicyBackend()
