"""The ``"locks"`` attention function: dense prefill, page-selected sparse decode.

Registered with transformers' `AttentionInterface` and `AttentionMaskInterface` when `locks_hf` is
imported. The mask function is required: without one, transformers hands a custom attention
function ``attention_mask=None`` and padded batches go silently wrong.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.utils import is_torchdynamo_compiling, logging

from .handoff import take_handoff
from .models_support import ATTENTION_NAME, REFUSED_GENERATION, UnsupportedModelError, check_attention_dispatch

logger = logging.get_logger(__name__)

# kwargs that change the attention math in ways sparse decode does not reproduce.
_UNSUPPORTED_KWARGS = {
    "softcap": "attention logit soft-capping",
    "s_aux": "attention sinks (s_aux)",
    "position_bias": "additive position biases",
}

# transformers writes every forward into a cache passed as past_key_values even with use_cache=False,
# and generate(use_cache=False) then re-feeds the whole sequence at each step: the cache fills with
# copies and the positions run past the sequence (a DynamicCache gives wrong tokens the same way).
USE_CACHE_FALSE = (
    "use_cache=False with a Locks cache as past_key_values: transformers would still write every forward into "
    "the cache, and generate() re-feeds the whole sequence each step, so the cache fills with duplicates and "
    "positions go wrong. Drop use_cache=False to decode with the cache, or drop past_key_values to run "
    "without one"
)


#: Callbacks of `observe_decode_queries`, called on every decode step of a Locks layer.
_DECODE_OBSERVERS: list[Callable[[int | None, int, torch.Tensor, float], None]] = []


@contextlib.contextmanager
def observe_decode_queries(callback: Callable[[int | None, int, torch.Tensor, float], None]) -> Iterator[None]:
    """Within the block, call ``callback(layer_idx, length, query, scale)`` at every decode step of a
    Locks layer, before it attends: ``length`` cached tokens (the step's own included), ``query``
    ``[b, Hq, 1, d]`` post-RoPE (not copied), ``scale`` the softmax scale. For analysis (capturing
    queries to score selectors offline); it runs whatever the selector, dense ``"full"`` included.
    """
    _DECODE_OBSERVERS.append(callback)
    try:
        yield
    finally:
        _DECODE_OBSERVERS.remove(callback)


def locks_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention with transformers' signature: dense unless this is a decode step of a `LocksLayer`.

    Dense (exactly transformers' SDPA) are: prefill and any forward with several query tokens,
    layers that are not Locks layers (sliding-window layers, or a cache other than `LocksCache` /
    `LocksStaticCache`), the ``"full"`` selector, and what the layer's `attends_densely` says.
    """
    layer_idx = getattr(module, "layer_idx", None)
    layer = take_handoff(layer_idx, key, kwargs.get("sliding_window"))
    if layer is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if kwargs.get("use_cache") is False:
        raise UnsupportedModelError(USE_CACHE_FALSE)
    for name, what in _UNSUPPORTED_KWARGS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"{type(module).__name__}: {what} is not supported by Locks sparse decode")
    if kwargs.get("sliding_window") is not None:
        raise UnsupportedModelError(
            f"layer {module.layer_idx} is a LocksLayer but the model passes sliding_window="
            f"{kwargs['sliding_window']}: its config's layer types do not match the model"
        )
    if scaling is None:
        scaling = 1.0 / math.sqrt(query.shape[-1])

    q_len = query.shape[2]
    if q_len > 1 and layer.recording_past:
        raise UnsupportedModelError(REFUSED_GENERATION)
    if q_len == 1:
        for observe in _DECODE_OBSERVERS:
            observe(layer_idx, key.shape[2], query, scaling)
    layer.prepare(attention_mask, q_len)
    if q_len > 1:
        layer.observe_prompt_queries(query, scaling)
    if layer.attends_densely(q_len):
        if q_len == 1:
            real = layer.real_tokens() * key.shape[1]
            layer.record_step(real, real)
        if attention_mask is not None and attention_mask.shape[-1] > key.shape[-2]:
            # a static mask spans the capacity; a quantized static layer hands a prefill only its written slots
            attention_mask = attention_mask[..., : key.shape[-2]]
        out = sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    else:
        # Sparse decode (score the pages from their summaries, select, attend the selection) or a token
        # policy's step, on the backend the layer chose when its buffers were allocated.
        out = layer.backend.decode(layer, query, scaling), None
    layer.release_forward_kv()
    return out


def locks_mask(*args, config=None, **kwargs):
    """transformers' SDPA mask, after refusing models whose attention cannot run as Locks: the mask is
    built once per forward with the model's config, also by models that bypass the attention
    function (MPT's ALiBi)."""
    if config is not None and not is_torchdynamo_compiling():  # prefill is eager: checked there
        check_attention_dispatch(config)
    return sdpa_mask(*args, config=config, **kwargs)


def register() -> None:
    """Register ``attn_implementation="locks"`` (attention and mask functions) with transformers."""
    AttentionInterface.register(ATTENTION_NAME, locks_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, locks_mask)
