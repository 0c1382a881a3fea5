"""One launch for the per-step page summaries of a cache's layers.

A static layer's decode step summarizes the page its newest token completed (the per-step page update):
one launch a layer and step, which returns at once on ``B - 1`` steps of ``B`` and on the last builds the
page's summary (a ``B x B`` eigensolver on one warp a row and KV head). A page completed at step ``t`` is
that step's recent page, attended unconditionally and never a candidate, so its summary is first read by
the scoring of step ``t + 1``: the updates of all layers may wait for the last of them. A cache therefore
launches them once a step, for every layer of one layout on one device, when the last such layer writes
the new token (before its attention), instead of once a layer: one launch a layer fewer, and the summaries
of a completing step built side by side rather than one layer after another.

`plan_page_updates` groups a cache's layers by their backend's `DecodeBackend.page_update_key` and marks
each member ``page_update_deferred`` (its own step and `prepare` then leave the update out); the cache keeps
the plan (the index of each launch's last layer -> its layers; a group of more than `MAX_LAYERS_PER_LAUNCH`
launches in parts) and calls `launch_page_updates` at that index.
``LOCKS_HF_GROUP_PAGE_UPDATES=0`` keeps one launch a layer (for comparisons).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transformers.utils import is_torchdynamo_compiling

from .paged import PagedLayer

#: Set to ``0`` to launch each layer's page update in its own decode step.
GROUP_ENV = "LOCKS_HF_GROUP_PAGE_UPDATES"
#: Layers a launch serves at most: the kernel takes 11 pointers a layer, and a CUDA launch's parameters are
#: held to 4 KB (sm_90 compiles the 40-layer kernel without spills). Larger groups launch in even parts.
MAX_LAYERS_PER_LAUNCH = 40


def grouping_enabled() -> bool:
    """Whether caches launch their layers' page updates together (``LOCKS_HF_GROUP_PAGE_UPDATES`` not ``0``)."""
    return os.environ.get(GROUP_ENV, "1") != "0"


def plan_page_updates(layers: Sequence) -> dict[int, tuple[int, ...]]:
    """Group ``layers`` (a cache's, in forward order) whose page updates can share a launch, mark each member
    ``page_update_deferred`` (and every other Locks layer not), and return ``{last layer's index: the layers'
    indices}`` of each launch, for groups of two or more. Eager: call it when the layers' buffers, backends or
    settings change (a compiled step guards on the flags and the plan, and traces again)."""
    groups: dict[object, list[int]] = {}
    for i, layer in enumerate(layers):
        if not isinstance(layer, PagedLayer):
            continue
        layer.page_update_deferred = False
        key = layer.backend.page_update_key(layer) if layer.is_initialized and grouping_enabled() else None
        if key is not None:
            groups.setdefault(key, []).append(i)
    plan = {}
    for members in groups.values():
        if len(members) < 2:
            continue
        for i in members:
            layers[i].page_update_deferred = True
        start = 0
        for size in launch_sizes(len(members)):
            part = tuple(members[start : start + size])
            plan[part[-1]] = part
            start += size
    return plan


def launch_sizes(layers: int) -> list[int]:
    """The layers of each launch for a group of ``layers``: as even as `MAX_LAYERS_PER_LAUNCH` allows."""
    parts = -(-layers // MAX_LAYERS_PER_LAUNCH)
    return [layers // parts + (i < layers % parts) for i in range(parts)]


def launch_page_updates(layers: Sequence, members: tuple[int, ...]) -> None:
    """The page updates of ``layers[i]`` for ``i`` in ``members`` (a group of `plan_page_updates`), one launch.

    Raises where a member no longer shares the group's key (its settings changed without the cache planning
    again): a launch for the group would otherwise skip or misread that layer's update."""
    group = [layers[i] for i in members]
    backend = group[0].backend
    # checked when eager: a compiled step is traced after an eager prefill, which planned from the layers as they are
    if not is_torchdynamo_compiling() and not _still_match(backend, group):
        raise RuntimeError(
            f"layers {list(members)} were planned to share one page-update launch but no longer match (their "
            "settings or buffers changed outside the cache): change settings through the cache (set_config, "
            "set_budget), which plans the launches again"
        )
    backend.update_pages_of_layers(group)


def _still_match(backend, group: list) -> bool:
    keys = {backend.page_update_key(layer) for layer in group}
    return len(keys) == 1 and None not in keys and all(layer.backend is backend for layer in group)
