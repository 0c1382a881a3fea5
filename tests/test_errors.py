"""Bad configurations and unsupported models raise errors that say what to change."""

import pytest
import torch
from conftest import tiny
from transformers import Gemma2Config, LlamaConfig, MistralConfig

from locks_hf import LocksCache, LocksConfig, LocksConfigError, UnsupportedModelError
from locks_hf.attention import locks_attention_forward

#: cache API, generate() with padding, beams and sampling, layouts, fork: checked on every supported version.
pytestmark = pytest.mark.compat


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(rank=0), "rank must be a positive int"),
        (dict(rank=17), "rank must be in"),
        (dict(budget=16), "budget must be at least two pages"),
        (dict(page_size=12), "power of two"),
        (dict(selector="topk"), "selector must be one of"),
        (dict(group_combine="vote"), "group_combine must be one of"),
        (dict(basis_bits=3), "basis_bits must be one of"),
        (dict(coef_bits=4), "coef_bits must be one of"),
        (dict(min_context=-1), "min_context"),
    ],
)
def test_bad_config_values(kwargs, needle):
    with pytest.raises(LocksConfigError, match=needle):
        LocksConfig(**kwargs)


def test_labels_parse_and_reject():
    cfg = LocksConfig.from_label("r4i2", budget=256)
    assert (cfg.rank, cfg.basis_bits, cfg.budget, cfg.page_slots) == (4, 2, 256, 16)
    assert LocksConfig.from_label("locks-r8bf16").basis_bits == 16
    assert LocksConfig.from_label("r8i4").label == "locks-r8i4-b128"
    for bad in ["r8", "8i4", "r8i5", "rxi4"]:
        with pytest.raises(LocksConfigError):
            LocksConfig.from_label(bad)


def _llama(**kw):
    return LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, **kw)


def test_rank_above_head_dim():
    with pytest.raises(LocksConfigError, match="head_dim"):
        LocksCache(_llama(head_dim=8), LocksConfig(rank=16))


def test_softcapping_model_is_refused():
    config = Gemma2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2
    )
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        LocksCache(config)


def test_all_sliding_model_is_refused():
    config = MistralConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        sliding_window=4096,
        layer_types=["sliding_attention"] * 2,
    )
    with pytest.raises(UnsupportedModelError, match="sliding_window=None"):
        LocksCache(config)


def test_softcap_kwarg_at_attention_time_is_refused():
    model = tiny("llama")
    cache = LocksCache(model.config, LocksConfig(budget=32))
    model(torch.randint(3, 200, (1, 80)), past_key_values=cache)
    layer_idx = 0
    q = torch.randn(1, 4, 1, 16, dtype=torch.float64)
    k = torch.randn(1, 2, 1, 16, dtype=torch.float64)
    keys, values = cache.update(k, k, layer_idx)
    module = model.model.layers[0].self_attn
    with pytest.raises(UnsupportedModelError, match="soft-capping"):
        locks_attention_forward(module, q, keys, values, None, scaling=0.25, softcap=30.0)


def test_beam_search_on_a_used_cache_says_to_pass_a_fresh_one():
    model = tiny("llama")
    ids = torch.randint(3, 200, (1, 40))
    cache = LocksCache(model.config)
    model(ids, past_key_values=cache)
    with pytest.raises(ValueError, match="fresh"):
        model(ids.repeat(2, 1), past_key_values=cache)


def test_offloading_is_refused():
    model = tiny("llama")
    cache = LocksCache(model.config)
    model(torch.randint(3, 200, (1, 20)), past_key_values=cache)
    with pytest.raises(ValueError, match="offloading"):
        cache.layers[0].offload()
