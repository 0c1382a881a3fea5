"""Selection-fidelity metrics vs brute force on random tensors, and capture on a tiny model."""

import math

import pytest
import torch

from locks_hf.config import LocksConfig
from locks_hf.eval.arms import parse_arms
from locks_hf.eval.fidelity import arm_selection, capture_decode, capture_metrics, selection_metrics


def _rand(b=1, h=2, G=3, P=12, B=4, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, P, B, d, generator=g) * 2
    values = torch.randn(b, h, P, B, d, generator=g)
    valid = torch.ones(b, 1, P, B, dtype=torch.bool)
    valid[..., -1, 2:] = False  # a partial last page
    query = torch.randn(b, h, G, d, generator=g)
    return keys, values, valid, query


def _brute(keys, values, valid, query, scale, selected):
    """Loops: mass on S and |o_S - o| / |o| per (b, h), averaged over the group's heads."""
    b, h, P, B, d = keys.shape
    G = query.shape[2]
    mass = torch.zeros(b, h)
    err = torch.zeros(b, h)
    for bi in range(b):
        for hi in range(h):
            for g in range(G):
                toks = [(p, i) for p in range(P) for i in range(B) if valid[bi, 0, p, i]]
                lg = torch.tensor(
                    [scale * float(query[bi, hi, g].double() @ keys[bi, hi, p, i].double()) for p, i in toks],
                    dtype=torch.float64,
                )
                w = torch.softmax(lg, 0)
                vals = torch.stack([values[bi, hi, p, i].double() for p, i in toks])
                o = w @ vals
                insel = torch.tensor([bool(selected[bi, hi, p]) for p, _ in toks])
                mass[bi, hi] += float(w[insel].sum()) / G
                ws = torch.softmax(lg.masked_fill(~insel, -math.inf), 0)
                err[bi, hi] += float((ws @ vals - o).norm() / o.norm()) / G
    return mass, err


def test_metrics_match_brute_force():
    keys, values, valid, query = _rand()
    scale = 0.37
    g = torch.Generator().manual_seed(3)
    selected = torch.rand(1, 2, 12, generator=g) < 0.4
    selected[..., 0] = True
    forced = torch.zeros_like(selected)
    m = selection_metrics(keys, values, valid, query, scale, selected, selected, forced)
    mass, err = _brute(keys, values, valid, query, scale, selected)
    assert torch.allclose(m["mass"].float(), mass, atol=1e-5)
    assert torch.allclose(m["rel_err"].float(), err, atol=1e-5)
    assert torch.allclose(m["excl_mass"], 1 - m["mass"])
    _, excl_err = _brute(keys, values, valid, query, scale, ~selected)
    assert torch.allclose(m["excl_err"].float(), excl_err, atol=1e-5)


def test_full_selection_and_oracle_recall():
    keys, values, valid, query = _rand(seed=1)
    scale = 0.5
    everything = torch.ones(1, 2, 12, dtype=torch.bool)
    m = selection_metrics(keys, values, valid, query, scale, everything, everything, torch.zeros_like(everything))
    assert torch.allclose(m["mass"], torch.ones_like(m["mass"]))
    assert float(m["rel_err"].max()) < 1e-12
    assert torch.isnan(m["excl_err"]).all()  # nothing left to attend

    cfg = LocksConfig(selector="oracle", page_size=4, rank=2, budget=24)  # k = 6 slots, 4 free
    sel, forced = arm_selection(cfg, keys, valid, 11, query, scale)
    assert int(sel[0, 0].sum()) == 6 and bool(forced[0, 0, 0]) and bool(forced[0, 0, -1])
    m = selection_metrics(keys, values, valid, query, scale, sel, sel, forced)
    assert torch.allclose(m["recall"], torch.ones_like(m["recall"]))
    # a different selection has recall < 1 and keeps less mass than the oracle's share-average pick on average
    other = forced | torch.zeros_like(sel).index_fill_(2, torch.tensor([1, 2, 3, 4]), True)
    m2 = selection_metrics(keys, values, valid, query, scale, other, sel, forced)
    assert float(m2["recall"].mean()) < 1.0


def test_capture_on_tiny_model():
    from locks_hf.models import tiny_model

    model = tiny_model("llama", vocab_size=256)
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(0))
    caps, cache = capture_decode(model, ids, steps=3, page_size=16)
    n_layers = len(cache.locks_layers)
    assert len(caps) == 3 * n_layers and caps[0].length == 151 and caps[-1].length == 153
    arms = parse_arms(["full", "oracle", "locks-r4i4", "quest", "shared_basis-r4", "shared_all-r6"], [32, 64])
    res = capture_metrics(caps[0], cache, arms, fit_length=caps[0].length)
    assert res["full"]["mass"] == pytest.approx(1.0) and res["full"]["rel_err"] < 1e-9
    assert res["oracle-b64"]["recall"] == pytest.approx(1.0)
    assert res["oracle-b32"]["attended_pages"] == 2.0  # k = 2: sink + recent only
    for name, r in res.items():
        assert 0.0 <= r["mass"] <= 1.0 + 1e-9, name
    assert res["oracle-b64"]["mass"] >= res["oracle-b32"]["mass"] - 1e-9
    assert res["shared_basis-r4-b64"]["attended_pages"] == 4.0 and 0 < res["shared_all-r6-b64"]["recall"] <= 1
    hit = capture_metrics(caps[0], cache, arms, fit_length=caps[0].length, needle=16 * 3 + 2)  # page 3
    assert hit["full"]["needle_hit"] == 1.0 and hit["oracle-b32"]["needle_hit"] == 0.0  # b=32: sink + recent only
