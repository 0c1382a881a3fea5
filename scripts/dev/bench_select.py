#!/usr/bin/env python
"""Selection and sparse attention of a Locks decode step on a CUDA GPU, the algorithms of today
against the previous ones, and the complete decode step's launches and time.

``--kernels``: one layer at the real attention shapes (synthetic cache, r4i4 summaries built by the
GPU kernels), CUDA-graph medians over several cache copies (no warm L2), per configuration:

* selection: per-chunk top-k + merge, without and with the page mask a static layer keeps, and (for a chunk
  count that is not a power of two) with the merge in one tile of the next power of two, as before;
* attention over the selected pages: the split merge in a second launch (the previous layout) vs
  merged by the last split, and a few split counts / tile sizes;
* score + select + attend as the previous chain and as `decode_step` runs it now, against the
  fastest dense attention measured in the same run.

``--step``: the complete decode step of a random-weight model (`bench_decode_step`'s setup, CUDA
graphs, static caches) for each arm, in two variants on one cache: ``new`` (today's kernels and the
static layer's step without glue launches) and ``old`` (a separate merge launch), with torch.profiler's kernel count per step.

Prints markdown tables and writes JSON (``--out``), saved after every configuration; a failing
candidate or configuration is logged and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import inspect
import json
import math
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: bench_decode, bench_decode_step
import bench_decode as BD  # noqa: E402  (loads locks_hf, with or without transformers)

from locks_hf.kernels import (
    decode as decode_mod,  # noqa: E402
    select as select_mod,  # noqa: E402
)
from locks_hf.kernels.attend import sparse_attention  # noqa: E402
from locks_hf.kernels.decode import decode_step  # noqa: E402
from locks_hf.kernels.score import score_pages  # noqa: E402
from locks_hf.kernels.select import select_pages  # noqa: E402

B = 16
RESULTS: dict = {"kernels": [], "step": [], "log": []}


def log(msg: str) -> None:
    print(msg, flush=True)
    RESULTS["log"].append(msg)


def save(path: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(RESULTS, indent=1, default=str))


@contextlib.contextmanager
def one_tile_merge():
    """The selection's merge as before `select.merge_tiles`: one tile of the next power of two of chunks."""
    saved = select_mod.merge_tiles
    select_mod.merge_tiles = lambda n_chunk, kp: (select_mod.next_pow2(n_chunk) * kp, 0)
    try:
        yield
    finally:
        select_mod.merge_tiles = saved


