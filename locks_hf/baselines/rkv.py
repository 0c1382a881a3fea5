"""R-KV (Cai et al., NeurIPS 2025): redundancy-aware KV eviction for long reasoning.

Decode-time compression with the published reasoning settings: generated tokens enter a buffer;
every 128 generated tokens, once the resident cache holds at least ``b + 128`` tokens, it is
compressed back to ``b``. Each resident token but the 8 newest is scored
``lambda * importance - (1 - lambda) * redundancy`` (``lambda = 0.1``):

* importance: softmax attention of the last 8 decode queries (logits max-reduced over the GQA group)
  over the older resident keys, averaged over the 8 queries and max-pooled over 7 neighbours;
* redundancy: the pairwise cosine similarity of the resident keys (diagonal zeroed); for every key
  its most recent neighbour above 0.5 similarity is exempted, and the column means of what remains,
  softmax-normalised, say how much each key repeats the others.

The ``b - 8`` best-scoring tokens and the 8 newest stay (one set per KV head).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..token_policy import PolicyState, TokenPolicy, gather_slots, kept_indices, slots_mask

OBSERVATION = 8  # the last decode queries that score importance (R-KV's alpha)
BUFFER = 128  # generated tokens between compressions
POOL_KERNEL = 7
MIX_LAMBDA = 0.1
SIMILARITY_THRESHOLD = 0.5


def redundancy(keys: torch.Tensor) -> torch.Tensor:
    """``[..., R]`` redundancy of each of the keys ``[..., R, d]`` (R-KV's ``retain_direction="last"``)."""
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = unit @ unit.transpose(-1, -2)
    sim.diagonal(dim1=-2, dim2=-1).zero_()
    R = sim.shape[-1]
    # each key's most recent highly similar neighbour (index 0 when it has none, as in the reference)
    newest = (torch.arange(R, device=keys.device) * (sim > SIMILARITY_THRESHOLD)).amax(-1, keepdim=True)
    sim = sim.scatter(-1, newest, 0.0)
    return sim.mean(-2).softmax(-1)


def rkv_scores(keys: torch.Tensor, window: torch.Tensor, scale: float) -> torch.Tensor:
    """Scores ``[b, h, R - w]`` of the resident keys ``[b, h, R, d]`` but the ``w`` newest, from the
    last ``w`` decode queries ``window [b, h, G, w, d]``."""
    acc = torch.promote_types(keys.dtype, torch.float32)
    k = keys.to(acc)
    w = window.shape[-2]
    logits = (scale * torch.einsum("bhgwd,bhrd->bhgwr", window.to(acc), k)).amax(2)  # [b, h, w, R]
    importance = torch.softmax(logits[..., :-w], dim=-1).mean(-2)
    importance = F.max_pool1d(importance, POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)
    return MIX_LAMBDA * importance - (1 - MIX_LAMBDA) * redundancy(k)[..., :-w]


class RKVPolicy(TokenPolicy):
    """R-KV at budget ``b`` (buffer 128, 8 observation queries, lambda 0.1)."""

    name = "rkv"
    report_order = 64

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        b, h, G, d = query.shape
        state.tensors["window"] = query.new_zeros((b, h, G, 0, d))
        return state

    def select(self, layer, state, query, scale):
        window = torch.cat([state.tensors["window"], query.unsqueeze(3)], dim=3)[..., -OBSERVATION:, :]
        state.tensors["window"] = window
        decoded = state.steps + 1
        if decoded % BUFFER == 0 and window.shape[3] == OBSERVATION:
            state.keep = self.compressed(layer, state, window, scale)
        return state.keep, 0

    def compressed(self, layer, state: PolicyState, window: torch.Tensor, scale: float) -> torch.Tensor:
        """The keep mask after one compression (rows whose resident cache is under ``b + 128`` unchanged)."""
        budget = self.config.budget
        keep = state.keep.clone()
        resident = keep[:, :, 0] & layer.slot_valid[:, None, : state.length]
        for row in range(keep.shape[0]):
            index, ok = kept_indices(resident[row : row + 1])  # [1, h, R]
            if not ok.all() or index.shape[-1] < budget + BUFFER:  # heads hold equal counts
                continue
            R = index.shape[-1]
            scores = rkv_scores(gather_slots(layer.keys[row : row + 1], index), window[row : row + 1], scale)
            best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : budget - OBSERVATION]
            newest = torch.arange(R - OBSERVATION, R, device=index.device).expand(*best.shape[:-1], -1)
            chosen = torch.cat([best, newest], -1)
            picked = index.gather(-1, chosen)
            keep[row, :, 0] = slots_mask(picked, torch.ones_like(picked, dtype=torch.bool), state.length)[0]
        return keep
