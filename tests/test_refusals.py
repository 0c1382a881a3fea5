"""Misuse is refused with a library error before any token, never run silently as something else."""

import inspect

import numpy as np
import pytest
import torch
import transformers
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
    kwargs = (
        {"assistant_model": tiny("llama", "sdpa", seed=1)} if option == "assistant" else {"prompt_lookup_num_tokens": 3}
    )
    log = _TokenLog()
    with pytest.raises(UnsupportedModelError, match="assisted decoding and prompt-lookup"):
        model.generate(
            _ids(),
            past_key_values=LocksCache(model.config, budget=32),
            max_new_tokens=8,
            do_sample=False,
            streamer=log,
            **kwargs,
        )
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


_CACHE_TAKES_OPTIONS = "kwargs" in inspect.signature(transformers.Cache.activate_past_recording).parameters


@pytest.mark.parametrize(
    "options",
    [
        {},
        pytest.param(
            {"recurrent_states_to_keep": 1},
            marks=pytest.mark.skipif(not _CACHE_TAKES_OPTIONS, reason="this transformers passes no options"),
        ),
    ],
)
def test_past_recording_after_prefill_keeps_single_token_decode(options):
    """generate()'s deferred stop check records past states after prefill: decode must keep working.
    transformers >= 5.25 passes the recurrent layers' ``recurrent_states_to_keep`` (5.24 nothing)."""
    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    out = model(_ids(), past_key_values=cache)
    cache.activate_past_recording(**options)
    assert all(layer.recording_past for layer in cache.locks_layers)
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
        model.generate(_ids(), past_key_values=LocksCache(budget=32), max_new_tokens=5, do_sample=False, streamer=log)
    assert len(log.tokens) <= 2  # the prompt and the prefill's (dense, exact) first token


def _deepseek_v3():
    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=256,
        intermediate_size=64,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
    )


@pytest.mark.parametrize(
    "config,needle",
    [
        (BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256), "ALiBi"),
        (MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256), "ALiBi"),
        (FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256, alibi=True), "ALiBi"),
        (
            FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256),
            "AttentionInterface",
        ),
        (_deepseek_v3(), "latent attention"),
        (
            Gemma2Config(
                hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2
            ),
            "soft-capping",
        ),
    ],
    ids=["bloom", "mpt", "falcon-alibi", "falcon-rope", "deepseek-v3", "gemma2"],
)
def test_unsupported_families_are_refused_at_cache_construction(config, needle):
    with pytest.raises(UnsupportedModelError, match=needle):
        LocksCache(config)
    with pytest.raises(UnsupportedModelError, match=needle):
        LocksStaticCache(config, max_cache_len=64)


@pytest.mark.parametrize(
    "config,needle",
    [
        (MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256), "ALiBi"),
        (BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256), "ALiBi"),
        (_deepseek_v3(), "latent attention"),
    ],
    ids=["mpt", "bloom", "deepseek-v3"],
)
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


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(basis_bits=4.0), "basis_bits must be an int"),
        (dict(rank=True), "rank must be an int"),
        (dict(budget=128.0), "budget must be an int"),
        (dict(page_size=2**40), "page_size must be a power of two in 2..1024"),
        (dict(selector=None), "selector must be a str"),
    ],
)
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
    out = model.generate(
        ids,
        past_key_values=LocksStaticCache(model.config, max_cache_len=110, budget=32),
        max_new_tokens=11,
        do_sample=False,
    )  # the 11th token is never written to the cache
    assert out.shape[1] == 111


@pytest.mark.parametrize("bad", [0, -5, 100.0, True])
def test_static_cache_max_cache_len_must_be_a_positive_int(bad):
    with pytest.raises(LocksConfigError, match="max_cache_len must be a positive int"):
        LocksStaticCache(tiny("llama").config, max_cache_len=bad)


# -- use_cache=False with a cache -------------------------------------------------------------------


