"""LocksCache's two layouts: the static one (compiled decode on a GPU) gives what the dynamic one gives.

The static layout runs on the CPU too (the PyTorch reference path), so every feature generate()
uses is compared here token for token: padding, beams, sampling, growth past the first capacity,
fork, continuing a cache, cropping, budgets switched in place.
"""

import logging

import pytest
import torch
from conftest import tiny
from selector_lists import selectors
from transformers import CompileConfig
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksLayer, LocksStaticCache, layout
from locks_hf.selectors import selector_class
from locks_hf.static_cache import LocksStaticLayer

#: cache API, generate() with padding, beams and sampling, layouts, fork: checked on every supported version.
pytestmark = pytest.mark.compat


def _ids(n=300, b=1, seed=1):
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def _pair(model, cfg, **static_kwargs):
    return (
        LocksCache(model.config, cfg, layout="dynamic"),
        LocksCache(model.config, cfg, layout="static", **static_kwargs),
    )


# -- routing -----------------------------------------------------------------------------------------
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the routing of a machine without CUDA")
def test_a_cpu_machine_keeps_the_dynamic_layout():
    model = tiny("gemma3")
    cache = LocksCache(model.config, LocksConfig(budget=64))
    assert not cache.is_static and not cache.is_compileable
    model.generate(_ids(), max_new_tokens=4, do_sample=False, past_key_values=cache)
    assert [type(layer) for layer in cache.layers] == [DynamicSlidingWindowLayer, LocksLayer] * 2


def test_auto_layout_follows_the_backend_and_the_config(monkeypatch, caplog):
    model = tiny("llama")
    monkeypatch.setattr(layout, "device_refusal", lambda: None)  # as on a GPU with the kernels
    cache = LocksCache(model.config, LocksConfig(budget=64))
    assert cache.is_static and cache.is_compileable  # answered before the first forward (generate asks)
    with caplog.at_level(logging.WARNING, logger="locks_hf.layout"):
        shared = LocksCache(model.config, LocksConfig(budget=64, selector="shared_basis", rank=8))
    assert not shared.is_static and "shared_basis" in caplog.text and "dynamic layout" in caplog.text
    assert not LocksCache(model.config, LocksConfig(min_context=512)).is_static
    monkeypatch.setattr(layout, "device_refusal", lambda: "no CUDA device")
    assert not LocksCache(model.config).is_static


@pytest.mark.parametrize(
    "bad, match", [(dict(selector="shared_all", rank=8), "selector"), (dict(min_context=512), "min_context")]
)
def test_static_layout_refuses_what_it_cannot_do(bad, match):
    model = tiny("llama")
    with pytest.raises(LocksConfigError, match=match):
        LocksCache(model.config, LocksConfig(**bad), layout="static")
    with pytest.raises(LocksConfigError, match="layout"):
        LocksCache(model.config, layout="fast")


# -- generate(): static layout = dynamic layout ------------------------------------------------------------
def test_static_layout_generates_the_dynamic_tokens_and_grows(arch, caplog):
    """Left padding in a batch, a capacity exceeded during decode (grown once, logged), gemma3's
    sliding layers included."""
    model = tiny(arch)
    cfg = LocksConfig(budget=64)
    ids = torch.cat([_ids(300, seed=2), torch.cat([torch.zeros(1, 40, dtype=torch.long), _ids(260, seed=3)], 1)])
    mask = torch.ones_like(ids)
    mask[1, :40] = 0
    dynamic, static = _pair(model, cfg, max_cache_len=310)
    outs = []
    with caplog.at_level(logging.WARNING, logger="locks_hf.cache"):
        for cache in (dynamic, static):
            outs.append(
                model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, past_key_values=cache)
            )
    assert torch.equal(outs[0], outs[1])
    assert static.capacity > 324 and "growing the static cache" in caplog.text
    assert all(isinstance(layer, (LocksStaticLayer, StaticSlidingWindowLayer)) for layer in static.layers)
    assert 0 < static.attended_fraction() < 0.5
    assert static.attended_fraction() == pytest.approx(dynamic.attended_fraction())


