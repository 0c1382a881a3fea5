"""``selector="locks_rerank"`` (Locks + exact re-ranking of a short list) against a loop-by-loop float64
statement of its rule, and through the caches, generate() and the byte accounting."""

import math

import pytest
import torch
from conftest import tiny

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache
from locks_hf.selectors import LocksRerankSelector, config_for_family, family_of, make_selector, parse_family
from locks_hf.selectors.rerank import rerank_pages
from locks_hf.summaries import summary_bytes

B = 16


def brute_force_rerank(est, exact, page_real, n_complete, k, M):
    """The rule written out with Python sets and floats: the M best candidates by share-average of the
    estimates, their estimates replaced by exact page LSEs and the other pages' shifted by the head's
    mean (exact - estimate) over the list, the share-average again (each head's softmax over every
    candidate page), the best k - 2 of the short list, plus sink and recent."""
    b, h, G, P = est.shape
    result = torch.zeros(b, h, P, dtype=torch.bool)

    def share_average(score, cands):
        avg = dict.fromkeys(cands, 0.0)
        for g in range(G):
            z = math.log(sum(math.exp(score[g][p]) for p in cands))
            for p in cands:
                avg[p] += math.exp(score[g][p] - z) / G
        return avg

    for i in range(b):
        real = [p for p in range(P) if page_real[i, p]]
        forced = {real[0], real[-1]}
        cands = [p for p in real if p < n_complete[i] and p not in forced]
        for j in range(h):
            chosen = set(forced)
            if cands:
                e = [[est[i, j, g, p].item() for p in range(P)] for g in range(G)]
                avg = share_average(e, cands)
                short = sorted(cands, key=lambda p: (-avg[p], p))[:M]
                sub = []
                for g in range(G):
                    gaps = [exact[i, j, g, p].item() - e[g][p] for p in short]
                    gaps = [x for x in gaps if math.isfinite(x)]
                    shift = sum(gaps) / len(gaps) if gaps else 0.0
                    sub.append([exact[i, j, g, p].item() if p in short else e[g][p] + shift for p in range(P)])
                avg = share_average(sub, cands)
                chosen |= set(sorted(short, key=lambda p: (-avg[p], p))[: k - 2])
            for p in chosen:
                result[i, j, p] = True
    return result


