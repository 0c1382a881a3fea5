#!/usr/bin/env python
"""Ahead-of-time compile of the "fma" Locks scoring kernel for sm_90 on a machine without a GPU:
seconds per compile stage, registers and SASS size (docs/compile_time.md).

    python scripts/compile_time.py --ranks 4,8          # the installed Triton
    PYTHONPATH=/path/to/triton-3.6 python scripts/compile_time.py --ranks 8

Launch arguments mirror `score_pages` at the Llama-3.1-8B shape (d = 128, 16-token pages, G = 4,
int4 basis, 32,768 pages, default tiles). Each run uses a fresh Triton cache, so nothing is reused.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time

os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="locks_ctime_")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import MockTensor, create_function_from_signature  # noqa: E402

from locks_hf.kernels.score_fma import _locks_fma_kernel as KERNEL  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)


def compile_fma(rank: int, bits: int = 4, d: int = 128, page: int = 16, G: int = 4, pages: int = 32768,
                kv_heads: int = 8, num_warps: int = 4):
    """Compile one specialization; returns (compiled kernel, seconds)."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(KERNEL.signature, KERNEL.params, backend)
    bp = 32 * num_warps
    words = d * bits // 32
    strides = [(kv_heads * pages * rank * words, pages * rank * words), (kv_heads * pages * rank, pages * rank),
               (kv_heads * pages * page * rank // 4, pages * page * rank // 4), (kv_heads * pages * page, pages * page),
               (kv_heads * pages * d // 4, pages * d // 4), (kv_heads * pages, pages)]
    dtypes = [torch.int32, torch.bfloat16, torch.int32, torch.bfloat16, torch.int32, torch.bfloat16]
    args = [MockTensor(torch.bfloat16), 32 * d, d]
    for dt, (sb, sh) in zip(dtypes, strides):
        args += [MockTensor(dt), sb, sh]
    args += [MockTensor(torch.uint8), pages * page, MockTensor(torch.int32), MockTensor(torch.int32),
             MockTensor(torch.int32), MockTensor(torch.float32), pages, MockTensor(torch.float32),
             -(-pages // bp), kv_heads, d ** -0.5, MockTensor(torch.float32), 1, 0x4B000000]
    kw = dict(G=G, GG=G, D=d, B=page, R=rank, BITS=bits, BP=bp, num_warps=num_warps, num_stages=1, debug=False)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = KERNEL._pack_args(backend, kw, bound, spec, opts)
    t0 = time.time()
    k = triton.compile(ASTSource(KERNEL, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    return k, time.time() - t0


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    usage = subprocess.run([os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name],
                           capture_output=True, text=True).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    instr = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))
    return dict(registers=int(m.group(1)), local_bytes=int(m.group(4)), sass_instructions=instr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--bits", type=int, default=4)
    args = ap.parse_args(argv)
    stages = {}
    try:  # per-stage times where this Triton has the compilation listener (3.4+)
        from triton import knobs

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            stages.clear()
            stages.update({name: round(us / 1e6, 2) for name, us in times.lowering_stages})

        knobs.compilation.listener = listener
    except (ImportError, AttributeError):
        pass
    print(f"Triton {triton.__version__}, sm_90 AOT, fresh cache {os.environ['TRITON_CACHE_DIR']}")
    for rank in [int(r) for r in args.ranks.split(",")]:
        k, seconds = compile_fma(rank, args.bits)
        print(f"rank {rank}: {seconds:.1f} s", resources(k.asm["cubin"]), "stages (s):", stages or "n/a", flush=True)


if __name__ == "__main__":
    main()
