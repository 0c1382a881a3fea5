"""The batched Jacobi eigensolver (locks_hf.kernels.eigh) against float64 ``torch.linalg.eigh``.

Small batches: without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest), about half a
second per 16x16 matrix.
"""

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from locks_hf.kernels.eigh import sym_eigh  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _eigh(a):
    w, v = sym_eigh(a.to(DEV))
    return w.cpu().double(), v.cpu().double()


def _check(a, w, v, tol=1e-5, rec_tol=None):
    """Eigenvalues (relative to the largest), ascending order, reconstruction (``rec_tol``, default ``3 * tol``)
    and orthogonality."""
    a = a.double()
    n = a.shape[-1]
    want = torch.linalg.eigh(a).eigenvalues
    scale = want.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    assert torch.isfinite(w).all() and torch.isfinite(v).all()
    assert ((w - want).abs() / scale).max() < tol
    assert (w.diff(dim=-1) >= 0).all(), "eigenvalues must be ascending"
    rec = v @ torch.diag_embed(w) @ v.transpose(-1, -2)
    assert ((rec - a).norm(dim=(-2, -1)) / a.norm(dim=(-2, -1)).clamp_min(1e-30)).max() < (rec_tol or 3 * tol)
    assert (v.transpose(-1, -2) @ v - torch.eye(n, dtype=torch.float64)).abs().max() < 3 * tol


def _gram(g, m, d, valid=None, B=16):
    """Gram matrices of centered page keys (pages with an offset; invalid tokens give zero rows)."""
    keys = torch.randn(m, B, d, generator=g) + 2 * torch.randn(m, 1, d, generator=g)
    w = torch.ones(m, B, 1) if valid is None else valid.float().unsqueeze(-1)
    mu = (keys * w).sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1.0)
    c = (keys - mu) * w
    return c @ c.transpose(-1, -2)


def _rotated(g, evals):
    """``Q diag(evals) Q^T`` for random orthogonal ``Q`` (one matrix per row of ``evals``)."""
    q, _ = torch.linalg.qr(torch.randn(*evals.shape, evals.shape[-1], generator=g, dtype=torch.float64))
    return (q @ torch.diag_embed(evals.double()) @ q.transpose(-1, -2)).float()


@pytest.mark.parametrize("d", [32, 64])
def test_page_gram_matrices(d):
    g = torch.Generator().manual_seed(d)
    valid = torch.rand(6, 16, generator=g) > 0.3
    valid[0] = True
    valid[1, 3:] = False  # few real tokens: rank 2, zero rows and columns
    valid[2] = False  # no real token: the zero matrix
    a = _gram(g, 6, d, valid)
    _check(a, *_eigh(a))


def test_top_subspace_of_separated_spectrum():
    g = torch.Generator().manual_seed(1)
    top = torch.tensor([64.0, 16.0, 8.0, 4.0])
    evals = torch.cat([top.expand(4, -1), torch.rand(4, 12, generator=g)], -1)
    a = _rotated(g, evals)
    w, v = _eigh(a)
    _check(a, w, v)
    ref = torch.linalg.eigh(a.double()).eigenvectors[..., -4:]
    got = v[..., -4:]
    proj = got @ got.transpose(-1, -2) - ref @ ref.transpose(-1, -2)
    assert proj.norm(dim=(-2, -1)).max() < 1e-4


def test_degenerate_spectra():
    g = torch.Generator().manual_seed(2)
    evals = torch.tensor(
        [
            [1.0] * 8 + [2.0] * 8,  # two 8-fold eigenvalues
            [1.0] * 6 + [2.0] * 5 + [2.0 + 1e-6] * 5,  # a tight cluster
            [0.0] * 15 + [3.0],  # rank 1
            [-1.0] * 8 + [1.0] * 8,
        ]
    )  # +-lambda pairs: (A + sigma I)^2 must not merge them
    u = torch.randn(16, 1, generator=g)
    a = torch.cat(
        [
            _rotated(g, evals),
            (u @ u.T)[None],
            torch.zeros(1, 16, 16),
            torch.eye(16)[None],
            torch.diag(torch.arange(16.0).flip(0))[None],
        ]
    )  # diagonal, descending
    _check(a, *_eigh(a))


def test_semidefinite_spectra_to_round_off():
    """Positive semi-definite spectra (as the page summaries' Gram matrices) to float32 round-off: a
    reconstruction error under 1e-5, which 6 sweeps miss (1.6e-5 on the 8-fold pair, 1.0e-5 over seven
    decades) and 7 or 8 reach (4.8e-6 at most)."""
    g = torch.Generator().manual_seed(4)
    evals = torch.tensor(
        [
            [1.0] * 8 + [2.0] * 8,
            [1.0] * 6 + [2.0] * 5 + [2.0 + 1e-6] * 5,
            [0.0] * 15 + [3.0],
        ]
    )
    geometric = 10.0 ** -(7 * torch.rand(3, 16, generator=g))  # eigenvalues over seven decades
    valid = torch.rand(4, 16, generator=g) > 0.3
    valid[0] = True
    a = torch.cat([_rotated(g, evals), _rotated(g, geometric), _gram(g, 4, 128, valid)])
    _check(a, *_eigh(a), rec_tol=1e-5)


@pytest.mark.parametrize("n", [2, 4, 8, 32])
def test_other_sizes(n):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(3, n, n, generator=g)
    a = torch.cat([x + x.transpose(-1, -2), _gram(g, 1, 64, B=n)])  # indefinite, and a PSD Gram matrix
    _check(a, *_eigh(a), tol=1e-5 * max(1, n // 16))  # float32 round-off grows with n


def test_drop_in_for_torch_eigh():
    """Batch dimensions kept, the lower triangle read (as ``torch.linalg.eigh``), empty batches."""
    g = torch.Generator().manual_seed(3)
    a = _gram(g, 4, 32).view(2, 2, 16, 16)
    junk = a + torch.randn(a.shape, generator=g).triu(1) * 100  # the upper triangle is ignored
    w, v = _eigh(junk)
    assert w.shape == (2, 2, 16) and v.shape == (2, 2, 16, 16)
    _check(a.flatten(0, 1), w.flatten(0, 1), v.flatten(0, 1))
    w, v = sym_eigh(torch.zeros(0, 3, 16, 16, device=DEV))
    assert w.shape == (0, 3, 16) and v.shape == (0, 3, 16, 16)
    with pytest.raises(ValueError):
        sym_eigh(torch.zeros(2, 12, 12, device=DEV))
