"""A quantized layer's decode step on the quantized-KV kernel (`locks_hf.backends.quantized`).

Selection runs in PyTorch as on the reference path and attention in `kernels.quantized_attention` over
the packed K/V: the outputs agree with the reference backend's to fp32 rounding and the bookkeeping
(selection, statistics, traffic) is identical, for Locks, Quest and the oracle, 4 and 2 bits, post and
pre summaries, left padding and decode steps across a key quantization boundary. The rule picks the
backend only for CUDA layers with the kernels enabled and available (`quantized_kernel_applies`, a
function of the device type, settings and flags); on a CPU machine the tests make the rule see CUDA.
"""

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "no CUDA and Triton was imported before TRITON_INTERPRET=1 was set: run the tests with "
            "TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from locks_hf import LocksCache, LocksConfig, kernels  # noqa: E402
from locks_hf.backends import (  # noqa: E402
    KERNELS_ENV,
    QUANTIZED_KERNEL,
    REFERENCE,
    choice,
    choose_backend,
    quantized_kernel_applies,
)
from locks_hf.cache import LocksLayer  # noqa: E402
from locks_hf.cache_stats import CacheStatistics  # noqa: E402
from locks_hf.kv_cache import QuantizedLocksLayer, adopt_config, to_quantized  # noqa: E402
from locks_hf.models import tiny_model  # noqa: E402

pytestmark = pytest.mark.interpret

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture
def as_if_cuda(monkeypatch):
    """The rule evaluated as if every layer's tensors were on CUDA (the rest of it as is: settings,
    ``LOCKS_HF_KERNELS``, Triton): on a CPU machine the interpreter runs the kernel."""
    seen = []

    def rule(device_type, config, **kw):
        seen.append((device_type, kw))
        return quantized_kernel_applies("cuda", config, **kw)

    monkeypatch.setattr(choice, "quantized_kernel_applies", rule)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    return seen


class _Stats(CacheStatistics):
    def __init__(self, layers):
        self.layers = layers


def _padding_mask(valid: torch.Tensor) -> torch.Tensor:
    b, T = valid.shape
    return torch.zeros(b, 1, T, T, device=valid.device).masked_fill(
        ~valid[:, None, None, :], torch.finfo(torch.float32).min
    )


def _decode(selector, bits, summary_from, steps, T=154):
    """A quantized layer (row 1 left-padded) after a prefill of ``T`` slots, then ``steps`` decode steps on
    its backend; returns the layer and the outputs, selections and counts of every step."""
    b, h, d, G = 2, 2, 64, 2
    g = torch.Generator().manual_seed(10 * bits + len(selector) + (summary_from == "pre"))
    channel = torch.where(torch.rand(d, generator=g) < 0.1, 8.0, 1.0)
    keys = (torch.randn(b, h, T + steps, d, generator=g) * channel + torch.randn(d, generator=g)).to(DEV)
    values = torch.randn(b, h, T + steps, d, generator=g).to(DEV)
    queries = torch.randn(steps, b, h * G, 1, d, generator=g).to(DEV) * 2
    valid = torch.ones(b, T, dtype=torch.bool, device=DEV)
    valid[1, :19] = False  # row 1's pages start at slot 19
    layer = LocksLayer(
        LocksConfig(selector=selector, budget=64, kv_bits=bits, kv_group=32, kv_residual=32, summary_from=summary_from)
    )
    assert isinstance(layer, QuantizedLocksLayer)
    layer.update(keys[:, :, :T], values[:, :, :T])
    layer.prepare(_padding_mask(valid), T)
    quantized, outs, selections, counts = [], [], [], []
    for i in range(steps):
        layer.update(keys[:, :, T + i : T + i + 1], values[:, :, T + i : T + i + 1])
        layer.prepare(None, 1)
        assert not layer.attends_densely(1)
        quantized.append(tuple(layer.packed_kv()["quantized"].tolist()))
        outs.append(layer.backend.decode(layer, queries[i], 0.125))
        selections.append(layer.last_selection)
        counts.append(layer.counts.tolist())
    return layer, quantized, outs, selections, counts


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize(
    "selector,summary_from",
    [("locks", "post"), ("locks", "pre"), ("quest", "post"), ("quest", "pre"), ("oracle", "post")],
)  # (the oracle: no summary)
def test_the_kernel_backend_decodes_as_the_reference(selector, bits, summary_from, as_if_cuda, monkeypatch):
    # keys are quantized 32 at a time (qk 128 -> 160): "pre" at length 160, "post" once row 1's page
    # holding slot 159 is summarized (slots 147-162)
    steps = 11
    layer, quantized, outs, selections, counts = _decode(selector, bits, summary_from, steps)
    assert layer.backend is QUANTIZED_KERNEL and as_if_cuda
    assert len({qk for qk, _ in quantized}) > 1 and len({qv for _, qv in quantized}) == steps
    monkeypatch.setenv(KERNELS_ENV, "0")
    ref, ref_quantized, ref_outs, ref_selections, ref_counts = _decode(selector, bits, summary_from, steps)
    assert ref.backend is REFERENCE
    assert quantized == ref_quantized
    for i in range(steps):
        assert outs[i].shape == ref_outs[i].shape and outs[i].dtype == ref_outs[i].dtype
        assert rel(outs[i], ref_outs[i]) < 1e-5, i
        assert torch.equal(selections[i], ref_selections[i]), i
    assert counts == ref_counts
    assert (layer.decode_steps, layer.estimate_bytes, layer.attended_kv_bytes()) == (
        ref.decode_steps,
        ref.estimate_bytes,
        ref.attended_kv_bytes(),
    )
    assert _Stats([layer]).decode_traffic() == _Stats([ref]).decode_traffic()