def test_static_layout_at_a_covering_budget_gives_dense_tokens():
    """Dense tokens; and on a CPU model generate() does not compile even though the cache says it is
    compileable (transformers auto-compiles on accelerators only)."""
    import torch._dynamo

    ids = _ids()
    ref = tiny("qwen3", "sdpa").generate(ids, max_new_tokens=8, do_sample=False)
    model = tiny("qwen3")
    cache = LocksCache(model.config, LocksConfig(budget=1024), layout="static")
    assert cache.is_compileable
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    assert torch.equal(model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache), ref)
    assert cache.attended_fraction() == 1.0
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 0


@pytest.mark.parametrize(
    "kwargs",
    [dict(num_beams=3, do_sample=False), dict(do_sample=True, top_k=20, num_return_sequences=2)],
    ids=["beams", "sampling"],
)
def test_static_layout_beams_and_sampling(kwargs):
    model = tiny("llama")
    outs = []
    for cache in _pair(model, LocksConfig(budget=64)):
        torch.manual_seed(0)
        outs.append(model.generate(_ids(280), max_new_tokens=10, past_key_values=cache, **kwargs))
    assert torch.equal(outs[0], outs[1])


def test_static_layout_continues_a_used_cache():
    """A second generate() on the same cache (chat continuation): prompt + answer + new turn."""
    model = tiny("llama")
    outs = []
    for cache in _pair(model, LocksConfig(budget=64)):
        first = model.generate(_ids(250), max_new_tokens=8, do_sample=False, past_key_values=cache)
        turn = torch.cat([first, _ids(30, seed=9)], 1)
        outs.append(model.generate(turn, max_new_tokens=8, do_sample=False, past_key_values=cache))
    assert torch.equal(outs[0], outs[1])


def test_fork_and_budget_switch_in_place():
    """A fork of a prefilled static cache decodes like a fresh cache with the fork's budget (switched in
    place; page lists sized for ``max_budget``, widened beyond) and leaves the original untouched."""
    model = tiny("llama")
    ids = _ids(240)
    small, large = LocksConfig(budget=64), LocksConfig(budget=96)
    fresh = model.generate(
        ids, max_new_tokens=6, do_sample=False, past_key_values=LocksCache(model.config, large, layout="dynamic")
    )
    base = LocksCache(model.config, small, layout="static", max_budget=128)
    first = model(ids, past_key_values=base).logits[:, -1:].argmax(-1)
    fork = base.fork(large)
    out = model.generate(torch.cat([ids, first], 1), max_new_tokens=5, do_sample=False, past_key_values=fork)
    assert torch.equal(out, fresh)
    assert int(base.layers[0].length_tensor()) == 240 and base.locks_config.budget == 64  # untouched
    assert base.layers[0].keys.data_ptr() != fork.layers[0].keys.data_ptr()
    base.set_budget(256)  # wider than max_budget: the page lists widen (a compiled step would recompile once)
    assert base.layers[0].page_slots()[0] == 16 and int(base.layers[0].slots_t) == 16
    # one settings object shared by every layer: a compiled step guards on the layers sharing it
    assert all(layer.config is base.locks_config for layer in base.locks_layers)


@pytest.mark.parametrize("selector", selectors(token_level=False, dense=False))
def test_fork_to_another_selector(selector, caplog):
    """From a dense-prefilled static cache (as the sweeps prefill once), a fork to another selector
    rebuilds its summaries (static layout) or, for a selector the static layout cannot serve,
    converts to the dynamic layout with a logged reason: the tokens are those of a dynamic fork."""
    model = tiny("gemma3")
    ids = _ids(240)
    arm = LocksConfig(budget=64, selector=selector, rank=8)
    outs = []
    for layout_name in ("dynamic", "static"):
        base = LocksCache(model.config, LocksConfig(selector="full"), layout=layout_name)
        with torch.no_grad():
            first = model(ids, past_key_values=base).logits[:, -1:].argmax(-1)
        with caplog.at_level(logging.WARNING, logger="locks_hf.cache"):
            fork = base.fork(arm)
        outs.append(model.generate(torch.cat([ids, first], 1), max_new_tokens=8, do_sample=False, past_key_values=fork))
    assert torch.equal(outs[0], outs[1])
    static = selector_class(selector).static_cache
    assert fork.is_static == static
    assert ("dynamic layout" in caplog.text) == (not static)


