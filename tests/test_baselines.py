"""The paper's baselines as token-level cache policies: each method's published rule against a
brute-force statement on small random inputs, generate() on the tiny models, sweep accounting."""

import math

import pytest
import torch
from conftest import tiny
from selector_lists import fits, selectors

from locks_hf import LocksCache, LocksConfig, LocksConfigError
from locks_hf.baselines.rocketkv import POOL_KERNEL, hybrid_scores, rocket_budgets, snapkv_keep
from locks_hf.token_policy import attend_slots

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
        pooled = [max(score[max(0, t - half) : t + half + 1]) for t in range(T - w)]
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
                kmax = (keys[0, j, c0 : c0 + chunk] * sign).amax(0)
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


# every token-level method that decodes straight from generate() (KVzip needs its context pass first)
@pytest.mark.parametrize("selector", selectors(token_level=True, needs_context_scores=False))
def test_covering_budget_generates_the_dense_tokens(arch, selector):
    ids = _ids(40)
    ref = tiny(arch, "sdpa").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny(arch)
    cache = LocksCache(model.config, LocksConfig(selector=selector, budget=512))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.attended_fraction() == 1.0


# (prompt, budget, new tokens) for each method to leave tokens out (R-KV: its first compression at
# 128 generated tokens; ShadowKV: its smallest budget and a prompt beyond its 48 outlier chunks)
SPARSE_RUN = {
    "rocketkv": (300, 64, 10),
    "rkv": (300, 64, 140),
    "lazy_eviction": (300, 64, 40),
    "shadowkv": (1000, 512, 6),
    "triattention": (30, 64, 120),
}


def test_sparse_runs_cover_every_generate_method():
    assert set(SPARSE_RUN) == set(selectors(token_level=True, needs_context_scores=False))


# Runs of 100+ generated tokens take most of this file's time: `slow` (CI runs them).
@pytest.mark.parametrize(
    "selector", [pytest.param(s, marks=pytest.mark.slow) if SPARSE_RUN[s][2] >= 100 else s for s in SPARSE_RUN]
)
def test_small_budget_generate_runs(arch, selector):
    model = tiny(arch)
    prompt, budget, n = SPARSE_RUN[selector]
    cache = LocksCache(model.config, LocksConfig(selector=selector, budget=budget))
    out = model.generate(_ids(prompt), max_new_tokens=n, do_sample=False, past_key_values=cache)
    assert out.shape == (1, prompt + n)
    assert 0 < cache.attended_fraction() < 1


# -- ShadowKV --------------------------------------------------------------------------------------
def test_shadowkv_landmarks_outliers_and_chunk_scores_follow_the_published_rule():
    from locks_hf.baselines.shadowkv import chunk_scores, landmarks_and_outliers

    h, C, d, G, n_out = 2, 12, 6, 3, 5
    keys = _randn(h, C * 8, d)
    marks, outliers = landmarks_and_outliers(keys, n_out)
    q = _randn(h, G, d)
    scores = chunk_scores(marks, q, 0.7)
    for j in range(h):
        lowest = []
        for c in range(C):
            chunk = keys[j, c * 8 : (c + 1) * 8]
            mean = chunk.mean(0)
            assert torch.allclose(marks[j, c], mean, atol=1e-12)
            lowest.append(min(float(k @ mean / (k.norm() * mean.norm())) for k in chunk))
        want = set(sorted(range(C), key=lambda c: (lowest[c], c))[:n_out])
        assert set(torch.nonzero(outliers[j]).flatten().tolist()) == want
        per_head = torch.stack([torch.softmax(0.7 * marks[j] @ q[j, g], 0) for g in range(G)])
        assert torch.allclose(scores[j], per_head.amax(0), atol=1e-12)