def timed(fns, reps: int) -> float | None:
    try:
        if BD.DEV != "cuda":  # a smoke run (interpreter): each closure once
            t0 = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t0) * 1e3 / len(fns)
        return BD.time_graph(fns, reps=reps)["ms"]
    except Exception as e:  # one candidate failing does not stop the run
        log(f"    FAILED {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        if BD.DEV == "cuda":
            torch.cuda.synchronize()
        return None


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if BD.DEV == "cuda" else 8


def old_splits(rows: int, width: int, tp: int = 4) -> int:
    """The previous default split count for a page list (about two programs per SM)."""
    return max(1, min(-(-2 * sms() // rows), -(-width // tp)))


# ----------------------------------------------------------------------------------------------
# one layer
# ----------------------------------------------------------------------------------------------
def kernel_config(model: str, ctx: int, batch: int, budget: int, reps: int, sweep: bool) -> dict:
    hq, h, d, _, _ = BD.MODELS[model]
    slots = math.ceil(budget / B)
    scale = d**-0.5
    rows = batch * h
    kv_bytes = batch * h * ctx * d * 2 * 2
    free = torch.cuda.mem_get_info()[0] if BD.DEV == "cuda" else 4 << 30
    # a few copies so that a replay does not find the previous one's scores and pages in L2 (their
    # K/V is what a real step reads from memory too); two where a copy is large
    nbuf = max(1, min(4 if kv_bytes < (4 << 30) else 2, int(0.5 * free / (kv_bytes * 1.3 + 1))))
    gen = torch.Generator(device=BD.DEV).manual_seed(ctx + batch)
    t0 = time.perf_counter()
    sets = [BD.CacheSet(batch, hq, h, d, ctx, gen) for _ in range(nbuf)]
    for s in sets:
        s.build([(4, 4)])
        # the length as the cache keeps it (a device tensor): no per-launch copy of an int
        s.length = torch.full((1,), ctx, dtype=torch.int32, device=BD.DEV)
    row = {
        "model": model,
        "context": ctx,
        "batch": batch,
        "budget": budget,
        "copies": nbuf,
        "build_s": time.perf_counter() - t0,
    }
    log(f"{model} {BD.fmt_ctx(ctx)} b{batch}: {nbuf} copies built in {row['build_s']:.1f} s")

    def score(s):
        return score_pages("locks", s.query, summary=s.summaries["r4i4"], scale=scale, basis_bits=4, **s.kw())

    sp = [score(s) for s in sets]

    def sel(i, **kw):
        s = sets[i]
        return select_pages(
            *sp[i], slots=slots, per_head=False, row_start=s.row_start, length=s.length, heads=h, page_size=B, **kw
        )

    pages = [sel(i) for i in range(nbuf)]
    t = {}
    t["select_chunks"] = timed([functools.partial(sel, i) for i in range(nbuf)], reps)
    # as a static layer's step runs it: the launch that writes the lists also overwrites the layer's page mask
    n_pages = sp[0][0].shape[-1]
    masks = [torch.ones((rows, n_pages), dtype=torch.bool, device=BD.DEV) for i in range(nbuf)]
    marked = [sel(i, mask=masks[i]) for i in range(nbuf)]
    if not all(torch.equal(marked[i], pages[i]) for i in range(nbuf)):
        log("    select_marked: pages differ from the unmarked selection's")
    t["select_marked"] = timed([functools.partial(sel, i, mask=masks[i]) for i in range(nbuf)], reps)
    _, n_chunk, group = select_mod.selection_stages(n_pages, select_mod.next_pow2(max(slots - 2, 1)), rows)
    n_lists = n_chunk if group is None else -(-n_chunk // group)  # the lists the merge takes
    if select_mod.merge_tiles(n_lists, 1)[1]:  # a chunk count that is not a power of two: the merge in one tile
        with one_tile_merge():
            if not all(torch.equal(sel(i), pages[i]) for i in range(nbuf)):
                log("    select_one_tile: pages differ from the two-tile merge's")
            t["select_one_tile"] = timed([functools.partial(sel, i) for i in range(nbuf)], reps)

    def time_setting(key, **kw):  # the selection with other settings: timed, and its pages checked
        if not all(torch.equal(sel(i, **kw), pages[i]) for i in range(nbuf)):
            log(f"    {key}: pages differ from the default's")
        t[key] = timed([functools.partial(sel, i, **kw) for i in range(nbuf)], reps)

    if "tickets" in inspect.signature(select_pages).parameters:
        # with a counter buffer the caller keeps (left zero by every launch): no zeroed buffer made a call
        time_setting("select_kept_tickets", tickets=torch.zeros(1 << 16, dtype=torch.int32, device=BD.DEV))
    if sweep:  # pages per first-stage program, its warps, the partials it folds per step; a middle stage
        for chunk in (512, 1024, 2048, 4096):
            for nw in (4, 8):
                for nbp in (64, 256):
                    if chunk > n_pages:
                        continue
                    time_setting(f"select_ch{chunk}_w{nw}_nbp{nbp}", chunk=chunk, num_warps=nw, partial_block=nbp)
        # short chunks (more programs a row) with a middle stage that merges their lists `group` at a time
        for chunk, group in ((256, 8), (512, 4), (512, 8), (512, 16), (1024, 4), (1024, 8), (2048, 4)):
            if chunk > n_pages:
                continue
            for nw in (4, 8, 16):
                time_setting(f"select_ch{chunk}_w{nw}_group{group}", chunk=chunk, num_warps=nw, group=group)

    def att(i, **kw):
        s = sets[i]
        return sparse_attention(
            s.query,
            s.keys,
            s.values,
            pages[i],
            slot_valid=s.slot_valid,
            row_start=s.row_start,
            length=s.length,
            scale=scale,
            page_size=B,
            **kw,
        )

    W = pages[0].shape[1]
    osp = old_splits(rows, W)
    ref = att(0, splits=osp, fused_combine=False).float()
    new = att(0, fused_combine=True).float()
    row["attend_rel_diff"] = float((new - ref).norm() / ref.norm())
    log(f"  fused vs separate merge: rel diff {row['attend_rel_diff']:.2e}")
    t["attend_old"] = timed([functools.partial(att, i, splits=osp, fused_combine=False) for i in range(nbuf)], reps)
    t["attend_fused"] = timed([functools.partial(att, i, fused_combine=True) for i in range(nbuf)], reps)
    if sweep:
        for splits, tp, nw in [(8, 4, 4), (16, 4, 4), (32, 4, 4), (8, 8, 4), (16, 8, 4), (16, 8, 8), (4, 8, 4)]:
            t[f"attend_fused_s{splits}_tp{tp}_w{nw}"] = timed(
                [
                    functools.partial(att, i, splits=splits, tile_pages=tp, num_warps=nw, fused_combine=True)
                    for i in range(nbuf)
                ],
                reps,
            )

    t["score"] = timed([functools.partial(score, s) for s in sets], reps)

    def total_old(i):
        s = sets[i]
        sc, pa = score(s)
        pg = select_pages(
            sc, pa, slots=slots, per_head=False, row_start=s.row_start, length=s.length, heads=h, page_size=B
        )
        return sparse_attention(
            s.query,
            s.keys,
            s.values,
            pg,
            slot_valid=s.slot_valid,
            row_start=s.row_start,
            length=s.length,
            scale=scale,
            page_size=B,
            splits=osp,
            fused_combine=False,
        )

    def total_new(i):
        s = sets[i]
        return decode_step(
            "locks",
            s.query,
            key_buf=s.keys,
            value_buf=s.values,
            slot_valid=s.slot_valid,
            row_start=s.row_start,
            n_complete=s.n_complete,
            length=s.length,
            n_pages=s.P,
            slots=slots,
            scale=scale,
            page_size=B,
            summary=s.summaries["r4i4"],
            basis_bits=4,
        )[0]

    t["total_old"] = timed([functools.partial(total_old, i) for i in range(nbuf)], reps)
    t["total_new"] = timed([functools.partial(total_new, i) for i in range(nbuf)], reps)

    dense = {}
    for name, fns in BD.dense_fns(sets, scale).items():
        if name not in ("sdpa-cudnn-gqa", "sdpa-flash-rows", "sdpa-efficient-rows", "locks-dense-kernel"):
            continue
        dense[name] = timed(fns, reps)
    dense_old = [
        functools.partial(
            sparse_attention,
            s.query,
            s.keys,
            s.values,
            None,
            n_pages=s.P,
            slot_valid=s.slot_valid,
            row_start=s.row_start,
            length=s.length,
            scale=scale,
            page_size=B,
            fused_combine=False,
        )
        for s in sets
    ]
    row["dense_kernel_separate_merge_ms"] = timed(dense_old, reps)  # the previous dense kernel: not a candidate
    ok = {k: v for k, v in dense.items() if v is not None}
    row["dense_ms"] = min(ok.values()) if ok else None
    row["dense_backend"] = min(ok, key=ok.get) if ok else None
    row["dense_candidates_ms"] = dense
    row["ms"] = t
    best = lambda prefix: min((v for k, v in t.items() if k.startswith(prefix) and v), default=None)  # noqa: E731
    row["best_select_ms"], row["best_attend_ms"] = best("select_chunks"), best("attend_fused")
    if row["dense_ms"] and t["total_new"]:
        row["speedup_new"] = row["dense_ms"] / t["total_new"]
    if row["dense_ms"] and t["total_old"]:
        row["speedup_old"] = row["dense_ms"] / t["total_old"]
    log(
        "  " + ", ".join(f"{k} {v:.4f}" for k, v in t.items() if v) + f"; dense {row['dense_ms']} "
        f"({row['dense_backend']})"
    )
    for held in (sets, sp, pages, masks, marked):  # the closures keep the lists, not their tensors
        held.clear()
    gc.collect()
    if BD.DEV == "cuda":
        torch.cuda.empty_cache()
    return row


def kernel_table(rows: list[dict]) -> str:
    out = [
        "| model | ctx | batch | score | select | select marked | select, one-tile merge | attend old | attend fused (best) "
        "| total old | **total new** | dense (backend) | old x | **new x** |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    f = lambda x: "-" if x is None else f"{x:.4f}"  # noqa: E731
    for r in rows:
        t = r["ms"]
        out.append(
            f"| {r['model']} | {BD.fmt_ctx(r['context'])} | {r['batch']} | {f(t.get('score'))} | "
            f"{f(t.get('select_chunks'))} | {f(t.get('select_marked'))} | {f(t.get('select_one_tile'))} | "
            f"{f(t.get('attend_old'))} | {f(t.get('attend_fused'))} ({f(r.get('best_attend_ms'))}) | "
            f"{f(t.get('total_old'))} | **{f(t.get('total_new'))}** | {f(r.get('dense_ms'))} "
            f"({r.get('dense_backend')}; ours, separate merge: {f(r.get('dense_kernel_separate_merge_ms'))}) | "
            f"{r.get('speedup_old', 0):.2f} | **{r.get('speedup_new', 0):.2f}** |"
        )
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------
# complete decode step
# ----------------------------------------------------------------------------------------------
@contextlib.contextmanager
def previous_kernels(cache):
    """The step as before: a separate merge launch."""
    saved_att = decode_mod.sparse_attention
    decode_mod.sparse_attention = functools.partial(saved_att, fused_combine=False)
    try:
        yield
    finally:
        decode_mod.sparse_attention = saved_att


def step_shape(shape: str, ctx: int, arms: list[str], steps: int, budget: int, out: list[dict], saved) -> None:
    """Time each arm's step (new and old variant) into ``out``, calling ``saved()`` after each arm."""
    import bench_decode_step as BS
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**BS.SHAPES[shape], max_position_embeddings=2**21)
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(config, attn_implementation="locks", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        for arm in arms:
            try:
                locks = BS.make_arm(arm, budget)
                t0 = time.perf_counter()
                cache = BS.make_cache("cuda", config, arm, locks, ctx + 4 * (steps + 8))
                BS.synthetic_prefill(cache, config, ctx, torch.device("cuda"), torch.bfloat16)
                log(f"{shape} {BD.fmt_ctx(ctx)} {arm}: cache in {time.perf_counter() - t0:.1f} s")
                logits = {}
                for variant in ("new", "old"):
                    ctxm = previous_kernels(cache) if variant == "old" else contextlib.nullcontext()
                    with ctxm:
                        torch._dynamo.reset()
                        stepper = BS.Stepper(model, cache, "cuda")
                        eager = stepper.fn().float()  # the same step for both variants (rewound between)
                        BS.rewind(cache)
                        logits[variant] = eager
                        stepper.warm_up(2)
                        diff = BS.check_replay(stepper)
                        times = BS.time_steps(stepper, steps)
                        prof = BS.profile_step(stepper, 1)
                        for _ in range(steps + 4):  # back to where this variant started
                            BS.rewind(cache)
                        rec = {
                            "shape": shape,
                            "context": ctx,
                            "arm": arm,
                            "variant": variant,
                            "median_ms": statistics.median(times),
                            "all_ms": times,
                            "replay_vs_eager": diff,
                            "kernels_per_step": prof["kernels_per_step"],
                            "device_ms_per_step": prof["device_ms_per_step"],
                            "top": prof["top"],
                        }
                        out.append(rec)
                        log(
                            f"  {variant}: {rec['median_ms']:.2f} ms/step, {rec['kernels_per_step']:.0f} kernels/step, "
                            f"replay diff {diff:.3g}"
                        )
                        del stepper
                        gc.collect()
                out[-1]["new_vs_old_logits_max_abs"] = float((logits["new"] - logits["old"]).abs().max())
                log(f"  new vs old logits max |diff| {out[-1]['new_vs_old_logits_max_abs']:.3g}")
            except Exception as e:
                log(f"  STEP FAILED {shape} {arm}: {type(e).__name__}: {str(e)[-400:]}")
                traceback.print_exc()
            finally:
                cache = None
                gc.collect()
                torch.cuda.empty_cache()
                saved()
    del model
    gc.collect()
    torch.cuda.empty_cache()


def step_table(rows: list[dict]) -> str:
    out = [
        "| shape | ctx | arm | variant | ms/step | vs dense (same variant) | kernels/step | GPU kernel ms/step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        dense = next(
            (
                x["median_ms"]
                for x in rows
                if x["shape"] == r["shape"]
                and x["context"] == r["context"]
                and x["arm"] == "full"
                and x["variant"] == r["variant"]
            ),
            None,
        )
        ratio = f"{dense / r['median_ms']:.2f}x" if dense else "-"
        out.append(
            f"| {r['shape']} | {BD.fmt_ctx(r['context'])} | {r['arm']} | {r['variant']} | {r['median_ms']:.2f} | "
            f"{ratio} | {r['kernels_per_step']:.0f} | {r['device_ms_per_step']:.2f} |"
        )
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", action="store_true")
    ap.add_argument("--step", action="store_true")
    ap.add_argument(
        "--configs",
        default="glm4-9b:512K:1,llama3.1-8b:512K:1,glm4-9b:1M:1,llama3.1-8b:1M:1,glm4-9b:512K:8,llama3.1-8b:512K:8",
        help="model:context:batch, comma separated",
    )
    ap.add_argument(
        "--sweep",
        default="glm4-9b:512K:1,llama3.1-8b:512K:1",
        help="configurations that also try other chunk / split / tile sizes",
    )
    ap.add_argument("--step-shapes", default="llama3.1-8b:full,r4i4;glm4-9b:full,r8i4,r4i4")
    ap.add_argument("--step-context", default="512K")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="bench_select.json")
    args = ap.parse_args(argv)
    assert torch.cuda.is_available(), "needs a CUDA GPU"
    RESULTS["device"] = torch.cuda.get_device_name()
    RESULTS["command"] = " ".join(sys.argv)
    if args.kernels:
        sweep = set(args.sweep.split(",")) if args.sweep else set()
        for cfg in args.configs.split(","):
            model, ctx, batch = cfg.split(":")
            try:
                RESULTS["kernels"].append(
                    kernel_config(model, BD.parse_ctx(ctx), int(batch), args.budget, args.reps, cfg in sweep)
                )
            except Exception as e:
                log(f"CONFIG FAILED {cfg}: {type(e).__name__}: {str(e)[-400:]}")
                traceback.print_exc()
                torch.cuda.empty_cache()
            save(args.out)
            print("\n## One layer (ms; CUDA-graph medians)\n\n" + kernel_table(RESULTS["kernels"]) + "\n", flush=True)
    if args.step:

        def saved():
            save(args.out)
            print(
                "\n## Complete decode step (CUDA graph, batch 1)\n\n" + step_table(RESULTS["step"]) + "\n", flush=True
            )

        for part in args.step_shapes.split(";"):
            shape, arms = part.split(":")
            step_shape(
                shape, BD.parse_ctx(args.step_context), arms.split(","), args.steps, args.budget, RESULTS["step"], saved
            )
    save(args.out)


if __name__ == "__main__":
    main()
