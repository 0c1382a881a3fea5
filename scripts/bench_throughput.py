#!/usr/bin/env python
"""Aggregate decode throughput at long context: each cache at the largest batch that fits on one GPU.

For every context (default 64K, 128K, 256K) and arm (default ``full`` = dense bf16, ``r4i4`` = Locks
on bf16 K/V, ``r4i4+kv4-post`` = Locks on 4-bit KIVI K/V), a random-weight model of a real shape
(default Llama-3.1-8B, bf16) decodes from a `LocksStaticCache` of ``batch`` rows holding a synthetic
prefix of ``context`` tokens, the one-token step captured in a CUDA graph (gpt-fast style; what
``generate()`` replays with the static layout). The synthetic prefix is written straight into the
cache's buffers (structured random keys and random values, or random packed codes with random
scales for quantized KV; summaries built from them, as after a prefill), so that no prefill
transient limits the batch: the batch is what the decode state allows.

The batch: the bytes one sequence's cache takes (measured on a one-row cache) divided into the memory
left beside the weights less a workspace margin, lowered by steps on out-of-memory. Per row of the
table: batch, median step, aggregate decode tokens/s, the cache's measured bytes per token (all
layers) against bf16 K/V, tokens attended, and the throughput against the dense arm of the same
context. Prints a markdown table and writes JSON after every arm::

    python scripts/bench_throughput.py --contexts 64K,128K,256K --out throughput.json
    python scripts/bench_throughput.py --device cpu --shape tiny --contexts 512 --max-batch 2   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from bench_decode_step import SHAPES, Stepper, parse_tokens, random_model, time_steps  # scripts/ is on sys.path

from locks_hf import LocksConfig, LocksStaticCache
from locks_hf.selectors import config_for_family

#: Memory kept free beside the weights and the cache (the step's activations, logits, graph pool).
WORKSPACE_GIB = 4.0


def arm_config(name: str, budget: int) -> LocksConfig:
    return config_for_family(name, budget=budget)


def fill_layer(layer, n: int, gen: torch.Generator, chunk_pages: int = 2048) -> None:
    """``n`` synthetic tokens in every row of one static Locks layer: bf16 K/V (a per-page key offset
    plus per-token noise), or for quantized KV random codes with random positive scales and zero points
    (and full-precision rings); then the summaries of the complete pages, ``chunk_pages`` at a time."""
    B = layer.config.page_size
    b, h = layer.row_start.shape[0], layer.num_heads
    packed = layer.packed_kv()
    dev = layer.row_start.device
    for p0 in range(0, -(-n // B), chunk_pages):
        s0, s1 = p0 * B, min(n, (p0 + chunk_pages) * B)
        if packed is None:
            d = layer.keys.shape[-1]
            pages = -(-(s1 - s0) // B)
            keys = torch.randn(b, h, pages, 1, d, device=dev, generator=gen) * 2 + torch.randn(
                b, h, pages, B, d, device=dev, generator=gen
            )
            layer.keys[:, :, s0:s1] = keys.flatten(2, 3)[:, :, : s1 - s0]
            layer.values[:, :, s0:s1] = torch.randn(b, h, s1 - s0, d, device=dev, generator=gen)
        else:
            G = layer.config.kv_group
            for name in ("key_codes", "value_codes"):
                packed[name][:, :, s0:s1].random_(0, 256, generator=gen)
            packed["key_scale"][:, :, s0 // G : -(-s1 // G)].uniform_(0.02, 0.3, generator=gen)
            packed["key_zero"][:, :, s0 // G : -(-s1 // G)].normal_(-2.0, 1.0, generator=gen)
            packed["value_scale"][:, :, s0:s1].uniform_(0.02, 0.3, generator=gen)
            packed["value_zero"][:, :, s0:s1].normal_(-2.0, 1.0, generator=gen)
    if packed is not None:
        for name in ("key_tail", "value_tail"):
            packed[name].normal_(generator=gen)
        R, G = layer.config.kv_residual, layer.config.kv_group
        keys_to = min(n // R * R, n // B * B // G * G)  # as KIVI leaves them after a prefill of n tokens
        packed["quantized"].copy_(torch.tensor([keys_to, max(n - R, 0)], dtype=torch.int32))
    layer.cumulative_length.fill_(n)
    layer.length_t.fill_(n)
    if layer.summary:
        for p0 in range(0, n // B, chunk_pages):
            p1 = min(n // B, p0 + chunk_pages)
            new = layer.summarize_pages(*layer.page_inputs(torch.arange(p0, p1, device=dev).expand(b, h, -1)))
            for name, t in new.items():
                layer.summary[name][:, :, p0:p1] = t


def build_cache(model, name: str, locks: LocksConfig, batch: int, context: int, capacity: int, seed: int = 0):
    """A static cache of ``batch`` rows holding ``context`` synthetic tokens in every Locks layer."""
    cfg = model.config
    cache = LocksStaticCache(cfg, max_cache_len=capacity, locks=locks)
    d = cfg.head_dim
    probe = torch.zeros(batch, cfg.num_key_value_heads, 1, d, dtype=model.dtype, device=model.device)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for layer in cache.locks_layers:
        layer.lazy_initialization(probe, probe)
        fill_layer(layer, context, gen)
    cache.mark_prefix()  # the host-side count of the tokens written, and each row's page bookkeeping
    cache.rewind()
    return cache


def allocated() -> int:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    return 0


def sequence_bytes(model, name, locks, context, capacity) -> int:
    """Bytes one row's cache holds (measured: allocated with the cache minus without)."""
    before = allocated()
    cache = build_cache(model, name, locks, 1, 16 * locks.page_size, capacity)
    held = allocated() - before
    del cache
    allocated()
    return held


