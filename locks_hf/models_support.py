"""Which model configurations a `LocksCache` can serve, with errors that say what to change."""

from __future__ import annotations

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from .config import LocksConfig, LocksConfigError
from .selectors import selector_class


class UnsupportedModelError(ValueError):
    """The model (or one attention call) uses a feature Locks' sparse decode cannot reproduce exactly."""


# Config attributes whose presence (non-None / truthy) means the attention is not plain softmax
# attention over cached post-RoPE keys, so page selection cannot be applied as the paper states it.
_UNSUPPORTED_ATTRIBUTES = {
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2 style)",
    "kv_lora_rank": "multi-head latent attention (MLA, DeepSeek style)",
    "q_lora_rank": "multi-head latent attention (MLA, DeepSeek style)",
    "use_alibi": "ALiBi position biases",
    "alibi": "ALiBi position biases",
}


def head_dim_of(config: PretrainedConfig) -> int:
    """Attention head dimension of a (text) config."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim else config.hidden_size // config.num_attention_heads


def check_model_supported(config: PretrainedConfig, locks: LocksConfig) -> None:
    """Raise `UnsupportedModelError` / `LocksConfigError` when ``locks`` cannot run on this model."""
    for attr, what in _UNSUPPORTED_ATTRIBUTES.items():
        if getattr(config, attr, None):
            raise UnsupportedModelError(
                f"{config.model_type}: {what} ({attr}={getattr(config, attr)!r}) is not supported by "
                "Locks sparse decode; use attn_implementation='sdpa' and a DynamicCache for this model"
            )
    layer_types, _ = get_layer_types_and_kwargs(config)
    if "full_attention" not in layer_types:
        raise UnsupportedModelError(
            f"{config.model_type}: no full-attention layer (layer types {sorted(set(layer_types))}); "
            "Locks selects pages only in full-attention layers. For a sliding-window model such as "
            "Mistral-7B-v0.1, load it with sliding_window=None to make its layers full attention"
        )
    d = head_dim_of(config)
    selector_class(locks.selector).validate(locks, head_dim=d)
    if locks.basis_bits in (2, 4) and (d * locks.basis_bits) % 8:
        raise LocksConfigError(f"head_dim={d} cannot be packed at {locks.basis_bits} bits per entry")
