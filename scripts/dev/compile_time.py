#!/usr/bin/env python
"""Ahead-of-time compile of the Locks scoring kernels ("fma", "mma") for sm_90 on a machine without a
GPU: seconds per compile stage, registers, spills and SASS size (docs/compile_time.md).

    python scripts/dev/compile_time.py --ranks 4,8                              # "fma", the installed Triton
    PYTHONPATH=/path/to/triton-3.6 python scripts/dev/compile_time.py --ranks 8
    python scripts/dev/compile_time.py --kernel mma --groups 4,16 --ranks 2,4,8 --bits 4

Launch arguments mirror `score_pages` at d = 128, 16-token pages, 32,768 pages, bf16 queries and the
default tiles (``G = 4``: the Llama-3.1-8B shape with 8 KV heads; other groups: 2 KV heads).
Each run uses a fresh Triton cache, so nothing is reused.
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
from locks_hf.kernels.score_mma import PAIR_BASE, _locks_mma_kernel  # noqa: E402
from locks_hf.kernels.score_tiles import FMA_PREFETCH, L2_PREFETCH, l2_prefetch_lines, mma_tiles  # noqa: E402

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
TARGET = GPUTarget("cuda", 90, 32)


def _summary_args(rank, bits, d, page, pages, kv_heads) -> list:
    """Pointer/stride triples of the six summary tensors as `score_pages` passes them (codes as int32 words)."""
    words = d * bits // 32
    strides = [
        (kv_heads * pages * rank * words, pages * rank * words),
        (kv_heads * pages * rank, pages * rank),
        (kv_heads * pages * page * rank // 4, pages * page * rank // 4),
        (kv_heads * pages * page, pages * page),
        (kv_heads * pages * d // 4, pages * d // 4),
        (kv_heads * pages, pages),
    ]
    dtypes = [torch.int32, torch.bfloat16, torch.int32, torch.bfloat16, torch.int32, torch.bfloat16]
    args = []
    for dt, (sb, sh) in zip(dtypes, strides):
        args += [MockTensor(dt), sb, sh]
    return args


def _aot(kernel, args, kw):
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **kw)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kw, bound, spec, opts)
    t0 = time.time()
    k = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
    return k, time.time() - t0


def compile_fma(
    rank: int,
    bits: int = 4,
    d: int = 128,
    page: int = 16,
    G: int = 4,
    pages: int = 32768,
    kv_heads: int = 8,
    num_warps: int = 4,
    prefetch: bool = FMA_PREFETCH,
):
    """Compile one specialization; returns (compiled kernel, seconds)."""
    bp = 32 * num_warps
    args = [MockTensor(torch.bfloat16), 32 * d, d, *_summary_args(rank, bits, d, page, pages, kv_heads)]
    args += [
        MockTensor(torch.uint8),
        pages * page,
        MockTensor(torch.int32),
        MockTensor(torch.int32),
        MockTensor(torch.int32),
        MockTensor(torch.float32),
        pages,
        MockTensor(torch.float32),
        -(-pages // bp),
        kv_heads,
        d**-0.5,
        MockTensor(torch.float32),
        1,
        0x4B000000,
    ]
    kw = dict(G=G, GG=G, D=d, B=page, R=rank, BITS=bits, BP=bp, num_warps=num_warps, num_stages=1, debug=False)
    kw["PF_LINES"] = l2_prefetch_lines(bp, d, page, rank, bits) if L2_PREFETCH else 0
    kw["PREFETCH"] = prefetch
    kw["VALID_WORDS"] = True  # a layer's own valid flags: whole pages of a 4-byte aligned buffer
    return _aot(KERNEL, args, kw)


def compile_mma(
    rank: int,
    bits: int = 4,
    d: int = 128,
    page: int = 16,
    G: int = 4,
    pages: int = 32768,
    kv_heads: int | None = None,
    **tiles,
):
    """Compile one "mma" specialization at `score_tiles.mma_tiles` (``tiles`` override them)."""
    GG = 1 << max(0, (G - 1).bit_length())
    kv_heads = kv_heads or (8 if G == 4 else 2)
    bp, hs, kcw, nw, ns = mma_tiles(
        GG,
        tiles.get("block_pages"),
        tiles.get("head_split"),
        tiles.get("words_per_chunk"),
        tiles.get("num_warps"),
        tiles.get("num_stages"),
        rank=rank,
        basis_bits=bits,
        query_bytes=2,
    )
    args = [MockTensor(torch.bfloat16), kv_heads * G * d, d, *_summary_args(rank, bits, d, page, pages, kv_heads)]
    args += [
        MockTensor(torch.uint8),
        pages * page,
        MockTensor(torch.int32),
        MockTensor(torch.int32),
        MockTensor(torch.int32),
        MockTensor(torch.float32),
        pages,
        MockTensor(torch.float32),
        -(-pages // bp),
        kv_heads,
        d**-0.5,
        1,
        0x4B000000,
        PAIR_BASE["bf16"],
    ]
    kw = dict(
        G=G,
        GG=GG,
        D=d,
        B=page,
        R=rank,
        BITS=bits,
        BP=bp,
        HS=hs,
        KCW=kcw,
        KCWM=kcw,
        DOT_PREC="tf32",
        PREFETCH=True,
        PF_LINES=l2_prefetch_lines(bp, d, page, rank, bits) if L2_PREFETCH else 0,
        VALID_WORDS=True,
        num_warps=nw,
        num_stages=ns,
        debug=False,
    )
    k, seconds = _aot(_locks_mma_kernel, args, kw)
    return k, seconds, dict(block_pages=bp, head_split=hs, words_per_chunk=kcw, num_warps=nw)


def resources(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    usage = subprocess.run(
        [os.path.join(BIN, "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True, text=True
    ).stdout
    sass = subprocess.run([os.path.join(BIN, "cuobjdump"), "-sass", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
    instr = sum(1 for line in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/", line))
    return dict(registers=int(m.group(1)), local_bytes=int(m.group(4)), sass_instructions=instr)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kernel", choices=("fma", "mma"), default="fma")
    ap.add_argument("--ranks", default="4,8")
    ap.add_argument("--bits", default="4")
    ap.add_argument("--groups", default="4", help="GQA group sizes (mma)")
    ap.add_argument("--prefetch", default=str(int(FMA_PREFETCH)), help="fma: 0, 1 or 0,1 (codes loaded a chunk ahead)")
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
    for bits in [int(b) for b in args.bits.split(",")]:
        for rank in [int(r) for r in args.ranks.split(",")]:
            if args.kernel == "fma":
                for pf in [bool(int(x)) for x in args.prefetch.split(",")]:
                    k, seconds = compile_fma(rank, bits, prefetch=pf)
                    print(
                        f"rank {rank} bits {bits} prefetch {int(pf)}: {seconds:.1f} s",
                        resources(k.asm["cubin"]),
                        "stages (s):",
                        stages or "n/a",
                        flush=True,
                    )
                continue
            for G in [int(g) for g in args.groups.split(",")]:
                k, seconds, tiles = compile_mma(rank, bits, G=G)
                print(
                    f"mma G={G} rank {rank} bits {bits} {tiles}: {seconds:.1f} s",
                    resources(k.asm["cubin"]),
                    f"shared {k.metadata.shared} B",
                    "stages (s):",
                    stages or "n/a",
                    flush=True,
                )


if __name__ == "__main__":
    main()
