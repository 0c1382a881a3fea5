"""Compiling a static cache's decode kernels during the prefill (`locks_hf.precompile`).

On the CPU: `kernels.compile_only` turns launches into compiles (Triton's ``warmup``) in its own thread
only; the background compile goes through every launch of a real step with the same kernel, grid and
arguments (so it specializes the kernels the step will run) and writes nothing; the cache starts it at
the prefill's first Locks layer and the first decode-time launch joins it (not the forwards before). On the GPU (``-m gpu``), in a
fresh process with an empty Triton cache: every kernel of the decode step compiles once, in the
background thread, and none at the step; with a short prompt under the compiled one-liner too (the thread
then runs on into torch.compile's work), with the tokens of a process that does not compile ahead.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest
import torch

from locks_hf import LocksCache, models, precompile
from locks_hf.backends import TRITON
from locks_hf.backends.triton import compile_decode_kernels, kernel_decode, kernel_update_newest_page
from locks_hf.kernels import _common, attend, page_update, rerank, score, select

#: Every kernel a decode step may launch, by module.
KERNELS = {
    page_update: ["_page_update_kernel"],
    score: ["_locks_fma_kernel", "_locks_mma_kernel", "_locks_wgmma_kernel", "_score_kernel"],
    select: ["_select_kernel", "_list_mask_kernel"],
    attend: ["_sparse_attn_kernel", "_combine_kernel"],
    rerank: ["_candidate_lse_kernel", "_rerank_select_kernel"],
}


def _describe(value):
    """A launch argument as what Triton specializes on: tensors by dtype, shape and strides; floats by type."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(value.shape), value.stride())
    if isinstance(value, float):
        return ("float",)
    if isinstance(value, tuple):  # one pointer a layer
        return tuple(_describe(v) for v in value)
    return value


class Recorder:
    """Stands in for a kernel: records launches (``kernel[grid](...)``) and compiles (``kernel.warmup``)."""

    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def __getitem__(self, grid):
        return lambda *args, **kw: self.log.append(("launch", self.name, grid, _args(args, kw)))

    def warmup(self, *args, grid, **kw):
        self.log.append(("warmup", self.name, grid, _args(args, kw)))


def _args(args, kw):
    return [_describe(a) for a in args], {k: _describe(v) for k, v in kw.items()}


@pytest.fixture
def recorded(monkeypatch):
    log: list = []
    for module, names in KERNELS.items():
        for name in names:
            monkeypatch.setattr(module, name, Recorder(name, log))
    return log


def tiny_model(layers: int = 2):
    # no eos or pad token: every generate() here decodes all the tokens it asks for, with no padding inferred
    return models.tiny_model(
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=8,
        head_dim=32,
        eos_token_id=None,
        pad_token_id=None,
    )


