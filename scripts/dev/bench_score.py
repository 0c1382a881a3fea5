#!/usr/bin/env python
"""Locks page scoring on a CUDA GPU: every scoring variant and a grid of "mma" tiles, checked against a
float64 reference, timed alone and inside the whole attention step (score + select + attend).

Phases (each can be skipped; a failing candidate is reported and skipped, never fatal):

1. ``precompile``: every candidate's Triton specialization compiled in parallel worker processes
   (the Triton cache is shared), so the timing phases do not wait on cold compiles one at a time.
2. ``check``: each candidate at 512K, batch 1, against the float64 evaluation of the same summaries
   (`locks_hf.summaries.estimated_page_lse`) and, through the selection kernel, the reference page set.
3. ``score``: scoring alone, CUDA-graph medians over several summary copies (no warm L2), for each
   shape, context, label and batch; the full grid at 512K batch 1, the best few elsewhere.
4. ``attn``: score + select + attend of the library default, the best "mma" tiles and dense SDPA
   (cuDNN / flash, GQA) on real K/V and built summaries.

Prints markdown tables and writes JSON::

    python scripts/dev/bench_score.py --out runs/score.json
    python scripts/dev/bench_score.py --dry-run      # the plan, no GPU needed

``--ncu-one``: one launch of each variant at the given shape (for ``ncu``; see scripts/dev/gpu_score.sh).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

MODELS = {"llama3.1-8b": (32, 8, 128), "glm4-9b": (32, 2, 128)}  # query heads, KV heads, head_dim
B = 16
BUDGET_TOKENS = 2048
L2_BYTES = 200 << 20  # bytes touched per graph replay (several times the L2)


def parse_ctx(s: str) -> int:
    s = s.strip().upper()
    return int(float(s[:-1]) * (1 << 20)) if s.endswith("M") else int(float(s.rstrip("K")) * (1 << 10))


def fmt_ctx(n: int) -> str:
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K"


def label_of(s: str) -> tuple[int, int]:
    return int(s[1 : s.index("i")]), int(s[s.index("i") + 1 :])


def candidates(G: int, rank: int, bits: int, d: int = 128, grid: str = "tiles") -> list[dict]:
    """The scoring settings tried for a group of ``G`` heads. ``grid="tiles"``: the old variants' defaults
    and "mma" tiles (block_pages, head_split, words_per_chunk, num_warps, num_stages; None = the default);
    ``"l2"``: the default variant at its default tiles with and without the L2 prefetch of each block;
    ``"prefetch"``: the default variant with and without each chunk of codes loaded ahead; ``"centroid"``:
    "mma" with the default (4), 8 and 16 words of each centroid row a product."""
    from locks_hf.kernels.score_dot import LOCKS
    from locks_hf.kernels.score_tiles import default_variant, fma_supported

    if grid == "l2":
        variant = default_variant(LOCKS, G, d, B, rank, bits)
        return [dict(variant=variant, l2_prefetch=True), dict(variant=variant, l2_prefetch=False)]
    if grid == "centroid":
        return [dict(variant="mma")] + [dict(variant="mma", centroid_words_per_chunk=w) for w in (8, 16)]
    if grid == "prefetch":
        variant = default_variant(LOCKS, G, d, B, rank, bits)
        return [dict(variant=variant, prefetch=True), dict(variant=variant, prefetch=False)]
    GG = 1 << max(0, (G - 1).bit_length())
    out = [dict(variant="dot")]
    if G <= 8 and fma_supported(d, B, rank, bits):
        out.append(dict(variant="fma"))
    grid = [(None, None, None, None, None)]  # the defaults
    if GG >= 16:
        grid += [
            (32, 4, 16, 4, 1),
            (32, 4, 8, 4, 1),
            (16, 8, 4, 4, 1),
            (64, 2, 4, 4, 1),
            (64, 4, 4, 8, 1),
            (16, 4, 4, 2, 1),
            (32, 4, 4, 4, 2),
            (8, 16, 4, 4, 1),
            (64, 4, 8, 8, 1),
        ]
    elif GG >= 8:
        grid += [
            (64, 2, 8, 4, 1),
            (32, 4, 4, 4, 1),
            (128, 1, 4, 4, 1),
            (128, 2, 4, 8, 1),
            (64, 2, 4, 4, 2),
            (32, 2, 4, 2, 1),
            (64, 2, 16, 4, 1),
        ]
    else:
        grid += [
            (128, 1, 8, 4, 1),
            (64, 2, 4, 4, 1),
            (32, 4, 4, 4, 1),
            (256, 1, 4, 8, 1),
            (64, 1, 4, 2, 1),
            (128, 1, 4, 4, 2),
            (64, 1, 16, 2, 1),
            (128, 2, 4, 8, 1),
        ]
    for bp, hs, kcw, nw, ns in grid:
        if hs is not None and GG % hs:
            continue
        cfg = dict(variant="mma", block_pages=bp, head_split=hs, words_per_chunk=kcw, num_warps=nw, num_stages=ns)
        out.append({k: v for k, v in cfg.items() if v is not None})
    return out


def cfg_name(cfg: dict) -> str:
    short = {
        "block_pages": "bp",
        "head_split": "hs",
        "words_per_chunk": "kw",
        "centroid_words_per_chunk": "cw",
        "num_warps": "nw",
        "num_stages": "ns",
        "sub_blocks": "sb",
        "prefetch": "pf",
        "by_token": "tok",
        "maxnreg": "reg",
        "l2_prefetch": "l2",
    }
    rest = ",".join(f"{short.get(k, k)}{v}" for k, v in cfg.items() if k != "variant")
    return cfg["variant"] + (f"[{rest}]" if rest else "")


# ----------------------------------------------------------------------------------------------
# random packed summaries (timing does not depend on the values; the check uses them too)
# ----------------------------------------------------------------------------------------------
def random_summary(batch: int, h: int, P: int, d: int, rank: int, bits: int, gen: torch.Generator) -> dict:
    dev = "cuda"
    per = 8 // bits

    def codes(*shape):
        return torch.randint(-127, 128, shape, device=dev, dtype=torch.int8, generator=gen)

    def scale(*shape, s=1.0):
        return (torch.rand(shape, device=dev, generator=gen) * 0.9 + 0.1).mul_(s).to(torch.bfloat16)

    basis = codes(batch, h, P, rank, d // per)
    # logits of a few units per token: a wrong projection shows in the check's relative error
    return {
        "basis": basis.view(torch.uint8) if bits < 8 else basis,
        "basis_scale": scale(batch, h, P, rank, s=1.0 if bits < 8 else 0.06),
        "coef": codes(batch, h, P, B, rank),
        "coef_scale": scale(batch, h, P, B, s=0.05),
        "mu": codes(batch, h, P, d),
        "mu_scale": scale(batch, h, P, 1, s=0.05),
    }


class ScoreSet:
    """Row tensors and a query for ``batch`` rows of one layer at ``length`` tokens, and summary copies."""

    def __init__(self, model: str, length: int, batch: int, rank: int, bits: int, copies: int, seed: int = 0):
        hq, h, d = MODELS[model]
        self.hq, self.h, self.d, self.G, self.batch, self.length = hq, h, d, hq // h, batch, length
        self.P = length // B
        self.rank, self.bits = rank, bits
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.query = torch.randn((batch, hq, 1, d), device="cuda", dtype=torch.bfloat16, generator=gen)
        self.summaries = [random_summary(batch, h, self.P, d, rank, bits, gen) for _ in range(copies)]
        self.slot_valid = torch.ones((batch, length), device="cuda", dtype=torch.bool)
        self.row_start = torch.zeros((batch,), device="cuda", dtype=torch.int32)
        self.n_complete = torch.full((batch,), self.P, device="cuda", dtype=torch.int32)

    def kw(self):
        return dict(
            slot_valid=self.slot_valid,
            row_start=self.row_start,
            n_complete=self.n_complete,
            length=self.length,
            n_pages=self.P,
            page_size=B,
        )

    def score(self, cfg: dict, i: int = 0):
        from locks_hf.kernels.score import score_pages

        return score_pages(
            "locks", self.query, summary=self.summaries[i], scale=self.d**-0.5, basis_bits=self.bits, **self.kw(), **cfg
        )

    def summary_bytes(self) -> int:
        from locks_hf.summaries import summary_bytes

        return self.batch * self.h * self.P * summary_bytes(self.d, B, self.rank, self.bits)


def copies_for(model: str, length: int, batch: int, rank: int, bits: int) -> int:
    from locks_hf.summaries import summary_bytes

    hq, h, d = MODELS[model]
    one = batch * h * (length // B) * summary_bytes(d, B, rank, bits)
    return max(2, min(8, math.ceil(L2_BYTES / one)))


# ----------------------------------------------------------------------------------------------
# phase 1: parallel compiles
# ----------------------------------------------------------------------------------------------
def _compile_one(task):
    model, label, cfg = task
    t0 = time.time()
    try:
        import bench_decode  # noqa: F401  (imports locks_hf with or without transformers)

        r, bits = label_of(label)
        s = ScoreSet(model, 512 << 10, 1, r, bits, copies=1)
        s.score(cfg)
        torch.cuda.synchronize()
        return task, time.time() - t0, None
    except Exception as e:
        return task, time.time() - t0, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"


def precompile(tasks, workers: int, timeout: float, log) -> dict:
    """Compile every ``(model, label, cfg)`` once in ``workers`` processes; ``{cfg_key: error or None}``."""
    res = {}
    ctx = mp.get_context("spawn")
    t0 = time.time()
    with ctx.Pool(workers) as pool:
        pending = [pool.apply_async(_compile_one, (t,)) for t in tasks]
        for p, t in zip(pending, tasks):
            left = max(1.0, timeout - (time.time() - t0))
            try:
                task, _, err = p.get(timeout=left)
            except mp.TimeoutError:
                task, err = t, "compile timed out"
            key = (task[0], task[1], cfg_name(task[2]))
            res[key] = err
            if err:
                log(f"  compile {key}: {err}")
        pool.terminate()
    log(
        f"precompiled {len(tasks)} specializations on {workers} processes in {time.time() - t0:.0f} s "
        f"({sum(e is not None for e in res.values())} failed)"
    )
    return res


# ----------------------------------------------------------------------------------------------
# phase 2: correctness against float64
# ----------------------------------------------------------------------------------------------
def check(model: str, label: str, cfgs: list[dict], log) -> dict:
    from locks_hf.kernels.select import select_pages
    from locks_hf.selectors import select_pages as reference_select
    from locks_hf.summaries import dequantize_summary, estimated_page_lse

    r, bits = label_of(label)
    s = ScoreSet(model, 512 << 10, 1, r, bits, copies=1, seed=5)
    summ = s.summaries[0]
    want = estimated_page_lse(
        *dequantize_summary(summ, bits, torch.float64),
        torch.ones_like(s.slot_valid).view(1, 1, s.P, B),
        s.query.view(1, s.h, s.G, s.d).double(),
        s.d**-0.5,
    )
    real = torch.ones((1, s.P), device="cuda", dtype=torch.bool)
    slots = BUDGET_TOKENS // B
    ref_pages = reference_select(want, real, real, slots, "share_average", False)
    out = {}
    for cfg in cfgs:
        name = cfg_name(cfg)
        try:
            got, part = s.score(cfg)
            err = ((got.double().view_as(want) - want).norm() / want.norm()).item()
            pages = select_pages(
                got, part, slots=slots, per_head=False, row_start=s.row_start, length=s.length, heads=s.h, page_size=B
            )
            mask = torch.zeros((s.h, s.P + 1), device="cuda", dtype=torch.bool)
            mask.scatter_(1, torch.where(pages >= 0, pages, s.P).long(), True)
            differ = int((mask[:, : s.P].view(1, s.h, s.P) != ref_pages).sum())
            out[name] = {"rel_err": err, "pages_differ": differ, "ok": err < 1e-5 and differ == 0}
        except Exception as e:
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[-300:]}"}
        log(f"  check {model} {label} {name}: {out[name]}")
    return out


# ----------------------------------------------------------------------------------------------
# phase 3: scoring alone
# ----------------------------------------------------------------------------------------------
def time_scores(model, length, batch, label, cfgs, bw, reps, log) -> list[dict]:
    from bench_decode import time_graph

    r, bits = label_of(label)
    s = ScoreSet(model, length, batch, r, bits, copies=copies_for(model, length, batch, r, bits), seed=1)
    floor = s.summary_bytes() / (bw * 1e9)
    rows = []
    for cfg in cfgs:
        name = cfg_name(cfg)
        try:
            fns = [lambda i=i, cfg=cfg, s=s: s.score(cfg, i) for i in range(len(s.summaries))]
            ms = time_graph(fns, reps=reps)["ms"]
        except Exception as e:
            log(f"  {model} {fmt_ctx(length)} b{batch} {label} {name}: FAILED {type(e).__name__}: {str(e)[-200:]}")
            continue
        rows.append(
            dict(
                model=model,
                context=length,
                batch=batch,
                label=label,
                cfg=cfg,
                name=name,
                score_ms=ms,
                floor_ms=floor,
                over_floor=ms / floor,
                gbps=s.summary_bytes() / ms / 1e6,
            )
        )
        log(f"  {model} {fmt_ctx(length)} b{batch} {label} {name:42s} {ms:.4f} ms  {ms / floor:5.2f}x floor")
    del s
    torch.cuda.empty_cache()
    return rows


# ----------------------------------------------------------------------------------------------
# phase 4: whole attention step
# ----------------------------------------------------------------------------------------------
def time_attention(model, length, batch, labels, best, bw, reps, log) -> list[dict]:
    from bench_decode import CacheSet, Step, time_graph

    from locks_hf.summaries import summary_bytes

    hq, h, d = MODELS[model]
    P = length // B
    slots = BUDGET_TOKENS // B
    scale = d**-0.5
    kv = batch * h * length * d * 4
    nbuf = max(2, min(8, math.ceil(L2_BYTES / (batch * h * (P * 490 + slots * B * d * 4)))))
    nbuf = max(1, min(nbuf, int(0.5 * torch.cuda.mem_get_info()[0] / (kv * 1.3))))
    gen = torch.Generator(device="cuda").manual_seed(length + batch)
    sets = [CacheSet(batch, hq, h, d, length, gen) for _ in range(nbuf)]
    for c in sets:
        c.build([label_of(x) for x in labels])
    F = torch.nn.functional
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dense = {}
    for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):

        def make(c, backend=backend):
            def f():
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(c.query, c.keys, c.values, scale=scale, enable_gqa=True)

            return f

        try:
            dense[name] = time_graph([make(c) for c in sets], reps=reps)["ms"]
        except Exception as e:
            log(f"  dense {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    dense_ms = min(dense.values()) if dense else float("nan")
    rows = []
    for label in labels:
        r, bits = label_of(label)
        old = "fma" if hq // h <= 8 else "dot"  # the default before variant "mma"
        arms = [(f"old default {old}", {"variant": old}), ("default", {})]
        arms += [(f"best {cfg_name(c)}", c) for c in best.get((model, label), [])[:1]]
        for arm, cfg in arms:
            try:
                steps = [Step(c, "locks", c.summaries[label], bits, slots, scale, cfg) for c in sets]
                t = {
                    st: time_graph([getattr(x, st) for x in steps], reps=reps)["ms"]
                    for st in ("score", "select", "attend", "total")
                }
            except Exception as e:
                log(f"  attn {model} {label} {arm}: FAILED {type(e).__name__}: {str(e)[-200:]}")
                continue
            attended = (steps[0].pages >= 0).sum().item() / (batch * h)
            floor = batch * h * (P * summary_bytes(d, B, r, bits) + attended * B * d * 4) / (bw * 1e9)
            row = dict(
                model=model,
                context=length,
                batch=batch,
                label=label,
                arm=arm,
                cfg=cfg,
                **{f"{k}_ms": v for k, v in t.items()},
                dense_ms=dense_ms,
                dense=dense,
                speedup=dense_ms / t["total"],
                floor_ms=floor,
            )
            rows.append(row)
            log(
                f"  attn {model} {fmt_ctx(length)} b{batch} {label} {arm:40s} score {t['score']:.4f} select "
                f"{t['select']:.4f} attend {t['attend']:.4f} total {t['total']:.4f} dense {dense_ms:.4f} "
                f"-> {row['speedup']:.2f}x"
            )
            del steps
    del sets
    torch.cuda.empty_cache()
    return rows


def ncu_one(model: str, label: str, cfgs: list[dict]):
    """Two launches of each setting (the first compiles or warms up), for a profiler to filter."""
    r, bits = label_of(label)
    s = ScoreSet(model, 512 << 10, 1, r, bits, copies=1)
    for cfg in cfgs:
        for _ in range(2):
            s.score(cfg)
        torch.cuda.synchronize()
        print(f"ncu-one {model} {label} {cfg_name(cfg)}", flush=True)


def markdown_scores(rows) -> str:
    out = [
        "| model | ctx | batch | label | setting | score ms | x byte floor | GB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {fmt_ctx(r['context'])} | {r['batch']} | {r['label']} | {r['name']} | "
            f"{r['score_ms']:.4f} | {r['over_floor']:.2f} | {r['gbps']:.0f} |"
        )
    return "\n".join(out)


def markdown_attn(rows) -> str:
    out = [
        "| model | ctx | batch | label | arm | score | select | attend | **total ms** | dense ms | **vs dense** |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {fmt_ctx(r['context'])} | {r['batch']} | {r['label']} | {r['arm']} | "
            f"{r['score_ms']:.4f} | {r['select_ms']:.4f} | {r['attend_ms']:.4f} | **{r['total_ms']:.4f}** | "
            f"{r['dense_ms']:.4f} | **{r['speedup']:.2f}x** |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3.1-8b,glm4-9b")
    ap.add_argument("--labels", default="r4i4,r8i4")
    ap.add_argument("--contexts", default="512K,1M")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--phases", default="precompile,check,score,attn")
    ap.add_argument("--workers", type=int, default=12)
    ap.add_argument("--compile-timeout", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--top", type=int, default=3, help="best mma settings (per model/label) timed beyond 512K b1")
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later phases are skipped past it")
    ap.add_argument("--out", default="score_bench.json")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--ncu-one", default=None, help="MODEL:LABEL: launch each setting twice and exit")
    ap.add_argument(
        "--grid",
        choices=("tiles", "l2", "prefetch", "centroid"),
        default="tiles",
        help="settings tried: 'tiles' (every variant, a grid of mma tiles), 'l2' (the default variant with "
        "and without the L2 prefetch of each block) or 'prefetch' (the default variant with and without each "
        "chunk of codes loaded ahead) or 'centroid' (\"mma\" with 4, 8 and 16 words of each centroid row a product)",
    )
    ap.add_argument(
        "--cfgs",
        default=None,
        help="JSON list of settings tried instead of the built-in grid, each with the defaults first, e.g. "
        '\'[{"variant": "mma", "maxnreg": 128}, {"variant": "mma", "num_stages": 2}]\'',
    )
    ap.add_argument("--only-cfgs", action="store_true", help="time the --cfgs settings alone, not the defaults first")
    args = ap.parse_args(argv)
    if args.only_cfgs and not args.cfgs:
        ap.error("--only-cfgs times the --cfgs settings alone: give --cfgs too")
    t_start = time.time()
    models, labels = args.models.split(","), args.labels.split(",")
    contexts = [parse_ctx(c) for c in args.contexts.split(",")]
    batches = [int(b) for b in args.batch.split(",")]
    phases = set(args.phases.split(","))

    import bench_decode  # noqa: F401  (imports locks_hf with or without transformers)

    plan = {
        (m, lab): candidates(MODELS[m][0] // MODELS[m][1], *label_of(lab), grid=args.grid)
        for m in models
        for lab in labels
    }
    if args.cfgs:
        extra = json.loads(args.cfgs)
        plan = {key: ([] if args.only_cfgs else [c for c in cfgs if len(c) == 1]) + extra for key, cfgs in plan.items()}
    if args.dry_run:
        for (m, lab), cfgs in plan.items():
            print(m, lab, len(cfgs), [cfg_name(c) for c in cfgs])
        return
    if args.ncu_one:
        m, lab = args.ncu_one.split(":")
        ncu_one(m, lab, [c for c in plan[(m, lab)] if c["variant"] != "mma" or len(c) == 1])
        return

    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    def over(phase):
        if time.time() - t_start > args.budget:
            log(f"time budget ({args.budget:.0f} s) spent: phase {phase} skipped")
            return True
        return False

    import triton
    from bench_decode import measure_bandwidth

    dev = torch.cuda.get_device_properties(0)
    result = {
        "info": {
            "device": dev.name,
            "sms": dev.multi_processor_count,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "argv": sys.argv,
        },
        "compile": {},
        "check": {},
        "score": [],
        "attn": [],
        "best": {},
    }

    def save():
        result["log"] = log_lines
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))

    bwi = measure_bandwidth()
    bw = max(bwi["copy_tbps"], bwi["read_tbps"])
    result["bandwidth"] = bwi
    log(json.dumps(result["info"]))
    log(f"bandwidth: copy {bwi['copy_tbps']:.2f} TB/s, read {bwi['read_tbps']:.2f} TB/s")

    failed = set()
    if "precompile" in phases:
        tasks = [(m, lab, c) for (m, lab), cfgs in plan.items() for c in cfgs]
        res = precompile(tasks, args.workers, args.compile_timeout, log)
        result["compile"] = {" ".join(k): v for k, v in res.items()}
        failed = {k for k, v in res.items() if v}
        save()
    if "check" in phases and not over("check"):
        for (m, lab), cfgs in plan.items():
            good = [c for c in cfgs if (m, lab, cfg_name(c)) not in failed]
            result["check"][f"{m} {lab}"] = chk = check(m, lab, good, log)
            failed |= {(m, lab, n) for n, v in chk.items() if not v["ok"]}
            save()
    if "score" in phases and not over("score"):
        for (m, lab), cfgs in plan.items():
            good = [c for c in cfgs if (m, lab, cfg_name(c)) not in failed]
            first = time_scores(m, contexts[0], batches[0], lab, good, bw, args.reps, log)
            result["score"] += first
            mma = sorted((r for r in first if r["cfg"]["variant"] == "mma"), key=lambda r: r["score_ms"])
            top = [r["cfg"] for r in mma[: args.top]]
            result["best"][f"{m} {lab}"] = top
            keep = [c for c in good if c["variant"] != "mma"] + top
            for ctx in contexts:
                for b in batches:
                    if (ctx, b) == (contexts[0], batches[0]) or (b > 1 and ctx > (512 << 10)):
                        continue
                    if over(f"score {m} {lab} {fmt_ctx(ctx)} b{b}"):
                        break
                    result["score"] += time_scores(m, ctx, b, lab, keep, bw, args.reps, log)
            save()
    if "attn" in phases:
        best = {tuple(k.split(" ")): v for k, v in result["best"].items()}
        for m in models:
            for ctx in contexts:
                for b in batches:
                    if b > 1 and ctx > (512 << 10):
                        continue
                    if over(f"attn {m} {fmt_ctx(ctx)} b{b}"):
                        break
                    try:
                        result["attn"] += time_attention(m, ctx, b, labels, best, bw, args.reps, log)
                    except Exception as e:
                        log(f"ATTN FAILED {m} {fmt_ctx(ctx)} b{b}: {type(e).__name__}: {str(e)[-300:]}")
                        traceback.print_exc()
                        torch.cuda.empty_cache()
                    save()
    print(markdown_scores(result["score"]))
    print()
    print(markdown_attn(result["attn"]))
    result["elapsed_s"] = time.time() - t_start
    save()


if __name__ == "__main__":
    main()
