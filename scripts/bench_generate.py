#!/usr/bin/env python
"""Real ``generate()`` speed: the README one-liner against transformers' own caches, in one run.

A random-weight model of a real shape (default Llama-3.1-8B, bf16, seeded) runs greedy ``generate()``
on random prompts (a real prefill, then ``--new-tokens`` decode steps) for each arm:

* ``hf-dynamic``  transformers' default (``DynamicCache``; the model's attention is SDPA for it);
* ``hf-static``   transformers' ``StaticCache`` (generate() auto-compiles: torch.compile + CUDA graphs);
* ``r4i4``, ``r8i4``, ``quest``, ``full`` ... the README one-liner,
  ``LocksCache(model.config, locks)`` with nothing else (on a GPU it picks the static layout and
  generate() compiles its decode step);
* ``captured-r4i4`` ... the one-liner with ``compile_config=decode_compile_config()``: the decode step
  compiled by inductor and captured in one CUDA graph by the library (no per-step checks of CUDA-graph trees);
* ``static-r4i4`` ... ``LocksStaticCache`` with ``max_cache_len`` = prompt + new tokens;
* ``dynamic-r4i4`` ... ``LocksCache(..., layout="dynamic")`` (eager, no compiled step): the layout that
  stores quantized KV, so ``dynamic-r4i4`` beside ``r4i4+kv4-post`` compares the storage alone;
* any arm ending in ``+gemv`` (``r4i4+gemv``, ``hf-static+gemv``): the same with the model's projections on the
  library's GEMV kernel (`locks_hf.gemv_projections`; the other arms run them on ``nn.Linear``).

Memory: ``peak_gib`` is the peak allocated during the generate(); ``cache_gib`` what the cache holds
when it returns (allocated memory with the cache alive minus after it is freed); ``kv_ratio`` that per
token and full-attention layer, over the bf16 K/V of one token (``2 * kv_heads * head_dim * 2`` bytes).
``--prefill-chunk`` prefills in chunks (transformers' ``prefill_chunk_size``), so the peak follows the
cache rather than one long forward's activations.

Per arm: the prefill time, the median decode step (wall clock between steps, device synchronised,
after the first ``--warm-steps`` steps), the warm-up (the first steps' time beyond the median: the
compile and the CUDA-graph capture), how much of it torch.compile took (dynamo and inductor) and how
much the library's Triton kernels took to compile at their first launch (``triton_compiles``: by kernel,
with Triton's compilation listener), peak memory, and the
new tokens. Prints a markdown table and writes JSON (after every arm, so a run cut short keeps what
it measured)::

    python scripts/bench_generate.py --runs 128K:1,32K:8 --out generate.json

Compiled code is cached on disk by Triton and inductor (``TRITON_CACHE_DIR``,
``TORCHINDUCTOR_CACHE_DIR``): a second run on the same machine shows the warm compile time.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import statistics
import time

import torch
from bench_decode_step import (  # scripts/ is on sys.path when run as a script
    GEMV_SUFFIX,
    SHAPES,
    arm_family,
    parse_tokens,
    random_model,
    set_projections,
    tokens_label,
)
from multi_gpu_generate import timed_generate
from transformers import StaticCache

from locks_hf import LocksCache, LocksConfig, LocksStaticCache, decode_compile_config

HF_ARMS = ("hf-dynamic", "hf-static")
STATIC_PREFIX = "static-"
DYNAMIC_PREFIX = "dynamic-"
CAPTURED_PREFIX = "captured-"


def locks_config(name: str, budget: int) -> LocksConfig:
    name = arm_family(name).removeprefix(STATIC_PREFIX).removeprefix(DYNAMIC_PREFIX).removeprefix(CAPTURED_PREFIX)
    if name in ("full", "quest", "oracle"):
        return LocksConfig(selector=name, budget=budget)
    return LocksConfig.from_label(name, budget=budget)


def make_cache(name: str, config, budget: int, capacity: int):
    name = arm_family(name)
    if name == "hf-dynamic":
        return None  # generate() creates its default DynamicCache
    if name == "hf-static":
        return StaticCache(config=config, max_cache_len=capacity)
    if name.startswith(STATIC_PREFIX):
        return LocksStaticCache(config, max_cache_len=capacity, locks=locks_config(name, budget))
    if name.startswith(DYNAMIC_PREFIX):
        return LocksCache(config, locks_config(name, budget), layout="dynamic")
    return LocksCache(config, locks_config(name, budget))  # the README one-liner


def allocated() -> int:
    gc.collect()
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


def kv_bf16_token_bytes(config) -> int:
    """Bytes of one token's bf16 K and V in one layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_key_value_heads * head_dim * 2


