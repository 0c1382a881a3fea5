#!/usr/bin/env python
"""Attention-only decode benchmark of the Locks kernels on a CUDA GPU (one layer, synthetic cache).

For each model shape and context: a synthetic prefill (structured random keys and values, bf16),
page summaries built by the GPU build kernel, then per-stage timings of one decode step of one
layer: scoring, selection, sparse attention, and the three together, for Locks (each summary
label), Quest on the same kernels, and the fastest dense PyTorch path measured in the same run.
Times are CUDA-event medians of CUDA-graph replays after warm-up; every replay walks several
independent cache copies so that no stage reads from a warm L2. Byte floors use the measured
device bandwidth. ``--check`` first runs the GPU tests that compare every kernel with a float64
reference at real shapes (tests/test_kernels_real_shapes.py, also ``pytest -m gpu``).

Prints a markdown table and writes JSON::

    python scripts/bench_decode.py --check --out runs/bench_h200.json --md runs/bench_h200.md   # summarised in docs/performance.md

Needs torch with CUDA and triton; not transformers (``locks_hf`` is loaded without its
transformers integration when that cannot be imported).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import statistics
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
#: The float64 correctness checks at real shapes (``--check`` runs them first).
CHECKS = ROOT / "tests" / "test_kernels_real_shapes.py"


def _load_locks_hf():
    """Import ``locks_hf`` (+ ``locks_hf.kernels``); without transformers, skip the package ``__init__``."""
    try:
        import locks_hf.kernels  # noqa: F401

        return
    except Exception:  # not installed, or transformers missing / of another version
        for name in [n for n in sys.modules if n == "locks_hf" or n.startswith("locks_hf.")]:
            del sys.modules[name]
    pkg = types.ModuleType("locks_hf")
    pkg.__path__ = [str(ROOT / "locks_hf")]
    sys.modules["locks_hf"] = pkg
    spec = importlib.util.spec_from_file_location(
        "locks_hf.kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["locks_hf.kernels"] = mod
    spec.loader.exec_module(mod)
    pkg.kernels = mod


_load_locks_hf()
from locks_hf import kernels as K  # noqa: E402
from locks_hf.kernels.attend import sparse_attention  # noqa: E402
from locks_hf.kernels.build import fit_pages_eigh, quantize_summary  # noqa: E402
from locks_hf.kernels.score import score_pages  # noqa: E402
from locks_hf.kernels.select import select_pages  # noqa: E402
from locks_hf.summaries import summary_bytes  # noqa: E402

MODELS = {  # name: (query heads, KV heads, head_dim, hidden, ffn) -- attention shapes of the real models
    "llama3.1-8b": (32, 8, 128, 4096, 14336),
    "glm4-9b": (32, 2, 128, 4096, 13696),
}
B = 16
DEV = "cuda"
L2_TARGET = 200 << 20  # bytes touched per graph replay, several times the 50-60 MB L2


def parse_ctx(s: str) -> int:
    s = s.strip().upper()
    if s.endswith("M"):
        return int(float(s[:-1]) * 1024 * 1024)
    if s.endswith("K"):
        return int(float(s[:-1]) * 1024)
    return int(s)


def fmt_ctx(n: int) -> str:
    return f"{n // (1024 * 1024)}M" if n % (1024 * 1024) == 0 else f"{n // 1024}K"


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------
def time_graph(fns, reps: int = 30, warmup: int = 3, min_ms: float = 1.0) -> dict:
    """Median ms per call of ``fns`` (one closure per cache copy), replayed as one CUDA graph.

    The graph runs every closure once per round, ``rounds`` rounds so that one replay lasts at
    least ``min_ms``; each replay is timed with CUDA events; the median over replays is divided
    by the calls per replay.
    """
    for f in fns:  # compile / warm up outside capture
        f()
    torch.cuda.synchronize()
    s0, s1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s0.record()
    for f in fns:
        f()
    s1.record()
    torch.cuda.synchronize()
    eager = s0.elapsed_time(s1) / len(fns)
    rounds = max(1, min(64, math.ceil(min_ms / max(eager, 1e-3) / len(fns))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(rounds):
            for f in fns:
                f()
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / (rounds * len(fns)))
    del graph
    # eager (no graph): launch overheads included
    torch.cuda.synchronize()
    s0.record()
    for _ in range(3):
        for f in fns:
            f()
    s1.record()
    torch.cuda.synchronize()
    return {
        "ms": statistics.median(times),
        "ms_min": min(times),
        "ms_max": max(times),
        "eager_ms": s0.elapsed_time(s1) / (3 * len(fns)),
        "calls_per_replay": rounds * len(fns),
    }


def measure_bandwidth() -> dict:
    """Device bandwidth: a large copy (read + write bytes) and a large read-only reduction."""
    n = 1 << 30  # 2 GiB of bf16
    x = torch.randn(n, device=DEV, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    out = torch.empty((), device=DEV, dtype=torch.float32)
    copy = time_graph([lambda: y.copy_(x)], reps=10)["ms"]
    red = time_graph([lambda: torch.sum(x, dim=0, dtype=torch.float32, out=out)], reps=10)["ms"]
    return {"copy_tbps": 2 * 2 * n / copy / 1e9, "read_tbps": 2 * n / red / 1e9}


# ----------------------------------------------------------------------------------------------
# synthetic caches
# ----------------------------------------------------------------------------------------------
class CacheSet:
    """One layer's cache for a batch: K/V buffers, validity, row tensors, a decode query, summaries."""

    def __init__(self, batch: int, hq: int, h: int, d: int, length: int, gen: torch.Generator):
        dev = DEV
        P = length // B
        self.batch, self.hq, self.h, self.d, self.length, self.P = batch, hq, h, d, length, P
        # structured keys: per-page offsets (pages differ) plus token noise
        self.keys = torch.randn((batch, h, length, d), device=dev, dtype=torch.bfloat16, generator=gen)
        off = torch.randn((batch, h, P, 1, d), device=dev, dtype=torch.bfloat16, generator=gen)
        self.keys.view(batch, h, P, B, d).add_(off * 1.5)
        self.values = torch.randn((batch, h, length, d), device=dev, dtype=torch.bfloat16, generator=gen)
        self.query = torch.randn((batch, hq, 1, d), device=dev, dtype=torch.bfloat16, generator=gen)
        self.slot_valid = torch.ones((batch, length), device=dev, dtype=torch.bool)
        self.row_start = torch.zeros((batch,), device=dev, dtype=torch.int32)
        self.n_complete = torch.full((batch,), P, device=dev, dtype=torch.int32)
        self.summaries: dict[str, dict] = {}

    def kw(self):
        return dict(
            slot_valid=self.slot_valid,
            row_start=self.row_start,
            n_complete=self.n_complete,
            length=self.length,
            n_pages=self.P,
            page_size=B,
        )

    def build(self, labels: list[tuple[int, int]]) -> float:
        """Locks summaries for every (rank, bits) label from one eigendecomposition; Quest's min/max."""
        if DEV == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pages = self.keys.view(self.batch, self.h, self.P, B, self.d)
        valid = torch.ones((1, 1, 1, B), device=DEV, dtype=torch.bool).expand(self.batch, self.h, self.P, B)
        rmax = max(r for r, _ in labels)
        mu, basis, coef = fit_pages_eigh(pages, valid, rmax)
        for r, bits in labels:
            self.summaries[f"r{r}i{bits}"] = quantize_summary(mu, basis[..., :r, :], coef[..., :r], bits)
        del mu, basis, coef
        self.summaries["quest"] = {"upper": pages.amax(-2), "lower": pages.amin(-2)}
        if DEV == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3


