"""LocksCache + attn_implementation="locks" inside generate(), on tiny models of each architecture."""

import pytest
import torch
from conftest import tiny
from selector_lists import selectors
from transformers.cache_utils import DynamicSlidingWindowLayer

from locks_hf import LocksCache, LocksConfig, LocksLayer

#: cache API, generate() with padding, beams and sampling, layouts, fork: checked on every supported version.
pytestmark = pytest.mark.compat

PROMPT = 300


def _ids(n=PROMPT, b=1, seed=1):
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("selector", selectors(token_level=False))
def test_covering_budget_gives_dense_tokens(arch, selector):
    ids = _ids()
    ref = tiny(arch, "sdpa").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny(arch)
    cache = LocksCache(model.config, LocksConfig(budget=1024, selector=selector))
    out = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)
    assert cache.attended_fraction() == 1.0


def test_sparse_path_with_every_page_equals_dense():
    """The gather-and-attend path itself (not the dense shortcut) reproduces dense attention."""
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=32))
    model(_ids(100), past_key_values=cache)
    layer = cache.layers[0]
    layer.config = layer.config.replace(budget=2048)  # k > pages: selection takes every page
    q = torch.randn(1, 4, 1, 16, dtype=torch.float64)
    out = layer.backend.decode(layer, q, 0.25)
    k = layer.keys.repeat_interleave(2, dim=1)
    v = layer.values.repeat_interleave(2, dim=1)
    want = torch.softmax(0.25 * q @ k.transpose(-1, -2), -1) @ v
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-6)


@pytest.mark.parametrize("selector", selectors(token_level=False, dense=False))
def test_small_budget_attends_at_most_k_pages_each_step(arch, selector):
    model = tiny(arch)
    cfg = LocksConfig(budget=64, selector=selector)  # k = 4 pages of 16
    cache = LocksCache(model.config, cfg)
    out = model(_ids(), past_key_values=cache)
    token = out.logits[:, -1:].argmax(-1)
    G = model.config.num_attention_heads // model.config.num_key_value_heads
    limit = cfg.page_slots * (G if selector == "quest" else 1)
    for _ in range(6):
        out = model(token, past_key_values=cache)
        token = out.logits[:, -1:].argmax(-1)
        for layer in cache.locks_layers:
            counts = layer.last_selection.sum(-1)
            assert (counts <= limit).all() and (counts >= 2).all()
            if selector != "quest":
                assert (counts == cfg.page_slots).all()
    assert 0 < cache.attended_fraction() < 0.5


def _brute_sparse_output(layer, q, scale):
    """Attention over exactly the tokens of ``layer.last_selection``, written directly (float64)."""
    b, hq, _, d = q.shape
    h = layer.keys.shape[1]
    B = layer.config.page_size
    out = torch.zeros(b, 1, hq, d, dtype=torch.float64)
    for i in range(b):
        for head in range(hq):
            j = head // (hq // h)
            slots = [s for s in range(layer.length) if layer.last_selection[i, j, s // B] and layer.slot_valid[i, s]]
            k, v = layer.keys[i, j, slots].double(), layer.values[i, j, slots].double()
            out[i, 0, head] = torch.softmax(scale * k @ q[i, head, 0].double(), 0) @ v
    return out


@pytest.mark.parametrize("selector", selectors(token_level=False, dense=False))
def test_sparse_output_equals_attention_over_selected_tokens(selector):
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=64, selector=selector))
    model(_ids(250), past_key_values=cache)
    layer = cache.layers[1]
    q = torch.randn(1, 4, 1, 16, dtype=torch.float64)
    out = layer.backend.decode(layer, q, 0.25)
    assert torch.allclose(out, _brute_sparse_output(layer, q, 0.25), atol=1e-10)


@pytest.mark.parametrize("budget,selector", [(64, "locks"), (64, "oracle"), (64, "quest"), (1024, "locks")])
def test_left_padded_batch_equals_rows_run_alone(budget, selector):
    model = tiny("llama")
    a, b = _ids(260, seed=2)[0], _ids(190, seed=3)[0]
    batch = torch.stack([a, torch.cat([torch.zeros(70, dtype=torch.long), b])])
    mask = (torch.arange(260)[None] >= torch.tensor([[0], [70]])).long()
    cfg = LocksConfig(budget=budget, selector=selector)
    out = model.generate(
        batch, attention_mask=mask, max_new_tokens=8, do_sample=False, past_key_values=LocksCache(model.config, cfg)
    )
    for row, ids in enumerate([a, b]):
        alone = model.generate(
            ids[None], max_new_tokens=8, do_sample=False, past_key_values=LocksCache(model.config, cfg)
        )
        assert torch.equal(out[row, -8:], alone[0, -8:])


