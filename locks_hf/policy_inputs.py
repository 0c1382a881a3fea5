"""`PolicyInputs`: what a dynamic layer keeps for the token-level policies besides its K/V.

KVzip and RocketKV score the prompt: they need the last prompt queries, scores computed once per
prompt, the decode length announced before decoding, the model's rotary settings, and the policy's
own `token_policy.PolicyState`. A dynamic Locks layer holds them through this mixin, so its storage
code does not mix with them; rows are re-mapped with the layer's (`map_policy_inputs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: Prompt queries kept per layer (the last ones of the multi-token forwards) for policies that score
#: the prompt with an observation window (RocketKV's SnapKV stage uses 32).
PROMPT_QUERY_WINDOW = 32


class PolicyInputs:
    """The token-level policies' host-side inputs of one layer (see the module docstring)."""

    keys: torch.Tensor | None

    def clear_policy_inputs(self) -> None:
        self.prompt_queries: torch.Tensor | None = None  # [b, Hq, <=PROMPT_QUERY_WINDOW, d]
        self.policy_state = None  # a token-level policy's `PolicyState`, built at the first decode step
        self.expected_new_tokens = 0  # decode length announced by `LocksCache.expect_new_tokens`
        self.text_config = None  # the model's text config, set by `LocksCache` (rotary frequencies)
        self.prefill_scores: dict[str, torch.Tensor] = {}  # per-token scores computed once per prompt (KVzip)
        self.score_request = None  # collects scores from the queries of multi-token forwards (KVzip)

    def observe_prompt_queries(self, query: torch.Tensor, scale: float) -> None:
        """Keep the last `PROMPT_QUERY_WINDOW` queries ``[b, Hq, t, d]`` of multi-token forwards (and
        hand them to a pending score request)."""
        held = query if self.prompt_queries is None else torch.cat([self.prompt_queries, query], dim=2)
        # a copy: a slice would keep the whole prompt's queries alive (32 GiB at 128K on Llama-3.1-8B)
        self.prompt_queries = held[:, :, -PROMPT_QUERY_WINDOW:].detach().clone()
        if self.score_request is not None:
            self.score_request.update(query, self.keys, scale)

    def map_policy_inputs(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim transform (beam reorder, row selection, clone) to the per-row inputs."""
        if self.prompt_queries is not None:
            self.prompt_queries = fn(self.prompt_queries)
        self.prefill_scores = {n: fn(t) for n, t in self.prefill_scores.items()}
        if self.policy_state is not None:
            self.policy_state = self.policy_state.mapped(fn)

    def truncate_policy_inputs(self, length: int) -> None:
        """The layer now holds ``length`` slots (a crop)."""
        if self.policy_state is not None:
            self.policy_state.truncate(length)
