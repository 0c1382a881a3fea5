"""Misuse is refused with a library error before any token, never run silently as something else."""

import numpy as np
import pytest
import torch
from conftest import tiny
from transformers import AutoModelForCausalLM, BloomConfig, DeepseekV3Config, FalconConfig, Gemma2Config, MptConfig

from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache, UnsupportedModelError
from locks_hf.demo import prefill
from locks_hf.models import tiny_config


def _ids(n=100, seed=1):
    return torch.randint(3, 256, (1, n), generator=torch.Generator().manual_seed(seed))


class _TokenLog:
    """A streamer recording every token generate() emits."""

    def __init__(self):
        self.tokens = []

    def put(self, value):
        self.tokens.append(value)

    def end(self):
        pass


# -- assisted and prompt-lookup decoding ----------------------------------------------------------

@pytest.mark.parametrize("option", ["assistant", "prompt_lookup"])
def test_assisted_and_prompt_lookup_decoding_are_refused_before_any_token(option):
    model = tiny("llama")
    kwargs = ({"assistant_model": tiny("llama", "sdpa", seed=1)} if option == "assistant"
              else {"prompt_lookup_num_tokens": 3})
    log = _TokenLog()
    with pytest.raises(UnsupportedModelError, match="assisted decoding and prompt-lookup"):
        model.generate(_ids(), past_key_values=LocksCache(model.config, budget=32), max_new_tokens=8,
                       do_sample=False, streamer=log, **kwargs)
    assert len(log.tokens) <= 1  # at most the prompt (the streamer's first put); no generated token


def test_assisted_decoding_on_a_prefilled_cache_is_refused_at_the_first_verification():
    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    ids = _ids()
    model(ids[:, :-1], past_key_values=cache)
    with pytest.raises(UnsupportedModelError, match="assisted decoding"):
        model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3)


def test_chunked_prefill_then_decode_still_runs_sparse():
    """Several multi-token forwards in a row (the demo's chunked prefill) are prompt, not verification."""
    model = tiny("llama")
    ids = _ids(300)
    cache = LocksCache(model.config, budget=32)
    first = prefill(model, ids, cache, chunk_size=64, progress=False)
    model.generate(torch.cat([ids, first], 1), past_key_values=cache, max_new_tokens=4, do_sample=False)
    assert cache.attended_fraction() < 0.5


def test_past_recording_after_prefill_keeps_single_token_decode():
    """generate()'s deferred stop check records past states after prefill: decode must keep working."""
    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    out = model(_ids(), past_key_values=cache)
    cache.activate_past_recording()
    model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
    with pytest.raises(UnsupportedModelError, match="verify several tokens"):
        model(_ids(3), past_key_values=cache)


# -- the model's attention is not "locks" ---------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_cache_for_a_model_not_loaded_with_locks_is_refused(attn):
    model = tiny("llama", attn)
    with pytest.raises(UnsupportedModelError, match="attn_implementation='locks'"):
        LocksCache(model.config, budget=32)
    with pytest.raises(UnsupportedModelError, match="attn_implementation='locks'"):
        LocksStaticCache(model.config, max_cache_len=256, budget=32)


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_config_free_cache_on_an_sdpa_model_fails_at_the_first_decode_step(arch):
    model = tiny(arch, "sdpa")
    log = _TokenLog()
    with pytest.raises(UnsupportedModelError, match="did not call Locks' attention"):
        model.generate(_ids(), past_key_values=LocksCache(budget=32), max_new_tokens=5, do_sample=False,
                       streamer=log)
    assert len(log.tokens) <= 2  # the prompt and the prefill's (dense, exact) first token


def _deepseek_v3():
    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
                            vocab_size=256, intermediate_size=64, moe_intermediate_size=32, kv_lora_rank=16,
                            q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=2)


@pytest.mark.parametrize("config,needle", [
    (BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256), "ALiBi"),
    (MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256), "ALiBi"),
    (FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256, alibi=True), "ALiBi"),
    (FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256), "AttentionInterface"),
    (_deepseek_v3(), "latent attention"),
    (Gemma2Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2),
     "soft-capping"),
], ids=["bloom", "mpt", "falcon-alibi", "falcon-rope", "deepseek-v3", "gemma2"])
def test_unsupported_families_are_refused_at_cache_construction(config, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        LocksCache(config)
    with pytest.raises(UnsupportedModelError, match=needle):
        LocksStaticCache(config, max_cache_len=64)


@pytest.mark.parametrize("config,needle", [
    (MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256), "ALiBi"),
    (BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256), "ALiBi"),
    (_deepseek_v3(), "latent attention"),
], ids=["mpt", "bloom", "deepseek-v3"])
def test_unsupported_families_loaded_with_locks_fail_at_the_first_forward(config, needle):
    """Loaded with attn_implementation="locks" and run with any cache (even none): refused, not dense."""
    model = AutoModelForCausalLM.from_config(config, attn_implementation="locks")
    with pytest.raises(UnsupportedModelError, match=needle):
        model(_ids(20))
    with pytest.raises(UnsupportedModelError, match=needle):
        model(_ids(20), past_key_values=LocksCache())


