"""Fuzzing configs x tiny models x generate() options x the cache API's arguments: every combination
either raises a library error before any generated token, or decodes; at a covering budget it gives
exactly the dense tokens.

Every registered selector is sampled, the token-level baselines included, except those that need a
scoring pass between prefill and decode (KVzip's `score_context`), which generate() cannot run.

A library error is `LocksConfigError`, `UnsupportedModelError`, or a ValueError raised from locks_hf's
own code (such as a LocksStaticCache overflow naming max_cache_len). Anything else (an error from
deep inside torch or transformers, or tokens that differ from dense at a covering budget) fails.
Run with ``--hypothesis-show-statistics`` to see how often each outcome occurred.
"""

import traceback
from pathlib import Path

import torch
from conftest import tiny
from hypothesis import HealthCheck, event, given, settings, strategies as st

import locks_hf
from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache, UnsupportedModelError
from locks_hf.models import TINY_ARCHS
from locks_hf.selectors import selector_class, selector_names

LIBRARY = Path(locks_hf.__file__).resolve().parent
_MODELS: dict = {}


def _model(arch: str, attn: str):
    if (arch, attn) not in _MODELS:
        _MODELS[arch, attn] = tiny(arch, attn)
    return _MODELS[arch, attn]


def _is_library_error(err: BaseException) -> bool:
    if isinstance(err, (LocksConfigError, UnsupportedModelError)):
        return True
    where = Path(traceback.extract_tb(err.__traceback__)[-1].filename).resolve()
    return isinstance(err, ValueError) and LIBRARY in where.parents


class _Streamer:
    """Counts what generate() emits: the prompt first, then one put per generated token."""

    def __init__(self):
        self.puts = 0

    def put(self, value):
        self.puts += 1

    def end(self):
        pass


#: Every registered selector generate() can run on its own (page selectors and token-level baselines).
SELECTORS = [n for n in selector_names() if not getattr(selector_class(n), "needs_context_scores", False)]
VALID_FIELDS = st.fixed_dictionaries(
    {},
    optional={
        "page_size": st.sampled_from([4, 8, 16]),
        "rank": st.sampled_from([1, 2, 3]),
        "basis_bits": st.sampled_from([2, 4, 8, 16]),
        "coef_bits": st.sampled_from([8, 16]),
        "centroid_bits": st.sampled_from([8, 16]),
        "selector": st.sampled_from(SELECTORS),
        "rerank": st.sampled_from([1, 2, 8]),
        "group_combine": st.sampled_from(["share_average", "group_max", "group_mass"]),
        "min_context": st.sampled_from([0, 0, 0, 64]),
    },
)
#: One bad field at a time (a third of the examples), so that most examples reach generate().
BAD_FIELD = st.one_of(
    st.none(),
    st.none(),
    st.sampled_from(
        [
            ("page_size", 3),
            ("page_size", 0),
            ("page_size", 2**40),
            ("page_size", 16.0),
            ("rank", 0),
            ("rank", 32),
            ("rank", True),
            ("basis_bits", 3),
            ("basis_bits", 4.0),
            ("coef_bits", 4),
            ("selector", "topk"),
            ("group_combine", "vote"),
            ("min_context", -1),
            ("rerank", 0),
            ("lazy_alpha", 1e-4),
        ]
    ),
)
#: How the cache is built: the settings as a LocksConfig, as an arm label, the model in place of its config,
#: or a wrong argument type or value (refused before any token).
CACHE_ARGS = st.sampled_from(
    [
        "config",
        "config",
        "config",
        "label",
        "model",
        "max_budget",
        "locks_dict",
        "locks_int",
        "bad_label",
        "max_budget_str",
        "max_budget_low",
    ]
)


@settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    arch=st.sampled_from(TINY_ARCHS),
    attn=st.sampled_from(["locks", "locks", "locks", "sdpa"]),
    fields=VALID_FIELDS,
    bad=BAD_FIELD,
    covering=st.booleans(),
    static=st.sampled_from([None, None, None, None, "fits", "short"]),
    prompt=st.integers(20, 90),
    new=st.integers(1, 4),
    batch=st.sampled_from([1, 1, 2]),
    option=st.sampled_from([{}, {}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 2}]),
    cache_args=CACHE_ARGS,
)
def test_fuzz_library_error_or_dense_tokens(
    arch, attn, fields, bad, covering, static, prompt, new, batch, option, cache_args
):
    model = _model(arch, attn)
    if fields.get("selector") != "locks_rerank":  # a re-ranking setting on another selector: a bad field
        fields = {k: v for k, v in fields.items() if k != "rerank"}
    fields = {**fields, **dict([bad])} if bad else fields
    ids = torch.randint(3, 256, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    mask = torch.ones_like(ids)
    mask[1:, : prompt // 3] = 0  # the second row is left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, **option)
    streamer = _Streamer()
    try:
        locks = LocksConfig(**{**fields, "budget": 1024 if covering else 32})
        given = {"label": locks.label, "locks_dict": dict(fields), "locks_int": 128, "bad_label": "r8"}.get(
            cache_args, locks
        )
        extra = {"max_budget": 2048, "max_budget_str": "2048", "max_budget_low": 16}.get(cache_args)
        extra = {} if extra is None else {"max_budget": extra}
        owner = model if cache_args == "model" else model.config
        if static is None:
            cache = LocksCache(owner, given, **extra)
        else:
            capacity = prompt + new - (1 if static == "fits" else 2)  # the last new token is never written
            cache = LocksStaticCache(owner, max_cache_len=capacity, locks=given, **extra)
        out = model.generate(
            ids, past_key_values=cache, streamer=streamer if batch == 1 and not option else None, **kwargs
        )
    except Exception as err:  # noqa: BLE001 - the property is about which errors escape
        assert _is_library_error(err), f"not a library error: {type(err).__name__}: {err}"
        if static != "short":  # an overflow shows when the token past max_cache_len is written
            assert streamer.puts <= 1, "a token was generated before the error"
        event(f"clear error: {type(err).__name__}: {str(err)[:70]}")
        return
    if covering:
        want = _model(arch, "sdpa").generate(ids, **kwargs)
        assert torch.equal(out, want), "a covering budget must give the dense tokens"
        event("correct: dense tokens at a covering budget")
    else:
        # (token-level baselines evict on their own schedule, e.g. R-KV every 128 generated tokens)
        sparse_steps = (
            new >= 2
            and prompt > 48
            and locks.selector != "full"
            and locks.min_context <= prompt
            and not selector_class(locks.selector).token_level
        )
        if sparse_steps:  # never silently dense: decode steps past the budget attend a part of the context
            assert cache.attended_fraction() < 1.0
        event("decoded sparsely at a small budget" if sparse_steps else "decoded at a small budget")
