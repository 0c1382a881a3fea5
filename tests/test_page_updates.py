"""One launch for the per-step page updates of a cache's layers (`locks_hf.page_updates`).

On the CPU the Triton kernels run under ``TRITON_INTERPRET=1`` (conftest), with the layers put on the kernel
backend as a GPU would (``choose_backend`` patched); ``-m gpu`` runs the same generate() on the GPU's kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: run the Triton kernel tests with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

import locks_hf.paged  # noqa: E402
from locks_hf import LocksCache, LocksConfig, LocksStaticCache, models, page_updates  # noqa: E402
from locks_hf.backends import TRITON  # noqa: E402
from locks_hf.backends.triton import compile_decode_kernels  # noqa: E402
from locks_hf.kernels import page_update  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
LAYERS, ROWS, KV_HEADS, B = 3, 2, 2, 8


def tiny_model():
    model = models.tiny_model(
        "llama",
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=KV_HEADS,
        head_dim=32,
        eos_token_id=None,
        pad_token_id=None,
    )
    return model.to(DEV)


@pytest.fixture
def on_kernels(monkeypatch):
    """The layers on the kernel backend (a GPU's choice) and every page-update launch recorded as
    ``(grid, layers)``."""
    if DEV == "cpu":
        monkeypatch.setattr(locks_hf.paged, "choose_backend", lambda layer: TRITON)
    launches: list = []
    real = page_update.launch

    def recorded(kernel, grid, *args, **kwargs):
        launches.append((grid, kwargs["LAYERS"]))
        real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(page_update, "launch", recorded)
    return launches


def decode(model, monkeypatch, launches, grouped: str, steps: int = 10):
    monkeypatch.setenv(page_updates.GROUP_ENV, grouped)
    cache = LocksCache(model.config, layout="static", max_cache_len=64, page_size=B, budget=3 * B)
    ids = torch.randint(0, 256, (ROWS, 29), generator=torch.Generator().manual_seed(5)).to(DEV)
    launches.clear()
    with torch.no_grad():
        out = model.generate(ids, past_key_values=cache, max_new_tokens=steps, do_sample=False, disable_compile=True)
    return out, cache, list(launches)


@pytest.mark.parametrize("per_launch,plan", [(40, {2: (0, 1, 2)}), (2, {1: (0, 1), 2: (2,)})])
def test_a_cache_launches_its_layers_page_updates_once_a_step(monkeypatch, on_kernels, per_launch, plan):
    """With grouping (the default) the layers' page updates are one launch a decode step over every layer,
    at the last layer (or, past `MAX_LAYERS_PER_LAUNCH`, one a part at the part's last layer); without, one a
    layer. The tokens, every layer's summaries (one of the 9 decode steps, at length 32, completes a page) and
    complete-page counts are the same bit for bit."""
    monkeypatch.setattr(page_updates, "MAX_LAYERS_PER_LAUNCH", per_launch)
    model = tiny_model()
    got = {mode: decode(model, monkeypatch, on_kernels, mode) for mode in ("1", "0")}
    (tokens, cache, launches), (own_tokens, own_cache, own_launches) = got["1"], got["0"]
    steps = tokens.shape[1] - 29 - 1  # the first new token comes from the prefill
    assert cache.page_update_plan == plan
    assert all(layer.page_update_deferred for layer in cache.layers)
    assert own_cache.page_update_plan == {} and not any(layer.page_update_deferred for layer in own_cache.layers)
    assert launches == [((len(part) * ROWS * KV_HEADS,), len(part)) for part in plan.values()] * steps
    assert own_launches == [((ROWS * KV_HEADS,), 1)] * (LAYERS * steps)
    assert torch.equal(tokens, own_tokens)
    for layer, own in zip(cache.layers, own_cache.layers):
        assert torch.equal(layer.n_complete, own.n_complete) and int(layer.n_complete[0]) == 38 // B
        for name, t in layer.summary.items():
            assert torch.equal(t.view(torch.uint8), own.summary[name].view(torch.uint8)), name


def test_the_plan_follows_the_layers_settings(monkeypatch, on_kernels):
    """Each prefill and each change of settings through the cache plans the launches again (an unchanged plan
    stays the same object): Quest's summaries are grouped as Locks' are, a dense fork keeps no summary and groups
    nothing, and a layer changed behind the cache's back is refused at the launch instead of being skipped."""
    model = tiny_model()
    monkeypatch.setenv(page_updates.GROUP_ENV, "1")
    cache = LocksStaticCache(model.config, max_cache_len=64, page_size=B, budget=3 * B)
    ids = torch.randint(0, 256, (ROWS, 29), generator=torch.Generator().manual_seed(6)).to(DEV)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert cache.page_update_plan == {LAYERS - 1: tuple(range(LAYERS))}
    plan = cache.page_update_plan
    cache.reset()
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    assert cache.page_update_plan is plan  # an equal plan keeps its object: a compiled step's guards hold
    cache.set_config(LocksConfig(selector="quest", page_size=B, budget=3 * B))
    assert cache.page_update_plan == {LAYERS - 1: tuple(range(LAYERS))}
    assert all(layer.kernel_plan.method == "quest" for layer in cache.layers)
    dense = cache.fork(LocksConfig(selector="full", page_size=B, budget=3 * B))
    assert dense.page_update_plan == {} and not any(layer.page_update_deferred for layer in dense.layers)
    assert cache.page_update_plan == {LAYERS - 1: tuple(range(LAYERS))}  # the original keeps its own
    cache.layers[0].set_config(LocksConfig(selector="locks", page_size=B, budget=3 * B))  # not through the cache
    with pytest.raises(RuntimeError, match="no longer match.*through the cache"):
        page_updates.launch_page_updates(cache.layers, cache.page_update_plan[LAYERS - 1])


def test_the_background_compile_compiles_the_launches_of_the_plan(monkeypatch, on_kernels):
    """The compile during the prefill (`compile_decode_kernels` with the plan's launch sizes) makes the grouped
    page update's launches and a step without its own update, as a grouped decode step then launches them."""
    model = tiny_model()
    monkeypatch.setenv(page_updates.GROUP_ENV, "1")
    cache = LocksCache(model.config, layout="static", max_cache_len=64, page_size=B, budget=3 * B)
    ids = torch.randint(0, 256, (ROWS, 29), generator=torch.Generator().manual_seed(6)).to(DEV)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    on_kernels.clear()
    compile_decode_kernels(cache.layers[0], model.config.num_attention_heads, tuple(page_updates.launch_sizes(LAYERS)))
    assert on_kernels == [((LAYERS * ROWS * KV_HEADS,), LAYERS)]
    on_kernels.clear()
    with torch.no_grad():
        model(ids[:, :1], past_key_values=cache, use_cache=True)
    assert on_kernels == [((LAYERS * ROWS * KV_HEADS,), LAYERS)]
    assert page_updates.launch_sizes(LAYERS) == [LAYERS] and page_updates.launch_sizes(81) == [27, 27, 27]


@pytest.mark.gpu
def test_on_a_gpu_the_compiled_step_launches_the_page_updates_once(monkeypatch, on_kernels):
    """The compiled one-token step (torch.compile, CUDA graphs) with grouped page updates gives the tokens of
    one launch a layer."""
    model = tiny_model().to(torch.bfloat16)
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(page_updates.GROUP_ENV, mode)
        cache = LocksCache(model.config, layout="static", max_cache_len=64, page_size=B, budget=3 * B)
        ids = torch.randint(0, 256, (ROWS, 29), generator=torch.Generator().manual_seed(5)).to(DEV)
        with torch.no_grad():
            out[mode] = model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)
        assert bool(cache.page_update_plan) == (mode == "1")
    assert torch.equal(out["1"], out["0"])