def test_use_cache_false_with_a_locks_cache_is_refused_before_any_token():
    """transformers writes every forward into a passed cache even with use_cache=False, and generate()
    re-feeds the whole sequence (a DynamicCache gives wrong tokens the same way): refused."""
    model = tiny("llama")
    log = _TokenLog()
    with pytest.raises(UnsupportedModelError, match="use_cache=False"):
        model.generate(
            _ids(),
            past_key_values=LocksCache(model.config, budget=1024),
            use_cache=False,
            max_new_tokens=4,
            do_sample=False,
            streamer=log,
        )
    assert len(log.tokens) <= 1
    with pytest.raises(UnsupportedModelError, match="use_cache=False"):
        model(_ids(), past_key_values=LocksCache(model.config), use_cache=False)
    # without a cache, use_cache=False is dense decoding, as with sdpa
    want = tiny("llama", "sdpa").generate(_ids(), use_cache=False, max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(_ids(), use_cache=False, max_new_tokens=4, do_sample=False), want)


# -- selector-specific settings ---------------------------------------------------------------------

_SETTING_VALUES = {"lazy_alpha": 1e-4, "rerank": 4}


def _budget_for(selector):
    from locks_hf.config import BudgetDoesNotFit

    try:
        LocksConfig(selector=selector)
        return 128
    except BudgetDoesNotFit:
        return 512


@pytest.mark.parametrize("setting", sorted(_SETTING_VALUES))
def test_every_selector_specific_setting_is_refused_on_selectors_that_ignore_it(setting):
    from locks_hf.config import SELECTOR_SETTINGS
    from locks_hf.selectors import selector_class, selector_names

    assert set(SELECTOR_SETTINGS) == set(_SETTING_VALUES)  # a new setting needs a value here
    owners = []
    for name in selector_names():
        kwargs = {"selector": name, "budget": _budget_for(name), setting: _SETTING_VALUES[setting]}
        if setting in selector_class(name).own_settings:
            assert getattr(LocksConfig(**kwargs), setting) == _SETTING_VALUES[setting]
            owners.append(name)
        else:
            with pytest.raises(
                LocksConfigError, match=f"{setting}=.* is a setting of selector .*leave {setting} unset"
            ):
                LocksConfig(**kwargs)
    assert owners  # every setting belongs to some selector


def test_rerank_defaults_to_eight_on_locks_rerank_only():
    assert LocksConfig(selector="locks_rerank").rerank == 8
    assert LocksConfig(selector="quest").rerank is None


# -- architectures whose attention bypasses transformers' AttentionInterface ------------------------


def _bypassing_configs():
    from transformers import CodeGenConfig, GPTJConfig, GPTNeoConfig, StableLmConfig

    return [
        pytest.param(
            FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256),
            "FalconForCausalLM",
            id="falcon",
        ),
        pytest.param(
            GPTJConfig(n_embd=64, n_head=4, n_layer=2, vocab_size=256, rotary_dim=8), "GPTJForCausalLM", id="gptj"
        ),
        pytest.param(
            CodeGenConfig(n_embd=64, n_head=4, n_layer=2, vocab_size=256, rotary_dim=8),
            "CodeGenForCausalLM",
            id="codegen",
        ),
        pytest.param(
            GPTNeoConfig(hidden_size=64, num_heads=4, num_layers=2, vocab_size=256, attention_types=[[["global"], 2]]),
            "GPTNeoForCausalLM",
            id="gpt_neo",
        ),
        pytest.param(
            StableLmConfig(
                hidden_size=64,
                num_attention_heads=4,
                num_key_value_heads=4,
                num_hidden_layers=2,
                vocab_size=256,
                intermediate_size=64,
            ),
            "StableLmForCausalLM",
            id="stablelm",
        ),
    ]


