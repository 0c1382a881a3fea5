#!/usr/bin/env python
"""How far a page's token logits lie from its centroid's on a real model, against the bound
``U = 128 * max_t |coef_scale_t| * sum_j |q . basis_j|`` (log2 units, the softmax scale included) that a page
LSE without a running max must stay under (docs/performance.md, 2026-12-06).

    python scripts/dev/logit_span.py --model smollm2-135m --context 4000 --out span.json

One prefill of a needle prompt; the last ``--queries`` positions' queries (after RoPE and any query norm)
against every complete page of every layer. A page's rank-``r`` basis is the top right singular vectors
of its centred keys (float64), its coefficient scale the largest coefficient: the summary the library
builds, without quantization. Prints the quantiles of ``U`` and of the true ``max_t |logit_t - logit_mu|``,
the share of (page, head) pairs at or over the threshold, and of 64-page blocks of a KV head's group
that would need the running max.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

THRESHOLD = 120.0  # log2 units: 2**120 * 16 tokens stays finite, 2**-120 normal
BLOCK = 64  # pages a "wgmma" program scores at once


def capture_queries(model, n_last: int) -> dict[int, torch.Tensor]:
    """Forward pre-hooks on each attention module: its query after the projection, norm and RoPE."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    queries: dict[int, torch.Tensor] = {}
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    def hook(mod, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        cos, sin = kwargs["position_embeddings"]
        q = mod.q_proj(h).view(h.shape[0], h.shape[1], -1, d).transpose(1, 2)
        if hasattr(mod, "q_norm"):
            q = mod.q_norm(q)
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        queries[mod.layer_idx] = q[0, :, -n_last:].double()

    for layer in model.model.layers:
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True)
    return queries


def spans(keys: torch.Tensor, q: torch.Tensor, page: int, rank: int, scale: float):
    """``U`` and the true span ``[hk, G, n_q, pages]`` of one layer (``keys [hk, T, d]``, ``q [hq, n_q, d]``)."""
    hk, T, d = keys.shape
    n = (T - 1) // page  # complete pages before the newest one
    kp = keys[:, : n * page].reshape(hk, n, page, d).double()
    centred = kp - kp.mean(2, keepdim=True)
    basis = torch.linalg.svd(centred, full_matrices=False).Vh[:, :, :rank]  # [hk, n, r, d]
    coef = torch.einsum("hnbd,hnrd->hnbr", centred, basis)
    q = q.view(hk, -1, q.shape[-2], d)
    to_log2 = scale / math.log(2)
    proj = torch.einsum("hgtd,hnrd->hgtnr", q, basis) * to_log2
    # int8 codes: |code| <= 128 with the scale set by the largest coefficient at 127
    u = coef.abs().amax(dim=(2, 3))[:, None, None, :] * proj.abs().sum(-1) * (128 / 127)
    true = (torch.einsum("hgtd,hnbd->hgtnb", q, centred) * to_log2).abs().amax(-1)
    return u, true


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", help="a name `locks_hf.models.load_model` knows")
    ap.add_argument("--context", type=int, default=4000, help="prompt tokens")
    ap.add_argument("--queries", type=int, default=8, help="last positions whose queries are used")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    args = ap.parse_args()

    from transformers import DynamicCache

    from locks_hf.models import encode_prompt, load_model
    from locks_hf.needle import build_needle_prompt

    model, tokenizer = load_model(args.model)
    model.eval()
    queries = capture_queries(model, args.queries)
    ids = encode_prompt(tokenizer, build_needle_prompt(tokenizer, context_tokens=args.context).text)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    pre = getattr(model.config, "query_pre_attn_scalar", None)
    head_dim = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    scale = (pre or head_dim) ** -0.5

    us, trues, blocks, over_blocks = [], [], 0, 0
    for i, layer in enumerate(cache.layers):
        keys = layer.keys[0]
        if i not in queries or keys.shape[1] <= 2 * args.page_size:
            continue
        u, true = spans(keys, queries[i], args.page_size, args.rank, scale)
        us.append(u.flatten())
        trues.append(true.flatten())
        for s in range(0, u.shape[-1], BLOCK):
            worst = u[..., s : s + BLOCK].amax(dim=(1, 3))  # [hk, n_q]: a block holds a group's heads
            blocks += worst.numel()
            over_blocks += int((worst >= THRESHOLD).sum())
    u, true = torch.cat(us), torch.cat(trues)
    probs = [0.5, 0.9, 0.99, 0.999, 1.0]
    result = {
        "model": args.model,
        "tokens": int(ids.shape[1]),
        "layers": len(us),
        "page_size": args.page_size,
        "rank": args.rank,
        "quantiles": probs,
        "bound_log2": [round(float(x), 2) for x in torch.quantile(u.float(), torch.tensor(probs))],
        "true_span_log2": [round(float(x), 2) for x in torch.quantile(true.float(), torch.tensor(probs))],
        "pairs_over_threshold": float((u >= THRESHOLD).double().mean()),
        "blocks_over_threshold": over_blocks / max(blocks, 1),
        "blocks": blocks,
    }
    print(
        f"{args.model}: {result['tokens']} tokens, {result['layers']} layers, pages of {args.page_size}, rank {args.rank}"
    )
    print("| quantile | " + " | ".join(str(p) for p in probs) + " |")
    print("|---|" + "---|" * len(probs))
    print("| bound U (log2) | " + " | ".join(str(x) for x in result["bound_log2"]) + " |")
    print("| true span (log2) | " + " | ".join(str(x) for x in result["true_span_log2"]) + " |")
    print(
        f"(page, head) pairs with U >= {THRESHOLD:g}: {result['pairs_over_threshold']:.4%}; "
        f"{BLOCK}-page blocks needing the running max: {over_blocks} of {blocks}"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