def test_static_layout_refuses_assisted_decoding():
    """Prompt-lookup (assisted) decoding verifies drafts in multi-token forwards, which would run dense:
    refused before any token, in the static layout as in the dynamic one."""
    from locks_hf import UnsupportedModelError

    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=1024), layout="static")
    with pytest.raises(UnsupportedModelError, match="prompt-lookup"):
        model.generate(_ids(200), max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=3, past_key_values=cache)


def test_long_generation_keeps_its_buffers_and_summarizes_decode_pages():
    """Capacity known up front: no re-allocation over a long decode (the buffers keep their address,
    memory is flat per token) and every page completed during decode is summarized in place, as the
    dynamic cache summarizes it."""
    model = tiny("llama")
    cfg = LocksConfig(budget=64)
    dynamic, static = _pair(model, cfg, max_cache_len=40 + 120)
    outs = [model.generate(_ids(40), max_new_tokens=8, do_sample=False, past_key_values=c) for c in (dynamic, static)]
    addresses = [layer.keys.data_ptr() for layer in static.locks_layers]
    outs = [
        model.generate(o, max_new_tokens=112, do_sample=False, past_key_values=c)
        for o, c in zip(outs, (dynamic, static))
    ]
    assert torch.equal(outs[0], outs[1])
    assert [layer.keys.data_ptr() for layer in static.locks_layers] == addresses
    for d, s in zip(dynamic.locks_layers, static.locks_layers):
        n = d.n_summarized[0]
        assert n == int(s.row_tensors()[1][0]) == 159 // 16
        for name, t in d.summary_view().items():
            assert torch.equal(s.summary[name][:, :, :n], t[:, :, :n]), name


def test_compiled_generate_with_growth_recompiles_once_per_growth():
    """generate() compiles the decode step of the static layout (dynamo on the CPU, no CUDA graphs):
    same tokens as eager, fullgraph, and one graph per capacity (a growth recompiles exactly once)."""
    import torch._dynamo

    model = tiny("llama", dtype=torch.float32)
    cfg = LocksConfig(budget=64)
    ids = _ids(200)
    eager = model.generate(
        ids,
        max_new_tokens=40,
        do_sample=False,
        disable_compile=True,
        past_key_values=LocksCache(model.config, cfg, layout="static", max_cache_len=224),
    )
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps the counters of earlier tests in this process
    compile_config = CompileConfig(fullgraph=True, backend="eager")
    compile_config._compile_all_devices = True  # transformers auto-compiles on accelerators only
    cache = LocksCache(model.config, cfg, layout="static", max_cache_len=224)
    compiled = model.generate(
        ids, max_new_tokens=40, do_sample=False, compile_config=compile_config, past_key_values=cache
    )
    assert torch.equal(compiled, eager)
    assert cache.capacity > 240
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, torch._dynamo.utils.counters


def test_static_cache_alias_keeps_a_fixed_capacity():
    model = tiny("llama")
    cache = LocksStaticCache(model.config, max_cache_len=310)
    assert cache.is_static and isinstance(cache, LocksCache)
    with pytest.raises(ValueError, match="max_cache_len"):
        model.generate(_ids(300), max_new_tokens=30, do_sample=False, past_key_values=cache)


# -- on the GPU (run by the CI of the GPU machine) -----------------------------------------------------------
def _cuda_model():
    from locks_hf.models import tiny_model

    # d=64: wide enough for the kernels; float32 so that inductor's fusions cannot flip a greedy token
    model = tiny_model("llama", head_dim=64).to("cuda")
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


