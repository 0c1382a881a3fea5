"""CPU decode-step time of the reference path at long context on a real model: dense vs Locks.

Prefills one prompt densely into a `LocksCache`, then times single-token decode steps for each arm
on a fork of that cache (same K/V for every arm). Prints a markdown table and writes JSON.

    python scripts/bench_cpu_decode.py --model smollm2-135m --context 8000 --steps 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from locks_hf import LocksCache, LocksConfig
from locks_hf.compat import cache_keyword
from locks_hf.models import encode_prompt, load_model
from locks_hf.needle import build_needle_prompt

ARMS = {
    "full (dense sdpa)": LocksConfig(selector="full"),
    "locks r8i4 b=128": LocksConfig.from_label("r8i4", budget=128),
    "locks r4i4 b=128": LocksConfig.from_label("r4i4", budget=128),
    "quest b=128": LocksConfig(selector="quest", budget=128),
    "oracle b=128": LocksConfig(selector="oracle", budget=128),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default="cpu_decode.json")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = load_model(args.model)
    text, _ = build_needle_prompt(tok, context_tokens=args.context)
    ids = encode_prompt(tok, text)
    base = LocksCache(model.config, LocksConfig())
    with torch.no_grad():
        t0 = time.perf_counter()
        logits = model(ids, **{cache_keyword(model): base}).logits
        prefill_s = time.perf_counter() - t0
    first = logits[:, -1:].argmax(-1)

    rows = []
    for name, cfg in ARMS.items():
        cache = base.fork(cfg)
        token, times = first, []
        with torch.no_grad():
            for step in range(args.steps + 2):
                t0 = time.perf_counter()
                token = model(token, **{cache_keyword(model): cache}).logits[:, -1:].argmax(-1)
                if step >= 2:  # warm-up: the first step also builds the summaries
                    times.append(time.perf_counter() - t0)
        rows.append({"arm": name, "median_ms": 1e3 * statistics.median(times), "attended": cache.attended_fraction()})
    dense = rows[0]["median_ms"]
    print(
        f"\n{args.model}, context {ids.shape[1]} tokens, {torch.get_num_threads()} threads, "
        f"prefill {prefill_s:.1f} s, median of {args.steps} steps\n"
    )
    print("| arm | decode step (ms) | vs dense | tokens attended |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['arm']} | {r['median_ms']:.1f} | {dense / r['median_ms']:.2f}x | {r['attended']:.3f} |")
    with open(args.json, "w") as f:
        json.dump(
            {
                "model": args.model,
                "context": ids.shape[1],
                "threads": torch.get_num_threads(),
                "prefill_s": prefill_s,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
