#!/usr/bin/env python
"""Compile the selection and attention kernels for sm_90 without a GPU and report their registers.

Triton's interpreter (the CPU tests) accepts programs the compiler rejects; this runs the compiler
itself (the PTX and cubin of ``triton.compile`` for an H100/H200 target, with the ptxas that ships
with Triton) for the specializations a decode step uses at the GLM-4-9B and Llama-3.1-8B shapes,
and reads each kernel's registers and spilled (stack) bytes a thread from the cubin (``cuobjdump
--dump-resource-usage``). A kernel at the 255-register cap need not spill: only stack bytes count.
Exit status 1 when a kernel does not compile or spills. Must run without ``TRITON_INTERPRET=1``.

    python scripts/dev/check_kernels_compile.py
    PYTHONPATH=/tmp/triton36 python scripts/dev/check_kernels_compile.py   # the H200's Triton 3.6
"""

from __future__ import annotations

import os
import struct
import sys

if os.environ.get("TRITON_INTERPRET") == "1":
    raise SystemExit("check_kernels_compile: unset TRITON_INTERPRET (the interpreter does not compile)")

import triton  # noqa: E402
from check_quant_attention_compile import cubin_resources  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from locks_hf.kernels import attend, select  # noqa: E402

I32, F32 = "*i32", "*fp32"
#: EIATTR_REGCOUNT in a cubin's .nv.info section (format EIFMT_SVAL: function index, count).
_REGCOUNT = 0x2F


def cubin_registers(cubin: bytes) -> int | None:
    """Registers per thread of the (single) kernel of an ELF cubin."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = sections[shstrndx][4]
    for name, _, _, _, off, size in sections:
        label = cubin[names + name : cubin.index(b"\0", names + name)]
        if not label.startswith(b".nv.info"):
            continue
        p = off
        while p < off + size:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 4:  # EIFMT_SVAL: a 2-byte size, then the value
                n = struct.unpack_from("<H", cubin, p + 2)[0]
                if attr == _REGCOUNT:
                    return struct.unpack_from("<II", cubin, p + 4)[1]
                p += 4 + n
            else:  # EIFMT_HVAL / BVAL: 4 bytes; NVAL: 2
                p += 4 if fmt in (2, 3) else 2
    return None


def compile_sm90(
    fn, pointers: dict[str, str], constants: dict, floats=(), num_warps: int = 4
) -> tuple[int | None, int | None]:
    """Compile ``fn`` (every other argument an int32 scalar): its registers and spilled bytes a thread
    (``None`` spilled bytes where this Triton ships no cuobjdump)."""
    signature, constexprs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            constexprs[(i,)] = constants[name]
        else:
            signature[name] = pointers.get(name, "fp32" if name in floats else "i32")
    kernel = triton.compile(
        ASTSource(fn=fn, signature=signature, constexprs=constexprs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps},
    )
    cubin = kernel.asm["cubin"]
    return cubin_registers(cubin), cubin_resources(cubin).get("stack_bytes")


def cases():
    att = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "sel_ptr": I32,
        "valid_ptr": "*u8",
        "row_start_ptr": I32,
        "len_ptr": I32,
        "part_o_ptr": F32,
        "part_l_ptr": F32,
        "out_ptr": "*bf16",
        "count_ptr": "*i64",
        "row_count_ptr": "*i64",
        "pad_ptr": I32,
        "sem_ptr": I32,
    }
    for G, dense, fused in ((16, False, True), (4, False, True), (16, True, True), (16, False, False)):
        yield (
            f"attention G={G} dense={dense} fused={fused}",
            attend._sparse_attn_kernel,
            att,
            dict(
                G=G,
                GP=max(16, G),
                D=128,
                B=16,
                TP=4,
                SPLIT=True,
                DOT_PREC="tf32",
                DENSE=dense,
                COUNT=True,
                ROW_COUNT=True,
                CONTEXT=True,
                FUSED=fused,
                SB=2 if G == 16 else 4,
            ),
            ("scale",),
            4,
        )
    sel = {
        n: I32
        for n in (
            "row_start_ptr", "len_ptr", "k_ptr", "key_ptr", "page_ptr", "key2_ptr", "page2_ptr", "tick_ptr",
            "out_ptr", "list_ptr",
        )
    }  # fmt: skip
    sel.update(score_ptr=F32, part_ptr=F32, mask_ptr="*i8")
    # The selection launches of a decode step at 512K (32,774 pages of a static cache of 512K tokens plus
    # headroom, budget 2,048): GLM-4-9B's two KV heads in 1,024-page chunks merged 8 at a time (33 chunks: 5
    # group lists, merged in tiles of 512 and 128 entries), with and without the page mask it marks; the
    # Llama-3.1-8B shape's 8 KV heads in 2,048-page chunks (17 lists: tiles of 2,048 and 128); Quest's per-head
    # rows at the GLM-4-9B shape (17 lists a head, then the union of 16 heads' lists). The partials' remainder
    # tile: none (512 a row), one (513) and nearly a whole step's. None may spill. (Triton 3.6's ptxas builds the
    # Llama-3.1-8B shape's chunk with a one-partial remainder tile, 1,025 partials a row, at 128 registers with 8
    # spilled bytes, stored once before the partials' loops and loaded once after them; Triton 3.9's at 148 with
    # none. The 512K launch folds 513 partials in one step: no remainder tile, no spill.)
    for G, GG, CH, GRP, M, per_head, marks in (
        (16, 16, 1024, 8, 512, False, (False, True)),
        (4, 4, 2048, 0, 2048, False, (True,)),
        (16, 16, 2048, 0, 2048, True, (True,)),
    ):
        nbp = select.default_partial_block(GG)
        for nbr in (0, 1, nbp // 2):
            for mark in marks:
                yield (
                    f"selection G={G} chunks {CH} groups {GRP} per_head={per_head} mark={mark} partials tile "
                    f"{nbp} remainder tile {nbr}",
                    select._select_kernel,
                    sel,
                    dict(
                        PER_HEAD=per_head, G=G, GG=GG, B=16, CH=CH, KP=128, NBP=nbp, NBR=nbr, GRP=GRP, M=M, MT=128,
                        MARK=mark, MB=select.MARK_BLOCK, N=2048 if per_head else 128,
                    ),
                    (),
                    8,
                )  # fmt: skip
    yield (
        "page mask from lists",
        select._list_mask_kernel,
        {"list_ptr": I32, "mask_ptr": "*i8"},
        dict(BLOCK=4096, WB=128),
        (),
        4,
    )
    yield (
        "attention merge",
        attend._combine_kernel,
        {"part_o_ptr": F32, "part_l_ptr": F32, "out_ptr": "*bf16"},
        dict(G=16, D=128, SBLK=32),
        (),
        4,
    )


def main() -> int:
    bad = 0
    for label, fn, pointers, constants, floats, warps in cases():
        try:
            regs, spilled = compile_sm90(fn, pointers, constants, floats, warps)
        except Exception as e:
            print(f"FAIL  {label}: {type(e).__name__}: {str(e)[:500]}", flush=True)
            bad += 1
            continue
        if spilled is None:
            print(f"?     {label}: {regs} registers (spills unknown: this Triton ships no cuobjdump)", flush=True)
            continue
        bad += spilled > 0
        print(f"{'SPILL' if spilled else 'ok   '} {label}: {regs} registers, {spilled} bytes spilled", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
