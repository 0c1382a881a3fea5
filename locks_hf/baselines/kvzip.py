"""KVzip (Kim et al., NeurIPS 2025): query-agnostic eviction scored by context reconstruction.

After prefill the model is asked to repeat its context, teacher-forced, chunk by chunk (2048 tokens
a chunk; the first chunk prompted with "Repeat the previous context exactly.", the next ones with
"Repeat the part of the previous context exactly, starting with" and the previous chunk's last 8
tokens). Each repeat forward runs on a copy of the prefilled cache; a context token's score is the
largest attention weight any repeat query of any head of its GQA group gives it, the weights taken
by a softmax over the sink token, the chunk being repeated and the repeat tokens themselves. Each
(layer, KV head) then keeps the sink and the best-scoring ``b - 1`` context tokens; the question and
the generated tokens are kept beyond the budget, so decode reads ``b + |q| + g`` tokens.

`score_context` runs once per prompt (the sweep shares it between all KVzip arms of a record).
"""

from __future__ import annotations

import torch

from ..compat import cache_keyword
from ..errors import LocksConfigError
from ..token_policy import TokenPolicy

CHUNK = 2048
PREVIOUS_TAIL = 8
SINK = 1  # the first token (bos), always kept
FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
QUERY_BLOCK = 256  # repeat queries scored at once (bounds the memory of the weights)


def repeat_inputs(encode, context_ids: torch.Tensor) -> list[tuple[int, int, torch.Tensor]]:
    """``(start, end, input_ids)`` of every reconstruction chunk of ``context_ids [1, n]`` (slots
    ``start..end`` of the context; ``encode(text) -> [1, m]`` tokenizes without special tokens)."""
    n = context_ids.shape[1]
    out = []
    for start in range(SINK, n, CHUNK):
        end = min(start + CHUNK, n)
        if start == SINK:
            prompt = encode(FIRST_PROMPT)
        else:
            prompt = torch.cat([encode(NEXT_PROMPT), context_ids[:, max(start - PREVIOUS_TAIL, 0) : start]], 1)
        out.append((start, end, torch.cat([prompt.to(context_ids.device), context_ids[:, start:end]], 1)))
    return out


class ReconstructionScores:
    """Collects one layer's KVzip scores ``[b, h, n]`` from the repeat queries of one chunk.

    ``start``, ``end`` and ``sink`` (the sink's first slot) are slot indices of the cache, which
    differ from context positions by the row's left padding."""

    def __init__(self, store: torch.Tensor, start: int, end: int, sink: int = 0) -> None:
        self.store, self.start, self.end, self.sink = store, start, end, sink

    def update(self, query: torch.Tensor, keys: torch.Tensor, scale: float) -> None:
        """``query [b, Hq, t, d]`` of the repeat tokens, ``keys [b, h, L, d]`` (the repeat tokens last)."""
        b, hq, t, d = query.shape
        h, L = keys.shape[1], keys.shape[2]
        acc = torch.promote_types(query.dtype, torch.float32)
        k = torch.cat(
            [keys[:, :, self.sink : self.sink + SINK], keys[:, :, self.start : self.end], keys[:, :, L - t :]], 2
        ).to(acc)
        n_ctx = self.end - self.start
        q = query.reshape(b, h, hq // h, t, d).to(acc)
        best = torch.zeros((b, h, n_ctx), dtype=acc, device=query.device)
        for lo in range(0, t, QUERY_BLOCK):
            hi = min(lo + QUERY_BLOCK, t)
            logits = scale * torch.einsum("bhgtd,bhnd->bhgtn", q[:, :, :, lo:hi], k)
            own = torch.arange(t, device=query.device)  # a repeat query sees the repeat tokens up to itself
            future = own[None, :] > torch.arange(lo, hi, device=query.device)[:, None]  # [hi - lo, t]
            logits[..., SINK + n_ctx :] = logits[..., SINK + n_ctx :].masked_fill(future, float("-inf"))
            weights = torch.softmax(logits, dim=-1)[..., SINK : SINK + n_ctx]
            best = torch.maximum(best, weights.amax((2, 3)))
        self.store[:, :, self.start : self.end] = best.to(self.store.dtype)


@torch.no_grad()
def score_context(model, tokenizer, cache, context_ids: torch.Tensor) -> None:
    """Run KVzip's reconstruction passes over the context ``context_ids [1, n]``, the first ``n``
    tokens cached in ``cache`` (a prefilled `LocksCache` of batch size 1, left unchanged) after any left
    padding, and keep the scores on its layers for every KVzip fork of it."""
    layers = cache.locks_layers
    if not layers or layers[0].keys is None or layers[0].keys.shape[0] != 1:
        raise ValueError("score_context needs a prefilled LocksCache of batch size 1")
    device = layers[0].keys.device
    context_ids = context_ids.to(device)
    context_len = context_ids.shape[1]

    def encode(text: str) -> torch.Tensor:
        return torch.tensor([tokenizer.encode(text, add_special_tokens=False)], device=device)

    # A left-padded prompt: the context starts at the row's first real slot, and the repeat forwards
    # see it as the prompt alone would (padding masked, positions counted from its first real token).
    pad = layers[0].row_start[0]
    cached = layers[0].slot_valid[:, : layers[0].length].long()
    stores = [
        torch.zeros((1, layer.keys.shape[1], pad + context_len), dtype=torch.float32, device=device) for layer in layers
    ]
    for start, end, ids in repeat_inputs(encode, context_ids):
        fork = cache.fork()
        for layer, store in zip(fork.locks_layers, stores):
            layer.score_request = ReconstructionScores(store, pad + start, pad + end, sink=pad)
        t = ids.shape[1]
        mask = torch.cat([cached, cached.new_ones((1, t))], 1)
        positions = torch.arange(cached.shape[1] - pad, cached.shape[1] - pad + t, device=device)[None]
        # only the attention is used
        model(
            ids,
            attention_mask=mask,
            position_ids=positions,
            **{cache_keyword(model): fork},
            use_cache=True,
            logits_to_keep=1,
        )
        del fork
    for layer, store in zip(layers, stores):
        store[:, :, :pad] = float("-inf")  # padding: never among the kept context tokens
        store[:, :, pad : pad + SINK] = float("inf")
        layer.prefill_scores["kvzip"] = store


class KVzipPolicy(TokenPolicy):
    """KVzip at budget ``b`` per (layer, KV head): the best ``b`` context tokens, question and
    generated tokens beyond it."""

    name = "kvzip"
    report_order = 61
    needs_context_scores = True

    def start(self, layer, query, scale):
        state = super().start(layer, query, scale)
        scores = layer.prefill_scores.get("kvzip")
        if scores is None:
            raise LocksConfigError(
                "kvzip needs its context-reconstruction scores: call "
                "locks_hf.baselines.kvzip.score_context(model, tokenizer, cache, context_ids) after prefill"
            )
        n = scores.shape[-1]
        if n > self.config.budget:
            order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : self.config.budget]
            context = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, order, True)
            state.keep[:, :, 0, :n] &= context
        return state