# ----------------------------------------------------------------------------------------------
# stages
# ----------------------------------------------------------------------------------------------
class Step:
    """Closures for one cache copy and one method: score, select, attend, and all three."""

    def __init__(
        self,
        c: CacheSet,
        method: str,
        summary: dict | None,
        bits: int,
        slots: int,
        scale: float,
        score_cfg: dict | None = None,
    ):
        self.c, self.method, self.summary, self.bits, self.slots, self.scale = c, method, summary, bits, slots, scale
        self.score_cfg = score_cfg or {}
        self.scores, self.partials = self.score()
        self.pages = self.select()
        self.out = self.attend()

    def score(self):
        c = self.c
        return score_pages(
            "quest" if self.method == "quest" else self.method,
            c.query,
            summary=self.summary,
            keys=c.keys,
            scale=self.scale,
            basis_bits=self.bits,
            **c.kw(),
            **self.score_cfg,
        )

    def select(self):
        c = self.c
        return select_pages(
            self.scores,
            self.partials,
            slots=self.slots,
            per_head=self.method == "quest",
            row_start=c.row_start,
            length=c.length,
            heads=c.h,
            page_size=B,
        )

    def attend(self):
        c = self.c
        return sparse_attention(
            c.query,
            c.keys,
            c.values,
            self.pages,
            slot_valid=c.slot_valid,
            row_start=c.row_start,
            length=c.length,
            scale=self.scale,
            page_size=B,
        )

    def total(self):
        s, p = self.score()
        pages = select_pages(
            s,
            p,
            slots=self.slots,
            per_head=self.method == "quest",
            row_start=self.c.row_start,
            length=self.c.length,
            heads=self.c.h,
            page_size=B,
        )
        c = self.c
        return sparse_attention(
            c.query,
            c.keys,
            c.values,
            pages,
            slot_valid=c.slot_valid,
            row_start=c.row_start,
            length=c.length,
            scale=self.scale,
            page_size=B,
        )


