"""RocketKV (Behnam et al., ICML 2025): two-stage compression under one token budget ``b``.

Stage 1 (once, after prefill): SnapKV-style permanent eviction of the prompt. The last 32 prompt
queries score every earlier prompt key (softmax attention, summed over the window and the GQA
group), the scores are max-pooled over 63 neighbouring tokens, and the best ``prompt_keep - 32``
keys plus the 32 window keys stay; decode tokens are never evicted.
Stage 2 (every decode step): hybrid top-k. Over the resident tokens, keys are multiplied by the sign
of the group's summed query, max-reduced over chunks of ``c`` consecutive tokens, and scored on the
``r`` channels of largest mean ``|q|``; a softmax of these estimates (temperature
``sqrt(d * sum|q_r| / sum|q|)``), averaged over the group, picks the ``b/2`` tokens attended exactly.

Budget rule (the reference implementation's): with ``S`` = prompt + generated tokens,
``ratio = S / b``, the stage-1 capacity is ``S / ratio^e`` (``e = min(0.2 + 0.06 log2 ratio, 0.8)``,
at least ``min(2 * generated, S)``), the prompt keeps that capacity minus the generated tokens, and
stage 2 uses ``c = ceil(sqrt(capacity / b))`` and ``r = d * c / (capacity / b)`` channels so that
its estimation reads about as much as the ``b/2`` attended tokens.

In a left-padded batch the rule is applied to each row's own prompt (its real tokens, not the padded
length of the batch), so that every row keeps and attends what it would if it ran alone.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import LocksConfigError
from ..token_policy import TokenPolicy, gather_slots, kept_indices, slots_mask

OBSERVATION_WINDOW = 32
POOL_KERNEL = 63


def rocket_budgets(prompt_len: int, new_tokens: int, budget: int) -> tuple[int, int, float]:
    """``(prompt_keep, topk, stage2_ratio)`` for a prompt of ``prompt_len`` tokens, ``new_tokens``
    to generate and token budget ``budget``."""
    total = prompt_len + new_tokens
    ratio = max(1.0, total / budget)
    exponent = min(0.2 + math.log2(ratio) * 0.06, 0.8)
    capacity = max(int(total / ratio**exponent), min(2 * new_tokens, total))
    return max(capacity - new_tokens, OBSERVATION_WINDOW), budget // 2, max(1.0, capacity / budget)


def snapkv_keep(keys: torch.Tensor, queries: torch.Tensor, real: torch.Tensor, keep: int, scale: float) -> torch.Tensor:
    """Stage 1: the prompt slots kept, ``[b, h, T]``.

    ``keys [b, h, T, d]`` (the prompt), ``queries [b, h, G, w, d]`` (the last ``w`` prompt positions),
    ``real [b, T]`` (False for padding).
    """
    b, h, T, _ = keys.shape
    w = queries.shape[-2]
    if T <= keep:
        return real[:, None].expand(b, h, T).clone()
    acc = torch.promote_types(keys.dtype, torch.float32)
    logits = scale * torch.einsum("bhgwd,bhtd->bhgwt", queries.to(acc), keys.to(acc))
    visible = torch.arange(T, device=keys.device) <= (T - w + torch.arange(w, device=keys.device))[:, None]
    visible = visible & real[:, None, None, None, :]  # [b, 1, 1, w, T]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
    score = probs[..., : T - w].sum((2, 3))  # [b, h, T - w]
    pooled = F.max_pool1d(score, POOL_KERNEL, stride=1, padding=POOL_KERNEL // 2)
    pooled = pooled.masked_fill(~real[:, None, : T - w], float("-inf"))
    order = torch.sort(pooled, dim=-1, descending=True, stable=True).indices[..., : keep - w]
    kept = torch.zeros((b, h, T), dtype=torch.bool, device=keys.device)
    kept.scatter_(-1, order, True)
    kept[..., T - w :] = True
    return kept & real[:, None]


def hybrid_scores(
    keys: torch.Tensor, ok: torch.Tensor, query: torch.Tensor, ratio: float
) -> tuple[torch.Tensor, int, int]:
    """Stage 2's estimated attention ``[b, h, R]`` over resident keys ``keys [b, h, R, d]`` (``ok``
    marks real ones) for ``query [b, h, G, d]``, and the chunk length and channel count used."""
    d = query.shape[-1]
    chunk = math.ceil(math.sqrt(ratio))
    chunk = chunk if chunk <= ratio else 1
    channels = min(max(int(d * chunk / ratio), 1), d)
    acc = torch.promote_types(keys.dtype, torch.float32)
    q, k = query.to(acc), keys.to(acc)
    sign = torch.where(q.sum(2, keepdim=True) > 0, 1.0, -1.0).to(acc)  # [b, h, 1, d]
    lowest = torch.finfo(acc).min
    signed = (k * sign).masked_fill(~ok.unsqueeze(-1), lowest)
    R = signed.shape[2]
    pad = -R % chunk
    signed = F.pad(signed, (0, 0, 0, pad), value=lowest)
    chunk_max = signed.unflatten(2, (-1, chunk)).amax(3)  # [b, h, n, d]
    top = torch.topk(q.abs().mean(2), channels, dim=-1).indices  # [b, h, r]
    q_hat = (q * sign).gather(-1, top.unsqueeze(2).expand(-1, -1, q.shape[2], -1))
    k_hat = chunk_max.gather(-1, top.unsqueeze(2).expand(-1, -1, chunk_max.shape[2], -1))
    est = torch.einsum("bhgr,bhnr->bhgn", q_hat, k_hat).repeat_interleave(chunk, -1)[..., :R]
    temperature = torch.sqrt(d * q_hat.abs().sum(-1, keepdim=True) / q.abs().sum(-1, keepdim=True))
    s_hat = torch.softmax(est.masked_fill(~ok.unsqueeze(2), float("-inf")) / temperature, dim=-1)
    return s_hat.mean(2), chunk, channels


class RocketKVPolicy(TokenPolicy):
    """RocketKV at token budget ``b``: stage-1 prompt eviction, stage-2 top-``b/2`` selection."""

    name = "rocketkv"
    report_order = 63

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        prompt_q = layer.prompt_queries
        if prompt_q is None:
            raise LocksConfigError(
                "rocketkv needs the prompt queries of a multi-token prefill (its SnapKV stage scores the "
                "prompt with the last 32 of them): prefill the prompt in one forward with this cache"
            )
        b, h, G, d = query.shape
        T = state.length
        window = prompt_q.reshape(b, h, G, -1, d)[..., -OBSERVATION_WINDOW:, :]
        # The budget rule depends on the prompt's length: each row's is its own, counted from its first
        # real token (left padding is no prompt), so that a padded row plans as it would alone.
        keep = torch.zeros_like(state.keep[:, :, 0])
        plans = []
        for row, start in enumerate(layer.row_tensors()[0].tolist()):
            prompt_keep, topk, ratio = rocket_budgets(T - start, layer.expected_new_tokens, self.config.budget)
            w = min(window.shape[-2], T - start)  # a short prompt has fewer real window queries
            keep[row : row + 1, :, start:] = snapkv_keep(
                layer.keys[row : row + 1, :, start:T],
                window[row : row + 1, ..., window.shape[-2] - w :, :],
                layer.slot_valid[row : row + 1, start:T],
                prompt_keep,
                scale,
            )
            plans.append((prompt_keep, topk, ratio))
        state.keep = keep.unsqueeze(2)
        # per-row values are batch-first tensors: beam reorders and row selections carry them along
        # (on the keys' device: a beam reorder indexes it with the layer's device index)
        state.tensors["ratio"] = torch.tensor([p[2] for p in plans], dtype=torch.float64, device=keep.device)
        state.info.update(topk=plans[0][1])  # budget // 2: the same for every row
        return state

    def select(self, layer, state, query, scale):
        topk = state.info["topk"]
        index, ok = kept_indices(state.keep[:, :, 0] & layer.slot_valid[:, None, : state.length])
        if index.shape[-1] <= topk:
            return state.keep, 0
        mask = torch.zeros_like(state.keep[:, :, 0])
        read = 0
        # rows grouped by their stage-2 ratio (one group when every row has the same prompt length)
        groups: dict[float, list[int]] = {}
        for row, ratio in enumerate(state.tensors["ratio"].tolist()):
            groups.setdefault(ratio, []).append(row)
        for ratio, rows in groups.items():
            at = torch.tensor(rows, device=index.device)
            scores, chunk, channels = hybrid_scores(gather_slots(layer.keys[at], index[at]), ok[at], query[at], ratio)
            order = torch.sort(scores.masked_fill(~ok[at], float("-inf")), dim=-1, descending=True, stable=True).indices
            best = order[..., :topk]
            mask[at] = slots_mask(index[at].gather(-1, best), ok[at].gather(-1, best), state.length)
            # the estimate reads ceil(R / c) chunk maxima of r channels for each row's R resident tokens
            chunks = ok[at].sum(-1).add(chunk - 1).div(chunk, rounding_mode="floor")
            read += int(chunks.sum()) * channels * layer.keys.element_size()
        return mask.unsqueeze(2), read
