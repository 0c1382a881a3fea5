"""KIVI-quantized KV under Locks (`locks_hf.kv_quant`, `locks_hf.kv_cache`).

The stored codes, scales and zero points are checked bit for bit against a float64 KIVI reference
written plainly here, on fresh random inputs, at every bits x group x residual setting; then the
bytes, the two summary orders, the sparse path against the dense one over the same quantized K/V,
generate() for every registered selector, the arm labels and the refusals.
"""

import json

import pytest
import torch
from conftest import tiny
from selector_lists import selectors

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache
from locks_hf.backends.reference import reference_decode
from locks_hf.cache import LocksLayer
from locks_hf.config import BudgetDoesNotFit
from locks_hf.kv_cache import QuantizedLocksLayer
from locks_hf.selectors import config_for_family, family_of, parse_family, selector_class, selector_names


# -- the float64 reference ----------------------------------------------------------------------------
def _ref_group(x: list[float], ok: list[bool], bits: int, dtype) -> tuple[list[int], float, float]:
    """KIVI on one group, scalar by scalar: zero = min, scale = (max - min) / (2^bits - 1) (both stored in
    ``dtype``), code = round-half-even(clamp((x - zero) / scale, 0, 2^bits - 1)); padding out of the
    range, with code 0."""
    qmax = 2**bits - 1
    real = [v for v, good in zip(x, ok) if good]
    lo, hi = (min(real), max(real)) if real else (0.0, 0.0)
    scale = torch.tensor((hi - lo) / qmax, dtype=torch.float64).to(dtype).item()
    zero = torch.tensor(lo, dtype=torch.float64).to(dtype).item()
    codes = [round(min(max((v - zero) / scale, 0.0), qmax)) if good and scale != 0 else 0 for v, good in zip(x, ok)]
    return codes, scale, zero


def _ref_groups(x: torch.Tensor, ok: torch.Tensor, bits: int, dtype):
    """`_ref_group` on every group along the last axis of ``x`` at once (float64; torch.round rounds
    half to even, as Python's round)."""
    qmax = 2**bits - 1
    x = x.double()
    lo = torch.where(ok, x, float("inf")).amin(-1, keepdim=True)
    hi = torch.where(ok, x, float("-inf")).amax(-1, keepdim=True)
    lo, hi = torch.where(ok.any(-1, keepdim=True), lo, 0.0), torch.where(ok.any(-1, keepdim=True), hi, 0.0)
    scale = ((hi - lo) / qmax).to(dtype).double()
    zero = lo.to(dtype).double()
    codes = torch.round(torch.clamp((x - zero) / torch.where(scale == 0, 1.0, scale), 0, qmax))
    codes = torch.where(ok & (scale != 0), codes, 0.0).long()
    return codes, scale.squeeze(-1), zero.squeeze(-1)


def _ref_pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Bytes of ``8 // bits`` codes each along the last dim, the first in the low bits."""
    per = 8 // bits
    weights = torch.tensor([2 ** (bits * i) for i in range(per)])
    return (codes.long().unflatten(-1, (-1, per)) * weights).sum(-1).to(torch.uint8)