def dense_fns(sets: list[CacheSet], scale: float) -> dict:
    """Dense decode attention closures per SDPA backend (+ the GQA-as-query-rows layout)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    F = torch.nn.functional
    out = {}
    for name, backend in [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("math", SDPBackend.MATH),
    ]:
        for layout in ("gqa", "rows"):

            def make(c, backend=backend, layout=layout):
                if layout == "gqa":

                    def f():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(
                                c.query, c.keys, c.values, scale=scale, enable_gqa=True
                            )
                else:  # the G query heads of a KV head as G query rows: one read of each K/V head
                    q = c.query.view(c.batch, c.h, c.hq // c.h, c.d)

                    def f():
                        with sdpa_kernel(backend):
                            return F.scaled_dot_product_attention(q, c.keys, c.values, scale=scale)

                return f

            out[f"sdpa-{name}-{layout}"] = [make(c) for c in sets]

    def ours(c):  # our split-K attention kernel over every page (the static cache's "full" decode)
        return lambda: sparse_attention(
            c.query,
            c.keys,
            c.values,
            None,
            n_pages=c.P,
            slot_valid=c.slot_valid,
            row_start=c.row_start,
            length=c.length,
            scale=scale,
            page_size=B,
        )

    out["locks-dense-kernel"] = [ours(c) for c in sets]

    from torch.nn.attention.flex_attention import flex_attention

    flex = torch.compile(flex_attention, dynamic=False)  # eager flex_attention is a reference loop

    def flexed(c):
        return lambda: flex(c.query, c.keys, c.values, scale=scale, enable_gqa=True)

    out["flex-attention"] = [flexed(c) for c in sets]
    return out


# ----------------------------------------------------------------------------------------------
# prefill cost (for the summary-build share of time to first token)
# ----------------------------------------------------------------------------------------------
def prefill_layer_ms(model: str, T: int) -> float:
    """One decoder layer's dense prefill of ``T`` tokens (random weights, bf16, SDPA causal)."""
    hq, h, d, hidden, ffn = MODELS[model]
    F = torch.nn.functional
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    w = {
        n: torch.randn(s, device=dev, dtype=dt, generator=g) * 0.02
        for n, s in {
            "qkv": (hidden, (hq + 2 * h) * d),
            "o": (hq * d, hidden),
            "gu": (hidden, 2 * ffn),
            "down": (ffn, hidden),
        }.items()
    }
    x = torch.randn((T, hidden), device=dev, dtype=dt, generator=g)

    def layer():
        y = F.rms_norm(x, (hidden,))
        qkv = y @ w["qkv"]
        q = qkv[:, : hq * d].view(1, T, hq, d).transpose(1, 2)
        k = qkv[:, hq * d : (hq + h) * d].view(1, T, h, d).transpose(1, 2)
        v = qkv[:, (hq + h) * d :].view(1, T, h, d).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x2 = x + a.transpose(1, 2).reshape(T, hq * d) @ w["o"]
        y2 = F.rms_norm(x2, (hidden,))
        gu = y2 @ w["gu"]
        return x2 + (F.silu(gu[:, :ffn]) * gu[:, ffn:]) @ w["down"]

    layer()
    torch.cuda.synchronize()
    ts = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        layer()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def build_cost(model: str, T: int, labels) -> dict:
    """Summary build of one layer after a ``T``-token prefill, per label, and of one decode page."""
    hq, h, d, _, _ = MODELS[model]
    gen = torch.Generator(device=DEV).manual_seed(2)
    keys = torch.randn((1, h, T, d), device=DEV, dtype=torch.bfloat16, generator=gen)
    pages = keys.view(1, h, T // B, B, d)
    valid = torch.ones((1, 1, 1, B), device=DEV, dtype=torch.bool).expand(1, h, T // B, B)
    res = {}
    for r, bits in labels:

        def run(r=r, bits=bits):
            return K.build_summary(pages, valid, r, bits)

        run()
        torch.cuda.synchronize()
        ts = []
        for _ in range(3):
            t0 = time.perf_counter()
            run()
            torch.cuda.synchronize()
            ts.append((time.perf_counter() - t0) * 1e3)
        res[f"r{r}i{bits}"] = statistics.median(ts)
    # the eigendecomposition alone
    gram = torch.randn((1, h, T // B, B, B), device=DEV)
    gram = gram @ gram.transpose(-1, -2)
    from locks_hf.kernels.eigh import sym_eigh

    sym_eigh(gram)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    sym_eigh(gram)
    torch.cuda.synchronize()
    res["eigh_only"] = (time.perf_counter() - t0) * 1e3
    # one page per KV head completed during decode (batch 1)
    one = pages[:, :, -1:]
    K.build_summary(one, valid[:, :, -1:], 4, 4)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(10):
        K.build_summary(one, valid[:, :, -1:], 4, 4)
    torch.cuda.synchronize()
    res["decode_page_r4i4"] = (time.perf_counter() - t0) * 1e3 / 10
    del keys, gram
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------------------------
# main benchmark
# ----------------------------------------------------------------------------------------------
def bench_config(
    model: str,
    length: int,
    batch: int,
    budget: int,
    labels,
    bw: float,
    log,
    score_cfgs: dict,
    reps: int,
    dense_all: bool,
) -> list[dict]:
    hq, h, d, _, _ = MODELS[model]
    P = length // B
    slots = math.ceil(budget / B)
    scale = d**-0.5
    kv_bytes = batch * h * length * d * 2 * 2
    touched = batch * h * (P * 490 + slots * B * d * 4)
    nbuf = max(2, min(16, math.ceil(L2_TARGET / touched)))
    free = torch.cuda.mem_get_info()[0]
    nbuf = max(1, min(nbuf, int(0.6 * free / (kv_bytes * 1.2 + 1))))
    gen = torch.Generator(device=DEV).manual_seed(length + batch)
    sets = [CacheSet(batch, hq, h, d, length, gen) for _ in range(nbuf)]
    build_ms = [s.build(labels) for s in sets][-1]
    rows = []
    base = {"model": model, "context": length, "batch": batch, "budget": budget, "copies": nbuf}

    # dense: every backend/layout, keep the fastest
    dense = {}
    for name, fns in dense_fns(sets, scale).items():
        if (
            "math" in name and length > (128 << 10) or name == "flex-attention" and length > (512 << 10)
        ) and not dense_all:
            continue  # far from the best dense (math: 10-100x; FlexAttention: 35x at 512K) and slow to time
        try:
            dense[name] = time_graph(fns, reps=reps)["ms"]
        except Exception as e:  # backend not available for this shape
            dense[name] = None
            log(f"  {name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
        torch.cuda.synchronize()
    ok = {k: v for k, v in dense.items() if v is not None}
    best = min(ok, key=ok.get)
    dense_ms = ok[best]
    dense_floor = kv_bytes / (bw * 1e9)
    log(
        f"{model} {fmt_ctx(length)} b{batch}: dense {best} {dense_ms:.4f} ms (floor {dense_floor:.4f}); "
        + ", ".join(f"{k}={v:.4f}" for k, v in ok.items())
    )

    arms = [(f"r{r}i{bits}", "locks", bits) for r, bits in labels] + [("quest", "quest", 16)]
    for label, method, bits in arms:
        cfg = score_cfgs.get((model, label), {}) if method == "locks" else {}
        # a profiler can keep to the sparse arms (ncu --nvtx --nvtx-include "sparse/")
        torch.cuda.nvtx.range_push("sparse")
        try:
            steps = [Step(s, method, s.summaries[label], bits, slots, scale, cfg) for s in sets]
            t = {}
            for stage in ("score", "select", "attend", "total"):
                t[stage] = time_graph([getattr(st, stage) for st in steps], reps=reps)
        except Exception as e:
            log(f"  {label}: FAILED {type(e).__name__}: {str(e)[-300:]}")
            continue
        finally:
            torch.cuda.nvtx.range_pop()
        width = steps[0].pages.shape[1]
        attended = (steps[0].pages >= 0).sum().item() / (batch * h)  # pages per (row, KV head)
        sb = summary_bytes(d, B, int(label[1]), bits) if method == "locks" else 2 * d * 2
        summ_bytes = batch * h * P * sb
        kv_sel = batch * h * attended * B * d * 4
        floor = (summ_bytes + kv_sel) / (bw * 1e9)
        score_floor = summ_bytes / (bw * 1e9)
        row = dict(
            base,
            arm=label,
            score_ms=t["score"]["ms"],
            select_ms=t["select"]["ms"],
            attend_ms=t["attend"]["ms"],
            total_ms=t["total"]["ms"],
            total_eager_ms=t["total"]["eager_ms"],
            total_ms_min=t["total"]["ms_min"],
            total_ms_max=t["total"]["ms_max"],
            dense_ms=dense_ms,
            dense_backend=best,
            dense_candidates_ms=ok,
            dense_floor_ms=dense_floor,
            floor_ms=floor,
            score_floor_ms=score_floor,
            speedup=dense_ms / t["total"]["ms"],
            over_floor=t["total"]["ms"] / floor,
            score_ns_per_page=t["score"]["ms"] * 1e6 / (batch * h * P),
            pages_attended=attended,
            width=width,
            summary_build_ms=build_ms,
            score_cfg=cfg,
            score_gbps=summ_bytes / t["score"]["ms"] / 1e6,
        )
        rows.append(row)
        log(
            f"  {label:6s} score {row['score_ms']:.4f} select {row['select_ms']:.4f} attend {row['attend_ms']:.4f} "
            f"total {row['total_ms']:.4f} (eager {row['total_eager_ms']:.4f}) floor {floor:.4f} "
            f"x{row['speedup']:.1f} vs dense, {row['over_floor']:.2f}x floor, score {row['score_gbps']:.0f} GB/s"
        )
        del steps
    del sets
    torch.cuda.empty_cache()
    return rows


def sweep_score(model: str, length: int, label: str, log, reps: int, variants=("dot", "fma")) -> dict:
    """Try a few scoring tile shapes at one size; return the fastest settings."""
    hq, h, d, _, _ = MODELS[model]
    r, bits = int(label[1]), int(label[3])
    gen = torch.Generator(device=DEV).manual_seed(3)
    nbuf = max(2, math.ceil(L2_TARGET / (h * (length // B) * 490)))
    sets = [CacheSet(1, hq, h, d, length, gen) for _ in range(min(nbuf, 8))]
    for s in sets:
        s.build([(r, bits)])
    G = hq // h
    cands = [
        dict(variant="dot", block_pages=bp, sub_blocks=ns, num_warps=nw, num_stages=st, by_token=bt)
        for bp, ns, nw, st, bt in [
            (16, 8, 4, 2, False),
            (32, 8, 4, 2, False),
            (32, 4, 4, 3, False),
            (32, 8, 4, 2, True),
            (64, 8, 4, 2, True),
            (32, 8, 8, 2, True),
            (128, 4, 4, 2, True),
            (64, 4, 8, 2, True),
            (16, 8, 4, 2, True),
        ]
        if not (G >= 16 and bp > 32 and not bt)
    ]
    cands += [
        dict(variant="fma"),
        dict(variant="fma", block_pages=256, num_warps=8),
        dict(variant="fma", sub_blocks=2),
        dict(variant="fma", maxnreg=128),
        dict(variant="fma", block_pages=256, num_warps=8, maxnreg=128),
    ]
    best, best_ms, res = None, float("inf"), []
    for cfg in [c for c in cands if c["variant"] in variants]:
        try:
            fns = [
                lambda s=s, cfg=cfg: score_pages(
                    "locks", s.query, summary=s.summaries[label], scale=0.1, basis_bits=bits, **s.kw(), **cfg
                )
                for s in sets
            ]
            ms = time_graph(fns, reps=reps)["ms"]
        except Exception as e:
            log(f"  sweep {cfg}: {type(e).__name__} {str(e)[:100]}")
            continue
        res.append((cfg, ms))
        log(f"  sweep {model} {label} {cfg}: {ms:.4f} ms")
        if ms < best_ms:
            best, best_ms = cfg, ms
    del sets
    torch.cuda.empty_cache()
    return {"best": best, "best_ms": best_ms, "all": [(c, m) for c, m in res]}


def sweep_select_attend(
    model: str, length: int, label: str, log, reps: int, batch: int = 1, budget: int = 2048
) -> dict:
    """Time page selection over the partials folded per step, chunk sizes and warps, and sparse attention
    over split counts, tiles and warps, on one label's scores at one size (each against its current
    default in the same run)."""
    hq, h, d, _, _ = MODELS[model]
    r, bits = int(label[1]), int(label[3])
    gen = torch.Generator(device=DEV).manual_seed(5)
    nbuf = max(2, min(8, math.ceil(L2_TARGET / (batch * h * (length // B) * 490))))
    sets = [CacheSet(batch, hq, h, d, length, gen) for _ in range(nbuf)]
    for s in sets:
        s.build([(r, bits)])
    slots, scale = math.ceil(budget / B), d**-0.5
    steps = [Step(s, "locks", s.summaries[label], bits, slots, scale) for s in sets]
    where = dict(per_head=False, heads=h, page_size=B)
    out = {"select": [], "attend": []}
    # the defaults; partials folded per step; chunk sizes x warps
    settings = [{}] + [{"partial_block": nbp} for nbp in (64, 128, 256, 512, 1024)]
    settings += [{"chunk": c, "num_warps": w} for c in (1024, 2048, 4096) for w in (4, 8, 16) if c <= length // B]
    for tiles in settings:
        fns = [
            lambda st=st, tiles=tiles: select_pages(
                st.scores, st.partials, slots=slots, row_start=st.c.row_start, length=st.c.length, **tiles, **where
            )
            for st in steps
        ]
        ms = time_graph(fns, reps=reps)["ms"]
        out["select"].append({**tiles, "partials": steps[0].partials.shape[1], "ms": ms})
        log(f"  sweep select {model} {fmt_ctx(length)} b{batch} {tiles or 'default'}: {ms * 1e3:.1f} us")
    for splits in (None, 16, 32, 64):
        for tp in (None, 4, 8):
            for warps in (4, 8):
                if (splits is None) != (tp is None) or splits is None and warps != 4:
                    continue
                tiles = {} if splits is None else dict(splits=splits, tile_pages=tp, num_warps=warps)
                fns = [
                    lambda st=st, tiles=tiles: sparse_attention(
                        st.c.query,
                        st.c.keys,
                        st.c.values,
                        st.pages,
                        slot_valid=st.c.slot_valid,
                        row_start=st.c.row_start,
                        length=st.c.length,
                        scale=scale,
                        page_size=B,
                        **tiles,
                    )
                    for st in steps
                ]
                try:
                    ms = time_graph(fns, reps=reps)["ms"]
                except Exception as e:  # a tile the kernel refuses
                    log(f"  sweep attend {tiles}: {type(e).__name__} {str(e)[:100]}")
                    continue
                out["attend"].append({**tiles, "ms": ms})
                log(f"  sweep attend {model} {fmt_ctx(length)} b{batch} {tiles or 'default'}: {ms * 1e3:.1f} us")
    del steps, sets
    torch.cuda.empty_cache()
    return out


def markdown(rows: list[dict], bw: float, extra: dict) -> str:
    out = [
        f"Device bandwidth used for floors: {bw:.2f} TB/s (measured; see json).",
        "",
        "| model | ctx | batch | arm | score ms | select ms | attend ms | **total ms** | byte floor ms | total/floor "
        "| best dense ms (backend) | **speedup vs dense** | eager total ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['model']} | {fmt_ctx(r['context'])} | {r['batch']} | {r['arm']} | {r['score_ms']:.4f} | "
            f"{r['select_ms']:.4f} | {r['attend_ms']:.4f} | **{r['total_ms']:.4f}** | {r['floor_ms']:.4f} | "
            f"{r['over_floor']:.2f} | {r['dense_ms']:.4f} ({r['dense_backend']}) | **{r['speedup']:.1f}x** | "
            f"{r['total_eager_ms']:.4f} |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama3.1-8b,glm4-9b")
    ap.add_argument("--contexts", default="16K,32K,64K,128K,256K,512K,1M")
    ap.add_argument("--labels", default="r8i4,r4i4,r2i4")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--batch", default="1")
    ap.add_argument("--max-context-batched", default="512K", help="largest context timed at batch > 1")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--check", action="store_true", help="float64 checks at real shapes first (pytest -m gpu)")
    ap.add_argument("--sweep", action="store_true", help="try scoring tile shapes at 512K first")
    ap.add_argument("--sweep-labels", default="r4i4", help="summary labels the sweep tunes (each its own best)")
    ap.add_argument("--sweep-variants", default="dot,fma", help="scoring variants the sweep tries")
    ap.add_argument(
        "--sweep-select-attend",
        action="store_true",
        help="time selection chunks and attention splits/tiles at the first context, for --sweep-labels",
    )
    ap.add_argument("--build", action="store_true", help="summary build vs one prefill layer at --build-context")
    ap.add_argument("--build-context", default="128K")
    ap.add_argument(
        "--dense-all", action="store_true", help="also time the math SDPA backend past 128K and FlexAttention past 512K"
    )
    ap.add_argument("--out", default="bench_decode.json")
    ap.add_argument("--md", default=None)
    args = ap.parse_args(argv)

    assert torch.cuda.is_available(), "needs a CUDA GPU"
    import triton

    log_lines = []

    def log(msg):
        print(msg, flush=True)
        log_lines.append(msg)

    dev = torch.cuda.get_device_properties(0)
    info = {
        "device": dev.name,
        "sms": dev.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "command": " ".join(sys.argv),
    }
    log(json.dumps(info))
    result = {"info": info, "rows": [], "checks": [], "build": {}, "sweep": {}}

    def save():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))

    bwi = measure_bandwidth()
    bw = max(bwi["copy_tbps"], bwi["read_tbps"])
    result["bandwidth"] = bwi
    log(f"bandwidth: copy {bwi['copy_tbps']:.2f} TB/s, read {bwi['read_tbps']:.2f} TB/s -> floors at {bw:.2f} TB/s")
    models = args.models.split(",")
    labels = [(int(x[1 : x.index("i")]), int(x[x.index("i") + 1 :])) for x in args.labels.split(",")]

    if args.check:  # the float64 checks at real shapes are GPU tests; their verdict goes in the json
        import pytest

        code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", str(CHECKS)])
        log(f"real-shape checks ({CHECKS.name}): pytest exit code {int(code)}")
        result["checks"].append({"tests": str(CHECKS.relative_to(ROOT)), "pytest_exit_code": int(code)})
        torch.cuda.empty_cache()
        save()
    score_cfgs = {}
    if args.sweep:
        for m in models:
            for label in args.sweep_labels.split(","):
                try:
                    sw = sweep_score(m, 512 << 10, label, log, reps=10, variants=tuple(args.sweep_variants.split(",")))
                except Exception as e:
                    log(f"SWEEP FAILED {m} {label}: {type(e).__name__}: {str(e)[-300:]}")
                    continue
                result["sweep"][f"{m} {label}"] = sw
                if sw["best"]:  # tiles and register caps depend on the rank: each label keeps its own
                    score_cfgs[(m, label)] = sw["best"]
                save()
    if args.sweep_select_attend:
        for m in models:
            for label in args.sweep_labels.split(","):
                for batch in [int(x) for x in args.batch.split(",")]:
                    ctx = parse_ctx(args.contexts.split(",")[0])
                    try:
                        sw = sweep_select_attend(m, ctx, label, log, reps=10, batch=batch, budget=args.budget)
                    except Exception as e:
                        log(f"SELECT/ATTEND SWEEP FAILED {m} {label}: {type(e).__name__}: {str(e)[-300:]}")
                        continue
                    result["sweep"][f"select-attend {m} {label} {fmt_ctx(ctx)} b{batch}"] = sw
                    save()
    if args.build:
        T = parse_ctx(args.build_context)
        for m in models:
            try:
                pre = prefill_layer_ms(m, T)
                bc = build_cost(m, T, labels)
            except Exception as e:
                log(f"BUILD FAILED {m}: {type(e).__name__}: {str(e)[-300:]}")
                continue
            result["build"][m] = {
                "context": T,
                "prefill_layer_ms": pre,
                **{f"build_{k}_ms": v for k, v in bc.items()},
                **{f"build_{k}_share": v / pre for k, v in bc.items()},
            }
            log(
                f"build {m} {fmt_ctx(T)}: prefill layer {pre:.1f} ms; "
                + ", ".join(f"{k} {v:.2f} ms ({100 * v / pre:.2f}%)" for k, v in bc.items())
            )
            save()
    for batch in [int(x) for x in args.batch.split(",")]:
        for m in models:
            for ctx in args.contexts.split(","):
                L = parse_ctx(ctx)
                if batch > 1 and L > parse_ctx(args.max_context_batched):
                    continue
                try:
                    result["rows"] += bench_config(
                        m, L, batch, args.budget, labels, bw, log, score_cfgs, args.reps, args.dense_all
                    )
                except Exception as e:
                    log(f"CONFIG FAILED {m} {ctx} batch {batch}: {type(e).__name__}: {str(e)[-300:]}")
                    torch.cuda.empty_cache()
                save()
    md = markdown(result["rows"], bw, result)
    print(md)
    result["log"] = log_lines
    save()
    if args.md:
        Path(args.md).write_text(md + "\n")


if __name__ == "__main__":
    main()
