#!/usr/bin/env python
"""`locks_hf.quant.unpack` against the fields stacked along a new last dim (its form before 2026-12-07), on the
CPU: the codes checked equal, then the best of ``--repeat`` timings of each, side by side. The PyTorch path
unpacks a layer's 4-bit summary basis, or its KIVI-packed K/V, at every decode step.

    python scripts/dev/bench_unpack.py --out unpack.json
"""

from __future__ import annotations

import argparse
import json
import timeit

import torch

from locks_hf.quant import unpack


def stacked_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """The fields sign-extended one by one and stacked along a new last dim."""
    x = packed.view(torch.int8)
    fields = [(x << (8 - bits * (i + 1))) >> (8 - bits) for i in range(8 // bits)]
    return torch.stack(fields, dim=-1).flatten(-2)


#: name -> packed shape: a SmolLM2-135M layer at 8K tokens (3 KV heads, 500 pages of 16, d = 64): its r8i4
#: basis, and its 4-bit keys.
SHAPES = {"basis r8, 500 pages": (1, 3, 500, 8, 32), "keys, 8K tokens": (1, 3, 8000, 32)}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=7, help="timings of each; the best is kept")
    parser.add_argument("--out", default=None, help="JSON file of the rows")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = []
    print("| packed | bits | unpack us | stacked us | speed-up |\n|---|---|---|---|---|")
    for name, shape in SHAPES.items():
        packed = torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        for bits in (4, 2):
            if not torch.equal(unpack(packed, bits), stacked_unpack(packed, bits)):
                raise SystemExit(f"unpack differs from the stacked fields at {shape}, {bits} bits")
            best = {}
            for label, fn in (("unpack", unpack), ("stacked", stacked_unpack)):
                timer = timeit.Timer(lambda fn=fn: fn(packed, bits))
                n, _ = timer.autorange()
                best[label] = min(timer.repeat(args.repeat, n)) / n * 1e6
            row = {"packed": name, "shape": list(shape), "bits": bits, **{f"{k}_us": v for k, v in best.items()}}
            rows.append(row)
            print(
                f"| {name} | {bits} | {best['unpack']:.0f} | {best['stacked']:.0f} | {best['stacked'] / best['unpack']:.2f}x |"
            )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