def test_cache_built_from_another_models_config_is_refused():
    llama, gemma = tiny("llama"), tiny("gemma3")
    with pytest.raises(UnsupportedModelError, match="LocksCache\\(model.config\\)"):
        llama(_ids(), past_key_values=LocksCache(gemma.config, budget=32))
    with pytest.raises(UnsupportedModelError, match="layer types do not match|model.config"):
        gemma(_ids(), past_key_values=LocksCache(llama.config, budget=32))
    deeper = tiny_model_config_cache("llama", num_hidden_layers=1)
    with pytest.raises(UnsupportedModelError, match="layer index 1 but the cache has 1 layers"):
        llama(_ids(), past_key_values=deeper)
    wider = tiny_model_config_cache("llama", head_dim=32)
    with pytest.raises(UnsupportedModelError, match="KV heads of dim 16 but the cache was built for 2 of dim 32"):
        llama(_ids(), past_key_values=wider)


def tiny_model_config_cache(arch, **overrides):
    config = tiny_config(arch, **overrides)
    config._attn_implementation = "locks"
    return LocksCache(config, budget=32)


# -- LocksConfig validation ------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,needle", [
    (dict(basis_bits=4.0), "basis_bits must be an int"),
    (dict(rank=True), "rank must be an int"),
    (dict(budget=128.0), "budget must be an int"),
    (dict(page_size=2**40), "page_size must be a power of two in 2..1024"),
    (dict(selector=None), "selector must be a str"),
])
def test_config_types_and_ranges(kwargs, needle):
    with pytest.raises(LocksConfigError, match=needle):
        LocksConfig(**kwargs)


def test_numpy_ints_are_accepted_as_ints():
    cfg = LocksConfig(rank=np.int64(4), budget=np.int32(64))
    assert type(cfg.rank) is int and type(cfg.budget) is int


def test_from_label_needs_a_string():
    with pytest.raises(LocksConfigError, match="label is a str"):
        LocksConfig.from_label(None)


def test_fork_checks_rank_against_the_head_dim():
    model = tiny("llama")  # head_dim 16
    cache = LocksCache(model.config, budget=32)
    model(_ids(), past_key_values=cache)
    with pytest.raises(LocksConfigError, match="head_dim=16"):
        cache.fork(LocksConfig(rank=32, page_size=32, budget=64))


def test_config_free_cache_checks_rank_against_the_head_dim():
    model = tiny("llama")
    with pytest.raises(LocksConfigError, match="head_dim=16"):
        model(_ids(), past_key_values=LocksCache(locks=LocksConfig(rank=32, page_size=32, budget=64)))


# -- LocksStaticCache capacity ---------------------------------------------------------------------

@pytest.mark.parametrize("max_cache_len", [110, 112])  # not a whole number of pages, and a whole one
def test_static_cache_overflow_during_decode_names_max_cache_len(max_cache_len):
    model = tiny("llama")
    ids = _ids(100)
    cache = LocksStaticCache(model.config, max_cache_len=max_cache_len, budget=32)
    with pytest.raises(ValueError, match=f"max_cache_len={max_cache_len}"):
        model.generate(ids, past_key_values=cache, max_new_tokens=20, do_sample=False)


def test_static_cache_holds_exactly_max_cache_len_tokens():
    model = tiny("llama")
    ids = _ids(100)
    out = model.generate(ids, past_key_values=LocksStaticCache(model.config, max_cache_len=110, budget=32),
                         max_new_tokens=11, do_sample=False)  # the 11th token is never written to the cache
    assert out.shape[1] == 111


@pytest.mark.parametrize("bad", [0, -5, 100.0, True])
def test_static_cache_max_cache_len_must_be_a_positive_int(bad):
    with pytest.raises(LocksConfigError, match="max_cache_len must be a positive int"):
        LocksStaticCache(tiny("llama").config, max_cache_len=bad)
