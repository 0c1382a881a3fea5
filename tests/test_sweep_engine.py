"""The sweep runner's static engine (`eval/engine.py`, `eval/batched.py`): same results as the eager
runner, batches equal rows run alone, arms decoded one after another from one prefill equal fresh
prefills, and resumability / sharding unchanged."""

import json
import random

import pytest
import torch
from conftest import count_forwards, tiny

from locks_hf.eval.arms import parse_arms
from locks_hf.eval.benchmarks import STOP_NEWLINE, Benchmark, RulerBenchmark
from locks_hf.eval.engine import Row, StaticEngine, choose_tokens, hash_uniform
from locks_hf.eval.merge import merge
from locks_hf.eval.runner import SweepRunner
from locks_hf.eval.testing import ByteTokenizer

TOK = ByteTokenizer()
ARMS = ("full", "oracle", "locks-r4i4", "quest")


def _results(model, bench, arms, out, **kw):
    r = SweepRunner(model, TOK, bench, arms, out, model_name="tiny", progress=False, **kw)
    r.run()
    merge(out)
    return (out / "results.jsonl").read_text()


class ToyBench(Benchmark):
    """Random-letter prompts of a few lengths (left padding in a batch), ``samples`` per record."""

    name = "toy"

    def __init__(self, lengths=(300, 290, 330), samples=1, sampling=None, max_new=8):
        self.lengths, self.samples, self.sampling, self.max_new = lengths, samples, sampling, max_new

    def records(self):
        rng = random.Random(0)
        return [
            {
                "id": f"toy-{i}",
                "task": "toy",
                "length": None,
                "text": "".join(rng.choice("abcdefgh ") for _ in range(n)),
            }
            for i, n in enumerate(self.lengths)
        ]

    def prompt_text(self, rec):
        return rec["text"]

    def max_new_tokens(self, rec):
        return self.max_new

    def stop(self, rec):
        return STOP_NEWLINE

    def score(self, rec, pred):
        return {"score": float("a" in pred)}


@pytest.mark.slow  # five sweeps of a tiny model: minutes of CPU
def test_static_engine_gives_the_eager_runners_results_and_resumes_and_shards(tmp_path, monkeypatch):
    """Gemma 3 (sliding-window layers restored from the prefix, Locks layers rewound): every field of
    every merged line equal to the eager runner's, for full / oracle / Locks / Quest; then resume
    runs nothing and two shards merge to the same bytes."""
    model = tiny("gemma3")
    bench = RulerBenchmark(TOK, ["niah_single_1", "niah_multikey_2"], [1024], num_samples=1)
    arms = parse_arms(ARMS, [64])
    eager = _results(model, bench, arms, tmp_path / "eager", max_new_tokens=8)
    static = _results(model, bench, arms, tmp_path / "static", max_new_tokens=8, engine="static")
    assert static == eager
    rows = [json.loads(line) for line in static.splitlines()]
    assert len(rows) == 8 and all(r["attended_fraction"] < 0.3 for r in rows if r["arm"] != "full")

    calls = count_forwards(model, monkeypatch)
    _results(model, bench, arms, tmp_path / "static", max_new_tokens=8, engine="static")
    monkeypatch.undo()
    assert calls["n"] == 0

    sharded = tmp_path / "sharded"
    for shard in ("0/2", "1/2"):
        SweepRunner(
            model,
            TOK,
            bench,
            arms,
            sharded,
            model_name="tiny",
            progress=False,
            max_new_tokens=8,
            engine="static",
            batch_rows=1,
            shard=shard,
        ).run()
    merge(sharded)
    assert (sharded / "results.jsonl").read_text() == eager


@pytest.mark.slow  # two sweeps: about a minute of CPU
def test_sampled_protocol_k_samples_in_one_batch_equal_the_eager_runner(tmp_path):
    """avg@k layout (prefill all but the last token, k rows per record) and records of different
    lengths in one left-padded batch: greedy results equal the eager runner's, sample by sample."""
    model = tiny("llama")
    bench = ToyBench(samples=2)
    arms = parse_arms(["full", "locks-r8i4", "quest"], [64])
    eager = _results(model, bench, arms, tmp_path / "eager")
    static = _results(model, bench, arms, tmp_path / "static", engine="static", batch_rows=6)
    assert static == eager and len(static.splitlines()) == 18


