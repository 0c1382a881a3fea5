"""End to end on the real SmolLM2-135M (Llama architecture, GGUF from PyPI, converted once and cached)."""

import pytest
import torch
from selector_lists import selectors

from locks_hf import LocksCache, LocksConfig
from locks_hf.models import encode_prompt, load_model
from locks_hf.needle import build_needle_prompt

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    locks, tok = load_model("smollm2-135m", attn_implementation="locks")
    dense, _ = load_model("smollm2-135m", attn_implementation="sdpa")
    text, answer = build_needle_prompt(tok, context_tokens=700, seed=3)
    return locks, dense, encode_prompt(tok, text)


def test_covering_budget_decodes_exactly_like_sdpa(smollm2):
    locks, dense, ids = smollm2
    ref = dense.generate(ids, max_new_tokens=12, do_sample=False)
    cache = LocksCache(locks.config, LocksConfig.from_label("r8i4", budget=1024))
    out = locks.generate(ids, max_new_tokens=12, do_sample=False, past_key_values=cache)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("selector", selectors(kernel=True, dense=False, summary_of=None))
def test_small_budget_attends_at_most_k_pages(smollm2, selector):
    locks, _, ids = smollm2
    cfg = LocksConfig(budget=128, selector=selector)
    cache = LocksCache(locks.config, cfg)
    token = locks(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    G = locks.config.num_attention_heads // locks.config.num_key_value_heads
    limit = cfg.page_slots * (G if selector == "quest" else 1)
    for _ in range(4):
        token = locks(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        assert len(cache.locks_layers) == locks.config.num_hidden_layers
        for layer in cache.locks_layers:
            counts = layer.last_selection.sum(-1)  # [batch, kv_heads]
            assert counts.shape == (1, locks.config.num_key_value_heads)
            assert (counts <= limit).all() and (counts >= 2).all()
            if selector != "quest":
                assert (counts == cfg.page_slots).all()
    assert cache.attended_fraction() <= limit * cfg.page_size / ids.shape[1]
