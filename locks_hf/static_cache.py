"""`LocksStaticCache`: `LocksCache` in the static layout (`LocksStaticLayer`) at a fixed capacity,
with one prefix decoded under several settings (`mark_prefix`, `rewind`, `set_config`) for sweeps."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

from .cache import LocksCache
from .config import LocksConfig, LocksConfigError
from .static_layer import LocksStaticLayer

__all__ = ["LocksStaticCache", "LocksStaticLayer"]


class LocksStaticCache(LocksCache):
    """`LocksCache` in the static layout with a fixed capacity.

    `LocksCache` chooses the static layout by itself on a GPU (and grows it); this class insists on
    it, on any device, and refuses to write past ``max_cache_len`` (rounded up to whole pages)
    instead of growing. Supports the selectors that keep per-page state only (``locks_hf.selectors.static_selector_names()``:
    ``locks``, ``oracle``, ``quest``, ``full``) with ``min_context=0``; for sweeps, one prefix decoded under several settings (`mark_prefix`,
    `rewind`, `set_config`).
    """

    _growable = False

    def __init__(
        self,
        config: PretrainedConfig,
        max_cache_len: int,
        locks: LocksConfig | None = None,
        *,
        max_budget: int | None = None,
        **overrides,
    ) -> None:
        super().__init__(
            config, locks, max_cache_len=max_cache_len, max_budget=max_budget, layout="static", **overrides
        )

    # -- one prefix, several decode settings (sweeps) -------------------------------------------------
    def mark_prefix(self) -> None:
        """Remember the current contents as the shared prefix that `rewind` returns to (e.g. a prefilled
        prompt that several arms decode from). Layers that keep only a window (sliding-window
        attention) are copied here, since decode overwrites them; Locks layers copy nothing."""
        self._prefix_length = int(self.get_seq_length())
        self._prefix_state = [
            None if isinstance(layer, LocksStaticLayer) else _window_state(layer) for layer in self.layers
        ]

    def rewind(self) -> None:
        """Back to the prefix of `mark_prefix`: the decode tail is forgotten, statistics restart at zero,
        summaries of the prefix's pages are kept (no K/V is copied)."""
        if getattr(self, "_prefix_length", None) is None:
            raise ValueError("LocksStaticCache.rewind: call mark_prefix() after the prefill first")
        for layer, state in zip(self.layers, self._prefix_state):
            if state is None:
                layer.rewind(self._prefix_length)
            else:
                _restore_window_state(layer, state)
        self._rewound_to(self._prefix_length)

    def set_config(self, locks: LocksConfig) -> None:
        """Decode with ``locks`` from here on (see `LocksStaticLayer.set_config`: summaries per layout)."""
        from . import arguments

        locks = arguments.locks_config(locks, "LocksStaticCache.set_config")
        if locks is None:
            raise LocksConfigError(
                "LocksStaticCache.set_config takes a LocksConfig or a label such as 'r8i4', got None"
            )
        self.locks_config = locks
        for layer in self.locks_layers:
            layer.set_config(locks)
        self.plan_page_updates()

    def row_stats(self) -> torch.Tensor:
        """``int64 [b, 2]``: per row, tokens attended and real tokens cached, summed over the Locks layers
        and the decode steps since the last `rewind` / `reset_stats` (their ratio is a row's attended
        fraction)."""
        return torch.stack([layer.row_counts for layer in self.locks_layers]).sum(0)


def _window_state(layer) -> dict:
    """A copy of what a transformers static (or sliding-window) layer holds: its K/V and counters."""
    if type(layer) not in (StaticLayer, StaticSlidingWindowLayer):
        raise ValueError(
            f"LocksStaticCache.mark_prefix cannot save a {type(layer).__name__} (its state is not "
            "only K/V): rewinding this model's cache is not supported"
        )
    if not layer.is_initialized:
        return {}
    return {
        name: value.clone() if torch.is_tensor(value) else value
        for name, value in vars(layer).items()
        if name in ("keys", "values", "cumulative_length", "cumulative_length_int")
    }


def _restore_window_state(layer, state: dict) -> None:
    for name, value in state.items():
        if torch.is_tensor(value):
            getattr(layer, name).copy_(value)  # in place: compiled graphs hold these addresses
        else:
            setattr(layer, name, value)
