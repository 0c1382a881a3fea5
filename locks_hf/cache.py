"""`LocksCache`: a transformers `Cache` that keeps every K/V and per-page key summaries.

Full-attention layers become Locks layers (`LocksLayer`, or `LocksStaticLayer` in the static layout
chosen on a GPU: `locks_hf.layout`); sliding-window, linear and other layers keep transformers' own
classes. Nothing is ever evicted: positions and masks stay those of full attention, and selection
happens in the attention function (`locks_hf.attention`), the first place where the decode query
exists. This module is the cache object; the layers, the layout, the fork and the statistics each
live in a module of their own.
"""

from __future__ import annotations

import copy
import logging

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DynamicCache, StaticLayer
from transformers.utils import is_torchdynamo_compiling

from . import arguments
from .cache_mixin import EMPTY_INPUT, LocksCacheMixin
from .compat import find_first_full_attention_index, get_layer_types_and_kwargs
from .compile_cache import keep_compiled_steps
from .config import LocksConfig, LocksConfigError
from .dynamic_layer import LocksLayer
from .fork import copied_layer, dynamic_layers
from .kv_quant import same_kv
from .layout import (
    CapacityPlan,
    build_static_layers,
    choose_layout,
    config_refusal,
    crop_hf_layer,
    page_slots_width,
    reallocate_hf_layer,
)
from .models_support import check_head_dim, check_model_supported
from .page_updates import grouping_enabled, launch_sizes
from .paged import PagedLayer
from .precompile import DecodePrecompile, precompile_applies

__all__ = ["LocksCache", "LocksLayer"]

logger = logging.getLogger(__name__)


