"""The rotary frequencies of a model's full-attention layers, read off its config."""

from __future__ import annotations

import torch

from .errors import UnsupportedModelError


def rope_frequencies(text_config, layer_type: str = "full_attention") -> torch.Tensor:
    """``omega [d/2]`` (float64) of the rotary embedding of ``layer_type`` layers, for models that
    rotate the whole head with transformers' half-split pairing (dimension ``i`` with ``i + d/2``)."""
    params = dict(getattr(text_config, "rope_parameters", None) or {})
    per_type = layer_type in params
    if per_type:
        params = dict(params[layer_type])
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // text_config.num_attention_heads
    partial = params.get("partial_rotary_factor", getattr(text_config, "partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModelError(f"partial rotary embeddings (factor {partial}) are not supported here")
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(text_config, "rope_theta", 10000.0))
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise UnsupportedModelError(f"rope_type {rope_type!r} is not supported here")
    inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](text_config, None, layer_type=layer_type if per_type else None)
    return inv_freq.to(torch.float64)