def test_sparse_question_protocol_equals_the_eager_runner(tmp_path):
    model = tiny("llama")
    bench = ToyBench(lengths=(300,), max_new=4)
    bench.question_start_text = lambda rec: len(rec["text"]) - 10  # 10 question tokens fed one by one
    arms = parse_arms(["full", "locks-r4i4"], [64])
    kw = dict(protocol="sparse-question")
    assert _results(model, bench, arms, tmp_path / "s", engine="static", **kw) == _results(
        model, bench, arms, tmp_path / "e", **kw
    )


def _rows(lengths, seeds=None, max_new=10, finished=lambda new: False):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g) for n in lengths]
    seeds = seeds or [None] * len(lengths)
    return [Row(p[:-1], [int(p[-1])], max_new, finished, seed=s) for p, s in zip(prompts, seeds)]


def _decode(engine, rows, arms):
    return {arm.name: [(r.tokens, r.attended, r.context) for r in run.results] for arm, run in engine.run(rows, arms)}


@pytest.mark.slow  # eight batches decoded: about a minute of CPU
def test_batch_rows_equal_rows_alone_greedy_and_sampled():
    """A left-padded batch (different prompt lengths, k sampled rows of one prompt) gives every row
    the tokens and statistics it gets alone; sampling depends on the row's seed only."""
    model = tiny("llama")
    arms = parse_arms(["locks-r4i4", "quest"], [64])
    for sampling, lengths, seeds in (
        (None, (300, 270, 320), None),
        ({"temperature": 0.8, "top_p": 0.9}, (300, 300, 300), [5, 6, 7]),
    ):
        engine = StaticEngine(model, sampling=sampling)
        rows = _rows(lengths, seeds)
        if seeds:  # the same prompt in every row, as the k samples of a record
            rows = [Row(rows[0].prefix, rows[0].forced, r.max_new, r.finished, seed=r.seed) for r in rows]
        batch = _decode(engine, rows, arms)
        for i, row in enumerate(rows):
            alone = _decode(engine, [row], arms)
            for arm in arms:
                assert batch[arm.name][i] == alone[arm.name][0], (sampling, arm.name, i)
        if seeds:
            assert len({tuple(t) for t, _, _ in batch["quest-b64"]}) > 1  # different seeds, different samples


@pytest.mark.slow  # ten decodes: minutes of CPU
def test_arms_one_after_another_equal_a_fresh_prefill_each():
    """Rewinding the decode tail and switching summary layouts (r8i4 -> quest -> r4i4 -> r8i4 again,
    another budget) gives each arm what a fresh prefill gives it: tokens and attended counts."""
    model = tiny("llama")
    engine = StaticEngine(model)
    arms = parse_arms(["locks-r8i4", "quest", "locks-r4i4", "oracle"], [64]) + parse_arms(["locks-r8i4"], [96])
    rows = _rows((300, 280), max_new=20)  # 20 steps complete pages past the prompt's
    shared = _decode(engine, rows, arms)
    for arm in arms:
        assert shared[arm.name] == _decode(engine, rows, [arm])[arm.name], arm.name
    assert shared["locks-r8i4-b64"] != shared["locks-r8i4-b96"]


@pytest.mark.slow  # 90 reference decode steps: about a minute of CPU
def test_rewind_and_layout_switches_leave_the_cache_as_a_fresh_prefill():
    """LocksStaticCache.rewind / set_config: after decoding under r8i4, then Quest, then rewinding and
    switching back, the summaries, length and statistics are a fresh prefill's, and the next decode
    step gives its logits (tiny Llama, float64)."""
    from locks_hf import LocksConfig, LocksStaticCache

    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 250), generator=torch.Generator().manual_seed(4))
    r8, quest = LocksConfig(budget=64), LocksConfig(budget=64, selector="quest")
    cache = LocksStaticCache(model.config, max_cache_len=320, locks=r8)
    model(ids, past_key_values=cache)
    cache.mark_prefix()
    for locks in (r8, quest, r8.replace(budget=96)):  # decode 30 tokens (pages complete), then rewind
        cache.rewind()
        cache.set_config(locks)
        token = ids[:, -1:]
        for _ in range(30):
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    cache.rewind()
    cache.set_config(r8)
    fresh = LocksStaticCache(model.config, max_cache_len=320, locks=r8)
    model(ids, past_key_values=fresh)
    for layer, ref in zip(cache.locks_layers, fresh.locks_layers):
        assert int(layer.length_t) == 250 and not layer.row_counts.any() and not layer.counts.any()
        n = 250 // 16
        assert set(layer.summary) == set(ref.summary)
        for name, t in ref.summary.items():
            assert torch.equal(layer.summary[name][:, :, :n], t[:, :, :n]), name
    step = ids[:, -1:]
    assert torch.equal(model(step, past_key_values=cache).logits, model(step, past_key_values=fresh).logits)
    assert torch.equal(cache.row_stats(), fresh.row_stats())


