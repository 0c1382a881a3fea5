"""Batched eigendecomposition of small symmetric matrices (parallel one-sided Jacobi, one Triton launch).

``sym_eigh`` is a drop-in for ``torch.linalg.eigh`` on a batch ``[..., n, n]`` of float32 symmetric
matrices (n a power of two, 2..32; the summary build uses n = 16): ascending eigenvalues,
eigenvectors as columns, only the lower triangle read. Unlike ``torch.linalg.eigh`` on CUDA it never
synchronises with the host and its grid depends only on the batch size, so it can be captured in a
CUDA graph, and it takes any batch size in one launch.

Method: one-sided (Hestenes) Jacobi on ``U = (A + sigma I) V``, shifted to be positive semi-definite.
Rotating pairs of columns of ``U`` and ``V`` until the columns of ``U`` are orthogonal diagonalises
``V^T (A + sigma I)^2 V``, hence ``A``. A sweep is ``n - 1`` steps of the round-robin
(chess-tournament) ordering: each step pairs every column with another and applies the ``n / 2``
disjoint rotations at once; over a sweep every pair meets once. Only columns move (the partner column
comes from ``tl.gather``), so a step costs ``O(n^2)`` per matrix and, unlike the two-sided
``A <- J^T A J``, never needs ``A``'s rows, which lie across the warp's lanes: for n = 16 a step is
about 130 instructions per warp on sm_90 against about 570 for the two-sided form. Eigenvalues are the
Rayleigh quotients ``v^T A v`` at the end. A fixed number of sweeps (no convergence test) keeps the
launch graph-capturable; 8 sweeps reach float32 round-off for n <= 16 (random Gram matrices,
rank-deficient ones, clustered and repeated eigenvalues, indefinite matrices), 10 for n = 32.
Non-finite input gives unspecified output.

One program (one warp; two for n = 32) holds one matrix in registers. The solver itself is the jit
function `jacobi_eigh` (with `ascending_rank` for the order), which the fused page update
(`page_update`) calls on a Gram matrix it holds in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import launch


def default_sweeps(n: int) -> int:
    """Jacobi sweeps that reach float32 round-off for ``n x n`` matrices (measured, with margin)."""
    return 8 if n <= 16 else 10


@triton.jit
def _partner(i, s, N: tl.constexpr):
    """Round-robin opponent of player ``i`` at round ``s``: ``i + j = 2s (mod N-1)``, player ``N-1`` fixed."""
    M1: tl.constexpr = N - 1
    j = (2 * s + M1 - i) % M1  # operands kept >= 0: the sign convention of % differs between backends
    j = tl.where(j == i, M1, j)
    return tl.where(i == M1, s, j)


@triton.jit
def jacobi_eigh(a, N: tl.constexpr, SWEEPS: tl.constexpr):
    """Eigenvalues ``w [N]`` and eigenvectors ``v [N, N]`` (column ``j`` belongs to ``w[j]``, unsorted) of
    the exactly symmetric float32 ``a [N, N]`` in registers (see `lower_symmetric`)."""
    r = tl.arange(0, N)
    rows = r[:, None] + 0 * r[None, :]
    cols = r[None, :] + 0 * r[:, None]
    eye = rows == cols
    # scale-free: the rotation formulas square entries, which must neither overflow nor go subnormal
    amax = tl.max(tl.max(tl.abs(a), axis=1), axis=0)
    scale = tl.where(amax > 0, amax, 1.0)
    a = a / scale
    # Shift to positive semi-definite (Gershgorin bound): the eigenvectors of (A + sigma I)^2 are those
    # of A only when no two eigenvalues of A + sigma I have opposite signs.
    gersh = tl.sum(tl.where(eye, a, -tl.abs(a)), axis=0)
    sigma = tl.maximum(-tl.min(gersh, axis=0), 0.0)
    u = tl.where(eye, a + sigma, a)  # invariant: U = (A + sigma I) V
    v = tl.where(eye, 1.0, 0.0)
    for _ in range(SWEEPS):
        for s in range(N - 1):
            p = _partner(r, s, N)
            lo = r < p
            at_p = p[None, :] + 0 * rows
            uc = tl.gather(u, at_p, 1)  # column p_j
            vc = tl.gather(v, at_p, 1)
            # the pair's 2x2 block of U^T U: both members get bitwise the same numbers
            nrm = tl.sum(u * u, axis=0)
            nrm_p = tl.sum(uc * uc, axis=0)
            off = tl.sum(u * uc, axis=0)
            diff = tl.where(lo, nrm_p - nrm, nrm - nrm_p)  # |u_hi|^2 - |u_lo|^2
            # t = tan(theta), the smaller root of t^2 + 2 t (diff / 2 off) - 1 = 0, written without
            # dividing by off (zero for an already orthogonal pair: t = 0)
            den = tl.abs(diff) + tl.sqrt(diff * diff + 4.0 * off * off)
            sgn = tl.where(diff < 0, -1.0, 1.0)
            t = tl.where(den > 0, 2.0 * off * sgn / tl.where(den > 0, den, 1.0), 0.0)
            c = 1.0 / tl.sqrt(1.0 + t * t)
            sn = tl.where(lo, -t * c, t * c)  # J[p_j, j]; J[j, j] = c
            u = u * c[None, :] + uc * sn[None, :]
            v = v * c[None, :] + vc * sn[None, :]
    # Eigenvalues as Rayleigh quotients v_j^T A v_j with A itself: U has drifted from (A + sigma I) V by
    # the round-off of every rotation, and sigma would cancel.
    av = tl.zeros([N, N], dtype=tl.float32)
    for k in tl.static_range(N):
        a_col = tl.sum(tl.where(cols == k, a, 0.0), axis=1)
        v_row = tl.sum(tl.where(rows == k, v, 0.0), axis=0)
        av += a_col[:, None] * v_row[None, :]
    w = tl.sum(v * av, axis=0) * scale
    return w, v


@triton.jit
def lower_symmetric(a):
    """The symmetric matrix whose lower triangle is that of ``a [N, N]`` (as ``torch.linalg.eigh`` reads it)."""
    r = tl.arange(0, a.shape[0])
    return tl.where(r[:, None] >= r[None, :], a, tl.trans(a))


@triton.jit
def ascending_rank(w, N: tl.constexpr):
    """Position of each of ``w [N]`` in ascending order (ties: by index): a permutation of ``0..N-1``."""
    r = tl.arange(0, N)
    before = (w[:, None] < w[None, :]) | ((w[:, None] == w[None, :]) & (r[:, None] < r[None, :]))
    return tl.sum(before.to(tl.int32), axis=0)


@triton.jit
def _eigh_kernel(a_ptr, w_ptr, v_ptr, N: tl.constexpr, SWEEPS: tl.constexpr):
    """Eigenpairs of matrix ``program_id`` of ``a [M, N, N]`` into ``w [M, N]`` and ``v [M, N, N]``."""
    base = tl.program_id(0).to(tl.int64) * (N * N)
    r = tl.arange(0, N)
    # the lower triangle only, as torch.linalg.eigh; A is then exactly symmetric
    rows = r[:, None] + 0 * r[None, :]
    cols = r[None, :] + 0 * r[:, None]
    lower = tl.load(a_ptr + base + rows * N + cols)
    upper = tl.load(a_ptr + base + cols * N + rows)
    w, v = jacobi_eigh(tl.where(rows >= cols, lower, upper), N, SWEEPS)
    # ascending order by rank, then a scatter store: no sort pass, no second kernel
    rank = ascending_rank(w, N)
    tl.store(w_ptr + tl.program_id(0).to(tl.int64) * N + rank, w)
    tl.store(v_ptr + base + r[:, None] * N + rank[None, :], v)


def sym_eigh(gram: torch.Tensor, sweeps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``[..., n]`` (ascending) and eigenvectors ``[..., n, n]`` (columns) of ``gram``.

    Float32 symmetric matrices, n a power of two in 2..32; the lower triangle is read. No host
    synchronisation: safe inside a CUDA graph.
    """
    n = gram.shape[-1]
    if gram.shape[-2] != n or n < 2 or n > 32 or n & (n - 1):
        raise ValueError(f"sym_eigh: square matrices of size 2, 4, 8, 16 or 32, got {tuple(gram.shape)}")
    if gram.dtype != torch.float32:
        raise TypeError(f"sym_eigh: float32 matrices, got {gram.dtype}")
    lead = gram.shape[:-2]
    flat = gram.reshape(-1, n, n).contiguous()
    m = flat.shape[0]
    w = torch.empty((*lead, n), dtype=torch.float32, device=gram.device)
    v = torch.empty((*lead, n, n), dtype=torch.float32, device=gram.device)
    if m:
        launch(
            _eigh_kernel,
            (m,),
            flat,
            w,
            v,
            N=n,
            SWEEPS=default_sweeps(n) if sweeps is None else sweeps,
            num_warps=max(1, n * n // 512),
        )
    return w, v
