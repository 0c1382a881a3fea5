#!/usr/bin/env python
"""Soak: a long sparse decode with memory sampled; the process must not grow per token beyond the K/V
and page summaries the cache holds.

A random-weight Llama of a real shape (default Llama-3.1-8B: 32 layers, 8 KV heads of 128, bf16 on
a GPU) prefills ``--prompt`` tokens, then decodes ``--new-tokens`` one-token forwards greedily through
a `LocksCache`. Every ``--sample-every`` tokens it records the allocated memory (CUDA allocator, or the
process RSS on the CPU) and the bytes the cache's Locks layers hold; the summary is the growth per
token beyond the cache (ideally 0) as a table and JSON.

    python scripts/dev/soak_decode.py --new-tokens 16384 --out runs/soak_h200.json      # ~8B shape on a GPU
    python scripts/dev/soak_decode.py --shape tiny --device cpu --new-tokens 2000       # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import psutil
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from locks_hf import LocksCache

SHAPES = {
    "llama3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
    ),
}


def cache_bytes(cache) -> int:
    """Bytes of the tensors the Locks layers hold: K/V storage, slot validity, summaries."""
    total = 0
    for layer in cache.locks_layers:
        tensors = [
            *layer.kv_buffers(),
            layer.slot_valid,
            *layer.summary.values(),
            *getattr(layer, "shared", {}).values(),
        ]
        total += sum(t.nbytes for t in tensors if t is not None)
    return total


def memory(device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return torch.cuda.memory_allocated(device)
    gc.collect()
    return psutil.Process().memory_info().rss


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES), help="model shape (random weights)")
    ap.add_argument("--device", default="cuda", help="cuda | cuda:N | cpu")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens prefilled before decoding")
    ap.add_argument("--new-tokens", type=int, default=8192, help="decode steps (one token each)")
    ap.add_argument("--budget", type=int, default=2048, help="Locks token budget per layer and KV head")
    ap.add_argument("--sample-every", type=int, default=1024, help="decode steps between memory samples")
    ap.add_argument("--out", default=None, help="write the samples and the summary to this JSON file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=args.prompt + args.new_tokens + 16)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, attn_implementation="locks", dtype=dtype).eval()
    cache = LocksCache(model.config, budget=args.budget, max_cache_len=args.prompt + args.new_tokens + 1)
    ids = torch.randint(3, config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(0)).to(device)
    samples, start = [], time.perf_counter()
    with torch.no_grad():
        token = model(ids, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
        for step in range(1, args.new_tokens + 1):
            token = model(token, past_key_values=cache, logits_to_keep=1).logits[:, -1:].argmax(-1)
            if step % args.sample_every == 0 or step == args.new_tokens:
                samples.append(
                    {
                        "tokens": args.prompt + step,
                        "memory": memory(device),
                        "cache": cache_bytes(cache),
                        "seconds": round(time.perf_counter() - start, 1),
                    }
                )
                s = samples[-1]
                print(
                    f"{s['tokens']:>9} tokens  memory {s['memory'] / 2**20:10.1f} MiB  cache "
                    f"{s['cache'] / 2**20:10.1f} MiB  beyond {(s['memory'] - s['cache']) / 2**20:10.1f} MiB  "
                    f"{s['seconds']:8.1f} s",
                    flush=True,
                )
    first, last = samples[0], samples[-1]
    tokens = max(last["tokens"] - first["tokens"], 1)
    beyond = (last["memory"] - first["memory"]) - (last["cache"] - first["cache"])
    summary = {
        "shape": args.shape,
        "device": str(device),
        "prompt": args.prompt,
        "new_tokens": args.new_tokens,
        "budget": args.budget,
        "attended_fraction": cache.attended_fraction(),
        "beyond_cache_bytes_per_token": beyond / tokens,
        "cache_bytes_per_token": (last["cache"] - first["cache"]) / tokens,
    }
    print(json.dumps(summary))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1) + "\n")
    return summary


if __name__ == "__main__":
    main()
