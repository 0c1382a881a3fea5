"""The paper's baselines as token-level cache policies: each method's published rule against a
brute-force statement on small random inputs, generate() on the tiny models, sweep accounting."""

import math

import pytest
import torch

from locks_hf import LocksCache, LocksConfig
from locks_hf.baselines.rocketkv import OBSERVATION_WINDOW, POOL_KERNEL, hybrid_scores, rocket_budgets, snapkv_keep
from locks_hf.token_policy import attend_slots

from conftest import tiny

GEN = torch.Generator().manual_seed(0)


def _randn(*shape):
    return torch.randn(*shape, generator=GEN, dtype=torch.float64)


def _ids(n, seed=1):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _ranked(scores):
    """Indices by descending score, ties to the earlier index (the policies' tie rule)."""
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i))


# -- the shared mechanism ------------------------------------------------------------------------
@pytest.mark.parametrize("per_query_head", [False, True])
def test_attend_slots_is_attention_over_each_heads_kept_tokens(per_query_head):
    b, h, G, L, d = 2, 2, 3, 20, 8
    keys, values, q = _randn(b, h, L, d), _randn(b, h, L, d), _randn(b, h, G, d)
    mask = torch.rand(b, h, G if per_query_head else 1, L, generator=GEN) < 0.4
    mask[..., -1] = True
    out, probs, union = attend_slots(keys, values, q, mask, 0.3)
    for i in range(b):
        for j in range(h):
            for g in range(G):
                slots = [t for t in range(L) if mask[i, j, g if per_query_head else 0, t]]
                p = torch.softmax(0.3 * keys[i, j, slots] @ q[i, j, g], 0)
                assert torch.allclose(out[i, j, g], p @ values[i, j, slots], atol=1e-12)
                assert torch.allclose(probs[i, j, g, slots], p, atol=1e-12)
                assert probs[i, j, g].sum() == pytest.approx(1.0)
    assert torch.equal(union, mask.any(2))


# -- RocketKV --------------------------------------------------------------------------------------
def test_rocket_budget_rule_worked_example():
    # S = 4096, ratio 32, exponent 0.2 + 5 * 0.06 = 0.5: capacity int(4096 / sqrt(32)) = 724
    keep, topk, ratio = rocket_budgets(4000, 96, 128)
    assert (keep, topk) == (724 - 96, 64) and ratio == pytest.approx(724 / 128)
    # the capacity never drops below twice the generated tokens
    assert rocket_budgets(1000, 600, 128)[0] == 1200 - 600


def test_snapkv_stage_keeps_the_pooled_top_tokens_and_the_window():
    b, h, G, T, d, w, keep = 1, 2, 2, 150, 8, 6, 40
    keys, queries = _randn(b, h, T, d), _randn(b, h, G, w, d)
    real = torch.ones(b, T, dtype=torch.bool)
    got = snapkv_keep(keys, queries, real, keep, 0.5)
    for j in range(h):
        score = [0.0] * (T - w)
        for g in range(G):
            for i in range(w):
                visible = T - w + i + 1
                p = torch.softmax(0.5 * keys[0, j, :visible] @ queries[0, j, g, i], 0)
                for t in range(T - w):
                    score[t] += float(p[t])
        half = POOL_KERNEL // 2
        pooled = [max(score[max(0, t - half): t + half + 1]) for t in range(T - w)]
        want = set(_ranked(pooled)[: keep - w]) | set(range(T - w, T))
        assert set(torch.nonzero(got[0, j]).flatten().tolist()) == want
    assert (got.sum(-1) == keep).all()


