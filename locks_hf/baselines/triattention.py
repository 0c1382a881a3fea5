"""TriAttention (Mao et al., 2026): trigonometric scoring of generated tokens for long reasoning.

The configuration of the paper's HF reasoning runs: the prompt is protected and never evicted; only
generated tokens compete. After a decode step whose position is a multiple of 128, once at least
``b`` generated tokens are resident, each (layer, KV head) keeps the ``b - prompt`` generated tokens
of highest score (none if the prompt alone fills ``b``), the score of a token being the maximum over
the group's query heads of the attention logit a future query is expected to give its key:

    sum_f |q_f| |k_f| mean_d cos(w_f (t + d - p) + phi_f) + (E|q_f| - |q_f|) |k_f|

over the rotary frequency bands ``f`` (``w_f`` the band's frequency, ``q_f`` the head's mean
pre-RoPE query as a complex pair, ``E|q_f|`` its mean modulus, ``k_f`` the key's pre-RoPE pair at
position ``p``, ``phi_f`` their phase difference, ``t`` the current position, ``d`` the future
offsets 1, 2, 4, ..., 65536). With post-RoPE keys the phase term is
``Re(q_f conj(k~_f) exp(i w_f (t + d)))``, so keys need no un-rotation.
"""

from __future__ import annotations

import torch

from ..errors import LocksConfigError
from ..rope import rope_frequencies
from ..token_policy import TokenPolicy, gather_slots, kept_indices, slots_mask

DIVIDE_LENGTH = 128
OFFSETS = 2.0 ** torch.arange(17, dtype=torch.float64)  # 1 ... 65536


def complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """``[..., d]`` real -> ``[..., d/2]`` complex with transformers' half-split rotary pairing."""
    half = x.shape[-1] // 2
    return torch.complex(x[..., :half].double(), x[..., half:].double())


def trig_scores(
    keys: torch.Tensor, q_mean: torch.Tensor, q_abs_mean: torch.Tensor, omega: torch.Tensor, now: float
) -> torch.Tensor:
    """Scores ``[..., G, R]`` of post-RoPE ``keys [..., R, d]`` for query heads with mean pre-RoPE
    query ``q_mean [..., G, d/2]`` (complex) and mean modulus ``q_abs_mean [..., G, d/2]``."""
    k = complex_pairs(keys).unsqueeze(-3)  # [..., 1, R, F]
    q = q_mean.unsqueeze(-2)  # [..., G, 1, F]
    fold = torch.exp(1j * omega * OFFSETS.to(omega.device)[:, None]).mean(0)  # mean over offsets, [F]
    rotation = torch.exp(1j * omega * now) * fold
    base = (q * k.conj() * rotation).real.sum(-1)
    extra = ((q_abs_mean - q_mean.abs()).unsqueeze(-2) * k.abs()).sum(-1)
    return base + extra


class TriAttentionPolicy(TokenPolicy):
    """TriAttention at budget ``b`` (prompt protected, group max, every 128 positions)."""

    name = "triattention"
    report_order = 65

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        if layer.text_config is None:
            raise LocksConfigError(
                "triattention needs the model config (rotary frequencies): build the LocksCache with the model's config"
            )
        omega = rope_frequencies(layer.text_config).to(query.device)
        b, h, G, d = query.shape
        F = d // 2
        state.info["omega"] = omega
        state.tensors["q_sum"] = torch.zeros((b, h, G, F), dtype=torch.complex128, device=query.device)
        state.tensors["abs_sum"] = torch.zeros((b, h, G, F), dtype=torch.float64, device=query.device)
        state.tensors["count"] = torch.zeros((b, 1, 1, 1), dtype=torch.float64, device=query.device)
        starts = layer.row_tensors()[0].long()
        if layer.prompt_queries is not None:  # the last prompt queries start the statistics
            w = layer.prompt_queries.shape[2]
            window = layer.prompt_queries.reshape(b, h, G, w, d)
            positions = state.length - w + torch.arange(w, device=query.device) - starts[:, None]  # [b, w]
            self._add_queries(state, window, positions)
        return state

    @staticmethod
    def _add_queries(state, queries: torch.Tensor, positions: torch.Tensor) -> None:
        """Add post-RoPE ``queries [b, h, G, n, d]`` at ``positions [b, n]`` to the running statistics."""
        pairs = complex_pairs(queries)  # [b, h, G, n, F]
        unrotated = pairs * torch.exp(-1j * state.info["omega"] * positions[:, None, None, :, None])
        state.tensors["q_sum"] += unrotated.sum(3)
        state.tensors["abs_sum"] += pairs.abs().sum(3)
        state.tensors["count"] += queries.shape[3]

    def select(self, layer, state, query, scale):
        position = (layer.length - 1 - layer.row_tensors()[0].long())[:, None]
        self._add_queries(state, query.unsqueeze(3), position)
        return state.keep, 0

    def observe(self, layer, state, query, probs):
        budget = self.config.budget
        starts = layer.row_tensors()[0].tolist()
        generated = torch.arange(state.length, device=query.device) >= state.prompt_len
        for row, start in enumerate(starts):
            now = layer.length - start  # the next position
            resident = state.keep[row : row + 1, :, 0] & generated & layer.slot_valid[row, None, : state.length]
            if now % DIVIDE_LENGTH or int(resident[0, 0].sum()) < budget:
                continue
            keep_count = max(budget - (state.prompt_len - start), 0)
            index, ok = kept_indices(resident)  # [1, h, R]: heads hold equal counts
            count = state.tensors["count"][row : row + 1]
            q_mean = state.tensors["q_sum"][row : row + 1] / count
            q_abs = state.tensors["abs_sum"][row : row + 1] / count
            scores = trig_scores(
                gather_slots(layer.keys[row : row + 1], index), q_mean, q_abs, state.info["omega"], float(now)
            ).amax(-2)  # [1, h, R]
            best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :keep_count]
            kept = slots_mask(index.gather(-1, best), ok.gather(-1, best), state.length)
            state.keep[row, :, 0] = (state.keep[row, :, 0] & ~generated) | kept[0]