def exact_lse_loops(keys, valid, query, scale):
    """``LSE_t(scale * q.k_t)`` over each page's real tokens, one page and head at a time."""
    b, h, P, _, _ = keys.shape
    G = query.shape[2]
    out = torch.full((b, h, G, P), float("-inf"), dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            for p in range(P):
                toks = [t for t in range(B) if valid[i, 0, p, t]]
                for g in range(G):
                    if toks:
                        out[i, j, g, p] = torch.logsumexp(scale * keys[i, j, p, toks] @ query[i, j, g], 0)
    return out


def _case(seed, b=3, h=2, G=4, P=22, d=8, ties=False):
    """Random float64 keys with page structure; rows padded on the left (whole pages of padding, and
    padding slots inside the first real page), a padding hole, an incomplete last page; estimates that
    disagree with the exact scores (so re-ranking changes the answer)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, P, 1, d, generator=g, dtype=torch.float64) + torch.randn(
        b, h, P, B, d, generator=g, dtype=torch.float64
    )
    if ties:
        keys[:, :, 9] = keys[:, :, 6]  # two pages with equal exact scores: the earlier one wins
    query = torch.randn(b, h, G, d, generator=g, dtype=torch.float64)
    length = P * B - 5
    slot = torch.arange(P * B)
    pads = [0] + torch.randint(1, 4 * B, (b - 1,), generator=g).tolist()
    valid = torch.stack([(slot >= pad) & (slot < length) for pad in pads]).view(b, 1, P, B)
    valid[-1, 0, P // 2, 3] = False  # a padding slot inside a page
    est = exact_lse_loops(keys, valid, query, 0.5) + torch.randn(b, h, G, P, generator=g, dtype=torch.float64)
    if ties:
        est = est.round()
    est = est.masked_fill(~valid[:, :, None].any(-1), float("-inf"))
    n_complete = [length // B] * b
    complete = torch.arange(P)[None].expand(b, P) < length // B
    return est, keys, valid, query, complete, n_complete


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("k,m", [(3, 1), (4, 1), (4, 2), (4, 4), (6, 2), (30, 1)])
@pytest.mark.parametrize("ties", [False, True])
def test_rerank_matches_brute_force(seed, k, m, ties):
    est, keys, valid, query, complete, n_complete = _case(seed + 10 * k + m, ties=ties)
    got = rerank_pages(est, keys, valid, query, 0.5, complete, k, m * k, "share_average")
    exact = exact_lse_loops(keys, valid, query, 0.5)
    want = brute_force_rerank(est, exact, valid[:, 0].any(-1), n_complete, k, m * k)
    assert torch.equal(got, want)
    assert (got.sum(-1) <= k).all()


def test_a_short_list_of_every_page_is_the_oracle():
    """With every candidate page on the short list, re-ranking selects exactly the oracle's pages;
    with one candidate per free slot it keeps the estimate's choice."""
    from locks_hf.selectors import select_pages

    est, keys, valid, query, complete, _ = _case(3)
    exact = exact_lse_loops(keys, valid, query, 0.5)
    page_real = valid[:, 0].any(-1)
    oracle = select_pages(exact, page_real, complete, 4, "share_average", False)
    plain = select_pages(est, page_real, complete, 4, "share_average", False)
    assert not torch.equal(oracle, plain)  # the case is one where the estimate errs
    assert torch.equal(rerank_pages(est, keys, valid, query, 0.5, complete, 4, 22, "share_average"), oracle)
    assert torch.equal(rerank_pages(est, keys, valid, query, 0.5, complete, 4, 2, "share_average"), plain)


def test_labels_config_and_refusals():
    cfg = config_for_family("locks-r4i4-rr4", budget=64)
    assert (cfg.selector, cfg.rank, cfg.basis_bits, cfg.rerank) == ("locks_rerank", 4, 4, 4)
    assert cfg.label == "locks-r4i4-rr4-b64" and family_of(cfg) == "locks-r4i4-rr4"
    assert parse_family("r8bf16-rr2")[1] == {"rank": 8, "basis_bits": 16, "rerank": 2}
    assert parse_family("locks-r4i4")[0].name == "locks"  # the paper's labels are unchanged
    assert make_selector(cfg).candidates() == 16
    assert cfg.summary_layout == cfg.replace(selector="locks", rerank=None).summary_layout  # the same summaries
    with pytest.raises(LocksConfigError, match="rerank"):
        LocksConfig(selector="locks_rerank", rerank=0)
    with pytest.raises(LocksConfigError, match="rerank must be an int"):
        LocksConfig(rerank=2.5)


def _ids(n=300, b=1, seed=1):
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def test_covering_budget_gives_dense_tokens(arch):
    ids = _ids()
    ref = tiny(arch, "sdpa").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny(arch)
    cache = LocksCache(model.config, LocksConfig(budget=1024, selector="locks_rerank", rank=4))
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache), ref)
    assert cache.attended_fraction() == 1.0


def test_long_short_list_generates_the_oracle_tokens(arch):
    """A short list covering every page makes generate() the oracle's, token for token."""
    model = tiny(arch)
    ids = _ids()
    want = model.generate(
        ids,
        max_new_tokens=16,
        do_sample=False,
        past_key_values=LocksCache(model.config, LocksConfig(budget=64, selector="oracle")),
    )
    cfg = LocksConfig(budget=64, selector="locks_rerank", rank=4, rerank=8)  # 32 candidates >= 20 pages
    cache = LocksCache(model.config, cfg)
    assert torch.equal(model.generate(ids, max_new_tokens=16, do_sample=False, past_key_values=cache), want)
    assert cache.attended_fraction() < 0.5


@pytest.mark.parametrize("rerank", [1, 2])
def test_static_equals_dynamic(arch, rerank):
    model = tiny(arch)
    cfg = LocksConfig(budget=64, selector="locks_rerank", rank=4, rerank=rerank)
    ids = _ids()
    want = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=LocksCache(model.config, cfg))
    static = LocksStaticCache(model.config, max_cache_len=340, locks=cfg)
    assert torch.equal(model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=static), want)
    assert static.attended_fraction() < 0.5


