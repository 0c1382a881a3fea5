#!/usr/bin/env python
"""Compile the quantized-KV attention kernel (`kernels.quantized_attention`) for sm_90 without a GPU and
check its shared memory against an H100/H200's 227 KB a block.

Triton's interpreter (the CPU tests) runs tiles the GPU cannot launch: a compiled kernel that asks for
more shared memory than the device has fails at its first launch (``OutOfResources``). This runs the
wrapper on CPU tensors at the configurations of ``tests/test_kv_quant_kernels.py`` (and the benchmarks'
bf16 ones) with the launch intercepted, compiles exactly what it would launch with ``triton.compile``
for an sm_90 target, and prints each kernel's tiles, shared memory, registers and spilled bytes (from
the cubin). Exit status 1 when a kernel does not compile or needs more shared memory than
``--limit``. Must run without ``TRITON_INTERPRET=1``. The H200 runs Triton 3.6: to compile with it,

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python scripts/dev/check_quant_attention_compile.py

    python scripts/dev/check_quant_attention_compile.py --only 0,3      # the listed cases
    python scripts/dev/check_quant_attention_compile.py --only 9,10,11,12   # the GLM-4-9B shape's dense launch
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("check_quant_attention_compile: unset TRITON_INTERPRET (the interpreter does not compile)")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import create_function_from_signature  # noqa: E402

from locks_hf.kernels import attend_quant  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
#: Shared memory a block may use on sm_90 (H100 / H200: 227 KB, ``cudaDevAttrMaxSharedMemoryPerBlockOptin``).
SM90_SHARED = 232448
BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

F32, BF16 = torch.float32, torch.bfloat16
#: (label, query dtype, K/V storage dtype, bits, group, GQA group, head_dim, page size, dense, splits,
#: counts, num_warps[, tile_pages]): the tests' launches (fp32 everywhere; bf16 storage under fp32 and bf16 queries;
#: the layer's head_dim 64), then the benchmarks' bf16 ones (the last four: the batch-8 dense arm at the
#: GLM-4-9B shape at 4 and 8 warps, and with tiles of 2 and 1 pages, `bench_kv_quant.py --tile-pages`).
CASES = [
    ("fp32 sparse G=4 split", F32, F32, 4, 32, 4, 128, 16, False, 3, True, 4),
    ("fp32 dense G=1 split", F32, F32, 2, 128, 1, 128, 16, True, 2, False, 4),
    ("fp32 sparse G=1", F32, F32, 2, 64, 1, 128, 16, False, 1, True, 4),
    ("fp32 over bf16 G=16", F32, BF16, 2, 128, 16, 128, 16, False, 1, False, 4),
    ("bf16 G=16", BF16, BF16, 4, 32, 16, 128, 16, False, 1, False, 4),
    ("fp32 d=64 G=2", F32, F32, 4, 32, 2, 64, 16, False, 1, True, 4),
    ("bf16 bench B=64 nw=8", BF16, BF16, 4, 32, 4, 128, 64, False, 4, False, 8),
    ("bf16 Llama-shape G=4 B=16", BF16, BF16, 4, 32, 4, 128, 16, False, 8, True, 4),
    ("bf16 2-bit G=4 B=16", BF16, BF16, 2, 32, 4, 128, 16, False, 8, True, 4),
    ("bf16 dense GLM-shape G=16 B=16", BF16, BF16, 4, 32, 16, 128, 16, True, 8, True, 4),
    ("bf16 dense GLM-shape G=16 B=16 nw=8", BF16, BF16, 4, 32, 16, 128, 16, True, 8, True, 8),
    ("bf16 dense GLM-shape G=16 B=16 tile 2", BF16, BF16, 4, 32, 16, 128, 16, True, 8, True, 4, 2),
    ("bf16 dense GLM-shape G=16 B=16 tile 1", BF16, BF16, 4, 32, 16, 128, 16, True, 8, True, 4, 1),
]


class _Launch:
    """Stands in for a jitted kernel: ``kernel[grid](*args, **kw)`` records ``(args, kw)``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kw: self.calls.append((args, kw))


