"""Shared fixtures: tiny random-weight models of the supported architectures (float64 for exactness)."""

import pytest
import torch
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM,
                          MistralConfig, MistralForCausalLM, Qwen3Config, Qwen3ForCausalLM)

import locks_hf  # noqa: F401  (registers attn_implementation="locks")

_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, max_position_embeddings=8192)

ARCHS = {
    "llama": lambda: (LlamaForCausalLM, LlamaConfig(num_hidden_layers=2, **_COMMON)),
    "qwen3": lambda: (Qwen3ForCausalLM, Qwen3Config(num_hidden_layers=2, **_COMMON)),
    "mistral": lambda: (MistralForCausalLM, MistralConfig(num_hidden_layers=2, sliding_window=None, **_COMMON)),
    "gemma3": lambda: (Gemma3ForCausalLM, Gemma3TextConfig(
        num_hidden_layers=4, sliding_window=24, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"], **_COMMON)),
}


def tiny(arch: str, attn: str = "locks", dtype=torch.float64, seed: int = 0):
    """A seeded random tiny model; ``tiny(a, "sdpa")`` and ``tiny(a, "locks")`` share weights."""
    cls, config = ARCHS[arch]()
    torch.manual_seed(seed)
    model = cls(config).to(dtype).eval()
    model.set_attn_implementation(attn)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random models: always generate max_new_tokens
    return model


@pytest.fixture(params=list(ARCHS))
def arch(request):
    return request.param