# -- the rule ---------------------------------------------------------------------------------------------------
def test_the_rule_takes_the_kernel_only_on_cuda_with_the_kernels():
    cfg = LocksConfig(budget=64, kv_bits=4, kv_group=32, kv_residual=32)
    ok = dict(dtype=torch.bfloat16, head_dim=128, value_head_dim=128, enabled=True, available=True)
    assert quantized_kernel_applies("cuda", cfg, **ok)
    assert quantized_kernel_applies("cuda", LocksConfig(budget=64, kv_bits=2, kv_group=128, kv_residual=128), **ok)
    assert quantized_kernel_applies("cuda", cfg, **dict(ok, dtype=torch.float32, head_dim=64, value_head_dim=64))
    assert not quantized_kernel_applies("cpu", cfg, **ok)
    assert not quantized_kernel_applies("meta", cfg, **ok)
    assert not quantized_kernel_applies("cuda", cfg, **dict(ok, enabled=False))  # LOCKS_HF_KERNELS=0
    assert not quantized_kernel_applies("cuda", cfg, **dict(ok, available=False))  # no Triton
    assert not quantized_kernel_applies("cuda", LocksConfig(budget=64), **ok)  # full-precision K/V
    assert not quantized_kernel_applies("cuda", cfg, **dict(ok, dtype=torch.float64))
    assert not quantized_kernel_applies("cuda", cfg, **dict(ok, head_dim=96, value_head_dim=96))
    assert not quantized_kernel_applies("cuda", cfg, **dict(ok, value_head_dim=64))
    assert kernels.implements_quantized(
        bits=4, group=64, head_dim=64, value_head_dim=64, dtype=torch.float16, page_size=16
    )
    assert not kernels.implements_quantized(
        bits=4, group=128, head_dim=64, value_head_dim=64, dtype=torch.float16, page_size=16
    )
    assert not kernels.implements_quantized(
        bits=3, group=32, head_dim=64, value_head_dim=64, dtype=torch.float16, page_size=16
    )
    assert not kernels.implements_quantized(
        bits=4, group=32, head_dim=64, value_head_dim=64, dtype=torch.float16, page_size=12
    )


def test_a_layer_asks_the_rule_when_its_storage_is_allocated(as_if_cuda):
    """Before its first update a quantized layer has no packed storage (the reference); its allocation,
    a conversion of a full-precision layer and its growth ask again. Without the forcing, a CPU layer
    stays on the reference."""
    cfg = LocksConfig(selector="quest", budget=64, kv_bits=4, kv_group=32, kv_residual=32)
    layer = LocksLayer(cfg)
    assert layer.packed_kv() is None and layer.backend is REFERENCE
    keys, values = torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64)
    layer.update(keys, values)
    assert layer.backend is QUANTIZED_KERNEL
    assert as_if_cuda[-1] == (
        "cpu",
        dict(dtype=torch.float32, head_dim=64, value_head_dim=64, enabled=True, available=True),
    )
    layer.update(torch.randn(1, 2, 400, 64), torch.randn(1, 2, 400, 64))  # grows
    assert layer.backend is QUANTIZED_KERNEL
    full = LocksLayer(LocksConfig(selector="quest", budget=64))
    full.update(keys, values)
    assert full.packed_kv() is None and full.backend is REFERENCE  # (CPU buffers)
    assert to_quantized(full.copy_sharing_summaries(), cfg).backend is QUANTIZED_KERNEL
    assert adopt_config(full.copy_sharing_summaries(), cfg).backend is QUANTIZED_KERNEL
    # token-level policies keep their own step
    policy = LocksLayer(LocksConfig(selector="rkv", budget=64, kv_bits=4, kv_group=32, kv_residual=32))
    policy.update(keys, values)
    assert policy.backend.name == "token_policy"


