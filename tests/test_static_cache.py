"""LocksStaticCache: same tokens as LocksCache, compiled decode with one graph and no recompiles."""

import pytest
import torch
from conftest import tiny
from selector_lists import selectors
from transformers import CompileConfig

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache

#: cache API, generate() with padding, beams and sampling, layouts, fork: checked on every supported version.
pytestmark = pytest.mark.compat

PROMPT = 300


def _ids(n=PROMPT, b=1, seed=1):
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("selector", selectors(static_cache=True))
def test_static_equals_dynamic_at_a_small_budget(arch, selector):
    """Same pages, same tokens: the static layout (capacity-wide page axis, per-step rebuild of the
    newest page) changes nothing but where the state lives."""
    model = tiny(arch)
    cfg = LocksConfig(budget=64, selector=selector)
    ids = _ids()
    want = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=LocksCache(model.config, cfg))
    static = LocksStaticCache(model.config, max_cache_len=PROMPT + 40, locks=cfg)
    got = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=static)
    assert torch.equal(got, want)
    if selector != "full":
        assert static.attended_fraction() < 0.5
    else:
        assert static.attended_fraction() == 1.0


def test_static_selection_and_summaries_match_dynamic():
    """After prefill + decode across a page boundary, the complete pages' summaries and the last
    page set are those of the dynamic cache (float64, tiny Llama)."""
    model = tiny("llama")
    cfg = LocksConfig(budget=64)
    ids = _ids(250)
    dyn = LocksCache(model.config, cfg, layout="dynamic")  # on a GPU the default would be static too
    sta = LocksStaticCache(model.config, max_cache_len=400, locks=cfg)
    for cache in (dyn, sta):
        token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
        for _ in range(20):  # 250 + 20 crosses the page boundary at 256
            token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
    for d, s in zip(dyn.locks_layers, sta.locks_layers):
        n = d.n_summarized[0]
        assert n == int(s.row_tensors()[1][0]) == 270 // 16
        for name, t in d.summary_view().items():
            assert torch.equal(s.summary[name][:, :, :n], t[:, :, :n]), name
        P = d.last_selection.shape[-1]
        assert torch.equal(s.last_selection[..., :P], d.last_selection)
        assert not s.last_selection[..., P:].any()