class LocksCache(LocksCacheMixin, DynamicCache):
    """A transformers `Cache` whose full-attention layers select pages for sparse decoding.

    Args:
        config: the model's config (its text config is used); full-attention layers become Locks
            layers, others keep transformers' layers. ``None``: every layer is a `LocksLayer`.
        locks: the method's settings; keyword overrides build one (``LocksCache(cfg, budget=256)``).
        max_cache_len: tokens the cache will hold (prompt + generated). Optional: without it the
            static layout starts at the first forward's length plus headroom and grows (each growth
            re-allocates once and recompiles the decode step once).
        max_budget: the widest budget the cache will decode with (`set_budget`); default the
            config's. The static layout sizes its page lists for it, so that budgets up to it share
            one compiled graph.
        layout: ``"auto"`` (default): the static layout (compiled decode: torch.compile + CUDA graphs
            through ``generate``) when a CUDA device and the Triton kernels are available and the
            configuration allows it, else the dynamic layout (eager; the CPU reference path);
            ``"static"`` or ``"dynamic"`` to choose.

    Use with a model loaded with ``attn_implementation="locks"``.
    """

    #: Whether the static layout may grow past its capacity (`LocksStaticCache`: no).
    _growable = True

    def __init__(
        self,
        config: PretrainedConfig | None = None,
        locks: LocksConfig | None = None,
        *,
        max_cache_len: int | None = None,
        max_budget: int | None = None,
        layout: str = "auto",
        **overrides,
    ) -> None:
        config = arguments.model_config(config)
        locks = (arguments.locks_config(locks, "LocksCache") or LocksConfig()).replace(**overrides)
        max_budget = arguments.max_budget(max_budget, locks.budget)
        if max_cache_len is not None and (
            isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1
        ):
            raise LocksConfigError(f"max_cache_len must be a positive int (prompt + new tokens), got {max_cache_len!r}")
        self.locks_config = locks
        self.max_budget = max_budget
        self._plan: CapacityPlan | None = None  # the static layout's capacity (None: dynamic layout)
        # the static layout's decode kernels, compiled during the prefill (`locks_hf.precompile`)
        self._precompile: DecodePrecompile | None = None
        self._precompile_started = False
        if config is None:
            choose_layout(layout, locks, None)
            super().__init__()
            self.layer_class_to_replicate = lambda: LocksLayer(locks)
            return
        text_config = config.get_text_config(decoder=True)
        check_model_supported(text_config, locks)
        super().__init__(config=text_config)
        self.remember_model_shape(text_config)
        self._query_heads = text_config.num_attention_heads
        self._layer_types, self._layer_kwargs = get_layer_types_and_kwargs(text_config)
        self._last_kv_layer = max(i for i, kind in enumerate(self._layer_types) if kind != "dummy")
        for i, layer_type in enumerate(self._layer_types):
            if layer_type == "full_attention":
                self.layers[i] = LocksLayer(locks)
                self.layers[i].text_config = text_config
        if choose_layout(layout, locks, self._layer_types):
            self._plan = CapacityPlan(max_cache_len, locks.page_size, self._growable)
            if torch.cuda.is_available():  # where generate() compiles this layout's decode step
                keep_compiled_steps()
            # every forward updates this layer first: where an eager forward is counted
            self._first_kv_layer = next(i for i, kind in enumerate(self._layer_types) if kind != "dummy")
            if max_cache_len is not None:
                self._allocate(self._plan.capacity)

    # -- the static layout ---------------------------------------------------------------------------
    @property
    def is_static(self) -> bool:
        """Whether the cache keeps the static layout (compiled decode on a GPU)."""
        return self._plan is not None

    @property
    def is_compileable(self) -> bool:
        # Asked by generate() before the first forward, when the static layers may not exist yet.
        return self._plan is not None

    @property
    def capacity(self) -> int | None:
        """Tokens the static layout holds before it grows (``None``: dynamic, or before the first forward)."""
        return None if self._plan is None else self._plan.capacity

    def _allocate(self, capacity: int) -> None:
        self.layers = build_static_layers(
            self._layer_types,
            self._layer_kwargs,
            self.locks_config,
            capacity,
            page_slots_width(self.locks_config, self.max_budget),
        )

    def _ensure(self, capacity: int | None) -> None:
        """Re-allocate every static layer to ``capacity`` slots (``None``: nothing to do)."""
        if capacity is None:
            return
        self._wait_precompile()
        self._precompile_started = False  # new buffers: compiled again from their first write
        if not any(layer.is_initialized for layer in self.layers if isinstance(layer, StaticLayer)):
            self._plan.capacity = capacity  # nothing written yet: (re)build the static layers at this size
            self._allocate(capacity)
            return
        logger.warning(
            "LocksCache: growing the static cache from %d to %d tokens (one re-allocation; a compiled "
            "decode step recompiles once). Pass max_cache_len to allocate it once.",
            self._plan.capacity,
            capacity,
        )
        self._plan.capacity = capacity
        for layer, kw in zip(self.layers, self._layer_kwargs):
            if isinstance(layer, PagedLayer):
                layer.reallocate(capacity)
            elif isinstance(layer, StaticLayer):
                reallocate_hf_layer(layer, capacity, window=kw.get("sliding_window"))

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self._plan is not None and layer_idx == self._first_kv_layer:
            if is_torchdynamo_compiling():
                self._plan.compiled_ran = True  # a constant store: replayed after the graph, no guard
            else:  # an eager forward (prefill, or a step not compiled): counted before any layer writes
                t = key_states.shape[2]
                if self._plan.capacity is None:
                    self._ensure(self._plan.first_capacity(t))
                self._ensure(self._plan.eager_write(t))
        out = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        if not is_torchdynamo_compiling() and self._plan is not None and not self._precompile_started:
            self._start_precompile(layer_idx)
        return out

    def _start_precompile(self, layer_idx: int) -> None:
        """After the first Locks layer's first write (its buffers now exist): compile the decode kernels in
        the background while the rest of this forward, the prefill, runs (`locks_hf.precompile`)."""
        layer = self.layers[layer_idx]
        if not isinstance(layer, PagedLayer):  # transformers' own layers (sliding windows) come first in some models
            return
        self._precompile_started = True
        if precompile_applies(layer):
            # the page updates as `plan_page_updates` will launch them: the Locks layers, on one device
            paged = sum(isinstance(other, PagedLayer) for other in self.layers)
            sizes = tuple(launch_sizes(paged)) if grouping_enabled() and paged > 1 else ()
            self._precompile = DecodePrecompile(layer, self._query_heads, sizes)

    def _wait_precompile(self) -> None:
        """Before the buffers change or are copied: the background compile is done (the decode step joins it
        itself, at its first launch)."""
        if self._precompile is not None:
            self._precompile.wait()
            self._precompile = None

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if isinstance(query_length, int) and query_length == 0:  # before any layer: the model would fail in a reshape
            raise ValueError(EMPTY_INPUT)
        # Runs eagerly before every forward that builds a mask, compiled decode steps included (generate
        # prepares their 4D mask outside the graph): the place to grow the static buffers.
        if (
            self._plan is not None
            and not is_torchdynamo_compiling()
            and layer_idx == find_first_full_attention_index(self)
        ):
            if self._plan.capacity is None:
                self._ensure(self._plan.first_capacity(query_length))
            self._ensure(self._plan.announce(query_length))
        return super().get_mask_sizes(query_length, layer_idx)

    def set_budget(self, budget: int) -> None:
        """Decode with budget ``budget`` from the next step on; the static layout switches in place
        (no recompile) up to ``max_budget``."""
        config = self.locks_config.replace(budget=budget)
        for layer in self.locks_layers:  # one config object for every layer (see LocksStaticLayer.set_budget)
            if isinstance(layer, LocksLayer):
                layer.set_config(config)
            else:
                layer.set_budget(config)
        self.locks_config = config

    def reset(self) -> None:
        super().reset()
        self.use_guard.release()
        self._rewound_to(0)  # buffers kept (same addresses: a compiled step serves the next prompt)

    def _rewound_to(self, length: int) -> None:
        """The static layout now holds ``length`` tokens (exact: after a host-side rewind)."""
        if self._plan is not None:
            self._plan.written, self._plan.announced, self._plan.compiled_ran = length, 0, False

    def crop(self, tokens_to_remove: int) -> None:
        if self._plan is None or not any(l.is_initialized for l in self.layers if isinstance(l, StaticLayer)):
            return super().crop(tokens_to_remove)
        for layer in self.layers:
            if isinstance(layer, PagedLayer):
                layer.crop(tokens_to_remove)
            elif isinstance(layer, StaticLayer):
                crop_hf_layer(layer, -tokens_to_remove)
        self._rewound_to(int(self.locks_layers[0].length_tensor()))  # exact again (a host op may sync)

    def expect_new_tokens(self, count: int) -> None:
        """Announce how many tokens the next decode will generate (policies whose budget rule uses
        the total sequence length, such as RocketKV's, read it; others ignore it)."""
        for layer in self.locks_layers:
            layer.expected_new_tokens = int(count)

    def fork(self, locks: LocksConfig | None = None) -> LocksCache:
        """An independent copy (e.g. of a prefilled prompt) that decodes with other settings.

        The K/V are copied once; summaries are shared when their layout is unchanged (each side copies
        them before it first summarizes a page) and rebuilt in one batched pass otherwise. A fork of a static-layout cache stays static when ``locks`` allows
        it and converts to the dynamic layout (logged) when not. The fork's statistics start at zero.
        """
        locks = arguments.locks_config(locks, "LocksCache.fork")
        self._wait_precompile()
        clone = copy.copy(self)
        clone.__dict__.pop("_use_guard", None)  # the fork is a cache of its own: any thread may use it
        if locks is not None:
            for layer in self.locks_layers:
                if layer.is_initialized:
                    check_head_dim(locks, layer.keys.shape[-1])
        clone.locks_config = locks or self.locks_config
        refusal = None if self._plan is None else config_refusal(clone.locks_config, self._layer_types)
        if refusal is None and self._plan is not None and not same_kv(self.locks_config, clone.locks_config):
            refusal = (
                f"kv_bits={clone.locks_config.kv_bits}: a static layer keeps the KV storage it was created with "
                f"(kv_bits={self.locks_config.kv_bits})"
            )
        if self._plan is not None and refusal is None:
            clone._plan = copy.copy(self._plan)
            width = page_slots_width(clone.locks_config, self.max_budget)
            clone.layers = [copied_layer(layer, locks, width) for layer in self.layers]
        elif self._plan is not None:
            logger.warning(
                "LocksCache.fork(%s): %s; the fork decodes with the dynamic layout", clone.locks_config.label, refusal
            )
            clone._plan = None
            clone.layers = dynamic_layers(self.layers, self._layer_kwargs, clone.locks_config)
        else:
            clone.layers = [copied_layer(layer, locks, None) for layer in self.layers]
        clone.reset_stats()
        clone.plan_page_updates()  # its own layers, perhaps of other settings or layout
        return clone