@pytest.mark.gpu  # the compiled kernels and CUDA graphs
def test_one_liner_compiles_once_across_budgets_on_cuda():
    """The README one-liner takes the static layout by itself; generate() compiles its decode step
    (inductor + CUDA graphs) once; budgets up to ``max_budget`` switch without a recompile; the tokens
    equal the same layout's uncompiled decode at every budget, and the dynamic layout's over 40
    tokens; memory stays flat however many tokens are decoded.

    Over 150 tokens the dynamic layout may part from the static one (scripts/dev/check_layouts_gpu.py):
    its pages are summarized by the batched build, the static layout's in place by the per-step
    update, and a last-bit difference in a basis can move an int4 code and flip a near-tie page."""
    import torch._dynamo

    model = _cuda_model()
    ids = _ids(600).cuda()
    cache = LocksCache(model.config, budget=64, max_budget=128, max_cache_len=800)
    assert cache.is_static
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=cache)  # compiles
    allocated = []
    for budget, new in ((64, 40), (96, 40), (128, 150)):
        eager = LocksCache(model.config, budget=budget, max_budget=128, max_cache_len=800)
        want = model.generate(ids, max_new_tokens=new, do_sample=False, disable_compile=True, past_key_values=eager)
        if new <= 40:
            dynamic = model.generate(
                ids,
                max_new_tokens=new,
                do_sample=False,
                past_key_values=LocksCache(model.config, budget=budget, layout="dynamic"),
            )
            assert torch.equal(dynamic, want), budget
        del eager
        cache.reset()
        cache.set_budget(budget)
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = model.generate(ids, max_new_tokens=new, do_sample=False, past_key_values=cache)
        assert torch.equal(got, want), budget
        del want, got
        torch.cuda.synchronize()
        allocated.append(torch.cuda.memory_allocated())
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1, torch._dynamo.utils.counters
    assert max(allocated) - min(allocated) < 1 << 20, allocated  # 40 or 150 new tokens: same memory


@pytest.mark.gpu  # the compiled kernels and CUDA graphs
def test_one_liner_grows_during_compiled_decode_on_cuda():
    """Without max_cache_len the one-liner sizes its buffers at the prompt and grows them (once here)
    between two compiled steps: one recompile, no write out of bounds, the dynamic layout's tokens."""
    import torch._dynamo

    model = _cuda_model()
    ids = _ids(600).cuda()
    want = model.generate(
        ids, max_new_tokens=60, do_sample=False, past_key_values=LocksCache(model.config, budget=64, layout="dynamic")
    )
    cache = LocksCache(model.config, budget=64, max_cache_len=620)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()  # reset() keeps them: earlier compiles in this process would count
    got = model.generate(ids, max_new_tokens=60, do_sample=False, past_key_values=cache)
    assert torch.equal(got, want)
    assert cache.capacity >= 660
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2, torch._dynamo.utils.counters


@pytest.mark.gpu  # the compiled kernels and CUDA graphs
def test_captured_decode_step_gives_the_compiled_tokens_on_cuda(caplog):
    """``compile_config=decode_compile_config()``: inductor's step captured by the library in one CUDA
    graph gives the tokens of the same step uncompiled, on a fresh cache and then on a second cache of
    the same shapes (new buffers: captured again, not replayed on the first cache's)."""
    import torch._dynamo

    from locks_hf import captured_step, decode_compile_config

    model = _cuda_model()
    ids = _ids(600).cuda()
    torch._dynamo.reset()
    for budget in (64, 64):
        eager = LocksCache(model.config, budget=budget, max_cache_len=700)
        want = model.generate(ids, max_new_tokens=40, do_sample=False, disable_compile=True, past_key_values=eager)
        cache = LocksCache(model.config, budget=budget, max_cache_len=700)
        assert cache.is_static and cache.is_compileable
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=captured_step.__name__):
            got = model.generate(
                ids, max_new_tokens=40, do_sample=False, past_key_values=cache, compile_config=decode_compile_config()
            )
        assert torch.equal(got, want)
        assert "captured step:" in caplog.text and "copied in each step" in caplog.text, (
            caplog.text,
            dict(torch._dynamo.utils.counters["stats"]),
        )
