"""Page selection against a direct, loop-by-loop implementation of the paper's §4 selection rule."""

import math

import pytest
import torch
from selector_lists import selectors

from locks_hf import LocksConfig
from locks_hf.selectors import QuestSelector, combine_group, select_pages


def brute_force_selection(scores, page_real, n_complete, k, per_head):
    """The paper's §4 selection rule written out: per row and KV head, the set of attended pages (Python sets)."""
    b, h, G, P = scores.shape
    result = torch.zeros(b, h, P, dtype=torch.bool)
    for i in range(b):
        real = [p for p in range(P) if page_real[i, p]]
        sink, recent = real[0], P - 1
        for j in range(h):
            if len(real) <= k:
                chosen = set(real)
            else:
                forced = {sink, recent}
                cands = [p for p in real if p < n_complete and p not in forced]
                if per_head:
                    chosen = set(forced)
                    for g in range(G):
                        ranked = sorted(cands, key=lambda p: (-scores[i, j, g, p].item(), p))
                        chosen |= set(ranked[: k - 2])
                else:
                    shares = []
                    for g in range(G):
                        z = torch.logsumexp(torch.stack([scores[i, j, g, p] for p in cands]), 0)
                        shares.append({p: math.exp(scores[i, j, g, p] - z) for p in cands})
                    avg = {p: sum(s[p] for s in shares) / G for p in cands}
                    ranked = sorted(cands, key=lambda p: (-avg[p], p))
                    chosen = forced | set(ranked[: k - 2])
            for p in chosen:
                result[i, j, p] = True
    return result


def _case(seed, b=3, h=2, G=4, P=20, ties=False):
    g = torch.Generator().manual_seed(seed)
    scores = torch.randn(b, h, G, P, generator=g, dtype=torch.float64) * 3
    if ties:
        scores = scores.round()  # many equal scores
        scores[..., 5:9] = 1.5  # a block of exact ties
    pads = torch.randint(0, P // 2, (b,), generator=g)
    pads[0] = 0
    page_real = torch.arange(P)[None] >= pads[:, None]
    return scores, page_real


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [2, 3, 5, 8, 30])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_selection_matches_brute_force(seed, k, per_head, ties):
    scores, page_real = _case(seed, ties=ties)
    P = scores.shape[-1]
    n_complete = P - (seed % 2)  # the recent page is complete or partial
    complete = torch.arange(P) < n_complete
    got = select_pages(scores, page_real, complete, k, "share_average", per_head)
    want = brute_force_selection(scores, page_real, n_complete, k, per_head)
    assert torch.equal(got, want)
    counts = got.sum(-1)
    limit = k if not per_head else 2 + scores.shape[2] * (k - 2)
    assert (counts <= limit).all()
    if not per_head:
        rows_pages = page_real.sum(-1)
        assert torch.equal(counts, torch.minimum(rows_pages, torch.tensor(k))[:, None].expand_as(counts))


def test_fewer_pages_than_slots_attends_all_real_pages():
    scores, page_real = _case(3, P=6)
    got = select_pages(scores, page_real, torch.ones(6, dtype=torch.bool), 8, "share_average", False)
    assert torch.equal(got, page_real[:, None].expand_as(got))


def test_pages_of_padding_are_never_selected_and_sink_is_per_row():
    scores, page_real = _case(4, b=2, P=12)
    page_real[1, :7] = False
    scores[1, ..., :7] = 100.0  # padding pages score highest: must still be ignored
    got = select_pages(scores, page_real, torch.ones(12, dtype=torch.bool), 4, "share_average", False)
    assert not got[1, :, :7].any()
    assert got[1, :, 7].all() and got[1, :, 11].all()  # sink = first real page, recent = last


@pytest.mark.parametrize("rule", ["share_average", "group_max", "group_mass"])
def test_group_combine_rules(rule):
    scores, _ = _case(1)
    cands = torch.ones(scores.shape[0], scores.shape[1], scores.shape[3], dtype=torch.bool)
    got = combine_group(scores, cands, rule)
    if rule == "share_average":
        want = torch.softmax(scores, -1).mean(2)
    elif rule == "group_max":
        want = scores.amax(2)
    else:
        want = torch.logsumexp(scores, 2)
    assert torch.allclose(got, want)


def test_quest_scores_match_brute_force():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 4, 8, 16, generator=g, dtype=torch.float64)
    valid = torch.ones(1, 2, 4, 8, dtype=torch.bool)
    valid[0, :, 0, :3] = False
    q = torch.randn(1, 2, 3, 16, generator=g, dtype=torch.float64)
    sel = QuestSelector(LocksConfig(selector="quest"))
    summary = sel.summarize(keys, valid)
    got = sel.page_scores(summary, keys, valid[:, :1], q, 1.0)
    for j in range(2):
        for p in range(4):
            ks = keys[0, j, p][valid[0, j, p]]
            u, l = ks.max(0).values, ks.min(0).values
            for gq in range(3):
                want = torch.maximum(q[0, j, gq] * u, q[0, j, gq] * l).sum()
                assert torch.isclose(got[0, j, gq, p].double(), want, atol=1e-5)


@pytest.mark.parametrize("selector", selectors(token_level=False, static_cache=False))
def test_shared_basis_controls_exact_at_full_rank_and_frozen(selector):
    """A full-rank unquantized shared basis reconstructs every key: exact page LSE."""
    from locks_hf.selectors import make_selector
    from locks_hf.summaries import exact_page_lse

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 2, 6, 16, 8, generator=g, dtype=torch.float64)
    valid = torch.ones(2, 2, 6, 16, dtype=torch.bool)
    q = torch.randn(2, 2, 3, 8, generator=g, dtype=torch.float64)
    cfg = LocksConfig(selector=selector, rank=8, basis_bits=16, coef_bits=16, centroid_bits=16)
    sel = make_selector(cfg)
    shared = sel.fit_sequence(keys[:, :, :4], valid[:, :, :4])  # fitted on the "prompt" pages
    summary = {**sel.summarize(keys, valid, shared), **shared}
    got = sel.page_scores(summary, None, valid[:, :1], q, 0.3)
    assert torch.allclose(got.double(), exact_page_lse(keys, valid[:, :1], q, 0.3), atol=2e-2)
    # int8 storage: page centroid (d + 2 bytes, not for shared_all) + coefficients (B*r + 2B bytes)
    qcfg = LocksConfig(selector=selector, rank=4)
    qsel = make_selector(qcfg)
    page_state = qsel.summarize(keys.float(), valid, qsel.fit_sequence(keys.float(), valid))
    per_page = sum(t.nbytes for t in page_state.values()) // (2 * 2 * 6)
    assert per_page == 16 * 4 + 2 * 16 + (0 if selector == "shared_all" else 8 + 2)