def test_padded_batch_rows_equal_rows_alone():
    model = tiny("llama")
    cfg = LocksConfig(budget=64, selector="locks_rerank", rank=4, rerank=2)
    a, b = _ids(300, seed=2), _ids(260, seed=3)
    batch = torch.cat([a, torch.cat([torch.zeros((1, 40), dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :40] = 0
    out = model.generate(
        batch, attention_mask=mask, max_new_tokens=10, do_sample=False, past_key_values=LocksCache(model.config, cfg)
    )
    for row, ids in ((0, a), (1, b)):
        alone = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=LocksCache(model.config, cfg))
        assert torch.equal(out[row, -10:], alone[0, -10:])


def test_decode_traffic_counts_the_short_lists_keys():
    """read_bytes per (layer, KV head) and step = Locks' (summaries + attended K/V) + m*k pages of keys."""
    model = tiny("llama")
    ids = _ids(320)
    steps = 6
    traffic = {}
    for selector in ("locks", "locks_rerank"):
        # the dynamic layout counts its reads on the host (a static one, auto-chosen where CUDA is, does not)
        rerank = {"rerank": 2} if selector == "locks_rerank" else {}  # a setting of locks_rerank only
        cache = LocksCache(model.config, LocksConfig(budget=64, selector=selector, rank=4, **rerank), layout="dynamic")
        model.generate(ids, max_new_tokens=steps + 1, do_sample=False, past_key_values=cache)
        traffic[selector] = cache.decode_traffic()
    d = model.config.head_dim
    key_page = B * d * 8  # float64 keys
    assert traffic["locks_rerank"]["attended_tokens"] == traffic["locks"]["attended_tokens"]
    extra = traffic["locks_rerank"]["read_bytes"] - traffic["locks"]["read_bytes"]
    assert extra == pytest.approx(2 * 4 * key_page)  # m * k = 8 candidate pages of keys
    assert summary_bytes(128, 16, 4) == 490  # the figure the docs' per-step accounting starts from


def test_selector_declares_its_reads():
    sel = LocksRerankSelector(LocksConfig(selector="locks_rerank", budget=128, rerank=3))
    assert sel.reads_candidate_keys and not sel.reads_keys
    assert sel.candidate_key_pages(1000) == 24 and sel.candidate_key_pages(5) == 5
    assert make_selector(LocksConfig()).candidate_key_pages(1000) == 0


def test_decode_step_benchmark_takes_rerank_arms(tmp_path):
    """scripts/bench_decode_step.py runs a re-ranking arm beside plain Locks (tiny shape, CPU) and reports
    the bytes each step reads by the arm's rule: the short list's keys on top of Locks'."""
    import json

    from test_bench_scripts import _load

    out = tmp_path / "step.json"
    _load().main(
        [
            "--shape",
            "tiny",
            "--device",
            "cpu",
            "--contexts",
            "512",
            "--budget",
            "64",
            "--arms",
            "r4i4,r4i4-rr2",
            "--steps",
            "2",
            "--warmup",
            "1",
            "--out",
            str(out),
        ]
    )
    rows = {r["arm"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["r4i4"]["attended"] == rows["r4i4-rr2"]["attended"] < 0.5
    tiny_shape = _load().SHAPES["tiny"]  # float32 on the CPU
    layers, heads, d = tiny_shape["num_hidden_layers"], tiny_shape["num_key_value_heads"], tiny_shape["head_dim"]
    assert rows["r4i4-rr2"]["read_bytes"] - rows["r4i4"]["read_bytes"] == layers * heads * 2 * 4 * B * d * 4
    per_head = 512 // B * summary_bytes(d, B, 4) + 4 * B * 2 * d * 4
    assert rows["r4i4"]["read_bytes"] == layers * heads * per_head


@pytest.mark.parametrize("static", [False, True])
def test_a_budget_switch_selects_at_the_new_budget(static):
    """`set_budget` moves the page slots (and the short list) of the next step; the static layout keeps
    its selector object, so the selection must read the layer's settings, not the selector's."""
    model = tiny("llama")
    cfg = LocksConfig(budget=64, selector="locks_rerank", rank=4, rerank=2)
    cache = (
        LocksStaticCache(model.config, max_cache_len=340, locks=cfg, max_budget=128)
        if static
        else LocksCache(model.config, cfg)
    )
    token = model(_ids(), past_key_values=cache).logits[:, -1:].argmax(-1)
    for budget in (64, 128, 64):
        cache.set_budget(budget)
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        for layer in cache.locks_layers:
            assert (layer.last_selection.sum(-1) == budget // B).all()