@pytest.mark.skipif(DEV == "cuda", reason="on a GPU the layer is on CUDA")
def test_cpu_layers_take_the_reference():
    layer = LocksLayer(LocksConfig(budget=64, kv_bits=4, kv_group=32, kv_residual=32))
    layer.update(torch.randn(1, 2, 100, 64), torch.randn(1, 2, 100, 64))
    assert layer.packed_kv() is not None
    assert layer.backend is REFERENCE and choose_backend(layer) is REFERENCE


# -- generate ------------------------------------------------------------------------------------------------------
def test_generate_matches_the_reference(as_if_cuda, monkeypatch):
    """A tiny fp32 model (head_dim 64), a left-padded batch: the tokens (and scores, to fp32 rounding) of
    the kernel backend are those of ``LOCKS_HF_KERNELS=0``, across key quantization boundaries."""
    model = tiny_model("llama", head_dim=64).to(DEV)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(3, 256, (2, 140), generator=g).to(DEV)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0
    ids[1, :16] = 0
    cfg = LocksConfig(selector="locks", budget=64, kv_bits=4, kv_group=32, kv_residual=32, summary_from="post")
    runs = {}
    for env in ("1", "0"):
        monkeypatch.setenv(KERNELS_ENV, env)
        cache = LocksCache(model.config, cfg, layout="dynamic")  # (on a GPU "auto" would take the static one)
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                past_key_values=cache,
                max_new_tokens=24,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        backends = {layer.backend for layer in cache.locks_layers}
        # keys quantized up to 128 by the prefill, then a group of 32 during decode
        assert {tuple(layer.packed_kv()["quantized"].tolist()) for layer in cache.locks_layers} == {(160, 130)}
        runs[env] = out, backends, cache.decode_traffic()
    (out, backends, traffic), (ref, ref_backends, ref_traffic) = runs["1"], runs["0"]
    assert backends == {QUANTIZED_KERNEL} and ref_backends == {REFERENCE}
    assert torch.equal(out.sequences, ref.sequences)
    assert rel(torch.stack(out.scores), torch.stack(ref.scores)) < 1e-5
    assert traffic == ref_traffic


def test_the_static_layout_on_the_kernels_matches_the_reference(as_if_cuda, monkeypatch):
    """A static quantized cache decoding on the kernels (the per-step write, the fused selection and
    attention, the page update from the ring) gives the tokens, codes and statistics of the same cache
    on the reference path, across a key group quantized during decode in a left-padded batch."""
    from locks_hf import LocksStaticCache

    model = tiny_model("llama", head_dim=64).to(DEV)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(3, 256, (2, 90), generator=g).to(DEV)
    mask = torch.ones_like(ids)
    mask[1, :16] = 0
    ids[1, :16] = 0
    cfg = LocksConfig(selector="locks", budget=48, kv_bits=4, kv_group=32, kv_residual=32)
    runs = {}
    # Both eagerly, so that the kernels and the reference see the same K/V (a compiled model's projections
    # may round differently); on a GPU the compiled generate() on the kernels must give the same tokens too.
    for run in ("1", "0", "1-compiled") if DEV == "cuda" else ("1", "0"):
        monkeypatch.setenv(KERNELS_ENV, run[0])
        cache = LocksStaticCache(model.config, max_cache_len=110, locks=cfg)
        eager = {} if run.endswith("compiled") else {"disable_compile": True}
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False, **eager
            )
        layer = cache.locks_layers[0]
        runs[run] = out, {lay.backend for lay in cache.locks_layers}, layer, cache.row_stats()
    (out, backends, layer, stats), (ref, ref_backends, ref_layer, ref_stats) = runs["1"], runs["0"]
    assert backends == {QUANTIZED_KERNEL} and ref_backends == {REFERENCE}
    assert torch.equal(out, ref)
    if "1-compiled" in runs:
        assert torch.equal(runs["1-compiled"][0], ref)
    assert layer.quantized.tolist() == ref_layer.quantized.tolist() == [96, 68]  # (as of the last step's write)
    for mine, theirs in zip(layer._kv_tensors(), ref_layer._kv_tensors()):
        assert torch.equal(mine, theirs)
    assert torch.equal(stats, ref_stats) and stats[:, 0].min() > 0
