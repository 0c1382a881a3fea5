"""Fuzzing configs x tiny models x generate() options: every combination either raises a library error
before any generated token, or decodes; at a covering budget it gives exactly the dense tokens.

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


VALID_FIELDS = st.fixed_dictionaries({}, optional={
    "page_size": st.sampled_from([4, 8, 16]),
    "rank": st.sampled_from([1, 2, 3]),
    "basis_bits": st.sampled_from([2, 4, 8, 16]),
    "coef_bits": st.sampled_from([8, 16]),
    "centroid_bits": st.sampled_from([8, 16]),
    "selector": st.sampled_from(["locks", "locks_rerank", "oracle", "quest", "full", "shared_basis", "shared_all"]),
    "rerank": st.sampled_from([1, 2, 8]),
    "group_combine": st.sampled_from(["share_average", "group_max", "group_mass"]),
    "min_context": st.sampled_from([0, 0, 0, 64]),
})
#: One bad field at a time (a third of the examples), so that most examples reach generate().
BAD_FIELD = st.one_of(st.none(), st.none(), st.sampled_from([
    ("page_size", 3), ("page_size", 0), ("page_size", 2**40), ("page_size", 16.0), ("rank", 0), ("rank", 32),
    ("rank", True), ("basis_bits", 3), ("basis_bits", 4.0), ("coef_bits", 4), ("selector", "topk"),
    ("group_combine", "vote"), ("min_context", -1), ("rerank", 0)]))


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(arch=st.sampled_from(TINY_ARCHS), attn=st.sampled_from(["locks", "locks", "locks", "sdpa"]),
       fields=VALID_FIELDS, bad=BAD_FIELD, covering=st.booleans(), static=st.sampled_from([None, None, None, None, "fits", "short"]),
       prompt=st.integers(20, 90), new=st.integers(1, 4), batch=st.sampled_from([1, 1, 2]),
       option=st.sampled_from([{}, {}, {"num_beams": 2}, {"prompt_lookup_num_tokens": 2}]))
def test_fuzz_library_error_or_dense_tokens(arch, attn, fields, bad, covering, static, prompt, new, batch, option):
    model = _model(arch, attn)
    fields = {**fields, **dict([bad])} if bad else fields
    ids = torch.randint(3, 256, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    mask = torch.ones_like(ids)
    mask[1:, : prompt // 3] = 0  # the second row is left-padded
    kwargs = dict(attention_mask=mask, max_new_tokens=new, do_sample=False, **option)
    streamer = _Streamer()
    try:
        locks = LocksConfig(**{**fields, "budget": 1024 if covering else 32})
        if static is None:
            cache = LocksCache(model.config, locks)
        else:
            capacity = prompt + new - (1 if static == "fits" else 2)  # the last new token is never written
            cache = LocksStaticCache(model.config, max_cache_len=capacity, locks=locks)
        out = model.generate(ids, past_key_values=cache, streamer=streamer if batch == 1 and not option else None,
                             **kwargs)
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
        sparse_steps = new >= 2 and prompt > 48 and locks.selector != "full" and locks.min_context <= prompt
        if sparse_steps:  # never silently dense: decode steps past the budget attend a part of the context
            assert cache.attended_fraction() < 1.0
        event("decoded sparsely at a small budget" if sparse_steps else "decoded at a small budget")
