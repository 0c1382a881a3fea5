"""`LocksCacheMixin`: what `LocksCache` and `LocksStaticCache` add to a transformers `Cache` on every
update: the hand-off to the attention function, refusals of misuse (another model, an empty input,
two threads, bad row indices) and the statistics."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers import PretrainedConfig
from transformers.utils import is_torchdynamo_compiling

from . import arguments
from .cache_stats import CacheStatistics
from .concurrency import UseGuard
from .errors import UnsupportedModelError
from .handoff import check_handoff_taken, hand_over
from .models_support import REFUSED_GENERATION, cache_model_mismatch, head_dim_of
from .page_updates import launch_page_updates, plan_page_updates
from .paged import PagedLayer

if TYPE_CHECKING:
    from transformers import Cache as _CacheBase  # the class a Locks cache mixes this into
else:
    _CacheBase = object

EMPTY_INPUT = (
    "the input has no tokens (input_ids of shape [batch, 0]): a Locks cache needs at least one token per "
    "forward; pass a non-empty prompt (e.g. start it with the tokenizer's BOS token)"
)


class LocksCacheMixin(CacheStatistics, _CacheBase):
    """Shared by `LocksCache` and `LocksStaticCache`: the attention hand-off, the checks of every update
    and the statistics."""

    #: ``(layers, kv_heads, head_dim)`` of the model config the cache was built from (``None``: any).
    model_shape: tuple[int, int, int] | None = None
    #: Index of the last layer a forward updates (``None``: not known, a cache built without a config).
    _last_kv_layer: int | None = None
    #: The layers whose page updates share a launch: the index of each group's last layer -> the group's
    #: indices (`locks_hf.page_updates`; set by `plan_page_updates`, read-only: a fork shares it).
    page_update_plan: dict[int, tuple[int, ...]] = {}  # noqa: RUF012

    @property
    def use_guard(self) -> UseGuard:
        """Which thread is in the middle of a forward through this cache (one per cache, fresh in a fork)."""
        guard = self.__dict__.get("_use_guard")
        if guard is None:
            guard = self.__dict__["_use_guard"] = UseGuard()
        return guard

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        check_handoff_taken()
        if key_states.shape[2] == 0:
            raise ValueError(EMPTY_INPUT)
        layers = self.layers
        if not is_torchdynamo_compiling():  # a compiled step replays without Python: checked when eager
            self.use_guard.enter(layer_idx, self._last_layer_index())
        if self.model_shape is not None:
            n, h, d = self.model_shape
            paged = layer_idx < len(layers) and isinstance(layers[layer_idx], PagedLayer)
            problem = cache_model_mismatch(layer_idx, key_states.shape, n, h if paged else None, d)
            if problem:
                raise UnsupportedModelError(problem)
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if key_states.shape[2] == 1:
            members = self.page_update_plan.get(layer_idx)
            if members:  # the page updates of the layers of its group, before this layer's attention
                launch_page_updates(self.layers, members)
        elif not is_torchdynamo_compiling() and layer_idx == self._last_layer_index():
            self.plan_page_updates()  # a prefill has allocated or written every layer
        hand_over(layer_idx, self.layers[layer_idx], key_states.shape[2])
        return keys, values

    def _last_layer_index(self) -> int:
        return self._last_kv_layer if self._last_kv_layer is not None else len(self.layers) - 1

    def plan_page_updates(self) -> None:
        """Which layers' per-step page updates share one launch (`locks_hf.page_updates`), planned again from
        the layers as they are: after a prefill, a fork, a change of settings."""
        plan = plan_page_updates(self.layers)
        if plan != self.page_update_plan:  # the same object otherwise: a compiled step's guard stays true
            self.page_update_plan = plan

    def remember_model_shape(self, text_config: PretrainedConfig) -> None:
        """Record the layer count, KV heads and head dim of the model ``text_config`` describes, so that
        use with another model is refused at its first update."""
        heads = getattr(text_config, "num_key_value_heads", None) or text_config.num_attention_heads
        self.model_shape = (text_config.num_hidden_layers, heads, head_dim_of(text_config))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        rows = self._batch_size()
        if rows is not None:
            arguments.row_indices(beam_idx, rows, "reorder_cache")
        super().reorder_cache(beam_idx)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        rows = self._batch_size()
        if rows is not None:
            arguments.row_indices(indices, rows, "batch_select_indices")
        super().batch_select_indices(indices)

    def _batch_size(self) -> int | None:
        """Rows the cache holds (``None`` before the first forward)."""
        for layer in self.locks_layers:
            keys, _ = layer.kv_buffers()
            if layer.is_initialized and keys is not None:
                return keys.shape[0]
        return None

    def activate_past_recording(self, **kwargs) -> None:
        """Called by generate() for assisted and prompt-lookup decoding, before their first forward
        (transformers >= 5.25 passes ``recurrent_states_to_keep``, which only recurrent layers use)."""
        if self.get_seq_length() == 0:
            raise UnsupportedModelError(REFUSED_GENERATION)
        super().activate_past_recording(**kwargs)  # a prefilled cache: refused at the first verification forward