def test_shadowkv_attends_outliers_local_window_and_the_budgets_chunks():
    from locks_hf.baselines.shadowkv import CHUNK, OUTLIER_CHUNKS

    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(selector="shadowkv", budget=512))
    T = 1003  # 121 chunks of context, then a local window of 4 chunks + 3 tokens
    out = model(_ids(T), past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    model(token, past_key_values=cache)
    state = cache.locks_layers[0].policy_state
    chunks = T // CHUNK - 4
    fixed = state.keep[0, :, 0, :T]
    assert (fixed[:, chunks * CHUNK :]).all()  # the local window
    assert (fixed[:, : chunks * CHUNK].sum(-1) == OUTLIER_CHUNKS * CHUNK).all()
    selected = (512 - 416) // CHUNK * CHUNK
    # every step: the outliers, the local window, the selected chunks and the generated tokens
    assert cache.decode_traffic()["attended_tokens"] == OUTLIER_CHUNKS * CHUNK + (T - chunks * CHUNK) + selected + 1


def test_shadowkv_below_its_fixed_blocks_does_not_fit_and_the_sweep_skips_it():
    from locks_hf.config import BudgetDoesNotFit
    from locks_hf.eval.arms import parse_arms

    with pytest.raises(BudgetDoesNotFit, match="424"):
        LocksConfig(selector="shadowkv", budget=256)
    not_run = []
    arms = parse_arms(["quest", "shadowkv"], [256, 512], not_run=not_run)
    assert [a.name for a in arms] == ["quest-b256", "quest-b512", "shadowkv-b512"]
    assert [n for n, _ in not_run] == ["shadowkv-b256"]
    with pytest.raises(BudgetDoesNotFit):
        parse_arms(["shadowkv"], [256])


# -- TriAttention ----------------------------------------------------------------------------------
def test_rope_frequencies_are_the_models(arch):
    from locks_hf.rope import rope_frequencies

    model = tiny(arch)
    rotary = model.model.rotary_emb
    buffers = dict(rotary.named_buffers())
    want = buffers.get("full_attention_inv_freq", buffers.get("inv_freq"))
    assert torch.allclose(rope_frequencies(model.config.get_text_config(decoder=True)), want.double())


def test_trig_scores_match_the_published_expectation_over_future_offsets():
    from locks_hf.baselines.triattention import OFFSETS, trig_scores

    h, G, R, d, now = 2, 3, 9, 8, 300.0
    F = d // 2
    omega = 1.0 / 100.0 ** (torch.arange(F, dtype=torch.float64) / F)
    pre = _randn(h, R, d)  # pre-RoPE keys at positions p
    positions = torch.randint(0, 290, (R,), generator=GEN).double()
    angle = positions[:, None] * omega  # [R, F]
    x1, x2 = pre[..., :F], pre[..., F:]
    post = torch.cat([x1 * angle.cos() - x2 * angle.sin(), x2 * angle.cos() + x1 * angle.sin()], -1)
    q_mean = torch.complex(_randn(h, G, F), _randn(h, G, F))
    q_abs = q_mean.abs() + torch.rand(h, G, F, generator=GEN, dtype=torch.float64)
    got = trig_scores(post, q_mean, q_abs, omega, now)
    for j in range(h):
        for g in range(G):
            for r in range(R):
                k = torch.complex(pre[j, r, :F], pre[j, r, F:])
                phi = torch.angle(q_mean[j, g] * k.conj())
                amp = q_mean[j, g].abs() * k.abs()
                trig = sum(
                    float((amp * torch.cos(omega * (now + off - positions[r]) + phi)).sum()) for off in OFFSETS.tolist()
                ) / len(OFFSETS)
                extra = float(((q_abs[j, g] - q_mean[j, g].abs()) * k.abs()).sum())
                assert got[j, g, r] == pytest.approx(trig + extra, abs=1e-9)


def test_triattention_keeps_the_prompt_and_the_best_generated_tokens():
    from locks_hf.baselines.triattention import trig_scores

    model = tiny("qwen3")
    budget, prompt = 64, 30
    cache = LocksCache(model.config, LocksConfig(selector="triattention", budget=budget))
    out = model(_ids(prompt), past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    layer = cache.locks_layers[0]
    for _ in range(128 - prompt):  # the step that reaches position 128 compresses
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
    state = layer.policy_state
    assert (state.keep[..., :prompt]).all()  # the prompt is protected
    assert (state.keep.sum(-1) == budget).all()  # budget - prompt generated tokens stay
    # the kept generated tokens are the best by the group-max score under the statistics of the step
    count = state.tensors["count"]
    q_mean, q_abs = state.tensors["q_sum"] / count, state.tensors["abs_sum"] / count
    for j in range(layer.keys.shape[1]):
        candidates = torch.arange(prompt, 128)  # every generated token was resident
        scores = trig_scores(layer.keys[0, j, candidates], q_mean[0, j], q_abs[0, j], state.info["omega"], 128.0)
        ranked = _ranked(scores.amax(0).tolist())[: budget - prompt]
        assert set(torch.nonzero(state.keep[0, j, 0, prompt:]).flatten().add(prompt).tolist()) == {
            int(candidates[i]) for i in ranked
        }


def test_triattention_needs_the_model_config():
    model = tiny("llama")
    cache = LocksCache(None, LocksConfig(selector="triattention", budget=64))
    with pytest.raises(Exception, match="model config"):
        _decode(model, cache, _ids(20), 1)


# -- the sweep -------------------------------------------------------------------------------------
SWEEP_FAMILIES = [s for s in selectors(token_level=True) if fits(s, 64)]  # the sweep runs them at budget 64


def test_sweep_rows_report_attended_tokens_and_bytes(tmp_path):
    from locks_hf.eval.arms import parse_arms
    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.merge import merge, read_scores
    from locks_hf.eval.runner import SweepRunner
    from locks_hf.eval.testing import ByteTokenizer
    from locks_hf.models import tiny_model

    torch.manual_seed(0)
    model = tiny_model("gemma3", vocab_size=256, max_position_embeddings=8192)
    tok = ByteTokenizer()
    bench = RulerBenchmark(tok, ["niah_single_1"], [1024], num_samples=1)
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


# -- R-KV ------------------------------------------------------------------------------------------
def _brute_redundancy(keys):
    R = keys.shape[0]
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    sim = [[0.0 if i == j else float(unit[i] @ unit[j]) for j in range(R)] for i in range(R)]
    for i in range(R):
        similar = [j for j in range(R) if sim[i][j] > 0.5]
        sim[i][max(similar) if similar else 0] = 0.0  # the newest near-duplicate is exempted
    col = torch.tensor([sum(sim[i][j] for i in range(R)) / R for j in range(R)], dtype=torch.float64)
    return torch.softmax(col, 0)


def test_rkv_scores_match_importance_minus_redundancy():
    from locks_hf.baselines.rkv import MIX_LAMBDA, rkv_scores

    b, h, G, R, d, w = 1, 2, 2, 30, 6, 8
    keys = _randn(b, h, R, d)
    keys[0, 0, 5] = keys[0, 0, 2] * 1.5 + 0.01  # near-duplicates so that the exemption matters
    window = _randn(b, h, G, w, d)
    got = rkv_scores(keys, window, 0.4)
    for j in range(h):
        imp = torch.zeros(R - w, dtype=torch.float64)
        for i in range(w):
            logits = torch.stack([0.4 * keys[0, j, : R - w] @ window[0, j, g, i] for g in range(G)]).amax(0)
            imp += torch.softmax(logits, 0) / w
        pooled = torch.stack([imp[max(0, t - 3) : t + 4].max() for t in range(R - w)])
        want = MIX_LAMBDA * pooled - (1 - MIX_LAMBDA) * _brute_redundancy(keys[0, j])[: R - w]
        assert torch.allclose(got[0, j], want, atol=1e-12)


def test_rkv_compression_keeps_the_best_scores_and_the_newest_tokens():
    from locks_hf import LocksLayer
    from locks_hf.baselines.rkv import RKVPolicy, rkv_scores
    from locks_hf.token_policy import PolicyState

    b, h, G, L, d, budget = 1, 2, 2, 200, 8, 64
    policy = RKVPolicy(LocksConfig(selector="rkv", budget=budget))
    layer = LocksLayer(policy.config)
    layer.update(_randn(b, h, L, d), _randn(b, h, L, d))
    keep = torch.rand(b, h, 1, L, generator=GEN) < 0.97
    keep[..., -8:] = True
    keep[:, 1] = keep[:, 0]  # the heads of a row hold the same number of tokens
    state = PolicyState(keep, L)
    window = _randn(b, h, G, 8, d)
    got = policy.compressed(layer, state, window, 0.3)
    for j in range(h):
        resident = torch.nonzero(keep[0, j, 0]).flatten().tolist()
        scores = rkv_scores(layer.keys[:, j : j + 1, resident], window[:, j : j + 1], 0.3)[0, 0].tolist()
        want = {resident[i] for i in _ranked(scores)[: budget - 8]} | set(resident[-8:])
        assert set(torch.nonzero(got[0, j, 0]).flatten().tolist()) == want
    # under b + 128 resident tokens nothing happens
    state.keep = keep & (torch.arange(L) >= L - 150)
    assert torch.equal(policy.compressed(layer, state, window, 0.3), state.keep)


@pytest.mark.slow  # generates past two compressions
def test_rkv_decode_compresses_every_128_generated_tokens():
    model = tiny("qwen3")
    cache = LocksCache(model.config, LocksConfig(selector="rkv", budget=64))
    out = model(_ids(100), past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    resident = []
    for _ in range(260):
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        resident.append(int(cache.locks_layers[0].policy_state.keep[0, 0, 0].sum()))
    # steps 1..127 keep everything; step 128 cuts 228 tokens to 64; step 256 cuts 192 to 64
    assert resident[:127] == list(range(101, 228))
    assert resident[127] == 64 and resident[128] == 65 and resident[254] == 191 and resident[255] == 64


# -- LazyEviction --------------------------------------------------------------------------------
def test_lazy_eviction_recurrence_and_importance_follow_the_published_rule():
    from locks_hf.baselines.lazy_eviction import DEFAULT_ALPHA as ALPHA, importance, record_recurrence
    from locks_hf.token_policy import PolicyState

    L, steps = 12, 9
    probs = torch.rand(steps, 1, 1, 1, L, generator=GEN, dtype=torch.float64) * 3e-4  # about 1/3 below alpha
    state = PolicyState(torch.ones(1, 1, 1, L, dtype=torch.bool), L)
    state.add_slot_tensor("last", torch.zeros(1, 1, 1, L, dtype=torch.float64), 0.0)
    state.add_slot_tensor("period", torch.zeros(1, 1, 1, L, dtype=torch.float64), 0.0)
    last, period = [0.0] * L, [0.0] * L
    for t in range(1, steps + 1):
        record_recurrence(state, t, probs[t - 1], ALPHA)
        for i in range(L):
            if probs[t - 1, 0, 0, 0, i] >= ALPHA:
                period[i] = max(period[i], t - last[i])
                last[i] = t
    assert state.slot["last"].flatten().tolist() == last and state.slot["period"].flatten().tolist() == period
    want = [
        2 / (1 + math.exp(1 + (steps - l) / (p + 1e-5))) + (0 if p == 0 else 2 / (1 + math.exp(p - 1)))
        for l, p in zip(last, period)
    ]
    assert torch.allclose(
        importance(steps, state.slot["last"], state.slot["period"]).flatten(),
        torch.tensor(want, dtype=torch.float64),
        atol=1e-12,
    )


def test_lazy_eviction_cut_keeps_the_window_and_the_most_important():
    from locks_hf.baselines.lazy_eviction import evicted

    b, h, G, L, budget, W = 1, 2, 3, 60, 20, 5
    keep = torch.rand(b, h, G, L, generator=GEN) < 0.7
    keep[0, 1, 2] = torch.arange(L) < 15  # a head under budget is left alone
    score = torch.rand(b, h, G, L, generator=GEN, dtype=torch.float64)
    got = evicted(keep, score, budget, W)
    for j in range(h):
        for g in range(G):
            kept = torch.nonzero(keep[0, j, g]).flatten().tolist()
            if len(kept) <= budget:
                want = set(kept)
            else:
                older = kept[:-W]
                ranked = sorted(older, key=lambda i: (-float(score[0, j, g, i]), i))
                want = set(ranked[: budget - W]) | set(kept[-W:])
            assert set(torch.nonzero(got[0, j, g]).flatten().tolist()) == want


def test_lazy_eviction_decode_keeps_each_query_heads_budget():
    from locks_hf.baselines.lazy_eviction import window_size

    model = tiny("llama")
    budget = 64
    W = window_size(budget)
    cache = LocksCache(model.config, LocksConfig(selector="lazy_eviction", budget=budget))
    out = model(_ids(100), past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    for step in range(1, 3 * W + 1):
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        keep = cache.locks_layers[0].policy_state.keep
        assert keep.shape[2] == model.config.num_attention_heads // model.config.num_key_value_heads
        counts = keep.sum(-1)
        if step < W:
            assert (counts == 100 + step).all()
        elif step % W == 0:
            assert (counts == budget).all()
    G = keep.shape[2]
    assert cache.decode_traffic()["attended_tokens"] <= G * (budget + W)


@pytest.mark.parametrize("arch,alpha", [("llama", 5e-4), ("qwen3", 1e-4), ("gemma3", 1e-4)])
def test_lazy_eviction_alpha_follows_the_model_family(arch, alpha):
    from locks_hf.baselines.lazy_eviction import family_alpha

    model = tiny(arch)
    assert family_alpha(model.config.get_text_config(decoder=True)) == alpha
    cache = LocksCache(model.config, LocksConfig(selector="lazy_eviction", budget=64))
    out = model(_ids(80), past_key_values=cache)
    model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    assert all(layer.policy_state.info["alpha"] == alpha for layer in cache.locks_layers)


def test_lazy_eviction_alpha_is_configurable_and_decides_what_recurs():
    from locks_hf.eval.arms import parse_arms

    arm = parse_arms(["lazy_eviction-a0.0005"], [64])[0]
    assert arm.name == "lazy_eviction-a0.0005-b64" and arm.config.lazy_alpha == 5e-4
    assert parse_arms(["lazy_eviction"], [64])[0].config.lazy_alpha is None
    model = tiny("llama")
    states = {}
    for alpha in (1e-12, 0.999):  # every token reaches the threshold at every step / none does
        cache = LocksCache(model.config, LocksConfig(selector="lazy_eviction", budget=64, lazy_alpha=alpha))
        token = model(_ids(80), past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(3):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        states[alpha] = cache.locks_layers[0].policy_state
    assert states[1e-12].info["alpha"] == 1e-12
    prompt = slice(0, 80)
    assert (states[1e-12].slot["last"][..., prompt] == 3).all() and (
        states[1e-12].slot["period"][..., prompt] == 1
    ).all()
    assert (states[0.999].slot["last"][..., prompt] == 0).all() and (states[0.999].slot["period"] == 0).all()
    for bad in (0.0, 1.0, -1e-4):
        with pytest.raises(ValueError, match="lazy_alpha"):
            LocksConfig(selector="lazy_eviction", lazy_alpha=bad)
    with pytest.raises(ValueError, match="lazy_alpha"):
        LocksConfig(selector="quest", lazy_alpha=1e-4)


# -- KVzip -------------------------------------------------------------------------------------------
def test_kvzip_repeat_inputs_follow_the_published_chunking():
    from locks_hf.baselines.kvzip import CHUNK, FIRST_PROMPT, NEXT_PROMPT, SINK, repeat_inputs

    def encode(text):
        return torch.tensor([[ord(c) % 200 for c in text]])

    context = torch.randint(3, 256, (1, SINK + CHUNK + 100), generator=GEN)
    chunks = repeat_inputs(encode, context)
    assert [(s, e) for s, e, _ in chunks] == [(SINK, SINK + CHUNK), (SINK + CHUNK, SINK + CHUNK + 100)]
    assert torch.equal(chunks[0][2], torch.cat([encode(FIRST_PROMPT), context[:, SINK : SINK + CHUNK]], 1))
    tail = context[:, SINK + CHUNK - 8 : SINK + CHUNK]
    assert torch.equal(chunks[1][2], torch.cat([encode(NEXT_PROMPT), tail, context[:, SINK + CHUNK :]], 1))


def test_kvzip_scores_are_the_max_reconstruction_attention():
    from locks_hf.baselines.kvzip import SINK, ReconstructionScores

    b, h, G, n_ctx, t, d = 1, 2, 2, 300, 40, 8
    start, end = 100, 170
    keys, q = _randn(b, h, n_ctx + t, d), _randn(b, h * G, t, d)
    store = torch.zeros(b, h, n_ctx, dtype=torch.float64)
    ReconstructionScores(store, start, end).update(q, keys, 0.4)
    for j in range(h):
        for r in range(start, end):
            best = 0.0
            for g in range(G):
                for i in range(t):
                    visible = list(range(SINK)) + list(range(start, end)) + list(range(n_ctx, n_ctx + i + 1))
                    p = torch.softmax(0.4 * keys[0, j, visible] @ q[0, j * G + g, i], 0)
                    best = max(best, float(p[SINK + r - start]))
            assert float(store[0, j, r]) == pytest.approx(best, abs=1e-12)
    assert (store[..., :start] == 0).all() and (store[..., end:] == 0).all()


def test_kvzip_keeps_the_best_context_tokens_the_question_and_the_generated():
    from locks_hf.baselines.kvzip import SINK, score_context
    from locks_hf.eval.testing import ByteTokenizer

    model, budget, context, T = tiny("gemma3"), 64, 250, 300
    ids = _ids(T)
    base = LocksCache(model.config, LocksConfig(selector="full"))
    with torch.no_grad():
        model(ids, past_key_values=base)
        score_context(model, ByteTokenizer(), base, ids[:, :context])
        cache = base.fork(LocksConfig(selector="kvzip", budget=budget))
        _decode(model, cache, ids[:, -1:], 3)  # the prompt's last token again, then 3 generated
    for base_layer, layer in zip(base.locks_layers, cache.locks_layers):
        scores = base_layer.prefill_scores["kvzip"]
        keep = layer.policy_state.keep[0, :, 0]
        assert (keep[:, context:]).all()  # question and generated tokens beyond the budget
        for j in range(keep.shape[0]):
            want = set(_ranked(scores[0, j].tolist())[:budget])
            assert set(torch.nonzero(keep[j, :context]).flatten().tolist()) == want
            assert set(range(SINK)) <= want


def test_kvzip_needs_its_scores():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(selector="kvzip", budget=64))
    with pytest.raises(Exception, match="reconstruction scores"):
        _decode(model, cache, _ids(100), 1)


# -- every registered method, as a class: padded batches and forks --------------------------------
def _config_at_small_budget(name):
    """``name``'s config at a budget small enough to leave tokens out (the smallest that fits)."""
    from locks_hf.config import BudgetDoesNotFit

    try:
        return LocksConfig(selector=name, budget=32)
    except BudgetDoesNotFit:
        return LocksConfig(selector=name, budget=512)


def _needs_context_scores(name):
    from locks_hf.selectors import selector_class

    return getattr(selector_class(name), "needs_context_scores", False)


def _registry_params(long_run):
    from locks_hf.selectors import selector_names

    mark = [pytest.mark.slow] if long_run else []
    return [pytest.param(name, marks=mark) for name in selector_names()]


def _padded_batch_case(name, new_tokens, **options):
    model = tiny("llama")
    a, b = _ids(300, seed=2)[0], _ids(250, seed=3)[0]
    batch = torch.zeros(2, 300, dtype=torch.long)
    batch[0], batch[1, 50:] = a, b
    mask = (torch.arange(300)[None] >= torch.tensor([[0], [50]])).long()
    cfg = _config_at_small_budget(name)
    if _needs_context_scores(name):  # per-row reconstruction scores: a batch is refused, by name
        from locks_hf.baselines.kvzip import score_context
        from locks_hf.eval.testing import ByteTokenizer

        cache = LocksCache(model.config, cfg)
        model(batch, attention_mask=mask, past_key_values=cache)
        with pytest.raises(ValueError, match="batch size 1"):
            score_context(model, ByteTokenizer(), cache, batch)
        return
    out = model.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        do_sample=False,
        past_key_values=LocksCache(model.config, cfg),
        **options,
    )
    for row, ids in enumerate([a, b]):
        alone = model.generate(
            ids[None],
            max_new_tokens=new_tokens,
            do_sample=False,
            past_key_values=LocksCache(model.config, cfg),
            **options,
        )
        assert torch.equal(out[row, -new_tokens:], alone[0, -new_tokens:]), f"row {row} depends on the batch"


@pytest.mark.parametrize("name", _registry_params(long_run=False))
def test_every_method_gives_a_left_padded_row_its_tokens_alone(name):
    """A row's tokens never depend on the rows it is batched with (RocketKV's budget rule once read the
    padded length of the batch)."""
    _padded_batch_case(name, new_tokens=12)


@pytest.mark.parametrize("name", _registry_params(long_run=False))
def test_every_method_gives_a_left_padded_row_its_beam_search_alone(name):
    """Beam search reorders the rows every step: per-row policy state travels with its row."""
    _padded_batch_case(name, new_tokens=6, num_beams=2)


@pytest.mark.parametrize("name", _registry_params(long_run=True))
def test_every_method_gives_a_left_padded_row_its_tokens_alone_past_the_first_compression(name):
    _padded_batch_case(name, new_tokens=140)  # R-KV and TriAttention compress at 128


def _decode_tokens(model, cache, first, steps):
    """``steps`` greedy tokens from ``first [1, 1]`` on a prefilled cache."""
    tokens, token = [], first
    for _ in range(steps):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        tokens.append(int(token))
    return tokens, token


def _prefilled(model, cfg, ids):
    cache = LocksCache(model.config, cfg)
    first = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    if _needs_context_scores(cfg.selector):
        from locks_hf.baselines.kvzip import score_context
        from locks_hf.eval.testing import ByteTokenizer

        score_context(model, ByteTokenizer(), cache, ids)
    return cache, first


def _fork_case(name, before, after):
    model = tiny("qwen3")
    ids = _ids(200, seed=4)
    cfg = _config_at_small_budget(name)
    with torch.no_grad():
        cache, first = _prefilled(model, cfg, ids)
        whole, _ = _decode_tokens(model, cache, first, before + after)
        cache, first = _prefilled(model, cfg, ids)
        head, token = _decode_tokens(model, cache, first, before)
        for fork in (cache.fork(), cache.fork(cfg)):  # the same settings: the run carries on
            tail, _ = _decode_tokens(model, fork, token, after)
            assert head + tail == whole
        other = cfg.replace(budget=cfg.budget * 2)
        if cache.locks_layers[0].policy_state is not None:  # a started token-level policy cannot switch
            with pytest.raises(LocksConfigError, match="cannot switch"):
                cache.fork(other)
            with pytest.raises(LocksConfigError, match="cannot switch"):
                cache.set_budget(other.budget)
        else:  # page selectors switch freely
            cache.fork(other)


@pytest.mark.parametrize("name", _registry_params(long_run=False))
def test_every_method_through_a_fork_mid_decode_equals_an_uninterrupted_run(name):
    _fork_case(name, before=3, after=5)


@pytest.mark.parametrize("name", _registry_params(long_run=True))
def test_every_method_through_a_fork_after_its_first_compression_equals_an_uninterrupted_run(name):
    _fork_case(name, before=130, after=10)  # R-KV and TriAttention have evicted by then
