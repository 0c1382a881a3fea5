"""What differs between the supported transformers releases (the range in pyproject.toml), in one place.

Each name here is the newest release's API, with a stand-in for the older releases that lack it; the
rest of the package imports these names and never checks a version. Detection is by feature, not by
version number, so a release that back-ports a name takes the same path as the newest.
"""

from __future__ import annotations

import inspect

from transformers.cache_utils import get_layer_types_and_kwargs as _hf_layer_types_and_kwargs

try:  # transformers >= 5.23
    from transformers.masking_utils import find_first_full_attention_index
except ImportError:  # older: the mask builders read the sizes of the first non-sliding layer

    def find_first_full_attention_index(cache) -> int:  # type: ignore[misc]  # transformers' own, typed, when present
        """The layer whose ``get_mask_sizes`` the causal mask builders ask (0 if every layer slides)."""
        try:
            return list(cache.is_sliding).index(False)
        except (AttributeError, ValueError):
            return 0


def get_layer_types_and_kwargs(config) -> tuple[list[str], list[dict]]:
    """Each cache layer's type and constructor keywords, one dict per layer (transformers >= 5.19; older
    releases return one dict shared by every layer, which their own caches pass to each layer)."""
    layer_types, layer_kwargs = _hf_layer_types_and_kwargs(config)
    if isinstance(layer_kwargs, dict):
        layer_kwargs = [dict(layer_kwargs) for _ in layer_types]
    return layer_types, layer_kwargs


def cache_keyword(model) -> str:
    """The keyword ``model(...)`` and ``model.generate(...)`` take a cache by: ``cache`` where the model's
    forward names it so (transformers >= 5.24, which deprecates ``past_key_values``), else
    ``past_key_values``. Ask it outside a compiled region and pass ``**{keyword: cache}``."""
    return "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"


__all__ = ["cache_keyword", "find_first_full_attention_index", "get_layer_types_and_kwargs"]