@pytest.mark.parametrize("config,class_name", _bypassing_configs())
def test_architectures_bypassing_the_attention_interface_are_refused_by_name(config, class_name):
    """transformers fails building such a model with attn_implementation="locks" (KeyError: 'locks' in its
    own attention-class table): `check_model` names the architecture first, and the caches refuse it."""
    import locks_hf

    if getattr(transformers, class_name).is_backend_compatible():  # e.g. GPT-J and CodeGen from 5.24 on
        locks_hf.check_model(config)
        pytest.skip(f"transformers {transformers.__version__} routes {class_name} through AttentionInterface")
    for build in (locks_hf.check_model, LocksCache, lambda c: LocksStaticCache(c, max_cache_len=64)):
        with pytest.raises(UnsupportedModelError, match=f"{class_name} computes attention in its own classes.*sdpa"):
            build(config)


@pytest.mark.slow  # imports every causal-LM modeling module of transformers
def test_every_causal_lm_class_outside_the_attention_interface_is_refused():
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import locks_hf

    checked = 0
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        model_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
        if model_class is None or model_class.is_backend_compatible() or model_type not in CONFIG_MAPPING:
            continue
        with pytest.raises(UnsupportedModelError, match=model_type):
            locks_hf.check_model(CONFIG_MAPPING[model_type]())
        checked += 1
    assert checked >= 10


def test_check_model_passes_supported_architectures(arch):
    import locks_hf

    locks_hf.check_model(tiny_config(arch))


# -- argument types at the cache API's entry points ---------------------------------------------------


def test_a_label_or_the_model_is_accepted_where_a_config_goes():
    model = tiny("llama")
    assert LocksCache(model.config, "r4i4").locks_config == LocksConfig.from_label("r4i4")
    assert LocksCache(model.config, "quest-b64").locks_config == LocksConfig(selector="quest", budget=64)
    assert LocksCache(model, budget=64).model_shape == LocksCache(model.config).model_shape
    cache = LocksCache(model.config, budget=32)
    model(_ids(), past_key_values=cache)
    assert cache.fork("r4i4-b64").locks_config == LocksConfig(rank=4, budget=64)


@pytest.mark.parametrize(
    "build,needle",
    [
        (lambda m: LocksCache("llama"), "first argument of a Locks cache is the model's config"),
        (lambda m: LocksCache(m.config, 128), "LocksCache takes a LocksConfig or an arm label"),
        (lambda m: LocksCache(m.config, "r8"), "cannot parse label 'r8'"),
        (lambda m: LocksCache(m.config, {"budget": 64}), "LocksCache takes a LocksConfig"),
        (lambda m: LocksCache(m.config, max_budget=-5), "max_budget=-5 is below the budget 128"),
        (lambda m: LocksCache(m.config, max_budget="256"), "max_budget must be an int"),
        (lambda m: LocksStaticCache(m.config, max_cache_len=256, max_budget="256"), "max_budget must be an int"),
        (lambda m: LocksStaticCache(m.config, max_cache_len=256, max_budget=True), "max_budget must be an int"),
        (lambda m: LocksCache(m.config).set_budget("64"), "budget must be an int"),
        (lambda m: LocksCache(m.config).set_budget(None), "budget must be an int"),
        (lambda m: LocksCache(m.config).fork({"budget": 64}), "fork takes a LocksConfig or an arm label"),
        (lambda m: LocksCache(m.config).fork(64), "fork takes a LocksConfig"),
        (lambda m: LocksStaticCache(m.config, max_cache_len=256).set_config("nonsense"), "cannot parse label"),
        (lambda m: LocksConfig("r8i4"), "from_label"),
        (lambda m: LocksConfig.from_label("quest-bx"), "cannot parse label"),
        (lambda m: LocksConfig(bogus=1), "unexpected keyword argument 'bogus'"),
        (lambda m: LocksConfig().replace(bogus=1), "unknown LocksConfig field"),
    ],
    ids=[
        "config-str",
        "locks-int",
        "bad-label",
        "locks-dict",
        "max-budget-negative",
        "max-budget-str",
        "static-max-budget-str",
        "static-max-budget-bool",
        "set-budget-str",
        "set-budget-none",
        "fork-dict",
        "fork-int",
        "static-set-config",
        "config-positional-label",
        "label-bad-budget",
        "config-unknown-field",
        "replace-unknown-field",
    ],
)
def test_wrong_argument_types_are_refused_with_what_to_pass(build, needle):
    with pytest.raises((LocksConfigError, TypeError), match=needle):
        build(tiny("llama"))


