#!/usr/bin/env python
"""Run a script with the "fma" scoring kernel's chunk loop rolled from another rank, and its wall time.

The kernel unrolls its chunk loop below ``ROLL_CHUNKS_FROM_RANK`` (8): unrolled, rank 4 compiles in
~22 s for sm_90, rolled in ~3 s (docs/compile_time.md), but the rolled form's speed at rank 4 has not
been measured on a GPU. With a fresh ``TRITON_CACHE_DIR`` per form, the wall times differ by the
compile; the script's own table gives the kernel times::

    TRITON_CACHE_DIR=/tmp/tc8 python3 scripts/dev/fma_roll.py 8 scripts/bench_decode.py --models llama3.1-8b --contexts 512K --labels r4i4
    TRITON_CACHE_DIR=/tmp/tc4 python3 scripts/dev/fma_roll.py 4 scripts/bench_decode.py --models llama3.1-8b --contexts 512K --labels r4i4
"""

from __future__ import annotations

import runpy
import sys
import time

import triton.language as tl

from locks_hf.kernels import score_fma


def main() -> None:
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    rank, script, rest = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    # read by the kernel at its compile (a global of its module): set before the first launch
    score_fma.ROLL_CHUNKS_FROM_RANK = tl.constexpr(rank)
    sys.argv = [script, *rest]
    t0 = time.perf_counter()
    runpy.run_path(script, run_name="__main__")
    print(f"fma_roll: chunk loop rolled from rank {rank}; {script} took {time.perf_counter() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
