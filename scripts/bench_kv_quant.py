#!/usr/bin/env python
"""Decode attention over KIVI-quantized K/V (`kernels.quantized_attention`) against the bf16 sparse
attention (`kernels.sparse_attention`) on a CUDA GPU: one layer, the same page lists.

At Llama-3.1-8B's attention shape (32 query heads, 8 KV heads, head_dim 128) by default; for each
context, page size and code width, a cache of random bf16 K/V is quantized as `QuantizedLocksLayer`
stores it (keys per channel over groups of ``--group`` tokens, values per token over groups of
``--group`` channels, the last ``--residual`` slots in bf16), and both kernels attend the same page
lists of ``--budget`` tokens (the first page, the last one, random others). Times are medians of
CUDA-graph replays cycling through ``--lists`` different page lists (so that the pages read are not
all in L2); the output's relative error against the bf16 kernel (the quantization's) is reported.
``--dense`` attends every written page instead (the dense 4-bit decode); ``--warps`` and ``--tile-pages``
are the quantized kernel's launch settings tried. Prints a table and writes JSON (``--out``).

    python scripts/bench_kv_quant.py --contexts 128K,512K --bits 4,2 --out results/bench_kv_quant.json
    python scripts/bench_kv_quant.py --shape glm4-9b --batch 8 --contexts 512K --page-sizes 16 --bits 4 --dense \
        --tile-pages auto,1,2
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

# query heads, KV heads, head_dim ("tiny": the CPU smoke test's)
SHAPES = {"llama3.1-8b": (32, 8, 128), "glm4-9b": (32, 2, 128), "tiny": (8, 2, 64)}


def parse_ctx(s: str) -> int:
    s = s.strip().upper()
    if s.endswith("M"):
        return int(float(s[:-1]) * (1 << 20))
    if s.endswith("K"):
        return int(float(s[:-1]) * (1 << 10))
    return int(s)


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shape", default="llama3.1-8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="128K,512K", help="cached tokens, comma-separated (K/M suffixes)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=int, default=2048, help="tokens attended per (row, KV head)")
    ap.add_argument("--page-sizes", default="16,64", help="tokens per page (16 = the library default)")
    ap.add_argument("--bits", default="4,2", help="code widths of the quantized K/V")
    ap.add_argument("--group", type=int, default=32, help="kv_group (tokens per key group, channels per value group)")
    ap.add_argument("--residual", type=int, default=128, help="slots kept in bf16 at the end of the cache")
    ap.add_argument("--warps", default="4,8", help="num_warps values of the quantized kernel timed")
    ap.add_argument(
        "--tile-pages",
        default="auto",
        help="pages a tile of the quantized kernel, comma-separated (auto: `attend_quant.launch_tiles`'s choice)",
    )
    ap.add_argument(
        "--dense",
        action="store_true",
        help="attend every written page (no page lists: the dense 4-bit decode) instead of --budget tokens",
    )
    ap.add_argument("--lists", type=int, default=16, help="page lists cycled through per graph replay")
    ap.add_argument("--reps", type=int, default=30, help="timed graph replays")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--device",
        default="cuda",
        help="cpu: a smoke test of the script (Triton's interpreter, TRITON_INTERPRET=1, float32, --shape tiny)",
    )
    ap.add_argument("--out", default="results/bench_kv_quant.json")
    return ap.parse_args(argv)


def time_graph(fns, reps: int, on_cuda: bool = True) -> float:
    """Median microseconds per call of the closures ``fns``, captured once each in a CUDA graph (off CUDA:
    called once each, timed on the host: a smoke test's figure, not a measurement)."""
    if not on_cuda:
        start = time.perf_counter()
        for f in fns:
            f()
        return (time.perf_counter() - start) * 1e6 / len(fns)
    for f in fns:  # compile outside capture
        f()
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in fns:
            f()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(fns))
    del graph
    return statistics.median(times)


