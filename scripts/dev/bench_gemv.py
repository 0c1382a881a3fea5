#!/usr/bin/env python
"""The one-token projections of a model's decode step on `locks_hf.kernels.gemv.gemv` against cuBLAS
(``F.linear``), each projection over every layer's own weights in one CUDA graph, several tiles of the
kernel side by side in one run; each tile's outputs are checked against a float64 product first.

    python scripts/dev/bench_gemv.py --shape glm4-9b --layout fused --out gemv.json
    python scripts/dev/bench_gemv.py --device cpu --shape tiny        # smoke test (interpreter, no timing)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shapes
from bench_decode import measure_bandwidth, time_graph  # noqa: E402
from dev.gemv_floor import LAYOUTS, config_projections, parse_shape_args  # noqa: E402

from locks_hf.kernels.gemv import gemv  # noqa: E402

DEFAULT_TILES = (
    "8:1024:4:1,4:1024:4:1,4:2048:4:1,4:512:2:1,2:1024:2:1,2:2048:4:1,1:2048:2:1,8:512:4:1,8:1024:8:1,16:1024:8:1,"
    "8:2048:4:1,4:1024:4:3"
)


def parse_tiles(text: str) -> list[tuple[int, int, int, int]]:
    tiles = []
    for part in filter(None, text.split(",")):
        n, k, w, s = (int(v) for v in part.split(":"))
        tiles.append((n, k, w, s))
    return tiles


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default="fused", choices=list(LAYOUTS))
    ap.add_argument("--tiles", default=DEFAULT_TILES, help="BLOCK_N:BLOCK_K:warps:stages, comma-separated")
    ap.add_argument("--layers", type=int, default=None, help="layers (default: the shape's)")
    args, device, config, dtype = parse_shape_args(ap, argv)
    n_layers = args.layers or config.num_hidden_layers
    spec = config_projections(args.layout, config) + [("head", config.hidden_size, config.vocab_size, False)]
    tiles = parse_tiles(args.tiles)
    tbps = measure_bandwidth()["read_tbps"] if device.type == "cuda" else float("nan")
    gen = torch.Generator(device=device).manual_seed(0)
    rows = []
    for name, n_in, n_out, has_bias in spec:
        layers = 1 if name == "head" else n_layers
        ws = [torch.randn(n_out, n_in, device=device, dtype=dtype, generator=gen) * n_in**-0.5 for _ in range(layers)]
        bs = [torch.randn(n_out, device=device, dtype=dtype, generator=gen) if has_bias else None for _ in ws]
        x = torch.randn(n_in, device=device, dtype=dtype, generator=gen)
        want = ws[0].double() @ x.double() + (bs[0].double() if has_bias else 0)
        ref_err = (F.linear(x[None], ws[0], bs[0])[0].double() - want).abs().max().item()
        nbytes = sum(w.numel() * w.element_size() for w in ws)
        row = {"projection": name, "in": n_in, "out": n_out, "layers": layers, "bytes": nbytes,
               "floor_ms": nbytes / tbps / 1e9, "cublas_err": ref_err, "tiles": []}  # fmt: skip
        outs = [x.new_empty(n_out) for _ in ws]
        if device.type == "cuda":

            def cublas(ws=ws, bs=bs, x=x):  # a [1, K] input, as a model's one-token step passes (addmm)
                for w, b in zip(ws, bs):
                    F.linear(x[None], w, b)

            row["cublas_ms"] = time_graph([cublas], reps=args.reps)["ms"]
        for tile in tiles:
            err = (gemv(x, ws[0], bs[0], tile=tile).double() - want).abs().max().item()
            entry = {"tile": list(tile), "err": err}
            if device.type == "cuda":

                def ours(tile=tile, ws=ws, bs=bs, outs=outs, x=x):
                    for w, b, o in zip(ws, bs, outs):
                        gemv(x, w, b, out=o, tile=tile)

                entry["ms"] = time_graph([ours], reps=args.reps)["ms"]
            row["tiles"].append(entry)
        rows.append(row)
        best = min(row["tiles"], key=lambda e: e.get("ms", float("inf")), default={})
        print(f"{name}: cuBLAS {row.get('cublas_ms', float('nan')):.4f} ms, best tile {best.get('tile')} "
              f"{best.get('ms', float('nan')):.4f} ms, floor {row['floor_ms']:.4f}", flush=True)  # fmt: skip
        del ws, bs, outs
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{args.shape} ({args.layout}), batch 1, {dtype}, read bandwidth {tbps:.2f} TB/s; ms over the layers")
    print("| projection | in x out | floor | cuBLAS | " + " | ".join(":".join(map(str, t)) for t in tiles) + " |")
    print("|---|---|---|---|" + "---|" * len(tiles))
    for r in rows:
        cells = [f"{e.get('ms', float('nan')):.4f}" for e in r["tiles"]]
        print(f"| {r['projection']} | {r['in']}x{r['out']} | {r['floor_ms']:.4f} | {r.get('cublas_ms', float('nan')):.4f} | "
              + " | ".join(cells) + " |")  # fmt: skip
    worst = max((e["err"] / max(r["cublas_err"], 1e-30) for r in rows for e in r["tiles"]), default=0.0)
    print(f"largest error against float64, relative to cuBLAS's: {worst:.2f}x")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "layout": args.layout, "read_tbps": tbps,
                                              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                              "rows": rows}, indent=1))  # fmt: skip
    return rows


if __name__ == "__main__":
    main()