def test_prefill_in_chunks_equals_one_prefill():
    model = tiny("llama")
    rows = _rows((300, 250), max_new=6)  # the short row's padding spans most of the first chunk
    arms = parse_arms(["locks-r4i4", "quest"], [64])
    assert _decode(StaticEngine(model, prefill_chunk=64), rows, arms) == _decode(StaticEngine(model), rows, arms)


def test_stop_checks_every_few_steps_cut_at_the_exact_step():
    """Stops found at a host check are cut back to the step where the answer ended."""
    model = tiny("llama")

    def finished(new):
        return len(new) == 5 and new[0] % 2 == 0 or 200 in new

    rows = _rows((300, 290, 310), max_new=20, finished=finished)
    arms = parse_arms(["locks-r4i4"], [64])
    every = _decode(StaticEngine(model, check_every=1), rows, arms)
    sparse = _decode(StaticEngine(model, check_every=16), rows, arms)
    assert every == sparse
    lengths = [len(t) for t, _, _ in every["locks-r4i4-b64"]]
    assert any(n < 20 for n in lengths)


def test_sampling_draws_from_the_nucleus():
    """Gumbel-max over the top-p nucleus with hashed uniforms: frequencies match the renormalized
    nucleus probabilities (brute force), tokens outside it never come."""
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.0, -1.0, -3.0]], dtype=torch.float64)
    t, p = 0.7, 0.8
    probs = torch.softmax(logits[0] / t, -1)
    order = probs.argsort(descending=True)
    keep = torch.zeros(6, dtype=torch.bool)
    mass = 0.0
    for i in order.tolist():  # a token stays if the mass ranked above it is <= p
        if mass <= p:
            keep[i] = True
        mass += float(probs[i])
    want = torch.where(keep, probs, 0.0) / probs[keep].sum()
    n = 20000
    seeds = torch.arange(n)
    draws = choose_tokens(logits.expand(n, -1), seeds, torch.tensor([7]), {"temperature": t, "top_p": p})
    freq = torch.bincount(draws, minlength=6).double() / n
    assert (freq[~keep] == 0).all()
    assert torch.allclose(freq, want, atol=0.015), (freq, want)
    u = hash_uniform(seeds, torch.tensor([3]), 64)
    assert 0 < float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.01
    assert torch.equal(u, hash_uniform(seeds, torch.tensor([3]), 64))
    assert not torch.equal(u, hash_uniform(seeds, torch.tensor([4]), 64))


def test_sampled_run_resumes_only_with_its_engine(tmp_path):
    model = tiny("llama")
    bench = ToyBench(lengths=(40,), samples=2, sampling={"temperature": 0.7, "top_p": 0.9}, max_new=2)
    arms = parse_arms(["full"], [64])
    SweepRunner(model, TOK, bench, arms, tmp_path, progress=False, engine="static").run()
    with pytest.raises(ValueError, match="different samples"):
        SweepRunner(model, TOK, bench, arms, tmp_path, progress=False).run()


def test_static_sweep_runs_every_arm_the_eager_path_decodes_too(tmp_path):
    """--engine static with arms it cannot decode itself (a shared-basis control, token-level
    baselines, min_context): those take the eager path, and every merged line equals the eager
    runner's; the engine itself still refuses them."""
    model = tiny("llama")
    arms = parse_arms(["locks-r4i4", "shared_basis-r8", "rkv", "triattention"], [64])
    bench = ToyBench(lengths=(300, 290), max_new=6)
    eager = _results(model, bench, arms, tmp_path / "eager")
    runner = SweepRunner(model, TOK, bench, arms, tmp_path / "static", progress=False, engine="static")
    assert [a.name for a in runner.static_arms] == ["locks-r4i4-b64"]
    runner.run()
    merge(tmp_path / "static")
    assert (tmp_path / "static" / "results.jsonl").read_text() == eager
    assert {a["arm"] for a in runner.arm_runs} == {"locks-r4i4-b64"}
    with pytest.raises(ValueError, match="eager path"):
        list(StaticEngine(model).run(_rows((300,)), arms))