def run_arm(model, name: str, locks: LocksConfig, context: int, args) -> dict:
    capacity = context + args.warmup + args.steps + 64
    per_row = sequence_bytes(model, name, locks, context, capacity)
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info()
        fits = int((free - WORKSPACE_GIB * 2**30) // max(per_row, 1))
    else:
        fits = args.max_batch
    batch = max(1, min(fits, args.max_batch))
    while True:
        try:
            before = allocated()
            cache = build_cache(model, name, locks, batch, context, capacity)
            cache_bytes = allocated() - before
            stepper = Stepper(model, cache, "cuda" if model.device.type == "cuda" else "none")
            stepper.token = torch.ones(batch, 1, dtype=torch.long, device=model.device)
            stepper.warm_up(args.warmup)
            cache.reset_stats()
            times = time_steps(stepper, args.steps)
            break
        except torch.OutOfMemoryError:
            stepper = cache = None
            gc.collect()
            torch.cuda.empty_cache()
            if batch == 1:
                raise
            batch -= max(1, batch // 16)
    med = statistics.median(times)
    layers = len(cache.locks_layers)
    kv_bf16 = 2 * model.config.num_key_value_heads * model.config.head_dim * 2 * layers  # a token's bf16 K/V
    row = {
        "arm": name,
        "context": context,
        "batch": batch,
        "fits_estimate": fits,
        "ms_per_step": med,
        "tokens_per_s": 1e3 * batch / med,
        "cache_gib": cache_bytes / 2**30,
        "bytes_per_token": cache_bytes / (batch * capacity),
        "vs_bf16_kv": cache_bytes / (batch * capacity * kv_bf16),
        "attended": cache.attended_fraction(),
        "all_ms": times,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if model.device.type == "cuda" else None,
    }
    del stepper, cache
    allocated()
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--contexts", default="64K,128K,256K")
    ap.add_argument("--arms", default="full,r4i4,r4i4+kv4-post", help="arm labels (full, r4i4, r4i4+kv4-post, ...)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--max-batch", type=int, default=256, help="never more rows than this")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use --shape tiny)")
    ap.add_argument("--out", default="throughput.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_model(args.shape, device)
    weights = allocated()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {"shape": args.shape, "budget": args.budget, "device": where, "weights_gib": weights / 2**30, "rows": []}
    t0 = time.time()
    with torch.no_grad():
        for context in map(parse_tokens, args.contexts.split(",")):
            for name in args.arms.split(","):
                torch._dynamo.reset()
                row = run_arm(model, name, arm_config(name, args.budget), context, args)
                result["rows"].append(row)
                print(
                    f"{context // 1024}K {name}: batch {row['batch']} (estimate {row['fits_estimate']}), "
                    f"{row['ms_per_step']:.2f} ms/step, {row['tokens_per_s']:.0f} tok/s, "
                    f"{row['vs_bf16_kv']:.3f}x bf16 K/V per token, {time.time() - t0:.0f} s",
                    flush=True,
                )
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    print(
        f"\nAggregate decode throughput, {args.shape} random weights, {dtype}, b={args.budget}, CUDA-graph "
        f"step, each arm at the largest batch that fits ({where}; weights {weights / 2**30:.1f} GiB)\n"
    )
    print(
        "| context | arm | batch | ms/step | tokens/s | vs dense | vs dense, same K/V | cache GiB | bytes/token "
        "| vs bf16 K/V | attended |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        print(
            f"| {r['context'] // 1024}K | {r['arm']} | {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.0f} "
            f"| {throughput_ratio(result['rows'], r, 'full')} | {throughput_ratio(result['rows'], r, dense_twin(r['arm']))} "
            f"| {r['cache_gib']:.1f} | {r['bytes_per_token']:.0f} | {r['vs_bf16_kv']:.3f} | {r['attended']:.4f} |"
        )


def dense_twin(arm: str) -> str:
    """The dense arm on the same K/V storage: ``full`` for a bf16 arm, ``full+kv4-post`` for ``r4i4+kv4-post``."""
    _, plus, storage = arm.partition("+")
    return "full" + plus + storage


def throughput_ratio(rows: list[dict], row: dict, dense_arm: str) -> str:
    """``row``'s tokens/s against ``dense_arm``'s at the same context (``-`` where that arm did not run)."""
    dense = next((x for x in rows if x["context"] == row["context"] and x["arm"] == dense_arm), None)
    return f"{row['tokens_per_s'] / dense['tokens_per_s']:.2f}x" if dense else "-"


if __name__ == "__main__":
    main()