def prefilled(selector: str = "locks", prompt: int = 100, **kw):
    """A static-layout cache after a prefill of ``prompt`` tokens, and its model."""
    model = tiny_model()
    cache = LocksCache(
        model.config, layout="static", max_cache_len=256, page_size=16, budget=64, selector=selector, **kw
    )
    ids = torch.randint(0, 256, (2, prompt), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    return model, cache


def _state(layer) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            out[name] = value.clone()
        elif isinstance(value, dict):
            out.update({f"{name}.{k}": v.clone() for k, v in value.items() if isinstance(v, torch.Tensor)})
    return out


def test_launch_compiles_only_inside_compile_only_and_in_its_own_thread():
    log: list = []
    kernel = Recorder("k", log)
    x = torch.zeros(4)
    _common.launch(kernel, (2,), x, 3, N=4)
    with _common.compile_only():
        assert _common.compiling_only()
        _common.launch(kernel, (2,), x, 3, N=4)
        elsewhere = threading.Thread(target=_common.launch, args=(kernel, (1,), x, 3), kwargs={"N": 4})
        elsewhere.start()
        elsewhere.join()
    assert not _common.compiling_only()
    assert [(kind, grid) for kind, _, grid, _ in log] == [("launch", (2,)), ("warmup", (2,)), ("launch", (1,))]


@pytest.mark.parametrize(
    "selector,kw",
    [("locks", {}), ("quest", {}), ("locks_rerank", {"rerank": 2}), ("full", {})],
)
def test_the_background_compile_is_the_real_step_without_running_it(recorded, selector, kw):
    """`compile_decode_kernels` makes the launches of the page update and the decode step (same kernels,
    grids, argument types, shapes, strides and compile options) as warmups, and changes no tensor of the
    layer; the real step then launches exactly those."""
    model, cache = prefilled(selector, **kw)
    layer = cache.layers[0]
    before = _state(layer)
    heads = model.config.num_attention_heads
    compile_decode_kernels(layer, heads)
    warm = [entry for entry in recorded]
    assert warm and all(kind == "warmup" for kind, *_ in warm)
    after = _state(layer)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
    recorded.clear()
    keys = layer.key_buffer()
    query = torch.randn(keys.shape[0], heads, 1, keys.shape[-1]).transpose(1, 2).contiguous().transpose(1, 2)
    if layer.summary and not TRITON.summarizes_in_step(layer):  # as the layer's prepare
        kernel_update_newest_page(layer)
    kernel_decode(layer, query.to(keys.dtype), keys.shape[-1] ** -0.5)
    assert [("warmup", *rest) for _, *rest in recorded] == warm
    # a static layer's decode step launches its page update itself
    assert bool(layer.summary) == any(rest[0] == "_page_update_kernel" for _, *rest in recorded)
    names = {name for _, name, *_ in warm}
    assert ("_page_update_kernel" in names) == (selector != "full") and "_sparse_attn_kernel" in names
    assert (selector == "full") != bool(names & {"_select_kernel", "_rerank_select_kernel"})


def test_the_cache_compiles_during_the_prefill_and_the_decode_step_joins_it(monkeypatch, recorded):
    """The compile starts at the prefill's first Locks layer, in a thread of its own; the forwards that
    follow do not wait for it (on the CPU the decode runs on the reference path, which launches nothing);
    the first decode-time launch joins it before it launches. Tokens are those of a cache that does not
    compile ahead."""
    events: list[str] = []
    release = threading.Event()

    def held_compile(layer, heads, sizes=()):
        events.append(f"compile in {threading.current_thread().name}")
        release.wait(10)
        events.append("compiled")

    # as on a GPU, where `precompile_applies` reads the switch too
    switch = lambda layer: os.environ.get(precompile.PRECOMPILE_ENV, "1") != "0"  # noqa: E731
    monkeypatch.setattr("locks_hf.cache.precompile_applies", switch)
    monkeypatch.setattr("locks_hf.backends.triton.compile_decode_kernels", held_compile)
    update = LocksCache.update

    def noted_update(self, key_states, *args, **kwargs):
        events.append(f"update of {key_states.shape[2]}")
        return update(self, key_states, *args, **kwargs)

    monkeypatch.setattr(LocksCache, "update", noted_update)
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 70), generator=torch.Generator().manual_seed(2))
    out = {}
    for mode in ("1", "0"):
        monkeypatch.setenv(precompile.PRECOMPILE_ENV, mode)
        events.clear()
        release.clear()
        cache = LocksCache(model.config, layout="static", max_cache_len=96, page_size=16, budget=48)
        out[mode] = model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, disable_compile=True)
        if mode == "0":
            assert not any(e.startswith("compile") for e in events)
            continue
        start = events.index("compile in locks_hf-precompile")
        assert events[start - 1] == "update of 70"  # the prefill's first layer
        assert events.count("update of 1") == 6 and "compiled" not in events  # the decode forwards did not wait
        assert cache._precompile.running
        threading.Timer(0.2, release.set).start()
        kernel_update_newest_page(cache.layers[0])  # a decode-time launch: joins the compile first
        events.extend(name for kind, name, *_ in recorded)
        assert events[-2:] == ["compiled", "_page_update_kernel"], events
        assert not cache._precompile.running
    assert torch.equal(out["1"], out["0"])


def test_the_decode_time_ops_join_a_background_compile_once_and_other_launches_do_not(recorded):
    """`kernels.join_before_decode`: the next decode-time op outside `compile_only` calls each registered wait
    once, before its first launch; a launch by itself (the prefill's summary build) does not."""
    _, cache = prefilled()
    layer = cache.layers[0]
    joined: list[str] = []
    keys = layer.key_buffer()
    query = torch.randn(keys.shape[0], 8, 1, keys.shape[-1], dtype=keys.dtype)
    with _common.compile_only():  # a compile does not join itself
        _common.join_before_decode(lambda: joined.append("first"))
        kernel_decode(layer, query, 0.1)
    assert joined == []
    _common.join_before_decode(lambda: joined.append("second"))
    _common.launch(Recorder("a prefill kernel", recorded), (1,), keys)  # a launch alone (the summary build's)
    assert joined == []
    recorded.clear()
    kernel_decode(layer, query, 0.1)
    assert joined == ["first", "second"] and recorded and recorded[0][0] == "launch"
    kernel_decode(layer, query, 0.1)
    assert joined == ["first", "second"]


def test_a_failed_background_compile_is_reported_and_the_cache_goes_on(monkeypatch, caplog, recorded):
    def broken(layer, heads, sizes=()):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr("locks_hf.cache.precompile_applies", lambda layer: True)
    monkeypatch.setattr("locks_hf.backends.triton.compile_decode_kernels", broken)
    model = tiny_model()
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    cache = LocksCache(model.config, layout="static", max_cache_len=64, page_size=16, budget=48)
    with caplog.at_level("WARNING", logger="locks_hf.precompile"):
        model.generate(ids, past_key_values=cache, max_new_tokens=2, do_sample=False, disable_compile=True)
        kernel_update_newest_page(cache.layers[0])  # the first decode-time launch (on a GPU) reports it
    assert "compiling the decode kernels during the prefill failed (RuntimeError: no compiler here)" in caplog.text
    assert [name for kind, name, *_ in recorded if kind == "launch"] == ["_page_update_kernel"]  # and launches


