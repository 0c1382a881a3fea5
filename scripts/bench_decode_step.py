#!/usr/bin/env python
"""Complete decode step of a random-weight model (one-token forward with the cache, as generate runs it).

Builds a random-weight model with a real shape (default Llama-3.1-8B: 32 layers, 32 query heads, 8 KV
heads, d=128, bf16), fills a `LocksCache` with a synthetic prefill of N tokens per layer (structured
random keys: a per-page offset plus per-token noise; summaries built as after a real prefill), then
times one-token forwards for each arm on the same cache: dense (``selector="full"``: transformers' SDPA
over the preallocated cache) and Locks / Quest at budget b. Eager mode (no CUDA graphs): the Python
cost of the model and of our glue is part of the step. CUDA-event medians after warm-up.

    python scripts/bench_decode_step.py --contexts 128K,512K --out docs/decode_step_h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from locks_hf import LocksCache, LocksConfig

SHAPES = {
    "llama3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=128, vocab_size=128256),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=256),
}


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(text.rstrip("KM")) * mult


def synthetic_prefill(cache: LocksCache, config, n_tokens: int, device, dtype) -> None:
    """Fill every layer with ``n_tokens`` of structured random K/V and summarize the pages."""
    h, d, B = config.num_key_value_heads, config.head_dim, cache.locks_config.page_size
    gen = torch.Generator(device=device).manual_seed(0)
    for idx in range(config.num_hidden_layers):
        pages = n_tokens // B
        keys = (torch.randn(1, h, pages, 1, d, device=device, generator=gen) * 2
                + torch.randn(1, h, pages, B, d, device=device, generator=gen)).flatten(2, 3).to(dtype)
        values = torch.randn(1, h, n_tokens, d, device=device, generator=gen, dtype=dtype)
        cache.update(keys, values, idx)
        cache.layers[idx].summarize_completed()
        del keys, values


def time_steps(model, cache, steps: int, warmup: int) -> list[float]:
    """Milliseconds per one-token forward (CUDA events; wall clock on the CPU smoke-test path)."""
    token = torch.ones(1, 1, dtype=torch.long, device=model.device)
    times = []
    for i in range(warmup + steps):
        if model.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(token, past_key_values=cache, logits_to_keep=1)
            stop.record()
            torch.cuda.synchronize()
            elapsed = start.elapsed_time(stop)
        else:
            t0 = time.perf_counter()
            model(token, past_key_values=cache, logits_to_keep=1)
            elapsed = 1e3 * (time.perf_counter() - t0)
        if i >= warmup:
            times.append(elapsed)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--contexts", default="128K,512K")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--arms", default="full,r4i4,r8i4,quest")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="decode_step.json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use --shape tiny)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=2**21)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, attn_implementation="locks", dtype=dtype).eval()
    arms = {}
    for arm in args.arms.split(","):
        if arm == "full":
            arms[arm] = LocksConfig(selector="full")
        elif arm == "quest":
            arms[arm] = LocksConfig(selector="quest", budget=args.budget)
        else:
            arms[arm] = LocksConfig.from_label(arm, budget=args.budget)

    rows = []
    with torch.no_grad():
        for ctx in map(parse_tokens, args.contexts.split(",")):
            cache = LocksCache(config, arms["full"])
            synthetic_prefill(cache, config, ctx, device, dtype)
            for name, cfg in arms.items():
                for layer in cache.locks_layers:
                    layer.set_config(cfg)
                    layer.summarize_completed()  # rebuilt only when the summary layout changed
                times = time_steps(model, cache, args.steps, args.warmup)
                med = statistics.median(times)
                rows.append({"context": ctx, "arm": name, "median_ms": med, "tokens_per_s": 1e3 / med,
                             "attended": cache.attended_fraction(), "all_ms": times})
                cache.reset_stats()
                cache.crop(-(args.steps + args.warmup))  # back to the prefilled length for the next arm
            del cache

    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"\nComplete decode step, {args.shape} random weights, {dtype}, batch 1, b={args.budget}, eager, "
          f"median of {args.steps} steps ({where})\n")
    print("| context | arm | ms/step | tokens/s | vs dense | tokens attended |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        dense = next(x["median_ms"] for x in rows if x["context"] == r["context"] and x["arm"] == "full")
        print(f"| {r['context'] // 1024}K | {r['arm']} | {r['median_ms']:.2f} | {r['tokens_per_s']:.1f} | "
              f"{dense / r['median_ms']:.2f}x | {r['attended']:.4f} |")
    with open(args.out, "w") as f:
        json.dump({"shape": args.shape, "budget": args.budget, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