def test_padding_never_selected_and_not_summarized():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=64))
    ids = torch.cat([torch.zeros(1, 40, dtype=torch.long), _ids(220)], 1)
    mask = (torch.arange(260) >= 40).long()[None]
    model.generate(ids, attention_mask=mask, max_new_tokens=3, do_sample=False, past_key_values=cache)
    layer = cache.layers[0]
    assert not layer.slot_valid[0, :40].any() and layer.slot_valid[0, 40 : layer.length].all()
    assert layer.row_start == [40]  # pages start at the first real token, as if run alone
    assert layer.last_selection[0, :, 0].all()  # the sink
    assert layer.page_validity().sum() == layer.length - 40  # no pad slot in any page
    slots = layer._page_slots(torch.arange(layer.num_pages)[None])
    assert slots[layer.page_validity()[:, 0]].min() == 40


def test_beam_search_and_sampling_run():
    ids = _ids()
    model = tiny("qwen3")
    ref = tiny("qwen3", "sdpa").generate(ids, max_new_tokens=6, num_beams=3, do_sample=False)
    out = model.generate(
        ids,
        max_new_tokens=6,
        num_beams=3,
        do_sample=False,
        past_key_values=LocksCache(model.config, LocksConfig(budget=1024)),
    )
    assert torch.equal(out, ref)
    sparse = model.generate(
        ids,
        max_new_tokens=6,
        num_beams=3,
        do_sample=False,
        past_key_values=LocksCache(model.config, LocksConfig(budget=64)),
    )
    assert sparse.shape == ref.shape
    torch.manual_seed(0)
    sampled = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=True,
        top_k=20,
        past_key_values=LocksCache(model.config, LocksConfig(budget=64)),
    )
    assert sampled.shape == (1, PROMPT + 6)


def test_reorder_keeps_summaries_in_sync():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=64))
    model(_ids(200, b=3), past_key_values=cache)
    model(torch.ones(3, 1, dtype=torch.long), past_key_values=cache)  # builds summaries
    layer = cache.layers[0]
    before = {n: t.clone() for n, t in layer.summary_view().items()}
    beam_idx = torch.tensor([2, 0, 0])
    cache.reorder_cache(beam_idx)
    for name, t in layer.summary_view().items():
        assert torch.equal(t, before[name][beam_idx])
    rebuilt = layer.selector.summarize(*_pages_of(layer))
    for name, t in layer.summary_view().items():
        assert torch.equal(t, rebuilt[name])


def _pages_of(layer):
    n, B = max(layer.n_summarized), layer.config.page_size
    keys = layer.keys[:, :, : n * B].unflatten(2, (n, B))
    valid = layer.slot_valid[:, : n * B].unflatten(1, (n, B))[:, None].expand(-1, keys.shape[1], -1, -1)
    return keys, valid


def test_crop():
    """Cropping (generate's deferred stop check rolls back its last step) drops incomplete pages.
    Assisted decoding, the other user of crop, is refused (tests/test_refusals.py)."""
    ids = _ids(200)
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=1024))
    model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=cache)
    layer = cache.layers[0]
    layer.crop(-(layer.length - 150))
    assert layer.length == 150 and layer.n_summarized == [150 // 16] and layer.keys.shape[2] == 150


def test_gemma3_only_global_layers_select():
    model = tiny("gemma3")
    cache = LocksCache(model.config, LocksConfig(budget=64))
    model.generate(_ids(), max_new_tokens=4, do_sample=False, past_key_values=cache)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicSlidingWindowLayer, LocksLayer, DynamicSlidingWindowLayer, LocksLayer]
    for layer in cache.locks_layers:
        assert layer.last_selection is not None and layer.n_summarized == [layer.length // 16]
    assert cache.layers[0].keys.shape[2] < cache.layers[1].keys.shape[2]  # the window is untouched


def test_fork_decodes_like_a_fresh_cache():
    model = tiny("llama")
    ids = _ids(240)
    cfg = LocksConfig(budget=64, selector="quest")
    fresh = model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=LocksCache(model.config, cfg))
    base = LocksCache(model.config, LocksConfig(budget=64))
    first = model(ids, past_key_values=base).logits[:, -1:].argmax(-1)
    fork = base.fork(cfg)
    out = model.generate(torch.cat([ids, first], 1), max_new_tokens=5, do_sample=False, past_key_values=fork)
    assert torch.equal(out, fresh)
    assert base.layers[0].length == 240  # the original is untouched


