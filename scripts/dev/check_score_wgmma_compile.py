#!/usr/bin/env python
"""Compile the "wgmma" page-scoring kernel (`kernels.score_wgmma`, Gluon) for sm_90 without a GPU: every shape
the tests and benchmarks launch, with its registers, spilled bytes and shared memory.

The kernel asserts at compile time that its unpacked codes reach the tensor-core operand without moving
(`gl.convert_layout(..., assert_trivial=True)`), so a case that compiles takes no shared-memory round trip; with
``--dump DIR`` each case's TTGIR and SASS are written and its opcode counts printed. Pointers are specialised
16-byte aligned, as a launch on the library's tensors is. Must run without ``TRITON_INTERPRET=1``; for Triton 3.6
(the H100/H200 image's):

    pip install --no-deps --target /tmp/triton36 triton==3.6.0
    PYTHONPATH=/tmp/triton36 python scripts/dev/check_score_wgmma_compile.py
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("check_score_wgmma_compile: unset TRITON_INTERPRET (the interpreter does not compile)")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import triton  # noqa: E402
from check_quant_attention_compile import TARGET, cubin_resources  # noqa: E402
from check_score_mma_compile import dump  # noqa: E402

from locks_hf.kernels import score_wgmma  # noqa: E402

#: (rank, G, page size, d, fp16 query): the GLM-4-9B shape at r4i4 and r8i4, then the tests' launches.
CASES = [
    (4, 16, 16, 128, False),
    (8, 16, 16, 128, False),
    (1, 16, 16, 128, False),
    (2, 16, 16, 64, False),
    (4, 12, 16, 128, False),
    (4, 8, 16, 64, True),
    (4, 5, 8, 32, False),
    (8, 16, 32, 256, True),
    (8, 6, 4, 64, False),
]
_POINTERS = {
    "q_ptr": "*bf16",
    "bas": "*i32",
    "bsc": "*bf16",
    "cf": "*i32",
    "csc": "*bf16",
    "mu": "*i32",
    "msc": "*bf16",
    "valid_ptr": "*u8",
    "row_start_ptr": "*i32",
    "n_complete_ptr": "*i32",
    "len_ptr": "*i32",
    "out_ptr": "*fp32",
    "part_ptr": "*fp32",
}


def compile_case(
    rank: int, G: int, B: int, d: int, f16: bool, maxnreg: int | None = None, head_split: int = 1, words: bool = True
):
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = score_wgmma._locks_wgmma_kernel
    names = kernel.arg_names
    GG = 1 << (G - 1).bit_length()
    constexprs = {"G": G, "GG": GG, "HS": head_split, "D": d, "B": B, "R": rank, "F16": f16, "VALID_WORDS": words}
    sig = {}
    for n in names:
        if n in _POINTERS:
            sig[n] = _POINTERS[n].replace("bf16", "fp16") if f16 and n == "q_ptr" else _POINTERS[n]
        else:
            sig[n] = "constexpr" if n in constexprs else ("fp32" if n == "scale" else "i32")
    aligned = {
        (names.index(n),): [["tt.divisibility", 16]] for n in names if n in _POINTERS or n.endswith(("_sb", "_sh"))
    }
    src = GluonASTSource(kernel, sig, {(names.index(k),): v for k, v in constexprs.items()}, aligned)
    options = {"num_warps": 4, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=TARGET, options=options)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="comma-separated indices into CASES")
    ap.add_argument("--maxnreg", type=int, default=None, help="register cap a thread")
    ap.add_argument("--head-split", type=int, default=1, help="programs sharing a group's heads (8+ heads each)")
    ap.add_argument("--valid-bytes", action="store_true", help="the valid flags a byte a token (unaligned rows)")
    ap.add_argument("--trace", action="store_true", help="print a failing case's whole exception chain")
    ap.add_argument("--dump", default=None, help="folder: each case's TTGIR and SASS, and its SASS opcode counts")
    args = ap.parse_args(argv)
    if not score_wgmma.wgmma_available():
        print(f"Triton {triton.__version__} has no Gluon: nothing to compile")
        return 1
    cases = CASES if args.only is None else [CASES[int(i)] for i in args.only.split(",")]
    print(f"Triton {triton.__version__}, sm_90 AOT", flush=True)
    bad = 0
    for rank, G, B, d, f16 in cases:
        label = f"{'fp16' if f16 else 'bf16'} G={G} r{rank}i4 d={d} B={B} split={args.head_split}"
        label += " valid-bytes" if args.valid_bytes else ""
        if (1 << (G - 1).bit_length()) // args.head_split < 8:
            continue
        t0 = time.time()
        try:
            kernel = compile_case(rank, G, B, d, f16, args.maxnreg, args.head_split, not args.valid_bytes)
        except Exception as e:  # noqa: BLE001 - report every case
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:1500]}", flush=True)
            if args.trace:  # the compiler's error names the innermost failing call only in its chain
                traceback.print_exc()
            bad += 1
            continue
        res = cubin_resources(kernel.asm["cubin"])
        print(f"ok    {label}: shared={kernel.metadata.shared} B {res} {time.time() - t0:.1f} s", flush=True)
        if args.dump:
            dump(kernel, os.path.join(args.dump, label.replace(" ", "_").replace("=", "")))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
