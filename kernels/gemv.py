"""One-token projections (``y = x W^T + b`` for a single row ``x``): a weight-streaming GEMV.

A decode step at batch 1 reads every weight once and does two flops a weight, so its projections are
bound by how fast their weights stream from DRAM. `gemv` gives each program ``BLOCK_N`` output rows and
walks their weights in ``BLOCK_K``-wide tiles of 16-byte loads, every product accumulated in float32 in
registers and summed once at the end; there is no split-K reduction kernel (the rows alone give the launch
enough programs at the shapes of a model's projections), where cuBLAS runs most of a 9B model's batch-1
products as a split-K GEMV and a reduction.

Measured on an H100 (GLM-4-9B's four projections a layer and its LM head, each layer's own weights,
2026-12-07): 6.07 ms a step against cuBLAS's 6.62, 1.06x the weights' read time against 1.16x; the
4096 x 4096 output projection 0.53 ms against 0.68 (docs/performance.md).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch, on_device

#: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` when the caller gives none: one row a program of two warps,
#: 2,048 columns a step, the fastest or within 0.3% of it for each of GLM-4-9B's projections on an H100
#: (`scripts/dev/bench_gemv.py`): small programs share the SMs out evenly whatever the row count, where a
#: tile of 8 or 16 rows leaves a partial last wave (4,608 rows of q/k/v in 576 programs of 8).
DEFAULT_TILE = (1, 2048, 2, 1)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    w_sn,
    b_ptr,
    y_ptr,
    N,
    K,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Program ``i``: outputs ``i*BLOCK_N ...`` of ``y [N]`` from ``x [K]`` and the rows of ``w`` (row stride
    ``w_sn``, unit column stride)."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < N
    # out-of-range rows read row 0 (in bounds, never stored): the row mask stays off the loads
    wrow = w_ptr + tl.where(rmask, rows, 0).to(tl.int64)[:, None] * w_sn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_whole = K - K % BLOCK_K
    for k0 in tl.range(0, k_whole, BLOCK_K, num_stages=STAGES):
        ks = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(wrow + ks[None, :], eviction_policy="evict_first")
        acc += w.to(tl.float32) * tl.load(x_ptr + ks).to(tl.float32)[None, :]
    if not EVEN_K:  # the last, partial tile
        ks = k_whole + tl.arange(0, BLOCK_K)
        w = tl.load(wrow + ks[None, :], mask=(ks < K)[None, :], other=0.0, eviction_policy="evict_first")
        acc += w.to(tl.float32) * tl.load(x_ptr + ks, mask=ks < K, other=0.0).to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rows, y.to(y_ptr.dtype.element_ty), mask=rmask)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """``x @ weight.T + bias`` for one row: ``x [K]``, ``weight [N, K]`` (unit column stride), ``bias [N]``;
    returns ``[N]`` in ``x``'s dtype (or writes ``out``). ``tile``: ``(BLOCK_N, BLOCK_K, num_warps, num_stages)``."""
    if x.dim() != 1 or weight.dim() != 2 or weight.shape[1] != x.shape[0]:
        raise ValueError(f"gemv: x [K] and weight [N, K], got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
    N, K = weight.shape
    if weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError("gemv: weight needs a unit column stride and x must be contiguous")
    if bias is not None and (bias.shape != (N,) or not bias.is_contiguous()):
        raise ValueError(f"gemv: bias must be a contiguous [{N}] tensor, got {tuple(bias.shape)}")
    if any(t is not None and t.device != x.device for t in (weight, bias, out)):
        raise ValueError(f"gemv: x, weight, bias and out on one device, got x on {x.device}, weight on {weight.device}")
    if out is None:
        out = x.new_empty(N)
    elif out.shape != (N,) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"gemv: out must be a contiguous {x.dtype} [{N}] tensor, got {out.dtype} {tuple(out.shape)}")
    block_n, block_k, warps, stages = tile or DEFAULT_TILE
    if block_n & (block_n - 1) or block_k & (block_k - 1) or min(block_n, block_k, warps, stages) < 1:
        raise ValueError(f"gemv: tile (BLOCK_N, BLOCK_K, warps, stages) needs powers of two >= 1, got {tile}")
    block_k = min(block_k, triton.next_power_of_2(K))
    with on_device(x.device):
        launch(
            _gemv_kernel,
            (triton.cdiv(N, block_n),),
            x,
            weight,
            weight.stride(0),
            bias if bias is not None else x,
            out,
            N,
            K,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            HAS_BIAS=bias is not None,
            EVEN_K=K % block_k == 0,
            STAGES=stages,
            num_warps=warps,
        )
    return out
