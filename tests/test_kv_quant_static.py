"""Quantized KV in the static layout (`locks_hf.static_kv_layer.QuantizedStaticLayer`), reference path.

The static layout stores the K/V KIVI-packed with the dynamic quantized layer's schedule, so both
layouts must give the same codes and tokens: single rows and left-padded batches (where "post"
summaries hold key quantization back), a cache that grows, chunked prefill, beam search, forks and a
reset; settings the static layout cannot serve are refused with what to use instead. The kernels'
twin of the per-step write is tested against `reference_append_kv` in tests/test_kv_quant_kernels.py.
"""

import pytest
import torch
from conftest import tiny

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache
from locks_hf.backends.reference import reference_append_kv
from locks_hf.kv_quant import dequantize_keys, dequantize_values
from locks_hf.static_kv_layer import QuantizedStaticLayer, ring_slots

pytestmark = pytest.mark.compat


def _batch(n=200, b=3, pads=(0, 37, 90), seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (b, n), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads[:b]):
        mask[row, :pad] = 0
        ids[row, :pad] = 0
    return ids, mask


def _kv(bits=4, **kw):
    return dict(kv_bits=bits, kv_group=32, kv_residual=32, **kw)


def _generate(model, cache, ids, mask, new=60, **kw):
    return model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False, **kw)


