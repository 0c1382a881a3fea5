"""Which model configurations a `LocksCache` can serve, with errors that say what to change."""

from __future__ import annotations

import torch
import transformers
from transformers import PretrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from .compat import get_layer_types_and_kwargs
from .config import LocksConfig, LocksConfigError
from .errors import UnsupportedModelError
from .kv_quant import check_kv_head_dim
from .selectors.registry import selector_class

ATTENTION_NAME = "locks"


# Config attributes whose presence (non-None / truthy) means the attention is not plain softmax
# attention over cached post-RoPE keys, so page selection cannot be applied as the paper states it.
_UNSUPPORTED_ATTRIBUTES = {
    "attn_logit_softcapping": "attention logit soft-capping (Gemma 2 style)",
    "kv_lora_rank": "multi-head latent attention (MLA, DeepSeek style)",
    "q_lora_rank": "multi-head latent attention (MLA, DeepSeek style)",
    "use_alibi": "ALiBi position biases",
    "alibi": "ALiBi position biases",
}
# Families whose position bias is ALiBi with no config switch (Bloom), or under a nested config (MPT).
_ALIBI_MODEL_TYPES = ("bloom",)

REFUSED_GENERATION = (
    "assisted decoding and prompt-lookup decoding (generate(assistant_model=...) / "
    "generate(prompt_lookup_num_tokens=...)) are not supported with a Locks cache: they verify several "
    "tokens per forward, which would run as dense prefill instead of Locks' sparse decode. Drop those "
    "generate() options"
)


def head_dim_of(config: PretrainedConfig) -> int:
    """Attention head dimension of a (text) config."""
    head_dim = getattr(config, "head_dim", None)
    return head_dim if head_dim else config.hidden_size // config.num_attention_heads


def _attention_feature(config: PretrainedConfig) -> tuple[str, str] | None:
    """``(attribute, description)`` of an attention feature Locks cannot reproduce, if ``config`` has one."""
    for attr, what in _UNSUPPORTED_ATTRIBUTES.items():
        if getattr(config, attr, None):
            return f"{attr}={getattr(config, attr)!r}", what
    if getattr(config, "model_type", None) in _ALIBI_MODEL_TYPES:
        return f"model_type={config.model_type!r}", "ALiBi position biases"
    if getattr(getattr(config, "attn_config", None), "alibi", False):
        return "attn_config.alibi=True", "ALiBi position biases"
    return None


def check_attention_dispatch(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` when the model's attention cannot run as Locks at all: a feature
    Locks cannot reproduce, or a model class whose attention does not go through transformers'
    `AttentionInterface` (so ``attn_implementation="locks"`` never reaches it)."""
    feature = _attention_feature(config)
    if feature is not None:
        raise UnsupportedModelError(
            f"{config.model_type}: {feature[1]} ({feature[0]}) is not supported by Locks sparse decode; "
            "load this model with attn_implementation='sdpa' and use a DynamicCache"
        )
    model_type = getattr(config, "model_type", None)
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if isinstance(model_type, str) else None
    model_class = getattr(transformers, class_name, None) if isinstance(class_name, str) else None
    if model_class is not None and not model_class.is_backend_compatible():
        raise UnsupportedModelError(
            f"{config.model_type}: {class_name} computes attention in its own classes, not through "
            "transformers' AttentionInterface, so attn_implementation='locks' cannot reach it; load it "
            "with attn_implementation='sdpa' and use a DynamicCache"
        )


def check_model(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` when a model of ``config`` cannot be loaded with
    ``attn_implementation="locks"``: call it before ``from_pretrained`` / ``from_config``. Models whose
    attention bypasses transformers' `AttentionInterface` (Falcon, GPT-J, CodeGen, ...) fail inside
    transformers while they are built (``KeyError: 'locks'``); this names the architecture first."""
    if not isinstance(config, PretrainedConfig):
        raise TypeError(
            f"check_model takes a transformers config (e.g. AutoConfig.from_pretrained(name)), "
            f"got {type(config).__name__}"
        )
    text_config = config.get_text_config(decoder=True)
    check_attention_dispatch(text_config)
    if text_config is not config:  # a composite model's class is named by the outer config's model type
        check_attention_dispatch(config)


def check_head_dim(locks: LocksConfig, head_dim: int) -> None:
    """Raise `LocksConfigError` when ``locks`` cannot summarize keys of ``head_dim``."""
    selector_class(locks.selector).validate(locks, head_dim=head_dim)
    check_kv_head_dim(locks, head_dim)
    if locks.basis_bits in (2, 4) and (head_dim * locks.basis_bits) % 8:
        raise LocksConfigError(f"head_dim={head_dim} cannot be packed at {locks.basis_bits} bits per entry")


def check_loaded_for_locks(config: PretrainedConfig) -> None:
    """Raise `UnsupportedModelError` when ``config`` is a loaded model's config whose attention is not
    ``"locks"``: such a model never calls Locks' attention function and would decode densely."""
    impl = getattr(config, "_attn_implementation", None)
    if impl is not None and impl != ATTENTION_NAME:
        raise UnsupportedModelError(
            f"the model was loaded with attn_implementation={impl!r}: a Locks cache only selects pages when "
            "the model is loaded with attn_implementation='locks' (after `import locks_hf`), e.g. "
            "AutoModelForCausalLM.from_pretrained(name, attn_implementation='locks')"
        )


def check_model_supported(config: PretrainedConfig, locks: LocksConfig) -> None:
    """Raise `UnsupportedModelError` / `LocksConfigError` when ``locks`` cannot run on this model."""
    check_attention_dispatch(config)
    check_loaded_for_locks(config)
    layer_types, _ = get_layer_types_and_kwargs(config)
    if "full_attention" not in layer_types:
        raise UnsupportedModelError(
            f"{config.model_type}: no full-attention layer (layer types {sorted(set(layer_types))}); "
            "Locks selects pages only in full-attention layers. For a sliding-window model such as "
            "Mistral-7B-v0.1, load it with sliding_window=None to make its layers full attention"
        )
    check_head_dim(locks, head_dim_of(config))


def cache_model_mismatch(
    layer_idx: int, key_shape: torch.Size, n_layers: int | None, kv_heads: int | None, head_dim: int | None
) -> str | None:
    """Why keys of ``key_shape [b, h, t, d]`` for layer ``layer_idx`` do not belong to the model a cache
    was built for (``n_layers`` layers of ``kv_heads`` heads of ``head_dim``), or ``None``."""
    got = (layer_idx, key_shape[1], key_shape[-1])
    if n_layers is not None and layer_idx >= n_layers:
        what = f"layer index {layer_idx} but the cache has {n_layers} layers"
    elif kv_heads is not None and (key_shape[1], key_shape[-1]) != (kv_heads, head_dim):
        what = f"{got[1]} KV heads of dim {got[2]} but the cache was built for {kv_heads} of dim {head_dim}"
    else:
        return None
    return (
        f"this Locks cache was built from another model's config ({what}): build it from the "
        "config of the model that uses it, e.g. LocksCache(model.config)"
    )