def _ref_keys(keys, valid, n, bits, G):
    """Codes ``[b, h, n, d]``, scale and zero ``[b, h, n/G, d]``: one (scale, zero) per channel per G tokens."""
    b, h, _, d = keys.shape
    codes = torch.zeros(b, h, n, d, dtype=torch.long)
    scale = torch.zeros(b, h, n // G, d, dtype=torch.float64)
    zero = torch.zeros_like(scale)
    for g in range(n // G):
        tokens = slice(g * G, (g + 1) * G)
        x = keys[:, :, tokens].transpose(-1, -2)  # [b, h, d, G]: a channel's G tokens
        ok = valid[:, None, None, tokens].expand(b, h, d, G)
        c, scale[:, :, g], zero[:, :, g] = _ref_groups(x, ok, bits, keys.dtype)
        codes[:, :, tokens] = c.transpose(-1, -2)
    return codes, scale, zero


def _ref_values(values, valid, n, bits, G):
    """Codes ``[b, h, n, d]``, scale and zero ``[b, h, n, d/G]``: one (scale, zero) per G channels per token."""
    b, h, _, d = values.shape
    codes = torch.zeros(b, h, n, d, dtype=torch.long)
    scale = torch.zeros(b, h, n, d // G, dtype=torch.float64)
    zero = torch.zeros_like(scale)
    for g in range(d // G):
        channels = slice(g * G, (g + 1) * G)
        ok = valid[:, None, :n, None].expand(b, h, n, G)
        codes[..., channels], scale[..., g], zero[..., g] = _ref_groups(
            values[:, :, :n, channels], ok, bits, values.dtype
        )
    return codes, scale, zero


def test_the_vectorized_reference_is_the_scalar_formula():
    """`_ref_groups` against `_ref_group` one scalar at a time, padding and a constant group included."""
    g = torch.Generator().manual_seed(21)
    for bits in (2, 4):
        for dtype in (torch.bfloat16, torch.float32):
            x = (torch.randn(6, 32, generator=g, dtype=torch.float64) * 3).to(dtype)
            x[4] = 1.5  # a constant group
            ok = torch.rand(6, 32, generator=g) < 0.9
            ok[5] = False  # all padding
            codes, scale, zero = _ref_groups(x, ok, bits, dtype)
            for r in range(6):
                want = _ref_group(x[r].double().tolist(), ok[r].tolist(), bits, dtype)
                assert (codes[r].tolist(), scale[r].item(), zero[r].item()) == want


def _random_kv(b, h, n, d, dtype, seed):
    """Keys with outlier channels and offsets (what per-channel quantization is for), values per token."""
    g = torch.Generator().manual_seed(seed)
    channel = torch.where(torch.rand(d, generator=g) < 0.1, 12.0, 1.0)
    keys = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * channel + torch.randn(d, generator=g)
    values = torch.randn(b, h, n, d, generator=g, dtype=torch.float64) * 2 + 0.5
    return keys.to(dtype), values.to(dtype)


def _padding_mask(valid: torch.Tensor, dtype) -> torch.Tensor:
    b, T = valid.shape
    mask = torch.zeros(b, 1, T, T, dtype=dtype)
    return mask.masked_fill(~valid[:, None, None, :], torch.finfo(dtype).min)


def _fill(layer, keys, values, T, valid=None, steps=0):
    """Prefill ``T`` slots (left padding where ``valid [b, T]`` is False), then decode ``steps`` tokens."""
    mask = None if valid is None else _padding_mask(valid, torch.float32)
    layer.update(keys[:, :, :T], values[:, :, :T])
    layer.prepare(mask, T)
    for i in range(T, T + steps):
        layer.update(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        layer.prepare(None, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("residual_groups", [1, 2, 4])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_storage_equals_the_float64_kivi_reference(bits, group, residual_groups, dtype):
    R = group * residual_groups
    T, steps = 2 * R + R // 2 + 3, R // 2 + 2  # the decode steps cross a key chunk boundary (3R)
    b, h, d = 2, 2, 128
    seed = 1000 * bits + 10 * group + residual_groups + (dtype == torch.bfloat16)
    keys, values = _random_kv(b, h, T + steps, d, dtype, seed)
    valid = torch.ones(b, T + steps, dtype=torch.bool)
    valid[1, :13] = False  # a left-padded row: its padding stays out of the groups' ranges
    # Quest at a small budget: decode steps are page-selected, so no step dequantizes the whole cache;
    # "pre" keeps KIVI's schedule on the padded row ("post" may hold a padded row's unsummarized page back)
    cfg = LocksConfig(selector="quest", budget=64, kv_bits=bits, kv_group=group, kv_residual=R, summary_from="pre")
    layer = LocksLayer(cfg)
    assert isinstance(layer, QuantizedLocksLayer)
    _fill(layer, keys, values, T, valid[:, :T], steps)

    # KIVI's schedule: a forward attends what the previous one left; keys quantized in whole chunks of R,
    # values all but the last R
    done = T + steps - 1
    qk, qv = done // R * R, done - R
    assert (layer._qk, layer._qv) == (qk, qv) and qk == 3 * R

    codes, scale, zero = _ref_keys(keys, valid, qk, bits, group)
    assert layer._kcodes.dtype == torch.uint8 and layer._kcodes.shape[-1] == d * bits // 8
    assert torch.equal(layer._kcodes[:, :, :qk], _ref_pack(codes, bits))
    assert torch.equal(layer._kscale[:, :, : qk // group].double(), scale)
    assert torch.equal(layer._kzero[:, :, : qk // group].double(), zero)
    vcodes, vscale, vzero = _ref_values(values, valid, qv, bits, group)
    assert torch.equal(layer._vcodes[:, :, :qv], _ref_pack(vcodes, bits))
    assert torch.equal(layer._vscale[:, :, :qv].double(), vscale)
    assert torch.equal(layer._vzero[:, :, :qv].double(), vzero)

    # dequantized: code * scale + zero in float64, rounded once to the K/V dtype; the tail as given
    want_k = (codes * scale.repeat_interleave(group, 2) + zero.repeat_interleave(group, 2)).to(dtype)
    want_v = (vcodes * vscale.repeat_interleave(group, 3) + vzero.repeat_interleave(group, 3)).to(dtype)
    L = T + steps
    real = valid[:, None, :, None]
    for got, want, q, raw in (
        (layer._dequantized(False), want_k, qk, keys),
        (layer._dequantized(True), want_v, qv, values),
    ):
        assert got.shape[2] == L
        assert torch.equal(torch.where(real[:, :, :q], got[:, :, :q], 0), torch.where(real[:, :, :q], want, 0))
        assert torch.equal(got[:, :, q:], raw[:, :, q:L])
    # pages read through the gather (the sparse path) are the same numbers
    pages = torch.tensor([[[0, 5, (L - 13) // 16]] * h, [[1, 3, (L - 14) // 16]] * h])
    slots = layer._page_slots(pages).flatten(2)
    for values_too, full in ((False, layer._dequantized(False)), (True, layer._dequantized(True))):
        got = layer.page_keys(pages, values_too).flatten(2, 3)
        ok = layer.page_validity_of(pages).flatten(2).unsqueeze(-1)
        want = full.gather(2, slots.clamp(max=L - 1).unsqueeze(-1).expand(-1, -1, -1, d))
        assert torch.equal(torch.where(ok, got, 0), torch.where(ok, want, 0))


def test_a_constant_group_dequantizes_to_its_value():
    layer = LocksLayer(LocksConfig(selector="full", kv_bits=2, kv_group=32, kv_residual=32))
    keys = torch.full((1, 1, 64, 32), 0.75, dtype=torch.bfloat16)
    _fill(layer, keys, keys.clone(), 64)
    assert (layer._kscale[:, :, :2] == 0).all() and torch.equal(layer._dequantized(False), keys)
    assert torch.equal(layer._dequantized(True), keys)


# -- bytes ---------------------------------------------------------------------------------------------
def _held_bytes(layer) -> int:
    """Bytes of every tensor storage a layer holds (shared storages once): what it really keeps."""
    seen, total = set(), 0
    tensors = [v for v in vars(layer).values() if torch.is_tensor(v)]
    tensors += [t for d in (layer.summary, layer.shared) for t in d.values()]
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


@pytest.mark.parametrize("bits, limit", [(4, 0.32), (2, 0.19)])
def test_packed_bytes_per_token(bits, limit):
    """bf16 K/V, head_dim 128, groups of 32: each quantized token's key and value, scales and zero
    points included, against bf16; and the whole layer, residual and headroom included, against a
    full-precision layer holding the same tokens."""
    b, h, d, T = 1, 2, 128, 4096
    keys, values = _random_kv(b, h, T + 4, d, torch.bfloat16, seed=7)
    cfg = LocksConfig(rank=4, budget=256, kv_bits=bits, kv_group=32, kv_residual=128)
    layer, full = LocksLayer(cfg), LocksLayer(LocksConfig(rank=4, budget=256))
    for one in (layer, full):
        _fill(one, keys, values, T, steps=4)
    G, qk, qv = 32, layer._qk, layer._qv
    quantized = sum(
        t.numel() * t.element_size()
        for t in (
            layer._kcodes[:, :, :qk],
            layer._kscale[:, :, : qk // G],
            layer._kzero[:, :, : qk // G],
            layer._vcodes[:, :, :qv],
            layer._vscale[:, :, :qv],
            layer._vzero[:, :, :qv],
        )
    )
    per_token = quantized / (b * h * (qk + qv))  # mean bytes of one token's key or value in one head
    ratio = per_token / (d * 2)
    assert ratio <= limit, ratio
    assert layer.storage_bytes()["quantized"] == quantized
    assert ratio == pytest.approx({4: 0.3125, 2: 0.1875}[bits])
    summaries = sum(t.numel() * t.element_size() for t in layer.summary.values())
    held = _held_bytes(layer) - summaries
    held_full = _held_bytes(full) - summaries
    assert held / held_full < ratio + 0.05, (held, held_full)  # residual, slot flags, headroom


@pytest.mark.parametrize("family", ["full", "locks-r4i4"])
def test_between_forwards_a_quantized_cache_holds_no_full_precision_copy(family):
    """Through the model: after the prefill and after decode steps (dense ones for "full") each layer
    holds its packed K/V, the residual and a few prompt queries, not the dequantized K/V attention was
    handed nor the prompt's queries (a slice of them kept the whole prompt's alive)."""
    model = tiny("llama", dtype=torch.bfloat16, head_dim=32)
    ids, T = _ids(1024, b=1), 1024
    held = {}
    for kv in ("", "+kv4"):
        quant = dict(kv_group=32, kv_residual=32) if kv else {}
        cache = LocksCache(model.config, config_for_family(family + kv, budget=128, **quant))
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            after_prefill = sum(_held_bytes(layer) for layer in cache.locks_layers)
            for _ in range(3):
                model(ids[:, :1], past_key_values=cache, use_cache=True)
        after_steps = sum(_held_bytes(layer) for layer in cache.locks_layers)
        held[kv] = (after_prefill, after_steps)
    layers, h, d = model.config.num_hidden_layers, model.config.num_key_value_heads, 32
    bf16_kv = layers * 2 * h * d * 2 * T
    prompt_queries = layers * model.config.num_attention_heads * d * 2 * T
    assert prompt_queries >= bf16_kv  # so that keeping them would show below
    for when in (0, 1):
        assert held[""][when] < 1.5 * bf16_kv, (when, held, bf16_kv)  # K/V headroom, summaries, 32 queries
    for when in (0, 1):  # prefill, steps
        ratio = held["+kv4"][when] / held[""][when]
        assert ratio < 0.55, (when, held)


# -- kv_bits=16 is today's cache; the sparse path over quantized KV ----------------------------------------
def _ids(n=200, b=1, seed=0):
    return torch.randint(3, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def test_kv16_is_the_full_precision_layer():
    assert type(LocksLayer(LocksConfig())) is LocksLayer
    model = tiny("llama", head_dim=32)
    ids = _ids(100, b=2)
    ref = tiny("llama", "sdpa", head_dim=32).generate(ids, max_new_tokens=6, do_sample=False)
    out = model.generate(
        ids, max_new_tokens=6, do_sample=False, past_key_values=LocksCache(model.config, LocksConfig(selector="full"))
    )
    assert torch.equal(out, ref)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_covering_budget_equals_full_on_the_same_quantized_kv(arch):
    model = tiny(arch, head_dim=32)
    ids = _ids(150, b=2)
    kv = dict(kv_group=32, kv_residual=32)  # kv_bits from the label
    outs = {}
    for family in ("full", "locks-r4i4", "oracle", "quest"):
        cache = LocksCache(model.config, config_for_family(f"{family}+kv4", budget=1024, **kv))
        outs[family] = model.generate(ids, max_new_tokens=24, do_sample=False, past_key_values=cache)
        assert all(isinstance(layer, QuantizedLocksLayer) for layer in cache.locks_layers)
    for family, out in outs.items():
        assert torch.equal(out, outs["full"]), family


@pytest.mark.parametrize("selector", selectors(kernel=True, dense=False))
@pytest.mark.parametrize("order", ["post", "pre"])
def test_sparse_path_with_every_page_equals_dense_over_the_quantized_kv(selector, order):
    """The gather-and-dequantize path (not the dense shortcut) gives dense attention over the
    dequantized K/V."""
    b, h, d, T = 2, 2, 32, 181
    keys, values = _random_kv(b, h, T + 5, d, torch.float64, seed=11)
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[0, :9] = False
    summary_from = order if selector != "oracle" else "post"
    layer = LocksLayer(
        LocksConfig(selector=selector, rank=4, budget=2048, kv_bits=4, kv_residual=32, summary_from=summary_from)
    )
    _fill(layer, keys, values, T, valid, steps=5)
    assert 0 < layer._qk < layer.length and 0 < layer._qv < layer.length
    q = torch.randn(b, 2 * h, 1, d, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    out = reference_decode(layer, q, 0.3)
    k = layer._dequantized(False).repeat_interleave(2, 1)
    v = layer._dequantized(True).repeat_interleave(2, 1)
    real = layer.slot_valid[:, None, None, : layer.length]
    logits = (0.3 * q @ k.transpose(-1, -2)).masked_fill(~real, float("-inf"))
    want = torch.softmax(logits, -1) @ v
    assert torch.allclose(out, want.transpose(1, 2), atol=1e-12)


def test_post_and_pre_summaries_differ_and_both_attend_the_quantized_kv():
    b, h, d, T, B = 1, 2, 32, 200, 16
    keys, values = _random_kv(b, h, T + 3, d, torch.float64, seed=3)
    kv = dict(selector="locks", rank=4, budget=64, page_size=B, kv_bits=2, kv_group=32, kv_residual=64)
    post, pre = LocksLayer(LocksConfig(**kv)), LocksLayer(LocksConfig(**kv, summary_from="pre"))
    plain = LocksLayer(LocksConfig(selector="locks", rank=4, budget=64, page_size=B))
    for layer in (post, pre, plain):
        _fill(layer, keys, values, T, steps=3)
    n, qk = post.n_summarized[0], post._qk
    assert pre.n_summarized[0] == n == plain.n_summarized[0] and qk == pre._qk == 192
    quantized_pages = qk // B
    # post: the summaries of the full-precision keys; pre: of the dequantized keys the cache attends
    dequantized = LocksLayer(LocksConfig(selector="locks", rank=4, budget=64, page_size=B))
    _fill(dequantized, torch.cat([post._dequantized(False), keys[:, :, T + 3 :]], 2), values, T, steps=3)
    for name in plain.summary:
        assert torch.equal(post.summary[name][:, :, :n], plain.summary[name][:, :, :n]), name
        assert torch.equal(pre.summary[name][:, :, :n], dequantized.summary[name][:, :, :n]), name
        # the pages still in full precision are summarized alike
        assert torch.equal(pre.summary[name][:, :, quantized_pages:n], post.summary[name][:, :, quantized_pages:n])
    assert any(
        not torch.equal(pre.summary[m][:, :, :quantized_pages], post.summary[m][:, :, :quantized_pages])
        for m in plain.summary
    )
    # both attend the same quantized K/V, not the original keys
    pages = torch.arange(post.num_pages).expand(b, h, -1)
    for values_too in (False, True):
        assert torch.equal(post.page_keys(pages, values_too), pre.page_keys(pages, values_too))
    assert not torch.equal(
        post.page_keys(pages)[:, :, :quantized_pages], plain.page_keys(pages)[:, :, :quantized_pages]
    )
    q = torch.randn(b, 2 * h, 1, d, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for layer in (post, pre):
        reference_decode(layer, q, 0.25)
        assert layer.last_selection.sum(-1).eq(4).all()


def test_post_never_quantizes_a_key_before_its_page_is_summarized():
    """Left-padded rows: a key chunk boundary inside a page not yet complete waits for the page (then
    catches up), so every "post" summary is the full-precision layer's."""
    b, h, d, T, steps, B = 2, 2, 32, 200, 70, 16
    keys, values = _random_kv(b, h, T + steps, d, torch.float64, seed=4)
    valid = torch.ones(b, T, dtype=torch.bool)
    valid[1, :5] = False
    kv = dict(selector="locks", rank=4, budget=64, page_size=B)
    post, plain = LocksLayer(LocksConfig(**kv, kv_bits=4, kv_residual=64)), LocksLayer(LocksConfig(**kv))
    held_back = []
    for layer in (post, plain):
        layer.update(keys[:, :, :T], values[:, :, :T])
        layer.prepare(_padding_mask(valid, torch.float32), T)
        for i in range(T, T + steps):
            layer.update(keys[:, :, i : i + 1], values[:, :, i : i + 1])
            layer.prepare(None, 1)
            if layer is post:
                held_back.append(post._qk < (i // 64) * 64)
    assert any(held_back) and post._qk == 256  # row 1's page 245..260 held slot 256's chunk back
    assert post.n_summarized == plain.n_summarized
    for name in plain.summary:
        n = max(plain.n_summarized)
        assert torch.equal(post.summary[name][:, :, :n], plain.summary[name][:, :, :n]), name


@pytest.mark.parametrize("order", ["post", "pre"])
def test_a_fork_of_a_full_precision_prefill_equals_a_quantized_prefill(order):
    """The sweep runner's flow (one dense bf16 prefill, an arm's fork) stores and decodes what a cache
    quantized from the start would."""
    model = tiny("llama", head_dim=32)
    ids = _ids(170, b=2)
    cfg = LocksConfig(rank=4, budget=64, kv_bits=4, kv_residual=64, summary_from=order)
    native = LocksCache(model.config, cfg)
    base = LocksCache(model.config, LocksConfig(selector="full"))
    with torch.no_grad():
        first = model(ids, past_key_values=native).logits[:, -1:].argmax(-1)
        model(ids, past_key_values=base)
        fork = base.fork(cfg)
        for a, c in zip(native.locks_layers, fork.locks_layers):
            assert isinstance(c, QuantizedLocksLayer)
            for name in QuantizedLocksLayer._STORAGE:
                x, y = getattr(a, name), getattr(c, name)
                assert x.shape[:2] == y.shape[:2]
            assert (a._qk, a._qv) == (c._qk, c._qv)
            assert torch.equal(a._dequantized(False), c._dequantized(False))
            assert torch.equal(a._dequantized(True), c._dequantized(True))
        out_native = model.generate(
            torch.cat([ids, first], 1), max_new_tokens=12, do_sample=False, past_key_values=native
        )
        out_fork = model.generate(torch.cat([ids, first], 1), max_new_tokens=12, do_sample=False, past_key_values=fork)
    assert torch.equal(out_native, out_fork)
    for a, c in zip(native.locks_layers, fork.locks_layers):
        for name in a.summary:
            n = a.n_summarized[0]
            assert torch.equal(a.summary[name][:, :, :n], c.summary[name][:, :, :n])


@pytest.mark.parametrize("order", ["post", "pre"])
def test_a_fork_before_the_first_forward_decodes_as_a_quantized_cache(order):
    """Forking a cache that holds nothing yet into quantized KV gives an empty quantized cache."""
    model = tiny("llama", head_dim=32)
    ids = _ids(170, b=1)
    cfg = LocksConfig(rank=4, budget=64, kv_bits=4, kv_residual=64, summary_from=order)
    fork = LocksCache(model.config, LocksConfig(budget=64)).fork(cfg)
    assert all(isinstance(layer, QuantizedLocksLayer) for layer in fork.locks_layers)
    with torch.no_grad():
        out_fork = model.generate(ids, max_new_tokens=8, do_sample=False, past_key_values=fork)
        out_native = model.generate(
            ids, max_new_tokens=8, do_sample=False, past_key_values=LocksCache(model.config, cfg)
        )
    assert torch.equal(out_fork, out_native)


# -- generate() for every registered selector ------------------------------------------------------------
def _kv4_config(name: str) -> LocksConfig:
    """``name`` at the smallest of a few budgets its method fits in, on 4-bit KV."""
    for budget in (64, 512):
        try:
            return LocksConfig(selector=name, rank=4, budget=budget, kv_bits=4, kv_group=32, kv_residual=32)
        except BudgetDoesNotFit:
            continue
    raise AssertionError(f"{name} fits no budget tried")


@pytest.mark.parametrize("selector", selector_names())
def test_generate_on_4bit_kv_for_every_selector(selector):
    from locks_hf.baselines.kvzip import score_context
    from locks_hf.eval.testing import ByteTokenizer

    cfg = _kv4_config(selector)
    model = tiny("llama", head_dim=32)
    ids = _ids(cfg.budget + 150)
    with torch.no_grad():
        if getattr(selector_class(selector), "needs_context_scores", False):
            # its prefill is scored by context reconstruction before it decodes (as the sweep does)
            base = LocksCache(model.config, LocksConfig(selector="full"))
            first = model(ids, past_key_values=base).logits[:, -1:].argmax(-1)
            score_context(model, ByteTokenizer(), base, ids[:, :-20])
            cache = base.fork(cfg)
            prompt = torch.cat([ids, first], 1)
        else:
            cache, prompt = LocksCache(model.config, cfg), ids
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, past_key_values=cache)
    assert out.shape[1] == prompt.shape[1] + 8
    for layer in cache.locks_layers:
        assert isinstance(layer, QuantizedLocksLayer)
        assert layer._qk > 0 and layer._qv > 0
        assert layer.storage_bytes()["quantized"] > 0
    traffic = cache.decode_traffic()
    assert traffic["read_bytes"] > 0
    cls = selector_class(selector)
    for layer in cache.locks_layers:  # the selector's own decode path ran
        if cls.token_level:
            assert layer.policy_state is not None
        elif not cls.dense:
            assert layer.last_selection is not None and cache.attended_fraction() < 1.0


def test_traffic_counts_the_packed_bytes():
    model = tiny("llama", head_dim=32)
    ids = _ids(300)
    traffic = {}
    for bits in (16, 4):
        kv = {} if bits == 16 else dict(kv_bits=4, kv_residual=32)
        for family in ("oracle", "locks-r4i4"):
            cache = LocksCache(model.config, config_for_family(family, budget=64, **kv))
            model.generate(ids, max_new_tokens=6, do_sample=False, past_key_values=cache)
            traffic[family, bits] = cache.decode_traffic()
    # float64 K/V (8 bytes) against 4-bit codes plus float64 scales and zero points per 32: 1/8 the bytes,
    # the last few full-precision tokens aside
    for family in ("oracle", "locks-r4i4"):
        assert traffic[family, 4]["attended_tokens"] == pytest.approx(traffic[family, 16]["attended_tokens"], rel=0.1)
        ratio = traffic[family, 4]["read_bytes"] / traffic[family, 16]["read_bytes"]
        assert ratio < 0.5, (family, ratio)


# -- labels, arms and refusals -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "label",
    [
        "locks-r8i4+kv4-post",
        "locks-r8i4+kv4-pre",
        "full+kv2",
        "oracle+kv4",
        "quest+kv2g64r256-pre",
        "locks-r4i4-rr8+kv4-post",
        "rocketkv+kv4",
    ],
)
def test_arm_labels_round_trip(label):
    config = config_for_family(label, budget=512)
    assert family_of(config) == label
    assert config.kv_bits in (2, 4)
    cls, _ = parse_family(label)
    assert config.label == (label if cls.dense else f"{label}-b512")


def test_sweep_arms_and_the_static_engine():
    from locks_hf.eval.arms import parse_arms
    from locks_hf.eval.engine import runs_static

    arms = parse_arms(["full+kv2", "locks-r8i4+kv4-post", "locks-r8i4+kv4-pre", "locks-r8i4"], [64, 256])
    assert [a.name for a in arms] == [
        "full+kv2",
        "locks-r8i4+kv4-post-b64",
        "locks-r8i4+kv4-post-b256",
        "locks-r8i4+kv4-pre-b64",
        "locks-r8i4+kv4-pre-b256",
        "locks-r8i4-b64",
        "locks-r8i4-b256",
    ]
    assert [runs_static(a.config) for a in arms] == [False] * 5 + [True] * 2
    with pytest.raises(LocksConfigError, match="kv_bits must be one of"):
        parse_arms(["locks-r8i4+kv3"], [64])


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(kv_bits=3), "kv_bits must be one of"),
        (dict(kv_bits=8), "kv_bits must be one of"),
        (dict(kv_bits=4, kv_group=16), "kv_group must be one of"),
        (dict(kv_bits=4, kv_group=64, kv_residual=96), "multiple of kv_group=64"),
        (dict(kv_bits=4, kv_group=32, kv_residual=0), "multiple of kv_group"),
        (dict(kv_bits=4, kv_residual=64, page_size=128, budget=512), "multiple of page_size=128"),
        (dict(kv_group=64), "no effect"),
        (dict(summary_from="pre"), "no effect"),
        (dict(kv_bits=4, summary_from="mid"), "summary_from must be one of"),
        (dict(kv_bits=4, summary_from="pre", selector="oracle"), "builds no page summaries"),
        (dict(kv_bits=4, summary_from="pre", selector="full"), "builds no page summaries"),
        (dict(kv_bits=4.0), "kv_bits must be an int"),
    ],
)
def test_bad_settings_are_refused(fields, match):
    with pytest.raises(LocksConfigError, match=match):
        LocksConfig(**fields)


def test_refusals_name_the_option():
    model = tiny("llama")  # head_dim 16: no value group of 32 channels fits
    with pytest.raises(LocksConfigError, match="kv_group=32 does not divide the model's head_dim=16"):
        LocksCache(model.config, LocksConfig(kv_bits=4))
    model = tiny("llama", head_dim=32)
    cfg = LocksConfig(kv_bits=4, kv_residual=32)
    pre = cfg.replace(summary_from="pre")  # the static layout builds summaries before quantization only
    for make in (
        lambda: LocksStaticCache(model.config, 512, pre),
        lambda: LocksCache(model.config, pre, layout="static"),
    ):
        with pytest.raises(LocksConfigError, match="summary_from='pre' on quantized KV.*layout='dynamic'"):
            make()
    static = LocksStaticCache(model.config, 512, cfg)
    model(_ids(100), past_key_values=static)
    with pytest.raises(LocksConfigError, match="stored quantized in the static layout"):
        static.fork(pre)  # a fork the static layout cannot serve would convert to the dynamic one
    cache = LocksCache(model.config, cfg)
    model(_ids(100), past_key_values=cache)
    for other in (LocksConfig(), cfg.replace(kv_bits=2), cfg.replace(summary_from="pre")):
        with pytest.raises(LocksConfigError, match="cannot switch a cache layer's KV storage"):
            cache.fork(other)
    with pytest.raises(LocksConfigError, match="cannot switch"):
        LocksLayer(LocksConfig()).set_config(cfg)
    cache.crop(-3)  # within the full-precision tail
    assert cache.get_seq_length() == 97
    with pytest.raises(ValueError, match="quantized groups cannot be reopened"):
        cache.crop(-50)


def test_report_has_the_papers_table_4_shape():
    from locks_hf.eval.report import tables_markdown

    scores = {
        "locks-r8i4": 73.1,
        "locks-r8i4+kv4-post": 72.8,
        "locks-r8i4+kv4-pre": 73.0,
        "locks-r8i4+kv2-post": 68.0,
        "locks-r8i4+kv2-pre": 67.6,
    }
    cells = [
        {
            "task": "niah",
            "length": 32768,
            "arm": f"{f}-b{b}",
            "family": f,
            "budget": b,
            "selector": "locks",
            "n": 1,
            "score": s + (b == 256) * 10,
            "read_bytes": 1000.0 if "kv" in f else 3000.0,
        }
        for f, s in scores.items()
        for b in (64, 256)
    ]
    cells += [
        {
            "task": "niah",
            "length": 32768,
            "arm": f,
            "family": f,
            "budget": None,
            "selector": "full",
            "n": 1,
            "score": s,
            "read_bytes": 2000.0,
        }
        for f, s in (("full", 90.0), ("full+kv4", 89.5))
    ]
    md, averages = tables_markdown(cells)
    assert averages[(32768, "full+kv4", 64)] == (89.5, 1)  # a dense family shown at every budget
    table = md.split("locks-r8i4 on quantized KV (KIVI), score x100\n\n")[1].split("\n\n")[0]
    assert table.splitlines() == [
        "| KV | b=64 | b=256 |",
        "|---|---|---|",
        "| KV bf16 | 73.1 | 83.1 |",
        "| 4-bit post | 72.8 | 82.8 |",
        "| 4-bit pre | 73.0 | 83.0 |",
        "| 2-bit post | 68.0 | 78.0 |",
        "| 2-bit pre | 67.6 | 77.6 |",
    ]
    assert "| full+kv4 | 89.5 | 89.5 |" in md
    assert "| 4-bit | 89.5 | 89.5 |" in md.split("full on quantized KV")[1]


def test_fidelity_refuses_quantized_arms():
    from locks_hf.eval.arms import parse_arms
    from locks_hf.eval.fidelity import run_fidelity

    with pytest.raises(ValueError, match=r"arms \['locks-r8i4\+kv4-post-b64'\] quantize their K/V"):
        run_fidelity(None, [], parse_arms(["locks-r8i4", "locks-r8i4+kv4-post"], [64]), "/nonexistent/out")


def test_sweep_runs_quantized_arms_and_reports_them(tmp_path):
    """`locks-hf-eval sweep` arms end to end (one dense bf16 prefill per record, each arm a fork)."""
    from locks_hf.eval.arms import parse_arms
    from locks_hf.eval.benchmarks import RulerBenchmark
    from locks_hf.eval.merge import merge
    from locks_hf.eval.report import write_report
    from locks_hf.eval.runner import SweepRunner
    from locks_hf.eval.testing import ByteTokenizer
    from locks_hf.models import tiny_model

    tok = ByteTokenizer()
    model = tiny_model("gemma3", vocab_size=256, max_position_embeddings=8192, head_dim=32)
    arms = parse_arms(
        ["full", "full+kv4", "locks-r4i4", "locks-r4i4+kv4-post", "locks-r4i4+kv4-pre", "locks-r4i4+kv2-post"], [64]
    )
    out = tmp_path / "kv"
    bench = RulerBenchmark(tok, ["niah_single_1"], [1024], num_samples=1)
    SweepRunner(model, tok, bench, arms, out, model_name="tiny-gemma3", progress=False, max_new_tokens=4, limit=1).run()
    merge(out)
    rows = {r["arm"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    assert set(rows) == {a.name for a in arms}
    # the few attended pages include the full-precision tail; a dense read is mostly packed
    assert rows["locks-r4i4+kv4-post-b64"]["read_bytes"] < rows["locks-r4i4-b64"]["read_bytes"]
    assert rows["full+kv4"]["read_bytes"] < 0.5 * rows["full"]["read_bytes"]
    text = write_report([out], tmp_path / "docs", title="tiny").read_text()
    assert "locks-r4i4 on quantized KV (KIVI)" in text and "| 4-bit pre |" in text and "| 2-bit post |" in text


def test_a_static_cache_forks_into_a_quantized_dynamic_one(caplog):
    """A static layer keeps the KV storage it was created with: a fork for a quantized arm converts to the
    dynamic layout (logged) and decodes as a fork of a dynamic prefill does."""
    model = tiny("llama", head_dim=32)
    ids = _ids(170)
    static = LocksStaticCache(model.config, 512, LocksConfig(selector="full"))
    dynamic = LocksCache(model.config, LocksConfig(selector="full"))
    cfg = LocksConfig(rank=4, budget=64, kv_bits=4, kv_residual=64)
    with torch.no_grad():
        first = model(ids, past_key_values=static).logits[:, -1:].argmax(-1)
        model(ids, past_key_values=dynamic)
        forks = static.fork(cfg), dynamic.fork(cfg)
        outs = [
            model.generate(torch.cat([ids, first], 1), max_new_tokens=10, do_sample=False, past_key_values=f)
            for f in forks
        ]
    assert not forks[0].is_static and all(isinstance(layer, QuantizedLocksLayer) for layer in forks[0].locks_layers)
    assert "kv_bits=4: a static layer keeps the KV storage it was created with (kv_bits=16)" in caplog.text
    assert torch.equal(outs[0], outs[1])
