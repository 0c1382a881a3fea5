#!/usr/bin/env python
"""generate() with a LocksCache on a model split over several GPUs, against the same model on one GPU.

Builds a random-weight model of a real shape (default Llama-3.1-8B, bf16, seeded) on GPU 0 and
runs greedy `generate()` on a random prompt of N tokens for each arm (dense = ``selector="full"``,
Locks, ...) on that single GPU. Then it places the *same* model over every visible GPU the way
``from_pretrained(..., device_map="balanced")`` does (accelerate's `get_balanced_memory` +
`infer_auto_device_map` + `dispatch_model`) and runs the same generations again. Reports whether
the tokens are identical, where each layer's cache lives, and the decode-step times (wall clock
between steps, device synchronised, prefill excluded).

    python scripts/multi_gpu_generate.py --context 128K --new-tokens 32 --out multi_gpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_decode_step import SHAPES, parse_tokens, random_model  # scripts/ is on sys.path when run as a script
from transformers import StoppingCriteria, StoppingCriteriaList

from locks_hf import LocksCache, LocksConfig
from locks_hf.compat import cache_keyword


class StepClock(StoppingCriteria):
    """Records the time at the end of every generate() step (after synchronising every GPU)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)
        self.stamps.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def timed_generate(model, ids: torch.Tensor, cache, new_tokens: int, **options) -> tuple[torch.Tensor, StepClock]:
    """Greedy ``generate()`` of exactly ``new_tokens`` tokens on ``cache``, each step's end stamped."""
    clock = StepClock()
    out = model.generate(
        ids,
        **{cache_keyword(model): cache},
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        stopping_criteria=StoppingCriteriaList([clock]),
        pad_token_id=0,
        **options,
    )
    return out, clock


def run_arm(model, config, ids: torch.Tensor, locks: LocksConfig, new_tokens: int) -> dict:
    cache = LocksCache(config, locks, layout="dynamic")  # the eager path (what this script has always measured)
    t0 = time.perf_counter()
    out, clock = timed_generate(model, ids, cache, new_tokens)
    steps = [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])]
    placement = sorted({str(layer.keys.device) for layer in cache.locks_layers})
    return {
        "tokens": out[0, ids.shape[1] :].tolist(),
        "prefill_s": clock.stamps[0] - t0,
        "step_ms_median": statistics.median(steps),
        "step_ms": steps,
        "cache_devices": placement,
        "attended": cache.attended_fraction(),
    }


def split_over_gpus(model, layer_class: str):
    """Place ``model`` over every visible GPU as ``device_map="balanced"`` would."""
    from accelerate import dispatch_model, infer_auto_device_map
    from accelerate.utils import get_balanced_memory

    memory = get_balanced_memory(model, no_split_module_classes=[layer_class], dtype=model.dtype)
    device_map = infer_auto_device_map(model, max_memory=memory, no_split_module_classes=[layer_class])
    return dispatch_model(model, device_map=device_map), device_map


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--context", default="128K")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--arms", default="full,r4i4,quest", help="full | quest | oracle | a Locks label (r4i4...)")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--out", default="multi_gpu.json")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"needs at least 2 GPUs, found {torch.cuda.device_count()}")

    torch.manual_seed(0)
    model = random_model(args.shape, torch.device("cuda:0"), bos_token_id=1, eos_token_id=2)
    config = model.config
    n = parse_tokens(args.context)
    ids = torch.randint(3, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0)).to("cuda:0")
    arms = {
        a: LocksConfig(selector=a, budget=args.budget)
        if a in ("full", "quest", "oracle")
        else LocksConfig.from_label(a, budget=args.budget)
        for a in args.arms.split(",")
    }

    results = {
        "context": n,
        "shape": args.shape,
        "budget": args.budget,
        "gpus": torch.cuda.device_count(),
        "gpu": torch.cuda.get_device_name(0),
        "one_gpu": {},
        "split": {},
    }
    with torch.no_grad():
        for name, locks in arms.items():
            results["one_gpu"][name] = run_arm(model, config, ids, locks, args.new_tokens)
            print(
                name,
                "1 GPU",
                {k: v for k, v in results["one_gpu"][name].items() if k not in ("tokens", "step_ms")},
                flush=True,
            )
        model, device_map = split_over_gpus(model, "LlamaDecoderLayer")
        results["device_map"] = {k: str(v) for k, v in device_map.items()}
        for name, locks in arms.items():
            results["split"][name] = run_arm(model, config, ids, locks, args.new_tokens)
            print(
                name,
                "split",
                {k: v for k, v in results["split"][name].items() if k not in ("tokens", "step_ms")},
                flush=True,
            )

    print(
        f"\n{args.shape} random weights, bf16, {n // 1024}K-token prompt, {args.new_tokens} greedy tokens, "
        f"b={args.budget}, eager ({results['gpu']})\n"
    )
    print("| arm | tokens identical (split vs 1 GPU) | step ms, 1 GPU | step ms, split | cache devices (split) |")
    print("|---|---|---|---|---|")
    for name in arms:
        one, split = results["one_gpu"][name], results["split"][name]
        same = one["tokens"] == split["tokens"]
        results["split"][name]["identical"] = same
        print(
            f"| {name} | {'yes' if same else 'NO'} | {one['step_ms_median']:.1f} | {split['step_ms_median']:.1f} | "
            f"{', '.join(split['cache_devices'])} |"
        )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