@pytest.mark.parametrize("method", ["reorder_cache", "batch_select_indices"])
@pytest.mark.parametrize("static", [False, True])
def test_row_indices_out_of_range_are_refused(method, static):
    model = tiny("llama")
    cache = (
        LocksStaticCache(model.config, max_cache_len=128, budget=32) if static else LocksCache(model.config, budget=32)
    )
    model(_ids().repeat(2, 1), past_key_values=cache)
    with pytest.raises(ValueError, match="out of range for a cache of batch size 2"):
        getattr(cache, method)(torch.tensor([0, 5]))
    with pytest.raises(ValueError, match="1-D integer tensor"):
        getattr(cache, method)(torch.tensor([0.0, 1.0]))
    getattr(cache, method)(torch.tensor([1, 0]))  # in range: fine


@pytest.mark.parametrize("static", [False, True])
def test_an_empty_prompt_is_refused_with_what_to_pass(static):
    model = tiny("llama")
    empty = torch.zeros(1, 0, dtype=torch.long)
    cache = LocksStaticCache(model.config, max_cache_len=64) if static else LocksCache(model.config)
    with pytest.raises(ValueError, match="input has no tokens"):
        model.generate(empty, past_key_values=cache, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match="input has no tokens"):
        model(empty, past_key_values=LocksCache(model.config))


# -- one cache, one thread at a time ------------------------------------------------------------------


def test_a_cache_used_by_a_second_thread_mid_forward_is_refused():
    import threading

    from locks_hf import CacheInUseError
    from locks_hf.attention import observe_decode_queries

    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    token = model(_ids(), past_key_values=cache).logits[:, -1:].argmax(-1)
    inside, release = threading.Event(), threading.Event()

    def pause_holder(layer_idx, *_):  # the holder's decode step waits inside its first layer
        if threading.current_thread().name == "holder" and layer_idx == 0:
            inside.set()
            release.wait(30)

    results = {}

    def holder():
        results["holder"] = model(token, past_key_values=cache).logits

    with torch.no_grad(), observe_decode_queries(pause_holder):
        thread = threading.Thread(target=holder, name="holder")
        thread.start()
        assert inside.wait(30)
        try:
            with pytest.raises(CacheInUseError, match="in use by thread 'holder'.*its own cache"):
                model(token, past_key_values=cache)
        finally:
            release.set()
            thread.join(30)
    assert "holder" in results  # the holder's step completed, undisturbed
    model(token, past_key_values=cache)  # between forwards, another thread may take the cache over


def test_a_copied_cache_decodes_like_the_original_with_a_guard_of_its_own():
    """deepcopy (a prompt cache reused for several prompts) copies no lock and no thread in flight."""
    import copy

    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    with torch.no_grad():
        token = model(_ids(), past_key_values=cache).logits[:, -1:].argmax(-1)
        copied = copy.deepcopy(cache)
        assert torch.equal(model(token, past_key_values=copied).logits, model(token, past_key_values=cache).logits)


def test_separate_caches_on_one_model_work_from_several_threads():
    import threading

    model = tiny("qwen3")
    prompts = [_ids(200, seed=s) for s in (1, 2, 3)]
    cfg = LocksConfig(budget=32)
    want = [
        model.generate(p, past_key_values=LocksCache(model.config, cfg), max_new_tokens=6, do_sample=False)
        for p in prompts
    ]
    got, errors = {}, []

    def run(i):
        try:
            got[i] = model.generate(
                prompts[i], past_key_values=LocksCache(model.config, cfg), max_new_tokens=6, do_sample=False
            )
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not errors
    assert all(torch.equal(got[i], want[i]) for i in range(len(prompts)))
