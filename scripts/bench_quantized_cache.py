#!/usr/bin/env python
"""Decode speed on quantized KV: transformers' `QuantizedCache` against Locks on 4-bit KIVI K/V, one run.

A random-weight model of a real shape (default Llama-3.1-8B, bf16) prefills a random prompt of N tokens
into each arm's cache with one forward, then runs one-token forwards eagerly, as `generate()` does with
a dynamic cache (no CUDA graph for any arm: transformers' quantized cache changes shape every step).
Arms (default ``dense,hf-quanto4,full+kv4,r4i4+kv4-post``):

* ``dense``: transformers' `DynamicCache`, bf16 K/V;
* ``hf-<backend><bits>``: transformers' `QuantizedCache` (quanto / HQQ backend, groups of 32, 128
  full-precision tokens), which dequantizes the whole cache at every step;
* any Locks arm label (``full+kv4``, ``r4i4+kv4-post``, ``r4i4``): `LocksCache` in its dynamic layout.

Per arm: the median step over ``--steps`` timed steps after ``--warmup``; the memory the cache holds
after the prefill and after the timed steps (allocated with the cache minus without: KIVI quantizes
the prompt once the prefill has attended it), and the peak allocated during the steps beyond that
baseline (what a step builds: a dequantized copy for the arms that dequantize the whole cache). Prints a markdown table, writes JSON::

    python scripts/bench_quantized_cache.py --contexts 32K,64K --out quantized_cache.json
    python scripts/bench_quantized_cache.py --device cpu --shape tiny --contexts 512 --steps 2   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from bench_decode_step import SHAPES, parse_tokens, random_model, tokens_label  # scripts/ is on sys.path
from transformers import DynamicCache

from locks_hf import LocksCache
from locks_hf.compat import cache_keyword
from locks_hf.eval.hf_quantized import parse_hf_quantized
from locks_hf.selectors import config_for_family


def new_cache(model, arm: str, budget: int):
    if arm == "dense":
        return DynamicCache()
    hf = parse_hf_quantized(arm)
    if hf is not None:
        return hf.new_cache(model.config)
    return LocksCache(model.config, config_for_family(arm, budget=budget), layout="dynamic")


def allocated(device: torch.device) -> int:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop)
    t0 = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t0)


@torch.no_grad()
def run_arm(model, arm: str, context: int, args, device: torch.device) -> dict:
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    prompt = torch.randint(0, model.config.vocab_size, (1, context), generator=gen).to(device)
    before = allocated(device)
    cache = new_cache(model, arm, args.budget)
    kw = {cache_keyword(model): cache}
    prefill_ms = timed(lambda: model(prompt, **kw, use_cache=True, logits_to_keep=1), device)
    held = allocated(device) - before
    token = torch.ones(1, 1, dtype=torch.long, device=device)
    step = lambda: model(token, **kw, use_cache=True)  # noqa: E731
    for _ in range(args.warmup):
        step()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = [timed(step, device) for _ in range(args.steps)]
    steady = allocated(device) - before
    peak = torch.cuda.max_memory_allocated() - before if device.type == "cuda" else 0
    layers, h, d = model.config.num_hidden_layers, model.config.num_key_value_heads, model.config.head_dim
    bf16_kv = 2 * layers * h * d * 2 * context
    row = {
        "arm": arm,
        "context": context,
        "prefill_ms": prefill_ms,
        "ms_per_step": statistics.median(times),
        "all_ms": times,
        "prefill_cache_gib": held / 2**30,
        "cache_gib": steady / 2**30,
        "cache_vs_bf16_kv": steady / bf16_kv if device.type == "cuda" else None,
        "step_peak_gib": peak / 2**30,
    }
    return row  # the cache goes with this frame: the next arm's `allocated` collects it


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--contexts", default="32K,64K")
    ap.add_argument("--arms", default="dense,hf-quanto4,full+kv4,r4i4+kv4-post")
    ap.add_argument("--budget", type=int, default=2048, help="tokens attended per (row, KV head), Locks arms")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use --shape tiny)")
    ap.add_argument("--out", default="quantized_cache.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {"shape": args.shape, "budget": args.budget, "device": where, "dtype": str(dtype), "rows": []}
    for context in map(parse_tokens, args.contexts.split(",")):
        for arm in args.arms.split(","):
            row = run_arm(model, arm, context, args, device)
            result["rows"].append(row)
            print(
                f"{tokens_label(context)} {arm}: {row['ms_per_step']:.2f} ms/step, {row['cache_gib']:.2f} GiB",
                flush=True,
            )
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    print(f"\nEager decode step, {args.shape} random weights, {dtype}, batch 1, b={args.budget} ({where})\n")
    print("| context | arm | ms/step | vs hf | cache GiB | cache vs bf16 K/V | step peak GiB | prefill ms |")
    print("|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        hf = next(
            (x for x in result["rows"] if x["context"] == r["context"] and x["arm"].startswith("hf-")),
            None,
        )
        vs = f"{hf['ms_per_step'] / r['ms_per_step']:.2f}x" if hf else "-"
        share = "-" if r["cache_vs_bf16_kv"] is None else f"{r['cache_vs_bf16_kv']:.3f}"
        print(
            f"| {tokens_label(r['context'])} | {r['arm']} | {r['ms_per_step']:.2f} | {vs} | {r['cache_gib']:.2f} | "
            f"{share} | {r['step_peak_gib']:.2f} | {r['prefill_ms']:.0f} |"
        )


if __name__ == "__main__":
    main()