def test_static_left_padded_batch_equals_rows_alone():
    model = tiny("llama")
    cfg = LocksConfig(budget=64)
    a, b = _ids(300, seed=2), _ids(260, seed=3)
    pad = torch.zeros((1, 40), dtype=torch.long)
    batch = torch.cat([a, torch.cat([pad, b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :40] = 0
    out = model.generate(
        batch,
        attention_mask=mask,
        max_new_tokens=12,
        do_sample=False,
        past_key_values=LocksStaticCache(model.config, max_cache_len=320, locks=cfg),
    )
    for row, ids in ((0, a), (1, b)):
        alone = model.generate(
            ids,
            max_new_tokens=12,
            do_sample=False,
            past_key_values=LocksStaticCache(model.config, max_cache_len=320, locks=cfg),
        )
        assert torch.equal(out[row, -12:], alone[0, -12:])


def test_static_real_tokens_count_padding_and_holes():
    """The per-step count of real cached tokens (kept from prefill, no pass over the capacity) equals
    a brute-force count of the real written slots, step after step: left padding and a hole."""
    model = tiny("llama")
    ids = _ids(100, b=2)
    mask = torch.ones_like(ids)
    mask[1, :30] = 0  # left padding
    mask[0, 50] = 0  # a hole
    cache = LocksStaticCache(model.config, max_cache_len=160, locks=LocksConfig(budget=64))
    token = model(ids, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)
    for step in range(5):
        mask = torch.cat([mask, torch.ones((2, 1), dtype=mask.dtype)], 1)
        for layer in cache.locks_layers:
            written = int(layer.length_t)
            assert written == 100 + step
            assert int(layer.real_tokens()) == int(layer.slot_valid[:, :written].sum()) == int(mask[:, :-1].sum())
        token = model(token, attention_mask=mask, past_key_values=cache).logits[:, -1:].argmax(-1)


@pytest.mark.slow  # torch.compile of a whole decode step
def test_compiled_decode_is_one_graph_without_recompiles():
    """generate() auto-compiles the decode step of a static cache: fullgraph (no graph break), one
    graph for every step (nothing that changes per step is a Python value), same tokens as eager."""
    import torch._dynamo

    model = tiny("llama", dtype=torch.float32)
    cfg = LocksConfig(budget=64)
    ids = _ids(200)
    eager = model.generate(
        ids,
        max_new_tokens=30,
        do_sample=False,
        disable_compile=True,
        past_key_values=LocksStaticCache(model.config, max_cache_len=256, locks=cfg),
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers auto-compiles on accelerators only
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(
            ids,
            max_new_tokens=30,
            do_sample=False,
            compile_config=compile_config,
            past_key_values=LocksStaticCache(model.config, max_cache_len=256, locks=cfg),
        )
    assert torch.equal(compiled, eager)
    frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert frames == 1, torch._dynamo.utils.counters


def test_static_beam_search_equals_dynamic():
    model = tiny("llama")
    cfg = LocksConfig(budget=64)
    ids = _ids(280)
    kwargs = dict(max_new_tokens=12, num_beams=3, do_sample=False)
    want = model.generate(ids, past_key_values=LocksCache(model.config, cfg), **kwargs)
    got = model.generate(ids, past_key_values=LocksStaticCache(model.config, max_cache_len=300, locks=cfg), **kwargs)
    assert torch.equal(got, want)


def test_static_cache_too_small_for_the_prompt_says_so():
    model = tiny("llama")
    with pytest.raises(ValueError, match="max_cache_len"):
        model(_ids(300), past_key_values=LocksStaticCache(model.config, max_cache_len=280))


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(selector="shared_basis"), "selector"),
        (dict(min_context=512), "min_context"),
    ],
)
def test_static_refuses_what_it_cannot_do(bad, match):
    model = tiny("llama")
    with pytest.raises(LocksConfigError, match=match):
        LocksStaticCache(model.config, max_cache_len=256, locks=LocksConfig(**bad))


def test_static_cache_crop_equals_dynamic():
    """Cropping a static cache (assisted decoding, rollbacks) forgets the last tokens exactly as the
    dynamic cache does: decoding on from the cropped cache gives the same tokens."""
    model = tiny("llama")
    cfg = LocksConfig(budget=64)
    ids = _ids(250)
    static = LocksStaticCache(model.config, max_cache_len=320, locks=cfg)
    assert static.attended_fraction() != static.attended_fraction()  # nan before any decode step
    outs = []
    for cache in (LocksCache(model.config, cfg), static):
        out = model.generate(ids, max_new_tokens=20, do_sample=False, past_key_values=cache)
        cache.crop(-12)  # 269 -> 257 cached: the page completed at 256 stays, the next one is partial again
        outs.append(model.generate(out[:, :-12], max_new_tokens=10, do_sample=False, past_key_values=cache))
    assert torch.equal(outs[0], outs[1])
    with pytest.raises(ValueError, match="negative"):
        static.crop(10)


@pytest.mark.gpu  # CUDA graphs and the compiled kernels
@pytest.mark.parametrize("selector", selectors(static_cache=True, summary_of=None))
def test_generate_auto_compiles_the_kernel_decode_step_on_cuda(selector):
    """On a GPU, generate() with a LocksStaticCache compiles the decode step (inductor + CUDA graphs,
    the kernels as custom ops): same tokens as the eager static cache and as the dynamic LocksCache
    (for ``"full"``: dense decode on our attention kernel = the dynamic cache's SDPA)."""
    import torch._dynamo

    from locks_hf.models import tiny_model

    # d=64: wide enough for the kernels; float32 so that inductor's fusions cannot flip a greedy token
    model = tiny_model("llama", head_dim=64).to("cuda")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    cfg = LocksConfig(budget=64, selector=selector)
    ids = _ids(600).cuda()
    kwargs = dict(max_new_tokens=40, do_sample=False)
    dynamic = model.generate(ids, past_key_values=LocksCache(model.config, cfg), **kwargs)
    eager = model.generate(
        ids,
        past_key_values=LocksStaticCache(model.config, max_cache_len=700, locks=cfg),
        disable_compile=True,
        **kwargs,
    )
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        compiled = model.generate(
            ids,
            past_key_values=LocksStaticCache(model.config, max_cache_len=700, locks=cfg),
            compile_config=CompileConfig(fullgraph=True),
            **kwargs,
        )
    assert torch.equal(eager, dynamic)
    assert torch.equal(compiled, eager)