def test_fork_shares_summaries_until_either_side_summarizes_a_page():
    model = tiny("llama")
    ids = _ids(250)  # 15 complete pages of 16 and 10 tokens: the 16th page completes after 6 decode steps
    cfg = LocksConfig(budget=64)
    fresh = model.generate(ids, max_new_tokens=10, do_sample=False, past_key_values=LocksCache(model.config, cfg))
    base = LocksCache(model.config, cfg)
    first = model(ids, past_key_values=base).logits[:, -1:].argmax(-1)
    before = {n: t.clone() for n, t in base.layers[0].summary.items()}
    fork, other = base.fork(), base.fork(cfg.replace(budget=128))  # the same layout: shared, not copied
    for name, t in base.layers[0].summary.items():
        assert fork.layers[0].summary[name].data_ptr() == t.data_ptr() == other.layers[0].summary[name].data_ptr()
    out = model.generate(torch.cat([ids, first], 1), max_new_tokens=9, do_sample=False, past_key_values=fork)
    assert torch.equal(out, fresh)  # the fork summarized its pages into a copy of its own
    for name, t in base.layers[0].summary.items():
        assert fork.layers[0].summary[name].data_ptr() != t.data_ptr()
    for name, t in base.layers[0].summary.items():  # the original's pages are untouched
        assert torch.equal(t[:, :, :15], before[name][:, :, :15])
    assert base.layers[0].n_summarized == [15]


def test_batch_repeat_and_select_keep_rows_consistent():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=64))
    ids = torch.cat([torch.zeros(1, 21, dtype=torch.long), _ids(200)], 1)
    ids = torch.cat([ids, _ids(221, seed=7)])
    mask = torch.ones_like(ids)
    mask[0, :21] = 0
    model(ids, attention_mask=mask, past_key_values=cache)
    model(
        torch.ones(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 222, dtype=torch.long), past_key_values=cache
    )
    layer = cache.layers[0]
    assert layer.row_start == [21, 0]
    summary = {n: t.clone() for n, t in layer.summary_view().items()}
    cache.batch_repeat_interleave(2)
    assert layer.row_start == [21, 21, 0, 0] and layer.keys.shape[0] == 4
    cache.batch_select_indices(torch.tensor([3, 0]))
    assert layer.row_start == [0, 21]
    for name, t in layer.summary_view().items():
        assert torch.equal(t, summary[name][[1, 0]])
    # decoding continues with the reordered rows
    model(
        torch.ones(2, 1, dtype=torch.long), attention_mask=torch.ones(2, 223, dtype=torch.long), past_key_values=cache
    )
    assert layer.last_selection.shape[0] == 2


# the page selectors whose state is fitted on the whole sequence (no static layout)
@pytest.mark.parametrize("selector", selectors(token_level=False, static_cache=False))
def test_shared_basis_controls_decode(selector):
    model = tiny("qwen3")
    cfg = LocksConfig(budget=64, selector=selector, rank=12)
    cache = LocksCache(model.config, cfg)
    model.generate(_ids(), max_new_tokens=20, do_sample=False, past_key_values=cache)
    for layer in cache.locks_layers:
        assert (layer.last_selection.sum(-1) == cfg.page_slots).all()
        assert layer.shared["seq_basis"].shape[:3] == (1, 2, 12)  # frozen after prefill, rank 12
        assert layer.n_summarized == [(PROMPT + 19) // 16]  # decode pages summarized with it


def test_continuing_with_an_input_that_does_not_extend_the_cache_behaves_as_a_dynamic_cache():
    """A cache holds K/V, not token ids: like transformers' DynamicCache, it takes whatever input follows
    as the continuation of what it holds (beam and assisted decoding rely on a cache not checking ids).
    Documented in the README's limits; at a covering budget the tokens are DynamicCache's."""
    from transformers import DynamicCache

    model, dense = tiny("llama"), tiny("llama", "sdpa")
    first, other = _ids(100, seed=5), _ids(150, seed=6)
    locks, dynamic = LocksCache(model.config, LocksConfig(budget=1024)), DynamicCache(config=dense.config)
    for ids in (first, other):  # the second prompt is not an extension of the first run's tokens
        got = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=locks)
        want = dense.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=dynamic)
        assert torch.equal(got, want)
    assert locks.get_seq_length() == dynamic.get_seq_length()


def test_the_library_passes_its_caches_by_the_keyword_the_release_names():
    """transformers >= 5.24 takes the cache as ``cache=`` and deprecates ``past_key_values=``: the demo's
    prefill and decode and the sweep runner pass it by the keyword the installed release names, so they
    warn on none (older releases name only ``past_key_values``)."""
    import warnings

    from locks_hf.compat import cache_keyword
    from locks_hf.demo import decode_from, prefill

    model = tiny("llama")
    assert cache_keyword(model) in ("cache", "past_key_values")
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = LocksCache(model.config, LocksConfig(selector="full"))
        first = prefill(model, ids, cache, chunk_size=16, progress=False)
        new = decode_from(model, ids, first, cache, max_new_tokens=4)
    assert new.shape == (1, 4)
    deprecated = [str(w.message) for w in caught if "past_key_values" in str(w.message)]
    assert not deprecated, deprecated
