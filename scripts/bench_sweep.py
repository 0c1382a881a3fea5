#!/usr/bin/env python
"""Sweep benchmark: the runner's static engine against the eager runner, same jobs, same run.

Random-weight model of a real shape (default Llama-3.1-8B, bf16 on a GPU), synthetic prompts
(random token ids; the weights are random too), no EOS (every row generates its cap):

* job ``a`` (RULER-style): ``--a-records`` records of ``--a-context`` tokens x the arms x budget
  ``--budget``, ``--a-new`` new tokens each (greedy, the dense-question protocol);
* job ``b`` (reasoning-style): ``--b-prompt``-token prompt, ``--b-new`` new tokens, ``--b-samples``
  sampled traces (temperature 0.6, top-p 0.95) x ``--b-arms``. The eager runner is far too slow for
  all of it: it is timed on ``--b-old-samples`` x ``--b-old-new`` tokens per arm and reported as
  tokens/s of that subset;
* job ``warmup``: the warm-up (Triton compiles, CUDA-graph captures) of a many-arm sweep, by default
  17 arms (full + oracle / r8i4 / r4i4 / quest x b = 64, 128, 256, 512) over ``--w-records`` records;
* job ``memory``: one ``--context`` prefix serving every arm of ``--arms`` (``--memory-new`` tokens
  each) on one cache: the peak memory. Its K/V is written synthetically (structured random keys, as
  `bench_decode_step.py`): a dense prefill of 512K tokens is not what this checks.

For jobs a and b the table gives wall time, decode tokens/s, warm-up (CUDA-graph capture or compile,
Triton compiles) and peak memory for both engines, and an identity check: both engines on a small
subset at a covering budget (every page selected), greedy, in float32 (same weights), same tokens.

    python scripts/bench_sweep.py --jobs a,b --out results/h200/bench_sweep_h200.json
    python scripts/bench_sweep.py --jobs memory --context 512K --out results/h200/bench_sweep_memory.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _sibling(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_step_bench = _sibling("bench_decode_step")
SHAPES, parse_tokens, synthetic_prefill = _step_bench.SHAPES, _step_bench.parse_tokens, _step_bench.synthetic_prefill

from locks_hf.eval.arms import parse_arms  # noqa: E402
from locks_hf.eval.benchmarks import STOP_EOS, Benchmark  # noqa: E402
from locks_hf.eval.engine import Row, StaticEngine  # noqa: E402
from locks_hf.eval.jsonl import read_jsonl  # noqa: E402
from locks_hf.eval.runner import SweepRunner  # noqa: E402


class IdTokenizer:
    """Token ids as text (``"17 4 99"``): predictions stay comparable; no EOS, pad 0."""

    eos_token_id = None
    pad_token_id = 0

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return " ".join(str(int(i)) for i in ids)


class SyntheticBench(Benchmark):
    """Records of random token ids (seeded per record), a fixed generation cap, EOS-only stop."""

    name = "synthetic"

    def __init__(self, records: int, prompt: int, new: int, vocab: int, samples: int = 1, sampling=None, seed: int = 0):
        self.n, self.prompt, self.new, self.vocab = records, prompt, new, vocab
        self.samples, self.sampling, self.seed = samples, sampling, seed

    def records(self):
        return [{"id": f"syn-{i}", "task": "synthetic", "length": self.prompt} for i in range(self.n)]

    def prompt_text(self, rec):
        raise TypeError("synthetic records have no text prompt: their token ids come from prompt_ids")

    def prompt_ids(self, rec, tokenizer):
        g = torch.Generator().manual_seed(self.seed * 1000 + int(rec["id"].split("-")[1]))
        return torch.randint(3, self.vocab, (1, self.prompt), generator=g)

    def max_new_tokens(self, rec):
        return self.new

    def stop(self, rec):
        return STOP_EOS

    def score(self, rec, pred):
        return {"score": 0.0}

    def describe(self):
        return {"name": self.name, "records": self.n, "prompt": self.prompt, "new": self.new}


def _reset_memory(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def run_engine(model, bench, arms, engine: str, args, keep_runs: bool = False, **kw) -> dict:
    """One sweep of ``bench`` x ``arms`` through `SweepRunner` with ``engine``: timings and predictions."""
    device = next(model.parameters()).device
    _reset_memory(device)
    with tempfile.TemporaryDirectory() as tmp:
        runner = SweepRunner(
            model,
            IdTokenizer(),
            bench,
            arms,
            tmp,
            model_name="random",
            progress=False,
            engine=engine,
            batch_rows=args.batch_rows,
            step=args.step,
            **kw,
        )
        t0 = time.perf_counter()
        runner.run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        rows = [r for p in sorted(Path(tmp, "predictions").glob("*.jsonl")) for r in read_jsonl(p, appended=True)]
    tokens = sum(r["new_tokens"] for r in rows)
    if engine == "static":
        prefill = sum({a["batch"]: a["prefill_seconds"] for a in runner.arm_runs}.values())
        warm = sum(a["warmup_seconds"] for a in runner.arm_runs)
        decode = sum(a["seconds"] for a in runner.arm_runs) - warm
    else:
        prefill = sum({r["id"]: r["prefill_seconds"] for r in rows}.values())
        warm = 0.0  # eager: nothing to capture or compile (its first step's lazy work is in decode)
        decode = sum(r["seconds"] for r in rows)
    extra = {"arm_runs": runner.arm_runs} if keep_runs else {}
    return {
        **extra,
        "engine": engine,
        "wall_s": wall,
        "prefill_s": prefill,
        "warmup_s": warm,
        "decode_s": decode,
        "tokens": tokens,
        "decode_tokens_per_s": tokens / decode if decode else None,
        "peak_gb": _peak_gb(device),
        "generations": len(rows),
        "preds": {(r["id"], r["arm"], r["sample"]): r["pred"] for r in rows},
        "attended": {(r["id"], r["arm"], r["sample"]): r["attended_fraction"] for r in rows},
    }


def identity_check(model, args, vocab: int, arm_names, context: int, new: int, records: int) -> dict:
    """Both engines, in ``--check-dtype`` (the same weights), budget covering the context: same tokens?
    (bf16 sums in the dense and the page kernels differ in order: a near-tie can flip a greedy token.)"""
    dtype = next(model.parameters()).dtype
    model.to(getattr(torch, args.check_dtype))
    try:
        budget = 1 << (context + new).bit_length()
        arms = parse_arms(arm_names, [budget])
        bench = SyntheticBench(records, context, new, vocab, seed=7)
        old = run_engine(model, bench, arms, "eager", args)
        new_ = run_engine(model, bench, arms, "static", args)
    finally:
        model.to(dtype)
    same = sum(old["preds"][k] == new_["preds"].get(k) for k in old["preds"])
    attended = all(new_["attended"][k] == old["attended"][k] for k in old["attended"])
    return {
        "context": context,
        "new": new,
        "records": records,
        "budget": budget,
        "arms": arm_names,
        "dtype": args.check_dtype,
        "identical": same,
        "compared": len(old["preds"]),
        "attended_equal": attended,
    }


def job_a(model, args, vocab):
    arms = parse_arms(args.arms.split(","), [args.budget])
    ctx = parse_tokens(args.a_context)
    bench = SyntheticBench(args.a_records, ctx, args.a_new, vocab)
    new = run_engine(model, bench, arms, "static", args)
    old_bench = SyntheticBench(args.a_old_records or args.a_records, ctx, args.a_new, vocab)
    old = run_engine(model, old_bench, arms, "eager", args)
    subset = None if not args.a_old_records else f"{args.a_old_records} records"
    return {
        "job": "a",
        "context": ctx,
        "records": args.a_records,
        "arms": [a.name for a in arms],
        "new_tokens": args.a_new,
        "static": _public(new),
        "eager": _public(old),
        "eager_subset": subset,
    }


def job_b(model, args, vocab):
    arms = parse_arms(args.b_arms.split(","), [args.budget])
    sampling = {"temperature": 0.6, "top_p": 0.95}
    bench = SyntheticBench(1, args.b_prompt, args.b_new, vocab, samples=args.b_samples, sampling=sampling)
    new = run_engine(model, bench, arms, "static", args)
    old_bench = SyntheticBench(1, args.b_prompt, args.b_old_new, vocab, samples=args.b_old_samples, sampling=sampling)
    old = run_engine(model, old_bench, arms, "eager", args)
    return {
        "job": "b",
        "prompt": args.b_prompt,
        "samples": args.b_samples,
        "arms": [a.name for a in arms],
        "new_tokens": args.b_new,
        "static": _public(new),
        "eager": _public(old),
        "eager_subset": f"{args.b_old_samples} sample(s) x {args.b_old_new} tokens per arm",
    }


def job_warmup(model, args, vocab):
    """The warm-up of a many-arm sweep: ``--w-arms`` x ``--w-budgets`` (+ full) over ``--w-records``
    records of ``--a-context`` tokens, cold (no Triton kernel compiled before in this process unless an
    earlier job compiled it; run this job first for a cold figure). Arms that differ only in budget
    replay one step, so the warm-up grows with the distinct (selector, summary) settings, not the arms."""
    budgets = [int(b) for b in args.w_budgets.split(",")]
    names = args.w_arms.split(",")
    arms = parse_arms([n for n in names if n == "full"], budgets[:1]) + parse_arms(
        [n for n in names if n != "full"], budgets
    )
    ctx = parse_tokens(args.a_context)
    bench = SyntheticBench(args.w_records, ctx, args.w_new, vocab)
    t0 = time.perf_counter()
    new = run_engine(model, bench, arms, "static", args, keep_runs=True)
    wall = time.perf_counter() - t0
    runs = new.pop("arm_runs")
    per_arm = [
        {"arm": r["arm"], "warmup_s": r["warmup_seconds"], "new_step": r["new_step"]} for r in runs if r["batch"] == 0
    ]
    return {
        "job": "warmup",
        "context": ctx,
        "records": args.w_records,
        "arms": [a.name for a in arms],
        "n_arms": len(arms),
        "new_tokens": args.w_new,
        "static": _public(new),
        "wall_s": wall,
        "steps_built": sum(r["new_step"] for r in runs),
        "per_arm": per_arm,
    }


def job_memory(model, args, vocab):
    """One synthetic prefix of ``--context`` tokens, every arm decoded from it on the same cache."""
    device = next(model.parameters()).device
    ctx = parse_tokens(args.context)
    arms = parse_arms(args.arms.split(","), [args.budget])
    _reset_memory(device)
    engine = StaticEngine(model, step=args.step)
    rows = [Row(torch.zeros(ctx, dtype=torch.long), [5], args.memory_new, lambda new: False)]
    dtype = next(model.parameters()).dtype
    t0 = time.perf_counter()
    batch = engine.prepare(
        rows, arms[0].config, prefill=lambda cache: synthetic_prefill(cache, model.config, ctx, device, dtype)
    )
    prefill_s = time.perf_counter() - t0
    per_arm = []
    for arm in arms:
        run = batch.decode(arm.config)
        per_arm.append(
            {
                "arm": arm.name,
                "tokens": len(run.results[0].tokens),
                "seconds": run.seconds,
                "warmup_s": run.warmup_seconds,
                "peak_gb_so_far": _peak_gb(device),
            }
        )
        print(
            f"  memory {ctx} tokens, {arm.name}: {run.seconds:.1f} s, peak {_fmt(per_arm[-1]['peak_gb_so_far'])} GB",
            flush=True,
        )
    kv = sum(t.numel() * t.element_size() for layer in batch.cache.locks_layers for t in (layer.keys, layer.values))
    batch.close()
    return {
        "job": "memory",
        "context": ctx,
        "arms": [a.name for a in arms],
        "prefill": "synthetic K/V",
        "prefill_s": prefill_s,
        "kv_gb": kv / 2**30,
        "peak_gb": _peak_gb(device),
        "per_arm": per_arm,
        "ok": True,
    }


def _public(result: dict) -> dict:
    return {k: v for k, v in result.items() if k not in ("preds", "attended")}


def _fmt(x, spec=".1f"):
    return "-" if x is None else format(x, spec)


def print_table(results: list[dict], header: str) -> None:
    print(f"\n{header}\n")
    print(
        "| job | engine | generations | wall s | prefill s | warm-up s | decode tokens | decode tok/s | "
        "speed-up | peak GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if r["job"] in ("memory", "warmup"):
            continue
        base = r["eager"]["decode_tokens_per_s"]
        for name in ("static", "eager"):
            e = r[name]
            speed = e["decode_tokens_per_s"] / base if base and e["decode_tokens_per_s"] else None
            note = f" ({r['eager_subset']})" if name == "eager" and r.get("eager_subset") else ""
            print(
                f"| {r['job']} | {name}{note} | {e['generations']} | {_fmt(e['wall_s'])} | {_fmt(e['prefill_s'])} | "
                f"{_fmt(e['warmup_s'])} | {e['tokens']} | {_fmt(e['decode_tokens_per_s'])} | "
                f"{_fmt(speed, '.1f')}x | {_fmt(e['peak_gb'])} |"
            )
    for r in results:
        if "identity" in r:
            c = r["identity"]
            print(
                f"\nidentity ({r['job']}): {c['identical']}/{c['compared']} generations with the same tokens, "
                f"attended fractions equal: {c['attended_equal']} ({c['dtype']}, context {c['context']}, budget "
                f"{c['budget']}, {c['new']} new tokens, arms {','.join(c['arms'])})"
            )
        if r["job"] == "warmup":
            e = r["static"]
            print(
                f"\nwarm-up: {r['n_arms']} arms x {r['records']} records of {r['context']} tokens: warm-up "
                f"{_fmt(e['warmup_s'])} s in all (steps built: {r['steps_built']}), wall {_fmt(r['wall_s'])} s, "
                f"prefill {_fmt(e['prefill_s'])} s, decode {_fmt(e['decode_tokens_per_s'])} tok/s, peak "
                f"{_fmt(e['peak_gb'])} GB"
            )
            for a in r["per_arm"]:
                print(f"  {a['arm']:<22} warm-up {a['warmup_s']:6.1f} s  {'built' if a['new_step'] else 'replayed'}")
        if r["job"] == "memory":
            print(
                f"\nmemory: {r['context']}-token prefix (synthetic K/V, {r['kv_gb']:.1f} GB) served "
                f"{len(r['arms'])} arms ({','.join(r['arms'])}) on one cache; peak {_fmt(r['peak_gb'])} GB"
            )


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", default="a,b", help="comma list of a, b, memory, warmup")
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument(
        "--step",
        default="auto",
        choices=["auto", "graph", "compile", "eager"],
        help="the static engine's step (auto: CUDA graph on a GPU)",
    )
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--arms", default="full,oracle,locks-r8i4,locks-r4i4,quest")
    ap.add_argument("--a-records", type=int, default=8)
    ap.add_argument("--a-context", default="32K")
    ap.add_argument("--a-new", type=int, default=32)
    ap.add_argument("--a-old-records", type=int, default=0, help="eager runner on this many records (0: all)")
    ap.add_argument("--b-arms", default="full,locks-r8i4,quest")
    ap.add_argument("--b-prompt", type=int, default=256)
    ap.add_argument("--b-new", type=int, default=8192)
    ap.add_argument("--b-samples", type=int, default=8)
    ap.add_argument("--b-old-samples", type=int, default=1)
    ap.add_argument("--b-old-new", type=int, default=256)
    ap.add_argument("--w-arms", default="full,oracle,locks-r8i4,locks-r4i4,quest", help="warm-up job: arm families")
    ap.add_argument("--w-budgets", default="64,128,256,512", help="warm-up job: budgets (x the families but full)")
    ap.add_argument("--w-records", type=int, default=2)
    ap.add_argument("--w-new", type=int, default=16)
    ap.add_argument("--context", default="512K", help="memory job: the shared prefix")
    ap.add_argument("--memory-new", type=int, default=32)
    ap.add_argument("--check-context", type=int, default=1024, help="identity check: prompt tokens")
    ap.add_argument("--check-new", type=int, default=16)
    ap.add_argument("--check-records", type=int, default=2)
    ap.add_argument(
        "--check-dtype", default="float32", help="identity check: weights and K/V dtype (exact cast from bf16 and back)"
    )
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--out", default="bench_sweep.json")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _step_bench.random_model(args.shape, device, eos_token_id=None, bos_token_id=None)
    config = model.config
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    vocab = config.vocab_size
    jobs = {"a": job_a, "b": job_b, "memory": job_memory, "warmup": job_warmup}
    results = []
    for name in args.jobs.split(","):
        if name not in jobs:
            raise SystemExit(f"unknown job {name!r}: use a, b, memory, warmup")
        t0 = time.perf_counter()
        res = jobs[name](model, args, vocab)
        if name in ("a", "b") and not args.no_check:
            names = args.arms.split(",") if name == "a" else args.b_arms.split(",")
            res["identity"] = identity_check(
                model, args, vocab, names, args.check_context, args.check_new, args.check_records
            )
        res["job_seconds"] = time.perf_counter() - t0
        results.append(res)
        print(f"job {name}: {res['job_seconds']:.0f} s", flush=True)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print_table(
        results,
        f"Sweep benchmark, {args.shape} random weights, {dtype}, b={args.budget}, static step {args.step} ({where})",
    )
    Path(args.out).write_text(
        json.dumps(
            {"shape": args.shape, "device": where, "dtype": str(dtype), "args": vars(args), "results": results},
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    sys.exit(main())