def top_functions(profiler: cProfile.Profile, n: int) -> list[dict]:
    """The ``n`` functions of a cProfile run with the most cumulative seconds (where a first generate()'s
    host time goes: tracing, compiling, loading cached code, capturing graphs)."""
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
    rows = sorted(stats.items(), key=lambda kv: -kv[1][3])[:n]
    return [
        {"function": f"{name} ({os.path.basename(file)}:{line})", "calls": calls, "own_s": own, "cumulative_s": cum}
        for (file, line, name), (_, calls, own, cum, _) in rows
    ]


def torch_compile_phases() -> dict[str, float]:
    """torch.compile's seconds so far in this process by phase, as torch counts them: ``entire_frame_compile``
    is all of it (dynamo's tracing, inductor's lowering and code generation, the Triton compiles of its own
    kernels; not the library's Triton kernels, which compile at their first launch), of which
    ``backend_compile`` is the compiler's share and the rest dynamo's tracing."""
    return dict(torch._dynamo.utils.calculate_time_spent())


def phases_since(before: dict[str, float]) -> dict[str, float]:
    """The phases' seconds spent since ``before`` (a `torch_compile_phases`), those that grew."""
    now = torch_compile_phases()
    return {k: round(v - before.get(k, 0.0), 3) for k, v in now.items() if v > before.get(k, 0.0)}


class TritonCompiles:
    """Triton compiles in this process while it is entered (Triton's compilation listener, 3.4+): the
    library's kernels at their first launch, by kernel name, with their seconds; cache hits counted apart.
    Inductor compiles most of its own kernels in worker processes (they count in `torch_compile_phases`);
    any it compiles here show under their ``triton_`` names. Empty where this Triton has no listener."""

    def __init__(self) -> None:
        self.by_kernel: dict[str, dict] = {}
        self.hits = 0

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs

            self._knobs, self._previous = knobs.compilation, knobs.compilation.listener
            knobs.compilation.listener = self._listen
        except (ImportError, AttributeError):
            self._knobs = None
        return self

    def _listen(self, *, src, metadata, metadata_group, times, cache_hit) -> None:
        if self._previous is not None:
            self._previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
        if cache_hit:
            self.hits += 1
            return
        seconds = (times.ir_initialization + sum(us for _, us in times.lowering_stages) + times.store_results) / 1e6
        entry = self.by_kernel.setdefault(str(metadata.get("name", "?")), {"compiles": 0, "seconds": 0.0})
        entry["compiles"] += 1
        entry["seconds"] += seconds

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.listener = self._previous

    def summary(self) -> dict:
        kernels = sorted(self.by_kernel.items(), key=lambda kv: -kv[1]["seconds"])
        return {
            "seconds": sum(e["seconds"] for e in self.by_kernel.values()),
            "compiles": sum(e["compiles"] for e in self.by_kernel.values()),
            "cache_hits": self.hits,
            "kernels": dict(kernels),
        }