def test_a_cache_copied_while_compiling_waits_for_it(monkeypatch):
    release = threading.Event()

    def held(layer, heads, sizes=()):
        release.wait(5)

    monkeypatch.setattr("locks_hf.cache.precompile_applies", lambda layer: True)
    monkeypatch.setattr("locks_hf.backends.triton.compile_decode_kernels", held)
    _, cache = prefilled()
    assert cache._precompile is not None and cache._precompile.running
    threading.Timer(0.2, release.set).start()
    clone = copy.deepcopy(cache)  # waits for the thread: a copy starts with its kernels compiled
    assert not cache._precompile.running and not clone._precompile.running
    cache.fork()
    assert cache._precompile is None


def test_applies_to_cuda_layers_on_the_kernels_only(monkeypatch):
    cuda = SimpleNamespace(is_cuda=True)
    layer = SimpleNamespace(backend=TRITON, key_buffer=lambda: cuda)
    monkeypatch.delenv(precompile.PRECOMPILE_ENV, raising=False)
    assert precompile.precompile_applies(layer)
    monkeypatch.setenv(precompile.PRECOMPILE_ENV, "0")
    assert not precompile.precompile_applies(layer)
    monkeypatch.delenv(precompile.PRECOMPILE_ENV)
    assert not precompile.precompile_applies(SimpleNamespace(backend=TRITON, key_buffer=lambda: torch.zeros(1)))
    assert not precompile.precompile_applies(SimpleNamespace(backend=object(), key_buffer=lambda: cuda))


_GPU_SCRIPT = r"""
import json, os, sys, threading, torch
from triton import knobs
from transformers import LlamaConfig, LlamaForCausalLM
from locks_hf import LocksCache

selector, mode, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3])
compiles = []
knobs.compilation.listener = lambda *, src, metadata, metadata_group, times, cache_hit: compiles.append(
    (str(metadata.get("name")), threading.current_thread().name, cache_hit))
torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=32,
                  num_key_value_heads=2, head_dim=128, vocab_size=512)
model = LlamaForCausalLM(cfg).eval().to("cuda", torch.bfloat16)
model.set_attn_implementation("locks")
ids = torch.randint(0, 512, (1, prompt), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
tokens = []
for precompile in ("1", "0") if mode == "compiled" else ("1",):
    os.environ["LOCKS_HF_PRECOMPILE"] = precompile  # the second run: no thread, the same compiled code
    cache = LocksCache(cfg, layout="static", max_cache_len=8192, budget=512, selector=selector)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=40, do_sample=False, disable_compile=mode == "eager")
    tokens.append(out[0, prompt:].tolist())
    if precompile == "1":
        first = list(compiles)
print(json.dumps({"compiles": first, "tokens": tokens}))
"""


def _run_gpu_script(tmp_path, *args, **env_extra) -> dict:
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), **env_extra}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "inductor")
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run(
        [sys.executable, "-c", _GPU_SCRIPT, *map(str, args)], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def _compiled_in_the_thread(compiles) -> None:
    decode = {n for names in KERNELS.values() for n in names}
    ours = [(name, thread) for name, thread, hit in compiles if name in decode and not hit]
    assert ours, compiles
    assert all(thread == "locks_hf-precompile" for _, thread in ours), ours
    assert len(ours) == len({name for name, _ in ours}), ours  # each once


@pytest.mark.gpu
@pytest.mark.parametrize("selector", ["locks", "quest"])
def test_on_a_gpu_the_step_compiles_nothing_of_its_own(tmp_path, selector):
    """A fresh process with an empty Triton cache: each kernel of the decode step compiles once, in the
    background thread during the prefill, and the decode steps (the page update's completing steps
    included) compile none."""
    _compiled_in_the_thread(_run_gpu_script(tmp_path, selector, "eager", 4000)["compiles"])


@pytest.mark.gpu
def test_on_a_gpu_a_short_prompt_compiles_alongside_torch_compile(tmp_path):
    """The one-liner (compiled decode step, CUDA graphs) after a prefill far shorter than the kernels'
    compiles: the compile thread runs on into torch.compile's trace and is joined at the step's first
    launch; every decode kernel still compiles once, in the thread, and a second cache in the same process,
    without the thread, gives the same tokens (inductor's choices are those of the first run)."""
    run = _run_gpu_script(tmp_path, "locks", "compiled", 256)
    _compiled_in_the_thread(run["compiles"])
    with_thread, without = run["tokens"]
    assert len(with_thread) == 40 and with_thread == without
