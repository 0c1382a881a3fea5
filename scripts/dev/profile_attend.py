#!/usr/bin/env python
"""Per-kernel profile of one layer's sparse decode (score, select, attend, merge, page mask) on a CUDA GPU.

For each shape at one context: torch.profiler kernel times of eager steps (the kernels alone, no
launch gaps), then CUDA-graph medians of the attention variants (separate merge, in-launch merge,
split counts), each compared with a float64 reference of the same page lists, and of the page
mask (one launch against the memset + scatter + copy it replaced). Writes JSON.

    python scripts/dev/profile_attend.py --models llama3.1-8b,glm4-9b --context 512K --out profile_attend.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]  # scripts/
spec = importlib.util.spec_from_file_location("bench_decode", ROOT / "bench_decode.py")
bd = importlib.util.module_from_spec(spec)
sys.modules["bench_decode"] = bd
spec.loader.exec_module(bd)
from locks_hf.kernels.attend import sparse_attention  # noqa: E402

try:
    from locks_hf.kernels.select import mark_lists  # noqa: E402
except ImportError:  # a tree from before the one-launch page mask: the page-mask rows are skipped
    mark_lists = None


def reference(c, pages, scale):
    """float64 attention of each (row, KV head) over its listed pages."""
    b, hq, _, d = c.query.shape
    h = c.keys.shape[1]
    G = hq // h
    out = torch.empty((b, hq, d), dtype=torch.float64, device=c.query.device)
    for r in range(b * h):
        bb, hh = divmod(r, h)
        pg = pages[r][pages[r] >= 0].long()
        slots = (pg[:, None] * bd.B + torch.arange(bd.B, device=pg.device)[None, :]).reshape(-1)
        slots = slots[slots < c.length]
        k = c.keys[bb, hh, slots].double()
        v = c.values[bb, hh, slots].double()
        q = c.query[bb, hh * G : (hh + 1) * G, 0].double()
        out[bb, hh * G : (hh + 1) * G] = torch.softmax(q @ k.T * scale, -1) @ v
    return out


def kernel_profile(fn, steps=10):
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if e.device_time_total > 0]
    ev.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:80], "us": e.device_time_total / steps, "per_step": e.count / steps} for e in ev]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="llama3.1-8b,glm4-9b")
    ap.add_argument("--context", default="512K")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--splits", default="1,2,4,8,16,32", help="split counts tried besides the default")
    ap.add_argument("--out", default="profile_attend.json")
    args = ap.parse_args()
    T = bd.parse_ctx(args.context)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "rows": {}}
    for model in args.models.split(","):
        hq, h, d, _, _ = bd.MODELS[model]
        slots = args.budget // bd.B
        scale = d**-0.5
        gen = torch.Generator(device="cuda").manual_seed(T)
        sets = [bd.CacheSet(1, hq, h, d, T, gen) for _ in range(args.copies)]
        for s in sets:
            s.build([(4, 4)])
        steps = [bd.Step(s, "locks", s.summaries["r4i4"], 4, slots, scale) for s in sets]
        r = {}
        prof = kernel_profile(lambda: [st.total() for st in steps[:1]])
        r["profile_total_r4i4"] = prof
        print(model, "kernels of one score+select+attend (us):")
        for e in prof:
            print(f"   {e['us']:8.2f} us x{e['per_step']:.0f} {e['kernel']}")
        variants = {"separate": {}, "fused": dict(fused_combine=True)}
        for sp in [int(x) for x in args.splits.split(",") if x]:
            variants[f"separate_s{sp}"] = dict(splits=sp)
            variants[f"fused_s{sp}"] = dict(splits=sp, fused_combine=True)
        # a static layer's launch: statistics in the launch (the fused merge's counters given by the caller)
        variants["separate_stats"] = dict(stats=True)
        variants["fused_stats"] = dict(stats=True, fused_combine=True)
        for st in steps:
            st.stats = dict(
                counts=torch.zeros(2, dtype=torch.int64, device="cuda"),
                row_counts=torch.zeros((1, 2), dtype=torch.int64, device="cuda"),
                pad=torch.zeros(1, dtype=torch.int32, device="cuda"),
                semaphore=torch.zeros(h, dtype=torch.int32, device="cuda"),
            )
            st.c.length_t = torch.tensor([st.c.length], dtype=torch.int32, device="cuda")
        ref = reference(sets[0], steps[0].pages, scale)
        times = {}
        for name, kw in variants.items():

            def fn(st, kw=kw):
                c = st.c
                kw = dict(kw)
                extra = st.stats if kw.pop("stats", False) else {}
                return sparse_attention(
                    c.query,
                    c.keys,
                    c.values,
                    st.pages,
                    slot_valid=c.slot_valid,
                    row_start=c.row_start,
                    length=c.length_t if extra else c.length,
                    scale=scale,
                    page_size=bd.B,
                    **kw,
                    **extra,
                )

            out = fn(steps[0]).view(1, hq, d).double()
            err = ((out - ref).norm() / ref.norm()).item()
            t = bd.time_graph([lambda st=st: fn(st) for st in steps], reps=20)["ms"] * 1e3
            kp = kernel_profile(lambda: fn(steps[0]))
            times[name] = {"us": t, "rel_err": err, "kernels": kp}
            print(
                f"  {model} attend {name:14s} {t:7.2f} us (graph)  err {err:.2e}  kernels: "
                + ", ".join(f"{e['kernel'][:24]} {e['us']:.2f}" for e in kp)
            )
        r["attend"] = times
        res["rows"][model] = r
        Path(args.out).write_text(json.dumps(res, indent=1))
        if mark_lists is None:
            continue
        # page mask: one launch against memset + scatter + copy
        rows, P = h, T // bd.B
        masks = [torch.zeros((rows, P), dtype=torch.bool, device="cuda") for _ in steps]

        def old_mask(m, pages):
            n = m.shape[1]
            hit = torch.zeros((m.shape[0], n + 1), dtype=torch.bool, device=m.device)
            hit.scatter_(1, torch.where(pages >= 0, pages, n).long(), True)
            m.copy_(hit[:, :n])

        t_old = bd.time_graph([lambda m=m, st=st: old_mask(m, st.pages) for m, st in zip(masks, steps)], reps=20)["ms"]
        want = masks[0].clone()
        t_new = bd.time_graph([lambda m=m, st=st: mark_lists(m, st.pages) for m, st in zip(masks, steps)], reps=20)[
            "ms"
        ]
        same = torch.equal(want, masks[0])
        r["mask"] = {
            "old_us": t_old * 1e3,
            "new_us": t_new * 1e3,
            "equal": same,
            "old_kernels": kernel_profile(lambda: old_mask(masks[0], steps[0].pages)),
            "new_kernels": kernel_profile(lambda: mark_lists(masks[0], steps[0].pages)),
        }
        print(
            f"  {model} page mask: memset+scatter+copy {t_old * 1e3:.2f} us, one launch {t_new * 1e3:.2f} us, "
            f"equal {same}"
        )
        res["rows"][model] = r
        Path(args.out).write_text(json.dumps(res, indent=1))
        sets = steps = masks = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
