"""In-place summary of each row's just-completed page during a decode step (one Triton launch).

A static cache's decode step appends one token per row. `update_completed_pages` runs one program per
(row, KV head): with ``n = length - row_start[row]`` tokens in the row, when ``n > 0`` and ``n`` is a
multiple of the page size ``B``, page ``n / B - 1`` has just completed and the program writes its
summary in place; otherwise it returns at once and writes nothing. The grid depends only on the
shapes and the length is read from an ``int32 [1]`` device tensor, so the launch can be captured in a
CUDA graph.

The Locks summary is `build.build_summary` for that one page, fused: float32 centroid over the page's
valid tokens, the Gram matrix ``D D^T`` of the centered keys (exact float32 products), the shared
Jacobi eigensolver (`eigh.jacobi_eigh`, as `eigh.sym_eigh` runs it), the top-r eigenpairs, the basis
``U^T D / sigma`` and coefficients ``U sigma`` (directions with ``sigma <= 1e-3 sigma_max`` zeroed), and
the quantization and layout of `build.store_summary` (shared with the batched build). Quest stores
the per-dimension max / min of the page's valid keys in the key dtype.

``tl.dot`` needs 16 rows: a page of 4 or 8 tokens is padded to 16 zero rows for the two products;
the eigensolver runs on the ``B x B`` block.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, next_pow2, on_device, slot_ok, take_rows
from .build import store_summary, summary_shapes
from .eigh import ascending_rank, default_sweeps, jacobi_eigh, lower_symmetric
from .score import SUMMARY_NAMES

#: Page sizes the kernel builds (the Jacobi eigensolver needs a power of two <= 32).
PAGE_SIZES = (4, 8, 16, 32)


@triton.jit
def _pad_rows(x, NP: tl.constexpr):
    """``x [N, M]`` followed by zero rows up to ``NP`` rows."""
    N: tl.constexpr = x.shape[0]
    if N == NP:
        y = x
    else:
        i = tl.arange(0, NP)
        at = tl.minimum(i, N - 1)[:, None] + 0 * tl.arange(0, x.shape[1])[None, :]
        y = tl.where((i < N)[:, None], tl.gather(x, at, 0), 0.0)
    return y


@triton.jit
def _of_layer(ptrs, layer, LAYERS: tl.constexpr):
    """``ptrs[layer]`` for a tuple of ``LAYERS`` pointers and a layer index known only at run time."""
    p = ptrs[0]
    for j in tl.static_range(1, LAYERS):
        if layer == j:
            p = ptrs[j]
    return p


@triton.jit
def _page_update_kernel(
    k_ptrs,
    k_sb,
    k_sh,
    k_st,
    valid_ptrs,
    valid_sb,
    row_start_ptrs,
    len_ptrs,
    BH,
    H,
    P,
    s0s,
    s1s,
    s2s,
    s3s,
    s4s,
    s5s,
    n_complete_ptrs,
    LAYERS: tl.constexpr,
    D: tl.constexpr,
    B: tl.constexpr,
    BP: tl.constexpr,
    R: tl.constexpr,
    RP: tl.constexpr,
    BITS: tl.constexpr,
    SWEEPS: tl.constexpr,
    QUEST: tl.constexpr,
    N_COMPLETE: tl.constexpr,
    RING: tl.constexpr,
):
    """Program ``(layer, row, head)``: summary of the row's just-completed page into ``s0..s5`` (the buffers
    of ``SUMMARY_NAMES``, contiguous ``[b, H, P, ...]``), nothing when no page has just completed; each
    pointer argument but the strides is a tuple of ``LAYERS`` (one a layer: same shapes and strides);
    with ``N_COMPLETE`` head 0 also writes the row's complete pages (what the scoring reads next). With
    ``RING`` the keys are a ring of that many slots (slot ``s`` at ``s % RING``: a static quantized
    layer's full-precision tail, which holds every slot of a page until it is summarized)."""
    layer = tl.program_id(0) // BH
    prog = tl.program_id(0) % BH
    k_ptr = _of_layer(k_ptrs, layer, LAYERS)
    valid_ptr = _of_layer(valid_ptrs, layer, LAYERS)
    row_start_ptr = _of_layer(row_start_ptrs, layer, LAYERS)
    len_ptr = _of_layer(len_ptrs, layer, LAYERS)
    n_complete_ptr = _of_layer(n_complete_ptrs, layer, LAYERS)
    s0 = _of_layer(s0s, layer, LAYERS)
    s1 = _of_layer(s1s, layer, LAYERS)
    s2 = _of_layer(s2s, layer, LAYERS)
    s3 = _of_layer(s3s, layer, LAYERS)
    s4 = _of_layer(s4s, layer, LAYERS)
    s5 = _of_layer(s5s, layer, LAYERS)
    bb = (prog // H).to(tl.int64)
    hh = prog % H
    length = tl.load(len_ptr)
    rs = tl.load(row_start_ptr + bb)
    n = length - rs
    if N_COMPLETE:
        if hh == 0:
            tl.store(n_complete_ptr + bb, tl.maximum(n, 0) // B)
    if (n <= 0) | (n % B != 0) | (n > P * B):
        return
    page = n // B - 1
    lin = prog.to(tl.int64) * P + page  # page index into the [b, H, P] lead of the summary buffers
    t = tl.arange(0, BP)
    c = tl.arange(0, D)
    slot = rs + page * B + t
    ok = (t < B) & slot_ok(valid_ptr + bb * valid_sb, slot, length)
    at = slot % RING if RING else slot
    keys = tl.load(k_ptr + bb * k_sb + hh * k_sh + at[:, None] * k_st + c[None, :], mask=ok[:, None], other=0.0)
    if QUEST:
        tl.store(s0 + lin * D + c, tl.max(tl.where(ok[:, None], keys, float("-inf")), axis=0))
        tl.store(s1 + lin * D + c, tl.min(tl.where(ok[:, None], keys, float("inf")), axis=0))
    else:
        # as build.fit_pages_eigh on one page: centroid, centered keys, Gram matrix, eigenpairs
        x = keys.to(tl.float32)
        w = ok.to(tl.float32)
        mu = tl.sum(x * w[:, None], axis=0) / tl.maximum(tl.sum(w, axis=0), 1.0)
        cen = (x - mu[None, :]) * w[:, None]  # [BP, D], rows >= B zero
        gram = tl.dot(cen, tl.trans(cen), input_precision="ieee")  # [BP, BP], zero beyond B
        if B < BP:  # its leading B x B block
            gram = tl.trans(take_rows(tl.trans(take_rows(gram, B, BP)), B, BP))
        lam, vec = jacobi_eigh(lower_symmetric(gram), B, SWEEPS)
        # position j of the descending order holds eigenpair src[j]; positions >= min(R, B) are zero
        j = tl.arange(0, RP)
        e = tl.arange(0, B)
        at_j = (B - 1 - ascending_rank(lam, B))[:, None] == j[None, :]  # [B, RP]
        src = tl.sum(tl.where(at_j, e[:, None], 0), axis=0)
        sig = tl.sqrt(tl.maximum(lam, 0.0))
        sig_j = tl.sum(tl.where(at_j, sig[:, None], 0.0), axis=0)
        keep = (j < R) & (j < B) & (sig_j > 1e-3 * tl.max(sig, axis=0))
        inv = tl.where(keep, 1.0 / tl.where(keep, sig_j, 1.0), 0.0)
        u = tl.where(((j < R) & (j < B))[None, :], tl.gather(vec, src[None, :] + 0 * e[:, None], 1), 0.0)  # [B, RP]
        basis = tl.dot(tl.trans(_pad_rows(u, BP)), cen, input_precision="ieee") * inv[:, None]  # [RP, D]
        coef = u * tl.where(keep, sig_j, 0.0)[None, :]  # [B, RP]
        pg = lin + tl.zeros([1], dtype=tl.int64)
        store_summary(pg, pg >= 0, mu[None, :], basis[None, :, :], coef[None, :, :], s0, s1, s2, s3, s4, s5, R, BITS)


def default_warps(B: int, RP: int, d: int) -> int:
    """Warps per program: the fewest without register spills on sm_90 (Triton 3.9, AOT-compiled).

    A page of 16 keys of 128 dims builds in one warp, which keeps the Jacobi sweeps inside the warp
    (as `eigh.sym_eigh` runs them); more warps for larger tiles, 4 to 8 for the 32 x 32 eigensolver.
    """
    if B == 4:
        # one warp, spilling: with more, Triton 3.6 fails to compile the eigensolver's tl.gather for a
        # 4 x 4 matrix ("GatherLoweringHelper(op).isWarpLocal()" in OptimizeThreadLocality; on the H200)
        return 1
    w = max(1, max(B, RP) * d // 2048)
    if B == 8:
        w = max(w, 2)  # one warp spills on the 8 x 8 layouts
    elif B == 32:
        w = max(w, 4 if d <= 64 else 8)
    return min(w, 8)


def _check_summary(
    method: str,
    summary: list[torch.Tensor],
    lead: tuple,
    key_buf: torch.Tensor,
    page_size: int,
    rank: int,
    basis_bits: int,
) -> None:
    names = SUMMARY_NAMES[method]
    d = key_buf.shape[-1]
    if method == "locks":
        shapes = summary_shapes(lead, page_size, d, rank, basis_bits)
        want = [shapes[n] for n in names]
    else:
        want = [((*lead, d), key_buf.dtype)] * len(names)
    if len(summary) != len(names):
        raise ValueError(
            f"update_completed_pages({method!r}): {len(names)} summary tensors {names}, got {len(summary)}"
        )
    for name, t, (shape, dtype) in zip(names, summary, want):
        if tuple(t.shape) != tuple(shape) or t.dtype != dtype or not t.is_contiguous() or t.device != key_buf.device:
            raise ValueError(
                f"update_completed_pages({method!r}): {name} must be a contiguous {dtype} tensor of "
                f"shape {tuple(shape)} on {key_buf.device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def update_completed_pages(
    method: str,
    key_buf: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    summary: list[torch.Tensor],
    *,
    page_size: int,
    rank: int,
    basis_bits: int,
    num_warps: int | None = None,
    n_complete: torch.Tensor | None = None,
    ring: int = 0,
    sweeps: int | None = None,
) -> None:
    """Summarize, in place, each (row, KV head)'s page that the newest token completed.

    ``key_buf [b, h, cap, d]`` (last dim contiguous), ``slot_valid [b, cap]`` bool, ``row_start``
    int32 ``[b]`` (page ``p`` of row ``i`` holds slots ``row_start[i] + p*B ...``), ``length`` int32
    ``[1]`` on the device (slots written). ``summary``: the contiguous ``[b, h, P, ...]`` buffers named
    by ``SUMMARY_NAMES[method]`` (the layout of `build.summary_shapes` for ``"locks"``, key-dtype
    ``[b, h, P, d]`` max / min for ``"quest"``); ``"oracle"`` keeps none and launches nothing. A row
    with ``n = length - row_start`` tokens gets page ``n / B - 1`` written when ``n > 0`` is a multiple
    of ``B``; every other page, and every other row, is left as it was. No host synchronisation.
    ``n_complete`` (int32 ``[b]``, optional): overwritten with each row's complete pages,
    ``max(length - row_start, 0) // B`` (so that a decode step needs no launch of its own for it).
    ``ring`` > 0: ``key_buf [b, h, ring, d]`` is a ring holding slot ``s`` at ``s % ring`` (a static
    quantized layer's full-precision tail); the summaries keep the capacity's page axis. ``sweeps``: the
    eigensolver's Jacobi sweeps (``None``: `eigh.default_sweeps`, float32 round-off).
    """
    update_completed_pages_of_layers(
        method,
        [key_buf],
        [slot_valid],
        [row_start],
        [length],
        [summary],
        page_size=page_size,
        rank=rank,
        basis_bits=basis_bits,
        num_warps=num_warps,
        n_complete=None if n_complete is None else [n_complete],
        ring=ring,
        sweeps=sweeps,
    )


def update_completed_pages_of_layers(
    method: str,
    key_bufs: list[torch.Tensor],
    slot_valid: list[torch.Tensor],
    row_start: list[torch.Tensor],
    length: list[torch.Tensor],
    summaries: list[list[torch.Tensor]],
    *,
    page_size: int,
    rank: int,
    basis_bits: int,
    num_warps: int | None = None,
    n_complete: list[torch.Tensor] | None = None,
    ring: int = 0,
    sweeps: int | None = None,
) -> None:
    """`update_completed_pages` of several layers in one launch: entry ``i`` of each list is layer ``i``'s
    argument there. The layers share one device, shapes, dtypes and strides (a static cache's layers
    do), each with its own buffers and lengths; ``n_complete`` is ``None`` or one tensor a layer."""
    if method not in SUMMARY_NAMES:
        raise ValueError(f"update_completed_pages: unknown method {method!r}")
    layers = len(key_bufs)
    given: dict[str, list] = {
        "slot_valid": slot_valid,
        "row_start": row_start,
        "length": length,
        "summaries": summaries,
        **({} if n_complete is None else {"n_complete": n_complete}),
    }
    for name, items in given.items():
        if len(items) != layers:
            raise ValueError(f"update_completed_pages: {layers} key buffers but {len(items)} {name} (one a layer)")
    if not SUMMARY_NAMES[method]:
        if n_complete is not None:
            raise ValueError(
                f"update_completed_pages({method!r}): keeps no summary and launches nothing, so it "
                "cannot write n_complete"
            )
        return
    if layers == 0:
        return
    key_buf = key_bufs[0]
    for i in range(layers):
        _check_layer(
            method,
            key_bufs[i],
            slot_valid[i],
            row_start[i],
            length[i],
            summaries[i],
            None if n_complete is None else n_complete[i],
            page_size=page_size,
            rank=rank,
            basis_bits=basis_bits,
            ring=ring,
            sweeps=sweeps,
        )
        same = (
            key_bufs[i].shape == key_buf.shape
            and key_bufs[i].stride() == key_buf.stride()
            and key_bufs[i].dtype == key_buf.dtype
            and key_bufs[i].device == key_buf.device
            and slot_valid[i].shape == slot_valid[0].shape
            and slot_valid[i].stride() == slot_valid[0].stride()
            and slot_valid[i].device == key_buf.device
            and [t.shape for t in summaries[i]] == [t.shape for t in summaries[0]]
        )
        if not same:
            raise ValueError(
                f"update_completed_pages: layer {i}'s keys, valid flags or summary differ from layer 0's in "
                f"shape, strides, dtype or device ({key_bufs[i].dtype} {tuple(key_bufs[i].shape)} on "
                f"{key_bufs[i].device} against {key_buf.dtype} {tuple(key_buf.shape)} on {key_buf.device}): "
                "one launch serves layers of one layout"
            )
    b, h, _, d = key_buf.shape
    summary = summaries[0]
    P = summary[0].shape[2] if summary and summary[0].dim() > 2 else 0
    if b * h == 0 or P == 0:
        return
    valid = [t.view(torch.uint8) if t.dtype == torch.bool else t for t in slot_valid]
    names = len(summary)
    ptrs = [tuple(s[j] if j < names else s[0] for s in summaries) for j in range(6)]
    locks = method == "locks"
    RP = max(16, next_pow2(rank)) if locks else 16
    if num_warps is None:
        num_warps = default_warps(page_size, RP, d)
    with on_device(key_buf.device):
        launch(
            _page_update_kernel,
            (layers * b * h,),
            tuple(key_bufs),
            key_buf.stride(0),
            key_buf.stride(1),
            key_buf.stride(2),
            tuple(valid),
            valid[0].stride(0),
            tuple(row_start),
            tuple(length),
            b * h,
            h,
            P,
            *ptrs,
            tuple(row_start if n_complete is None else n_complete),
            LAYERS=layers,
            D=d,
            B=page_size,
            BP=max(16, page_size),
            R=rank if locks else 1,
            RP=RP,
            BITS=basis_bits if locks else 8,
            SWEEPS=default_sweeps(page_size) if sweeps is None else sweeps,
            QUEST=not locks,
            N_COMPLETE=n_complete is not None,
            RING=ring,
            num_warps=num_warps,
        )


def _check_layer(
    method: str,
    key_buf: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    summary: list[torch.Tensor],
    n_complete: torch.Tensor | None,
    *,
    page_size: int,
    rank: int,
    basis_bits: int,
    ring: int,
    sweeps: int | None,
) -> None:
    """One layer's arguments of `update_completed_pages`, refused with what to change."""
    b, h, _, d = key_buf.shape
    if n_complete is not None and (
        n_complete.dtype != torch.int32 or n_complete.numel() != b or not n_complete.is_contiguous()
    ):
        raise ValueError(
            f"update_completed_pages: n_complete must be a contiguous int32 [{b}] tensor, got "
            f"{n_complete.dtype} {tuple(n_complete.shape)}"
        )
    B = page_size
    if B not in PAGE_SIZES:
        raise ValueError(f"update_completed_pages: page_size in {PAGE_SIZES}, got {B}")
    if d < 16 or d & (d - 1) or key_buf.stride(-1) != 1 or slot_valid.stride(-1) != 1:
        raise ValueError(
            f"update_completed_pages: key head dim a power of two >= 16, contiguous; got {d} "
            f"(stride {key_buf.stride(-1)})"
        )
    if method == "locks" and (basis_bits not in (2, 4, 8) or rank < 1):
        raise ValueError(f"update_completed_pages: basis_bits in (2, 4, 8) and rank >= 1, got {basis_bits}, {rank}")
    if sweeps is not None and sweeps < 1:
        raise ValueError(f"update_completed_pages: sweeps must be >= 1 (None: the default), got {sweeps}")
    if ring < 0 or ring & (ring - 1) or (ring and key_buf.shape[2] != ring):
        raise ValueError(f"update_completed_pages: ring must be 0 or the power-of-two slots of key_buf, got {ring}")
    if row_start.dtype != torch.int32 or length.dtype != torch.int32 or length.numel() != 1:
        raise ValueError("update_completed_pages: row_start int32 [b] and length int32 [1] tensors")
    P = summary[0].shape[2] if summary and summary[0].dim() > 2 else 0
    _check_summary(method, summary, (b, h, P), key_buf, B, rank, basis_bits)