def test_hybrid_stage_scores_match_the_published_estimate():
    b, h, G, R, d, ratio = 1, 2, 3, 37, 16, 6.0
    keys, q = _randn(b, h, R, d), _randn(b, h, G, d)
    ok = torch.ones(b, h, R, dtype=torch.bool)
    got, chunk, channels = hybrid_scores(keys, ok, q, ratio)
    assert chunk == 3 and channels == int(d * 3 / ratio)
    for j in range(h):
        qs = q[0, j]
        sign = torch.where(qs.sum(0) > 0, 1.0, -1.0)
        top = torch.topk(qs.abs().mean(0), channels).indices.tolist()
        per_head = []
        for g in range(G):
            est = []
            for t in range(R):
                c0 = (t // chunk) * chunk
                kmax = (keys[0, j, c0: c0 + chunk] * sign).amax(0)
                est.append(sum(float(qs[g, c] * sign[c] * kmax[c]) for c in top))
            temp = math.sqrt(d * sum(abs(float(qs[g, c])) for c in top) / float(qs[g].abs().sum()))
            per_head.append(torch.softmax(torch.tensor(est, dtype=torch.float64) / temp, 0))
        assert torch.allclose(got[0, j], torch.stack(per_head).mean(0), atol=1e-10)


def _decode(model, cache, prompt, steps):
    out = model(prompt, past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
    return token


def test_rocketkv_decode_attends_half_the_budget_within_the_stage1_set():
    model = tiny("llama")
    cfg = LocksConfig(selector="rocketkv", budget=64)
    cache = LocksCache(model.config, cfg)
    cache.expect_new_tokens(6)
    _decode(model, cache, _ids(400), 6)
    for layer in cache.locks_layers:
        state = layer.policy_state
        keep, topk, _ = rocket_budgets(400, 6, 64)
        assert (state.keep[..., :400].sum(-1) == keep).all()  # stage 1 evicted the rest of the prompt
        assert (state.keep[..., 400:]).all()  # decode tokens are never evicted
    traffic = cache.decode_traffic()
    assert traffic["attended_tokens"] == 32  # b / 2 each step, per (layer, KV head)
    assert traffic["read_bytes"] > 32 * 2 * 16 * 8  # the attended K/V plus the estimation's reads


def test_rocketkv_needs_a_prefill_with_queries():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(selector="rocketkv", budget=64))
    with pytest.raises(Exception, match="prompt queries"):
        _decode(model, cache, _ids(1), 2)


@pytest.mark.parametrize("selector", ["rocketkv"])
def test_covering_budget_generates_the_dense_tokens(arch, selector):
    ids = _ids(40)
    ref = tiny(arch, "sdpa").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny(arch)
    cache = LocksCache(model.config, LocksConfig(selector=selector, budget=256))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.attended_fraction() == 1.0


@pytest.mark.parametrize("selector", ["rocketkv"])
def test_small_budget_generate_runs(arch, selector):
    model = tiny(arch)
    cache = LocksCache(model.config, LocksConfig(selector=selector, budget=64))
    out = model.generate(_ids(300), max_new_tokens=10, do_sample=False, past_key_values=cache)
    assert out.shape == (1, 310)
    assert 0 < cache.attended_fraction() < 0.5


# -- the sweep -------------------------------------------------------------------------------------
SWEEP_FAMILIES = ["rocketkv"]


def test_sweep_rows_report_attended_tokens_and_bytes(tmp_path):
    from locks_hf.eval.arms import parse_arms
    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.runner import SweepRunner, merge, read_scores
    from locks_hf.eval.testing import ByteTokenizer
    from locks_hf.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("gemma3", vocab_size=256, max_position_embeddings=8192)
    tok = ByteTokenizer()
    bench = RulerBenchmark(tok, ["niah_single_1"], [768], num_samples=1)
    arms = parse_arms(["full", "locks-r4i4", *SWEEP_FAMILIES], [64])
    SweepRunner(model, tok, bench, arms, tmp_path, model_name="tiny", progress=False, max_new_tokens=5).run()
    merge(tmp_path)
    rows = {r["arm"]: r for r in read_scores(tmp_path)}
    assert float(rows["full"]["attended_fraction"]) == 1.0
    assert float(rows["rocketkv-b64"]["attended_tokens"]) == 32.0
    for arm in ["locks-r4i4-b64", *[f"{f}-b64" for f in SWEEP_FAMILIES]]:
        assert float(rows[arm]["read_bytes"]) > 0
    # Locks reads its summaries besides the attended pages: more than the K/V of its tokens
    kv_bytes = 2 * model.config.head_dim * 4  # float32 K and V per token
    assert float(rows["locks-r4i4-b64"]["read_bytes"]) > float(rows["locks-r4i4-b64"]["attended_tokens"]) * kv_bytes
