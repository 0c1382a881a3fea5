#!/usr/bin/env python
"""Offline study of page selection at tight budgets (b = 64 / 128 / 256): which candidate score and
which softmax normaliser let exact re-ranking reach the oracle's pages (docs/eval/tight_budget.md).

Two steps, so that many variants are scored on the same decode steps without a prefill each:

``capture`` prefills RULER records densely (as ``locks-hf-eval fidelity`` does), decodes ``--steps``
greedy tokens with full attention and saves, per record, every full-attention layer's keys and the
decode queries (``<out>/<record id>.pt``);

``study`` scores, per (record, layer, step, budget), the exact-LSE page recall against the oracle
(share-average of exact page LSEs, sink and recent forced) of:

* plain Locks (r4i4, r8i4, r4i4 with a Hadamard-rotated int4 basis: keys and query rotated by the
  same orthonormal matrix before the summary is fitted and quantized, so only quantization changes);
* exact re-ranking (`locks_hf.selectors.rerank.rerank_pages`, the library's rule) with ``m * k``
  candidates, ``m`` in 1..16, and as variants of its normaliser: no tail shift, the short list alone,
  the exact normaliser (an upper reference: it reads every key);
* other candidate scores for the short list (``m = 4``), each with the library's normaliser: the
  Cauchy-Schwarz residual bound ``LSE_t(est_t + scale * |q_perp| |e_t|)`` with one stored byte per
  token of residual norm ``|e_t| = |k_t - k_hat_t|`` (``k_hat`` the dequantized reconstruction,
  ``q_perp`` the query off the page's basis), blends ``est_t + lam * bound_t``, the Gaussian residual
  correction ``est_t + scale^2 |q_perp|^2 |e_t|^2 / (2 (d - r))``, the per-token max, and the group
  max of the heads' shares instead of their average;
* a residual-aware tail for the normaliser: the off-list pages shifted by a per-head least-squares
  fit of (exact - estimate) on the Gaussian correction over the list.

Prints one table per budget and writes ``<out>/study.json``.

    python scripts/dev/tight_budget_study.py capture --tasks niah_single_1,vt --num-samples 4 --steps 16 --out runs/cap
    python scripts/dev/tight_budget_study.py study --captures runs/cap --out runs/cap
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

import torch

from locks_hf.selectors import combine_group
from locks_hf.selectors.rerank import rerank_pages
from locks_hf.summaries import build_summary, dequantize_summary

B = 16
NEG = float("-inf")
SUMMARIES = {"r4i4": (4, False), "r8i4": (8, False), "r4i4-hadamard": (4, True)}
MULTIPLES = (1, 2, 4, 8, 16)
LAMBDAS = (0.05, 0.1, 0.2, 0.3)


def capture(args) -> None:
    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.cli import load_any_model
    from locks_hf.eval.fidelity import capture_decode

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model, tok = load_any_model(args.model)
    bench = RulerBenchmark(tok, args.tasks.split(","), [args.length], num_samples=args.num_samples)
    for rec in bench.records():
        path = out / f"{rec['id']}.pt"
        if path.exists():
            continue
        with torch.no_grad():
            caps, cache = capture_decode(model, bench.prompt_ids(rec, tok), steps=args.steps, page_size=B)
        keys = {c.layer: cache.layers[c.layer].keys[0, 0].clone() for c in caps}  # one KV head (Gemma 3 270M)
        torch.save(
            {"id": rec["id"], "keys": keys, "steps": [(c.layer, c.length, c.query[0], c.scale) for c in caps]}, path
        )
        print(rec["id"], flush=True)


def hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def reconstruction(keys: torch.Tensor, rank: int, rotate: bool):
    """Complete pages of ``keys [T, d]`` as ``[n, B, d]``, their dequantized int4 rank-r reconstruction
    and orthonormal bases of the dequantized basis rows ``[n, d, r]`` (original coordinates)."""
    n, d = keys.shape[0] // B, keys.shape[1]
    k = keys[: n * B].double().view(n, B, d)
    rot = hadamard(d) if rotate else torch.eye(d, dtype=torch.float64)
    s = build_summary((k @ rot.T)[None, None].float(), torch.ones(1, 1, n, B, dtype=torch.bool), rank, 4)
    mu, basis, coef = dequantize_summary(s, 4, torch.float64)
    k_hat = (mu[0, 0, :, None] + coef[0, 0] @ basis[0, 0]) @ rot
    return k, k_hat, torch.linalg.qr((basis[0, 0] @ rot).transpose(-1, -2))[0]


def shares(scores: torch.Tensor, cand: torch.Tensor, rule: str = "share_average") -> torch.Tensor:
    """One group score per page from ``scores [G, P]`` (``cand [P]``)."""
    return combine_group(scores[None, None], cand[None, None], rule)[0, 0]


def top(score: torch.Tensor, pool: torch.Tensor, n: int) -> torch.Tensor:
    order = torch.sort(score.masked_fill(~pool, NEG), descending=True, stable=True).indices[:n]
    return torch.zeros_like(pool).index_fill_(0, order, True) & pool


def lse(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.masked_fill(~mask[None], NEG), -1)


def pick(sub: torch.Tensor, z: torch.Tensor, listed: torch.Tensor, free: int) -> torch.Tensor:
    """The best ``free`` listed pages by share-average with per-head normalisers ``z [G]``."""
    return top(torch.exp(sub - z[:, None]).mean(0), listed, free)


def study(args) -> None:
    torch.set_num_threads(args.threads)
    recall = defaultdict(list)
    files = sorted(Path(args.captures).glob("*.pt"))
    for path in files:
        data = torch.load(path)
        for layer, keys in data["keys"].items():
            d = keys.shape[1]
            fits = {name: reconstruction(keys, r, rot) for name, (r, rot) in SUMMARIES.items()}
            for lay, length, q, scale in data["steps"]:
                if lay == layer:
                    _score_step(recall, fits, keys, length, q.double(), scale, d)
        print(path.name, flush=True)
    table = {" ".join(map(str, k)): 100 * sum(v) / len(v) for k, v in recall.items()}
    table["steps x layers"] = len(recall[("r4i4", 64, "plain")])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "study.json").write_text(json.dumps(table, indent=1) + "\n")
    for key, value in table.items():
        print(f"{key}: {value:.1f}")


def _score_step(recall, fits, keys, length, q, scale, d) -> None:
    P, n = math.ceil(length / B), length // B
    paged = torch.nn.functional.pad(keys[:length].double(), (0, 0, 0, P * B - length)).view(P, B, d)
    valid = (torch.arange(P * B) < length).view(P, B)
    exact = torch.logsumexp((scale * torch.einsum("gd,pid->gpi", q, paged)).masked_fill(~valid[None], NEG), -1)
    complete = torch.arange(P) < n
    forced = torch.zeros(P, dtype=torch.bool)
    forced[[0, P - 1]] = True
    cand = complete & ~forced
    for name, (k, k_hat, basis) in fits.items():
        est_t = scale * torch.einsum("gd,pid->gpi", q, k_hat[:n])  # [G, n, B]
        est = torch.nn.functional.pad(torch.logsumexp(est_t, -1), (0, P - n), value=NEG)
        err = (k[:n] - k_hat[:n]).norm(dim=-1)
        err = torch.round(err / err.amax(-1, keepdim=True).clamp_min(1e-30) * 255) * err.amax(-1, keepdim=True) / 255
        q_perp = q.norm(dim=-1)[:, None] ** 2 - torch.einsum("gd,ndr->gnr", q, basis[:n]).norm(dim=-1) ** 2
        bound_t = scale * q_perp.clamp_min(0).sqrt()[:, :, None] * err[None]  # [G, n, B]
        gauss_t = bound_t**2 / (2 * (d - basis.shape[-1]))
        for slots in (4, 8, 16):
            if P <= slots:
                continue
            budget = slots * B
            oracle = top(shares(exact, cand), cand, slots - 2)

            def rec(sel, _o=oracle):
                return (sel & _o & cand).sum().item() / _o.sum().item()

            recall[(name, budget, "plain")].append(rec(top(shares(est, cand), cand, slots - 2)))
            for m in MULTIPLES:
                sel = rerank_pages(
                    est[None, None],
                    paged[None, None],
                    valid[None, None],
                    q[None, None],
                    scale,
                    complete[None],
                    slots,
                    m * slots,
                    "share_average",
                )[0, 0]
                recall[(name, budget, f"rr{m}")].append(rec(sel))
                listed = top(shares(est, cand), cand, m * slots)
                recall[(name, budget, f"rr{m} candidates")].append(rec(listed))
                sub = torch.where(listed[None], exact, est)
                tail = cand & ~listed
                head = lse(exact, listed)
                shifted = torch.logaddexp(head, lse(est, tail) + (exact - est)[:, listed].mean(-1))
                # the library's rule restated here (equal but for float ties)
                recall[(name, budget, f"rr{m} = restated")].append(
                    float(torch.equal(pick(sub, shifted, listed, slots - 2), sel & cand))
                )
                for variant, z in (
                    ("no shift", torch.logaddexp(head, lse(est, tail))),
                    ("list only", head),
                    ("exact normaliser", lse(exact, cand)),
                ):
                    recall[(name, budget, f"rr{m} {variant}")].append(rec(pick(sub, z, listed, slots - 2)))
                if name == "r4i4" and m in (4, 8):
                    gauss = torch.nn.functional.pad(torch.logsumexp(est_t + gauss_t, -1), (0, P - n), value=NEG)
                    recall[(name, budget, f"rr{m} residual tail")].append(
                        rec(pick(sub, _residual_tail(exact, est, gauss - est, listed, tail), listed, slots - 2))
                    )
            if name != "r4i4":
                continue
            scores = {"bound": est_t + bound_t, "gauss": est_t + gauss_t, "max": None}
            scores.update({f"blend{lam}": est_t + lam * bound_t for lam in LAMBDAS})
            for variant, s_t in scores.items():
                s = est_t.amax(-1) if s_t is None else torch.logsumexp(s_t, -1)
                listing = shares(torch.nn.functional.pad(s, (0, P - n), value=NEG), cand)
                _candidate_variant(recall, (name, budget, f"rr4 by {variant}"), listing, exact, est, cand, slots, rec)
            by_max = torch.softmax(est.masked_fill(~cand[None], NEG), -1).nan_to_num(0).amax(0)
            _candidate_variant(
                recall, (name, budget, "rr4 by group max of shares"), by_max, exact, est, cand, slots, rec
            )


def _candidate_variant(recall, key, listing, exact, est, cand, slots, rec) -> None:
    """A short list of 4k pages by ``listing``, then the library's final pick on it (`rerank_pages`:
    exact scores on the list, the rest shifted by the list's mean gap)."""
    listed = top(listing, cand, 4 * slots)
    recall[(*key[:2], key[2] + " candidates")].append(rec(listed))
    tail = cand & ~listed
    z = torch.logaddexp(lse(exact, listed), lse(est, tail) + (exact - est)[:, listed].mean(-1))
    recall[key].append(rec(pick(torch.where(listed[None], exact, est), z, listed, slots - 2)))


def _residual_tail(exact, est, corr, listed, tail) -> torch.Tensor:
    """Per-head normalisers with the off-list pages shifted by ``a + c * corr``, ``(a, c)`` fitted per
    head by least squares of (exact - estimate) on ``corr`` over the list."""
    gap, x = (exact - est)[:, listed], corr[:, listed]
    xm, gm = x.mean(-1, keepdim=True), gap.mean(-1, keepdim=True)
    c = ((x - xm) * (gap - gm)).sum(-1, keepdim=True) / ((x - xm) ** 2).sum(-1, keepdim=True).clamp_min(1e-12)
    c = c.clamp(0, 2)
    return torch.logaddexp(lse(exact, listed), lse(est + gm - c * xm + c * corr, tail))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--model", default="gemma3-270m")
    c.add_argument("--tasks", default="niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,vt")
    c.add_argument("--length", type=int, default=4096)
    c.add_argument("--num-samples", type=int, default=4)
    c.add_argument("--steps", type=int, default=16)
    c.add_argument("--threads", type=int, default=1)
    c.add_argument("--out", required=True)
    s = sub.add_parser("study")
    s.add_argument("--captures", required=True)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    {"capture": capture, "study": study}[args.cmd](args)


if __name__ == "__main__":
    main()