@pytest.mark.parametrize("selector", ["locks", "quest", "full"])
@pytest.mark.parametrize("bits", [4, 2])
def test_static_quantized_equals_dynamic_in_a_padded_batch(selector, bits):
    """Same tokens and the same packed storage: across key and value quantization boundaries, with rows
    whose pages start at other slots ("post" summaries hold key quantization for the padded rows)."""
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(budget=48, selector=selector, **_kv(bits))
    ids, mask = _batch()
    dyn = LocksCache(model.config, cfg, layout="dynamic")
    want = _generate(model, dyn, ids, mask)
    sta = LocksStaticCache(model.config, max_cache_len=270, locks=cfg)
    got = _generate(model, sta, ids, mask)
    assert torch.equal(got, want)
    for d, s in zip(dyn.locks_layers, sta.locks_layers):
        assert isinstance(s, QuantizedStaticLayer)
        qk, qv = s.quantized.tolist()
        assert (qk, qv) == (d._qk, d._qv) and qk > 200 and qv > 200  # (quantized during decode too)
        assert torch.equal(s.key_codes[:, :, :qk], d._kcodes[:, :, :qk])
        assert torch.equal(s.value_codes[:, :, :qv], d._vcodes[:, :, :qv])
        assert torch.equal(s.key_scale[:, :, : qk // 32], d._kscale[:, :, : qk // 32])
        assert torch.equal(s.value_zero[:, :, :qv], d._vzero[:, :, :qv])
    assert sta.attended_fraction() == pytest.approx(dyn.attended_fraction())
    if selector != "full":
        assert sta.attended_fraction() < 0.6


def test_a_growing_static_cache_and_a_chunked_prefill_equal_the_dynamic_layout():
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(budget=48, **_kv())
    ids, mask = _batch()
    want = _generate(model, LocksCache(model.config, cfg, layout="dynamic"), ids, mask)
    grown = LocksCache(model.config, cfg, layout="static")  # allocated at the prompt + headroom, then grows
    assert torch.equal(_generate(model, grown, ids, mask), want)
    assert grown.is_static
    chunked = _generate(model, LocksCache(model.config, cfg, layout="dynamic"), ids, mask, prefill_chunk_size=64)
    sta = LocksStaticCache(model.config, max_cache_len=270, locks=cfg)
    assert torch.equal(_generate(model, sta, ids, mask, prefill_chunk_size=64), chunked)


def test_beam_search_fork_and_reset():
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(budget=48, **_kv())
    ids, mask = _batch(b=2)
    beams = dict(num_beams=3, num_return_sequences=3, new=30)
    want = _generate(model, LocksCache(model.config, cfg, layout="dynamic"), ids, mask, **beams)
    sta = LocksStaticCache(model.config, max_cache_len=240, locks=cfg)
    assert torch.equal(_generate(model, sta, ids, mask, **beams), want)

    # a prefilled prompt forked, each copy decoding on its own
    one = ids[:1, 10:]
    cache = LocksStaticCache(model.config, max_cache_len=260, locks=cfg)
    logits = model(one, past_key_values=cache).logits[:, -1:]
    fork = cache.fork()
    runs = []
    for c in (cache, fork, None):
        c = c or LocksCache(model.config, cfg, layout="dynamic")
        if not c.is_static:
            logits = model(one, past_key_values=c).logits[:, -1:]
        token, out = logits.argmax(-1), []
        for _ in range(40):
            token = model(token, past_key_values=c).logits[:, -1:].argmax(-1)
            out.append(token)
        runs.append(torch.cat(out, 1))
    assert torch.equal(runs[0], runs[2]) and torch.equal(runs[1], runs[2])

    # reset: the same buffers serve the next prompt
    sta.reset()
    assert sta.locks_layers[0].quantized.tolist() == [0, 0]
    again = _generate(model, sta, ids, mask, **beams)
    assert torch.equal(again, want)


def test_the_reference_step_quantizes_what_is_due_and_writes_the_ring():
    """One decode-step write on a hand-made state: a key group and a value slot due, the token into the
    ring at ``length % ring``; the codes are those of the dynamic layer's quantizer (`kv_quant`)."""
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(budget=48, selector="full", **_kv())
    cache = LocksStaticCache(model.config, max_cache_len=400, locks=cfg)
    model(_batch(n=95, b=1)[0], past_key_values=cache)  # 95 slots: keys < 64 and values < 63 quantized
    layer = cache.locks_layers[0]
    assert layer.quantized.tolist() == [64, 63]
    ring = layer.key_ring.shape[2]
    assert ring == ring_slots(cfg) == 128
    keys = layer.page_keys(torch.arange(6).view(1, 1, 6).expand(1, layer.num_heads, 6))  # slots 0..95
    layer.length_t.fill_(96)  # as after one more token: keys < 96 are due, values < 64
    layer.cumulative_length.fill_(96)
    new_k, new_v = torch.randn(1, layer.num_heads, 1, 32).double(), torch.randn(1, layer.num_heads, 1, 32).double()
    ring_before = layer.key_ring[:, :, 64:96].clone()
    reference_append_kv(layer, new_k, new_v)
    assert layer.quantized.tolist() == [96, 64]
    assert torch.equal(layer.key_ring[:, :, 96], new_k[:, :, 0]) and torch.equal(
        layer.value_ring[:, :, 96], new_v[:, :, 0]
    )
    deq = dequantize_keys(
        layer.key_codes[:, :, 64:96],
        layer.key_scale[:, :, 2:3].repeat_interleave(32, 2),
        layer.key_zero[:, :, 2:3].repeat_interleave(32, 2),
        4,
        torch.float64,
    )
    err = (deq - ring_before).abs().amax()
    width = (ring_before.amax(2) - ring_before.amin(2)).amax()
    assert 0 < err <= width / 15 / 2 + 1e-12  # within half a step of the 4-bit grid
    v = dequantize_values(
        layer.value_codes[:, :, 63:64], layer.value_scale[:, :, 63:64], layer.value_zero[:, :, 63:64], 4, torch.float64
    )
    assert (v - layer.value_ring[:, :, 63:64]).abs().amax() <= (
        layer.value_ring[:, :, 63].amax() - layer.value_ring[:, :, 63].amin()
    ) / 15
    assert torch.equal(
        layer.page_keys(torch.arange(4).view(1, 1, 4).expand(1, layer.num_heads, 4)).flatten(2, 3)[:, :, :64],
        keys.flatten(2, 3)[:, :, :64],
    )


def test_storage_shrinks_as_kivi_says():
    """The allocated storage: packed codes with a scale and zero point per group (``kv_token_bytes``: in
    bf16, 0.3125x a bf16 token at 4 bits in groups of 32, 0.1875x at 2), for the capacity plus a ring's
    worth of spare slots, and the fixed full-precision ring."""
    from locks_hf.kv_quant import kv_token_bytes

    model = tiny("llama", head_dim=32)
    for bits, ratio in ((4, 0.3125), (2, 0.1875)):
        cfg = LocksConfig(budget=48, selector="full", **_kv(bits))
        assert sum(kv_token_bytes(cfg, 128, 128, 2)) / (2 * 128 * 2) == ratio
        cache = LocksStaticCache(model.config, max_cache_len=4096, locks=cfg)
        model(_batch(n=50, b=1)[0], past_key_values=cache)
        layer = cache.locks_layers[0]
        elem, h = layer.key_scale.element_size(), layer.num_heads  # (float64 here)
        slots = 4096 + ring_slots(cfg)
        packed = sum(t.numel() * t.element_size() for t in layer._kv_tensors()[:6])
        assert packed == round(h * slots * sum(kv_token_bytes(cfg, 32, 32, elem)))
        ring = layer.storage_bytes()["full_precision"]
        assert ring == 2 * h * ring_slots(cfg) * 32 * elem
        assert layer.storage_bytes()["quantized_tokens"] == h * (32 + 18)  # keys of slots < 32, values < 18


@pytest.mark.parametrize(
    "overrides,needs",
    [
        (dict(summary_from="pre"), "summary_from='pre'"),
        (dict(selector="oracle"), "reads every candidate"),
        (dict(selector="locks_rerank", rerank=4), "rerank"),
    ],
)
def test_settings_the_static_layout_cannot_store_are_refused(overrides, needs):
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(budget=48, **_kv(), **overrides)
    with pytest.raises(LocksConfigError, match=needs):
        LocksStaticCache(model.config, max_cache_len=300, locks=cfg)
    with pytest.raises(LocksConfigError, match="layout='dynamic'"):
        LocksCache(model.config, cfg, layout="static")
    assert not LocksCache(model.config, cfg).is_static  # "auto" keeps the dynamic layout


def test_crop_and_rewind_refuse_what_quantization_closed():
    model = tiny("llama", head_dim=32)
    cache = LocksStaticCache(model.config, max_cache_len=300, locks=LocksConfig(budget=48, **_kv()))
    model(_batch(n=120, b=1)[0], past_key_values=cache)  # keys < 64 and values < 88 quantized
    cache.crop(-20)
    assert int(cache.get_seq_length()) == 100
    with pytest.raises(ValueError, match="quantized groups cannot be reopened"):
        cache.crop(-20)
    cache.mark_prefix()
    with pytest.raises(ValueError, match="fork the prefilled cache"):
        model(torch.ones(1, 1, dtype=torch.long), past_key_values=cache)
        cache.rewind()