def test_arms_differing_only_in_budget_share_one_step():
    """Page lists are sized for the widest arm up front; an arm that differs from an earlier one only
    in budget replays that arm's step (same buffers) and still gets what it gets alone."""
    model = tiny("llama")
    engine = StaticEngine(model)
    arms = parse_arms(["locks-r4i4"], [64, 128]) + parse_arms(["quest"], [64]) + parse_arms(["locks-r4i4"], [96, 32])
    rows = _rows((300, 280), max_new=12)
    runs = list(engine.run(rows, arms))
    assert [run.new_step for _, run in runs] == [True, False, True, False, False]
    for arm, run in runs:
        alone = _decode(engine, rows, [arm])[arm.name]
        assert [(r.tokens, r.attended, r.context) for r in run.results] == alone, arm.name
    batch = engine.prepare(rows, arms[0].config, max_budget=128)
    assert {layer.page_slots()[0] for layer in batch.cache.locks_layers} == {8}  # ceil(128 / 16), from the start
    batch.close()


@pytest.mark.gpu  # CUDA graphs and the compiled kernels
@pytest.mark.parametrize("step", ["graph", "compile"])
def test_steps_replayed_across_budgets_equal_fresh_steps_on_cuda(step):
    """On a GPU: one captured (or compiled) step replayed for arms that differ only in budget gives
    each arm the tokens and statistics of the eager step run for that arm alone."""
    from locks_hf.models import tiny_model

    model = tiny_model("llama", head_dim=64).to("cuda")
    arms = parse_arms(["locks-r4i4"], [64, 128, 96]) + parse_arms(["quest"], [64, 128])
    rows = _rows((600, 560), max_new=40)
    runs = list(StaticEngine(model, step=step).run(rows, arms))
    assert [run.new_step for _, run in runs] == [True, False, False, True, False]
    for arm, run in runs:
        alone = _decode(StaticEngine(model, step="eager"), rows, [arm])[arm.name]
        assert [(r.tokens, r.attended, r.context) for r in run.results] == alone, arm.name


def test_static_engine_refuses_bad_settings(tmp_path):
    model = tiny("llama")
    arms = parse_arms(["locks-r4i4"], [64])
    with pytest.raises(ValueError, match="engine"):
        SweepRunner(model, TOK, ToyBench(), arms, tmp_path, engine="fast")
    with pytest.raises(ValueError, match="CUDA"):
        StaticEngine(model, step="graph")
    with pytest.raises(ValueError, match="top_p"):
        StaticEngine(model, sampling={"temperature": 0.7, "top_k": 20})


@pytest.mark.gpu  # CUDA graphs and the compiled kernels
@pytest.mark.parametrize("step", ["graph", "compile"])
def test_cuda_graph_and_compiled_steps_equal_the_eager_step_on_cuda(step):
    """On a GPU (the kernels): a left-padded batch decoded by replayed CUDA graphs, or by the compiled
    step, gives the eager step's tokens and statistics for every arm, greedy and sampled."""
    from locks_hf.models import tiny_model

    # d=64: wide enough for the kernels; float32 so that inductor's fusions cannot flip a token
    model = tiny_model("llama", head_dim=64).to("cuda")
    arms = parse_arms(["locks-r4i4", "quest", "oracle", "full"], [64])
    for sampling in (None, {"temperature": 0.8, "top_p": 0.9}):
        rows = _rows((600, 560), seeds=[1, 2], max_new=40)
        eager = _decode(StaticEngine(model, step="eager", sampling=sampling), rows, arms)
        assert _decode(StaticEngine(model, step=step, sampling=sampling), rows, arms) == eager


def test_rewind_of_an_empty_cache_to_its_empty_prefix():
    """`mark_prefix` before any forward marks an empty prefix: `rewind` returns to it (nothing held, no
    buffers yet) instead of failing on buffers a first forward would allocate, and the cache then
    prefills and decodes as a fresh one (tiny Llama, float64)."""
    from locks_hf import LocksConfig, LocksStaticCache

    model = tiny("llama")
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    cache = LocksStaticCache(model.config, max_cache_len=64, locks=LocksConfig(budget=32))
    cache.mark_prefix()
    cache.rewind()
    assert cache.get_seq_length() == 0
    with pytest.raises(ValueError, match="rewind to 0..0"):
        cache.locks_layers[0].rewind(3)
    fresh = LocksStaticCache(model.config, max_cache_len=64, locks=LocksConfig(budget=32))
    got = model(ids, past_key_values=cache).logits
    assert torch.equal(got, model(ids, past_key_values=fresh).logits)
