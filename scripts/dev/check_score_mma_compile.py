#!/usr/bin/env python
"""Compile the "mma" page-scoring kernel (`kernels.score_mma`) for sm_90 without a GPU and check its
shared memory against an H100/H200's 227 KB a block.

Runs `score_pages(variant="mma")` on CPU tensors with the launch intercepted, at the default tiles of
`score_tiles.mma_tiles` (whatever the call leaves ``None``), compiles exactly what it would launch for
an sm_90 target and prints the tiles, shared memory, registers and spilled bytes. The tensor-core
operand tiles are staged in shared memory, so the widest configurations are the ones to check: float32
queries (``"ieee"`` products on float32 operands, twice bf16's bytes), rank 8, 2-bit bases (16 codes a
word) and the groups that run 128-page blocks. Exit status 1 when a kernel does not compile or needs
more shared memory than ``--limit``. Must run without ``TRITON_INTERPRET=1``; for Triton 3.6 (the H200's):

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python scripts/dev/check_score_mma_compile.py
    PYTHONPATH=/tmp/triton36 python scripts/dev/check_score_mma_compile.py --grid     # every G x rank x bits
"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("check_score_mma_compile: unset TRITON_INTERPRET (the interpreter does not compile)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402
from check_quant_attention_compile import BIN, SM90_SHARED, compile_sm90, cubin_resources  # noqa: E402

from locks_hf.kernels import score  # noqa: E402
from locks_hf.kernels.score_tiles import L2_PREFETCH, l2_prefetch_lines  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
_DT = {"fp32": F32, "bf16": BF16, "fp16": F16}
#: (query dtype, G, rank, bits, d, page size): the widest default tiles (float32 queries, rank 8 at 2 and
#: 4 bits in 128-page blocks: 2-word and 4-word chunks at the 128 KiB code tile), the CPU tests' d = 64 launch that overflowed on the H200 before the chunk width followed the
#: row width, and the bf16 tiles the H200 timings were taken with (G = 4 and the head-split G = 16).
CASES = [
    (F32, 1, 8, 2, 64, 16),
    (F32, 4, 8, 2, 128, 16),
    (F32, 4, 8, 4, 128, 16),
    (BF16, 4, 8, 4, 128, 16),
    (BF16, 16, 8, 4, 128, 16),
]
#: Cases also compiled with the L2 prefetch of each block (`score_parts.prefetch_block`, off by default): its
#: inline PTX assembles and adds no shared memory.
L2_CASES = [(BF16, 16, 4, 4, 128, 16)]


class _Launch:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kw)`` records ``(args, kw)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def launch_args(qdt, G, rank, bits, d, B, h=2, b=1, pages=64, l2_prefetch=L2_PREFETCH, centroid_words=None):
    """The arguments `score_pages(variant="mma")` launches its kernel with, on CPU tensors, and on a CUDA
    device the L2 prefetch if ``l2_prefetch`` (the default's)."""
    per = 8 // bits
    summary = {
        "basis": torch.zeros(b, h, pages, rank, d // per, dtype=torch.uint8 if bits < 8 else torch.int8),
        "basis_scale": torch.zeros(b, h, pages, rank, dtype=BF16),
        "coef": torch.zeros(b, h, pages, B, rank, dtype=torch.int8),
        "coef_scale": torch.zeros(b, h, pages, B, dtype=BF16),
        "mu": torch.zeros(b, h, pages, d, dtype=torch.int8),
        "mu_scale": torch.zeros(b, h, pages, dtype=BF16),
    }
    rec, kernel = _Launch(), score._locks_mma_kernel
    score._locks_mma_kernel = rec
    try:
        score.score_pages(
            "locks",
            torch.zeros(b, h * G, d, dtype=qdt),
            summary=summary,
            scale=0.1,
            basis_bits=bits,
            variant="mma",
            slot_valid=torch.ones(b, pages * B, dtype=torch.bool),
            row_start=torch.zeros(b, dtype=torch.int32),
            n_complete=torch.full((b,), pages, dtype=torch.int32),
            length=pages * B,
            n_pages=pages,
            page_size=B,
        )
    finally:
        score._locks_mma_kernel = kernel
    ((args, kw),) = rec.calls
    # a CUDA launch's L2 prefetch of each block (CPU tensors launch without it)
    kw["PF_LINES"] = l2_prefetch_lines(kw["BP"], d, B, rank, bits) if l2_prefetch else 0
    if centroid_words:
        kw["KCWM"] = centroid_words
    return args, kw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=SM90_SHARED, help="shared memory a block may use (bytes)")
    ap.add_argument("--only", default=None, help="comma-separated indices into CASES")
    ap.add_argument("--grid", action="store_true", help="every group 1-16 x rank 2/4/8 x bits 2/4/8 at page 16")
    ap.add_argument("--dtypes", default="fp32,bf16", help="query dtypes of --grid")
    ap.add_argument("--d", type=int, default=128, help="head dim of --grid")
    ap.add_argument("--ranks", default="2,4,8", help="ranks of --grid (16 at 2 bits, float32: half the warps)")
    ap.add_argument("--centroid-words", type=int, default=None, help="words of each centroid row a product")
    ap.add_argument(
        "--dump",
        default=None,
        help="folder: write each case's TTGIR and SASS there and print its shared-memory round trips "
        "(local_alloc / local_load) and SASS opcode counts",
    )
    args = ap.parse_args(argv)
    if args.grid:
        cases = [
            (_DT[t], G, r, bits, args.d, 16, L2_PREFETCH)
            for t in args.dtypes.split(",")
            for G, r, bits in itertools.product((1, 2, 4, 8, 16), [int(r) for r in args.ranks.split(",")], (2, 4, 8))
        ]
    else:
        cases = CASES if args.only is None else [CASES[int(i)] for i in args.only.split(",")]
        cases = [(*c, L2_PREFETCH) for c in cases] + ([] if args.only is not None else [(*c, True) for c in L2_CASES])
    print(f"Triton {triton.__version__}, sm_90 AOT, shared memory limit {args.limit} B", flush=True)
    bad = 0
    for case in cases:
        qdt, G, rank, bits, d, B, l2 = case
        label = f"{str(qdt)[6:]} G={G} r{rank}i{bits} d={d} B={B}{' l2_prefetch' if l2 else ''}"
        t0 = time.time()
        try:
            launch, kw = launch_args(*case[:6], l2_prefetch=l2, centroid_words=args.centroid_words)
            kernel = compile_sm90(score._locks_mma_kernel, launch, kw)
        except Exception as e:  # noqa: BLE001 - report every case
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            bad += 1
            continue
        shared = kernel.metadata.shared
        over = shared > args.limit
        bad += over
        print(
            f"{'OVER' if over else 'ok  '}  {label}: block_pages={kw['BP']} head_split={kw['HS']} "
            f"words_per_chunk={kw['KCW']} num_warps={kw['num_warps']} shared={shared} B "
            f"l2_prefetches={kernel.asm['ptx'].count('prefetch.global.L2')} "
            f"{cubin_resources(kernel.asm['cubin'])} {time.time() - t0:.1f} s",
            flush=True,
        )
        if args.dump:
            dump(kernel, os.path.join(args.dump, label.replace(" ", "_").replace("=", "")))
    return 1 if bad else 0


def dump(kernel, stem: str) -> None:
    """Write the TTGIR and SASS of ``kernel`` to ``stem.ttgir`` / ``stem.sass``; print how its operands go through
    shared memory and its most frequent SASS opcodes (static counts)."""
    os.makedirs(os.path.dirname(stem), exist_ok=True)
    ttgir = kernel.asm["ttgir"]
    with open(stem + ".ttgir", "w") as f:
        f.write(ttgir)
    tool = os.path.join(BIN, "cuobjdump")
    sass = ""
    if os.path.exists(tool):
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            sass = subprocess.run([tool, "--dump-sass", f.name], capture_output=True, text=True).stdout
        with open(stem + ".sass", "w") as f:
            f.write(sass)
    ops = collections.Counter(
        m.group(1) for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass)
    )
    print(
        f"      {ttgir.count('ttg.local_alloc')} local_alloc, {ttgir.count('ttg.local_load')} local_load, "
        f"{ttgir.count('ttng.warp_group_dot ')} warp_group_dot; SASS {sum(ops.values())}: "
        + ", ".join(f"{op} {n}" for op, n in ops.most_common(12)),
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