def quantized_storage(keys, values, slot_valid, bits, group, qk, qv, chunk=1 << 15):
    """The packed storage of `QuantizedLocksLayer` for ``keys``/``values [b, h, T, d]``: keys of slots
    ``< qk`` and values of slots ``< qv`` quantized (on the GPU, ``chunk`` slots at a time)."""
    from locks_hf.kv_quant import quantize_keys, quantize_values

    b, h, T, d = keys.shape
    per = 8 // bits
    st = dict(
        key_codes=keys.new_zeros((b, h, T, d // per), dtype=torch.uint8),
        key_scale=keys.new_zeros((b, h, -(-T // group), d)),
        key_zero=keys.new_zeros((b, h, -(-T // group), d)),
        value_codes=keys.new_zeros((b, h, T, d // per), dtype=torch.uint8),
        value_scale=keys.new_zeros((b, h, T, d // group)),
        value_zero=keys.new_zeros((b, h, T, d // group)),
    )
    for s in range(0, qk, chunk):  # chunk is a multiple of group
        e = min(s + chunk, qk)
        codes, scale, zero = quantize_keys(keys[:, :, s:e], bits, group, slot_valid[:, s:e])
        st["key_codes"][:, :, s:e] = codes
        st["key_scale"][:, :, s // group : e // group] = scale
        st["key_zero"][:, :, s // group : e // group] = zero
    for s in range(0, qv, chunk):
        e = min(s + chunk, qv)
        codes, scale, zero = quantize_values(values[:, :, s:e], bits, group, slot_valid[:, s:e])
        st["value_codes"][:, :, s:e], st["value_scale"][:, :, s:e], st["value_zero"][:, :, s:e] = codes, scale, zero
    st["key_tail"] = keys[:, :, qk:].clone()
    st["value_tail"] = values[:, :, qv:].clone()
    st["quantized"] = torch.tensor([qk, qv], dtype=torch.int32, device=keys.device)
    return st


def page_lists(n, b, h, T, B, slots, gen):
    """``n`` page lists ``[b, h, slots]``: the first page, the last (partly bf16) one, random others."""
    P = -(-T // B)
    out = []
    for _ in range(n):
        middle = torch.rand((b, h, P - 2), generator=gen, device=gen.device).argsort(-1)[..., : slots - 2] + 1
        first = torch.zeros((b, h, 1), dtype=middle.dtype, device=gen.device)
        out.append(torch.cat([first, middle, first + P - 1], -1).to(torch.int32).contiguous())
    return out


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit(
            "bench_kv_quant.py times Triton kernels on a CUDA GPU and none is available here "
            "(the kernels' CPU tests are tests/test_kv_quant_kernels.py; --device cpu smoke-tests this script)"
        )
    from locks_hf import kernels

    hq, h, d = SHAPES[args.shape]
    b, dev = args.batch, args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32  # the interpreter computes in float32
    scale = d**-0.5
    rows = []
    for T in (parse_ctx(c) for c in args.contexts.split(",")):
        gen = torch.Generator(device=dev).manual_seed(args.seed + T)
        keys = torch.randn((b, h, T, d), generator=gen, device=dev, dtype=dtype)
        values = torch.randn((b, h, T, d), generator=gen, device=dev, dtype=dtype)
        slot_valid = torch.ones((b, T), dtype=torch.bool, device=dev)
        row_start = torch.zeros((b,), dtype=torch.int32, device=dev)
        length = torch.full((1,), T, dtype=torch.int32, device=dev)
        query = torch.randn((b, hq, 1, d), generator=gen, device=dev, dtype=dtype)
        qk = (T - args.residual) // args.group * args.group
        qv = T - args.residual
        for B in (int(x) for x in args.page_sizes.split(",")):
            n_pages = -(-T // B)
            if args.dense:
                lists = flat = [None]
            else:
                lists = page_lists(args.lists, b, h, T, B, args.budget // B, gen)
                flat = [p.view(b * h, -1) for p in lists]

            def bf16(p, keys=keys, values=values):
                return kernels.sparse_attention(
                    query,
                    keys,
                    values,
                    p,
                    slot_valid=slot_valid,
                    row_start=row_start,
                    length=length,
                    scale=scale,
                    page_size=B,
                    n_pages=n_pages,
                )

            base_us = time_graph([lambda p=p: bf16(p) for p in flat], args.reps, dev == "cuda")
            want = bf16(flat[0]).view(b, hq, d).double()
            for bits in (int(x) for x in args.bits.split(",")):
                st = quantized_storage(keys, values, slot_valid, bits, args.group, qk, qv)

                def quant(p, warps, tiles, st=st, bits=bits):
                    return kernels.quantized_attention(
                        query,
                        p,
                        **st,
                        bits=bits,
                        group=args.group,
                        slot_valid=slot_valid,
                        row_start=row_start,
                        length=length,
                        scale=scale,
                        page_size=B,
                        n_pages=n_pages,
                        num_warps=warps,
                        tile_pages=tiles,
                    )

                settings = [
                    (int(w), None if t == "auto" else int(t))
                    for w in args.warps.split(",")
                    for t in args.tile_pages.split(",")
                ]
                for warps, tiles in settings:
                    us = time_graph([lambda p=p: quant(p, warps, tiles) for p in lists], args.reps, dev == "cuda")
                    got = quant(lists[0], warps, tiles).view(b, hq, d).double()
                    err = ((got - want).norm() / want.norm()).item()
                    row = {
                        "shape": args.shape,
                        "context": T,
                        "batch": b,
                        "page_size": B,
                        "budget": args.budget,
                        "bits": bits,
                        "group": args.group,
                        "residual": args.residual,
                        "num_warps": warps,
                        "tile_pages": kernels.attend_quant.launch_tiles(B, d, dtype, dtype, tiles)[0],
                        "dense": args.dense,
                        "bf16_us": base_us,
                        "quant_us": us,
                        "speedup": base_us / us,
                        "rel_err_vs_bf16": err,
                    }
                    rows.append(row)
                    print(
                        f"{args.shape} T={T >> 10}K B={B:3d} kv{bits}g{args.group} warps {warps} tile "
                        f"{row['tile_pages']}: bf16 "
                        f"{base_us:8.2f} us  quantized {us:8.2f} us  x{base_us / us:5.2f}  rel err vs bf16 "
                        f"{err:.2e}",
                        flush=True,
                    )
                del st
            torch.cuda.empty_cache()
        keys = values = None
        torch.cuda.empty_cache()
    print()
    print(
        f"{'context':>8} {'B':>4} {'bits':>4} {'warps':>5} {'tile':>4} {'bf16 us':>9} {'quant us':>9} {'speedup':>8} "
        f"{'rel err':>9}"
    )
    for r in rows:
        print(
            f"{r['context'] >> 10:>7}K {r['page_size']:>4} {r['bits']:>4} {r['num_warps']:>5} {r['tile_pages']:>4} "
            f"{r['bf16_us']:>9.2f} "
            f"{r['quant_us']:>9.2f} {r['speedup']:>8.2f} {r['rel_err_vs_bf16']:>9.2e}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "command": " ".join(sys.argv),
                "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (smoke test)",
                "args": vars(args),
                "rows": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main()