def run_arm(
    model,
    ids: torch.Tensor,
    name: str,
    budget: int,
    new_tokens: int,
    warm_steps: int,
    prefill_chunk: int = 0,
    host_profile: int = 0,
    inductor_options: dict | None = None,
) -> dict:
    cache = make_cache(name, model.config, budget, ids.shape[1] + new_tokens)
    before = allocated()
    if model.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    options = {"prefill_chunk_size": prefill_chunk} if prefill_chunk else {}
    if name.startswith(CAPTURED_PREFIX):
        options["compile_config"] = decode_compile_config(inductor_options)
    phases_before = torch_compile_phases()
    triton_compiles = TritonCompiles()
    t0 = time.perf_counter()
    profiler = cProfile.Profile() if host_profile else None
    with triton_compiles, profiler or contextlib.nullcontext():
        out, clock = timed_generate(model, ids, cache, new_tokens, **options)
    phases = phases_since(phases_before)
    steps = [1e3 * (b - a) for a, b in zip(clock.stamps, clock.stamps[1:])]
    timed = steps[warm_steps:] or steps
    median = statistics.median(timed)
    row = {
        "arm": name,
        "batch": ids.shape[0],
        "context": ids.shape[1],
        "prefill_s": clock.stamps[0] - t0,
        "ms_per_step": median,
        "tokens_per_s": 1e3 * ids.shape[0] / median,
        "warmup_s": max(0.0, sum(steps[:warm_steps]) - warm_steps * median) / 1e3,
        "torch_compile_s": phases.get("entire_frame_compile", 0.0),
        "torch_compile_phases_s": phases,
        "host_profile": top_functions(profiler, host_profile) if profiler else None,
        "triton_compiles": triton_compiles.summary(),
        "step_ms": steps,
        "tokens": out[0, ids.shape[1] :].tolist(),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if model.device.type == "cuda" else None,
        "compiled_layout": bool(getattr(cache, "is_static", False)) or arm_family(name) == "hf-static",
        "attended": cache.attended_fraction() if hasattr(cache, "attended_fraction") else 1.0,
    }
    if model.device.type == "cuda" and cache is not None:
        held = allocated()
        del cache
        row["cache_gib"] = (held - allocated()) / 2**30
        tokens = ids.shape[0] * (ids.shape[1] + new_tokens)
        layers = sum(
            kind == "full_attention"
            for kind in getattr(model.config, "layer_types", None)
            or ["full_attention"] * model.config.num_hidden_layers
        )
        row["kv_ratio"] = row["cache_gib"] * 2**30 / (tokens * layers * kv_bf16_token_bytes(model.config))
        row["peak_gib"] -= before / 2**30  # the weights and whatever ran before are not the generate()'s
    else:
        row["cache_gib"] = row["kv_ratio"] = None
    del out
    return row


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--runs", default="128K:1,32K:8", help="comma list of context:batch")
    ap.add_argument(
        "--arms",
        default="hf-dynamic,hf-static,r4i4,r8i4,static-r4i4",
        help=f"{', '.join(HF_ARMS)}, a Locks label (r4i4...), quest, full, oracle; "
        f"'{STATIC_PREFIX}<arm>' for LocksStaticCache, '{DYNAMIC_PREFIX}<arm>' for the dynamic layout; "
        "a '+kv4-post'-style suffix quantizes the KV (dynamic layout)",
    )
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--warm-steps", type=int, default=3, help="first decode steps counted as warm-up")
    ap.add_argument(
        "--prefill-chunk", type=int, default=0, help="prefill in chunks of this many tokens (0: one forward)"
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use --shape tiny)")
    ap.add_argument(
        "--host-profile",
        type=int,
        default=0,
        help="cProfile each arm's generate() and keep this many functions by cumulative time (host_profile)",
    )
    ap.add_argument(
        "--inductor-options",
        type=json.loads,
        default=None,
        help=f"for the '{CAPTURED_PREFIX}' arms: inductor options as JSON (decode_compile_config(options)); default: "
        "decode_compile_config's (captured_step.DECODE_INDUCTOR_OPTIONS), '{}': inductor's",
    )
    ap.add_argument("--out", default="bench_generate.json")
    args = ap.parse_args(argv)
    if args.inductor_options is not None and not any(a.startswith(CAPTURED_PREFIX) for a in args.arms.split(",")):
        ap.error(f"--inductor-options applies to the '{CAPTURED_PREFIX}' arms (decode_compile_config); none is asked")
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    torch.manual_seed(0)
    model = random_model(args.shape, device, bos_token_id=1, eos_token_id=None)
    config = model.config
    model.generation_config.eos_token_id = None  # random weights: always decode --new-tokens
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    result = {
        "shape": args.shape,
        "budget": args.budget,
        "new_tokens": args.new_tokens,
        "device": where,
        "torch": torch.__version__,
        "inductor_options": args.inductor_options,
        "rows": [],
    }
    with torch.no_grad():
        for run in args.runs.split(","):
            context, batch = run.split(":")
            n, b = parse_tokens(context), int(batch)
            ids = torch.randint(3, config.vocab_size, (b, n), generator=torch.Generator().manual_seed(0)).to(device)
            for name in args.arms.split(","):
                torch._dynamo.reset()  # each arm compiles its own graph (never hits dynamo's recompile limit)
                set_projections(model, name.endswith(GEMV_SUFFIX))
                row = run_arm(
                    model,
                    ids,
                    name,
                    args.budget,
                    args.new_tokens,
                    args.warm_steps,
                    args.prefill_chunk,
                    args.host_profile,
                    args.inductor_options,
                )
                result["rows"].append(row)
                print(
                    f"{tokens_label(n)} x{b} {name}: {row['ms_per_step']:.2f} ms/step, warm-up {row['warmup_s']:.1f} s, "
                    f"prefill {row['prefill_s']:.1f} s, peak {row['peak_gib'] or 0:.1f} GiB, "
                    f"library Triton compiles {row['triton_compiles']['compiles']} "
                    f"({row['triton_compiles']['seconds']:.1f} s)",
                    flush=True,
                )
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del ids

    print(
        f"\ngenerate(), {args.shape} random weights, {dtype}, {args.new_tokens} greedy tokens, b={args.budget}, "
        f"median ms per step after {args.warm_steps} warm-up steps ({where})\n"
    )
    print(
        "| context | batch | arm | ms/step | vs hf-dynamic | vs hf-static | warm-up s | of which torch.compile s | "
        "Triton compiles s | prefill s | peak GiB | cache GiB | KV vs bf16 | attended | tokens = first Locks arm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        same_run = [x for x in result["rows"] if (x["context"], x["batch"]) == (r["context"], r["batch"])]
        base = {x["arm"]: x["ms_per_step"] for x in same_run}
        ratios = [f"{base[a] / r['ms_per_step']:.2f}x" if a in base else "-" for a in HF_ARMS]
        first_locks = next((x for x in same_run if x["arm"] not in HF_ARMS), None)
        same = "-" if first_locks is None or r["arm"] in HF_ARMS else str(r["tokens"] == first_locks["tokens"])
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.2f}"
        held = "-" if r["cache_gib"] is None else f"{r['cache_gib']:.2f}"
        ratio = "-" if r["kv_ratio"] is None else f"{r['kv_ratio']:.3f}"
        print(
            f"| {tokens_label(r['context'])} | {r['batch']} | {r['arm']} | {r['ms_per_step']:.2f} | {ratios[0]} | "
            f"{ratios[1]} | {r['warmup_s']:.1f} | {r['torch_compile_s']:.1f} | {r['triton_compiles']['seconds']:.1f} | "
            f"{r['prefill_s']:.1f} | {peak} | {held} | "
            f"{ratio} | {r['attended']:.4f} | {same} |"
        )


if __name__ == "__main__":
    main()