def launch_args(
    qdt, sdt, bits, group, G, d, B, dense, splits, counts, num_warps, tile_pages=None, b=2, h=2, length=293
):
    """The arguments `quantized_attention` launches its kernel with, on CPU tensors."""
    cap, per = length + 40, 8 // bits
    codes = torch.zeros(b, h, cap, d // per, dtype=torch.uint8)
    key_scale = torch.zeros(b, h, -(-cap // group), d, dtype=sdt)
    value_scale = torch.zeros(b, h, cap, d // group, dtype=sdt)
    tail = torch.zeros(b, h, 100, d, dtype=sdt)
    P = -(-length // B)
    pages = None if dense else torch.arange(8, dtype=torch.int32).expand(b, h, 8).contiguous()
    rec = _Launch()
    kernel, combine = attend_quant._quant_attn_kernel, attend_quant._combine_kernel
    attend_quant._quant_attn_kernel, attend_quant._combine_kernel = rec, _Launch()
    try:
        attend_quant.quantized_attention(
            torch.zeros(b, h * G, d, dtype=qdt),
            pages,
            key_codes=codes,
            key_scale=key_scale,
            key_zero=key_scale,
            value_codes=codes.clone(),
            value_scale=value_scale,
            value_zero=value_scale,
            key_tail=tail,
            value_tail=tail.clone(),
            quantized=(256 - group, length - 70),
            bits=bits,
            group=group,
            slot_valid=torch.ones(b, cap, dtype=torch.bool),
            row_start=torch.zeros(b, dtype=torch.int32),
            length=length,
            scale=0.3,
            page_size=B,
            n_pages=P if dense else None,
            counts=torch.zeros(2, dtype=torch.int64) if counts else None,
            splits=splits,
            num_warps=num_warps,
            tile_pages=tile_pages,
        )
    finally:
        attend_quant._quant_attn_kernel, attend_quant._combine_kernel = kernel, combine
    ((args, kw),) = rec.calls
    return args, kw


def compile_sm90(kernel, args, kw):
    """``triton.compile`` of ``kernel`` specialized as a launch with ``args`` / ``kw`` would be."""
    backend = make_backend(TARGET)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, spec, opts = binder(*args, **dict(kw, debug=False))
    options, signature, constexprs, attrs = kernel._pack_args(backend, dict(kw, debug=False), bound, spec, opts)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=TARGET, options=options.__dict__)


def cubin_resources(cubin: bytes) -> dict:
    """Registers and spilled (stack) bytes a thread, from ``cuobjdump --dump-resource-usage`` (empty
    when this Triton ships no cuobjdump)."""
    tool = os.path.join(BIN, "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return {"registers": int(m.group(1)), "stack_bytes": int(m.group(2))} if m else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--limit", type=int, default=SM90_SHARED, help="shared memory a block may use (bytes)")
    ap.add_argument("--only", default=None, help="comma-separated indices into CASES")
    args = ap.parse_args(argv)
    cases = CASES if args.only is None else [CASES[int(i)] for i in args.only.split(",")]
    print(
        f"Triton {triton.__version__}, sm_90 AOT, shared memory limit {args.limit} B, {len(cases)} launches", flush=True
    )
    bad = 0
    for label, *case in cases:
        t0 = time.time()
        try:
            launch, kw = launch_args(*case)
            kernel = compile_sm90(attend_quant._quant_attn_kernel, launch, kw)
        except Exception as e:  # noqa: BLE001 - report every case
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            bad += 1
            continue
        shared = kernel.metadata.shared
        over = shared > args.limit
        bad += over
        print(
            f"{'OVER' if over else 'ok  '}  {label}: tile_pages={kw['TP']} num_stages={kw['num_stages']} "
            f"num_warps={kw['num_warps']} shared={shared} B {cubin_resources(kernel.asm['cubin'])} "
            f"{time.time() - t0:.1f} s",
            flush=True,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
