#!/usr/bin/env python
"""Worst error of the Jacobi eigensolver (`locks_hf.kernels.eigh.sym_eigh`) against float64 `torch.linalg.eigh`, by
number of sweeps, on the spectra that need the most: clustered and repeated eigenvalues, rank one, +-lambda
pairs, eigenvalues spread over seven decades, and Gram matrices of centered page keys (16 x 16).

Runs on a GPU, or on the CPU under Triton's interpreter (set here when no GPU is present; about a minute for the default 8 matrices a spectrum). Prints a table and writes JSON:

    python scripts/dev/eigh_sweeps.py --sweeps 4,5,6,7,8 --out eigh_sweeps.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from locks_hf.kernels.eigh import default_sweeps, sym_eigh  # noqa: E402


def rotated(g: torch.Generator, evals: torch.Tensor) -> torch.Tensor:
    """``Q diag(evals) Q^T`` for a random orthogonal ``Q`` a row of ``evals``."""
    q, _ = torch.linalg.qr(torch.randn(*evals.shape, evals.shape[-1], generator=g, dtype=torch.float64))
    return (q @ torch.diag_embed(evals.double()) @ q.transpose(-1, -2)).float()


def page_grams(g: torch.Generator, m: int, n: int = 16, d: int = 128) -> torch.Tensor:
    """Gram matrices of the centered keys of ``m`` pages of ``n`` tokens (keys with a common offset)."""
    keys = torch.randn(m, n, d, generator=g) + 2 * torch.randn(m, 1, d, generator=g)
    c = keys - keys.mean(1, keepdim=True)
    return c @ c.transpose(-1, -2)


def cases(seed: int, m: int) -> dict[str, tuple[torch.Tensor, bool, bool]]:
    """name: (``m`` matrices, positive semi-definite, top-4 eigenspace defined); a fixed spectrum in ``m``
    random orientations."""
    g = torch.Generator().manual_seed(seed)

    def fixed(evals: list[float]) -> torch.Tensor:
        return rotated(g, torch.tensor(evals).expand(m, -1))

    return {
        "two 8-fold": (fixed([1.0] * 8 + [2.0] * 8), True, False),
        "clustered": (fixed([1.0] * 6 + [2.0] * 5 + [2.0 + 1e-6] * 5), True, False),
        "rank one": (fixed([0.0] * 15 + [3.0]), True, False),
        "seven decades": (rotated(g, 10.0 ** -(7 * torch.rand(m, 16, generator=g))), True, True),
        "page Gram": (page_grams(g, m), True, True),
        "+-lambda (indefinite)": (fixed([-1.0] * 8 + [1.0] * 8), False, False),
        "random (indefinite)": (rotated(g, torch.randn(m, 16, generator=g)), False, True),
    }


def errors(a: torch.Tensor, sweeps: int) -> dict[str, float]:
    """Worst eigenvalue error (relative to the largest), reconstruction error, loss of orthogonality and
    distance of the top-4 eigenspace from float64's."""
    ref = torch.linalg.eigh(a.double())
    w, v = sym_eigh(a.to("cuda" if torch.cuda.is_available() else "cpu"), sweeps=sweeps)
    w, v = w.cpu().double(), v.cpu().double()
    scale = ref.eigenvalues.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    rec = (v @ torch.diag_embed(w) @ v.mT - a.double()).norm(dim=(-2, -1)) / a.double().norm(dim=(-2, -1))
    top, got = ref.eigenvectors[..., -4:], v[..., -4:]
    return {
        "eigenvalue": ((w - ref.eigenvalues).abs() / scale).max().item(),
        "reconstruction": rec.max().item(),
        "orthogonality": (v.mT @ v - torch.eye(a.shape[-1], dtype=torch.float64)).abs().max().item(),
        "top4_subspace": (got @ got.mT - top @ top.mT).norm(dim=(-2, -1)).max().item(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sweeps", default="4,5,6,7,8")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--matrices", type=int, default=8, help="matrices a spectrum (random orientations)")
    ap.add_argument("--out", default="eigh_sweeps.json")
    args = ap.parse_args()
    mats = cases(args.seed, args.matrices)
    rows = []
    for name, (a, psd, top4) in mats.items():
        for sweeps in (int(s) for s in args.sweeps.split(",")):
            err = errors(a, sweeps)
            if not top4:  # a repeated or clustered top eigenvalue: no top-4 eigenspace to compare
                err["top4_subspace"] = None
            rows.append({"spectrum": name, "psd": psd, "sweeps": sweeps, **err})
    metrics = ("eigenvalue", "reconstruction", "orthogonality", "top4_subspace")
    print(f"default_sweeps(16) = {default_sweeps(16)}")
    print("| spectrum | sweeps | " + " | ".join(metrics) + " |")
    print("|---|---|" + "---|" * len(metrics))
    for r in rows:
        cells = ("-" if r[m] is None else f"{r[m]:.1e}" for m in metrics)
        print(f"| {r['spectrum']} | {r['sweeps']} | " + " | ".join(cells) + " |")
    with open(args.out, "w") as f:
        json.dump(
            {"default_sweeps_16": default_sweeps(16), "seed": args.seed, "matrices": args.matrices, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
