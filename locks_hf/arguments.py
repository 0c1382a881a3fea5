"""Checks of the arguments of the caches' public entry points, with errors that say what to pass.

Wrong types would otherwise fail deep inside (an ``AttributeError`` on a label, a ``TypeError`` in a
comparison, an ``IndexError`` in a gather); a few unambiguous forms are accepted instead (a model
where its config goes, an arm label where a `LocksConfig` goes).
"""

from __future__ import annotations

import numbers

import torch
from transformers import PretrainedConfig

from .config import LocksConfig, LocksConfigError


def model_config(value) -> PretrainedConfig | None:
    """The model config a cache is built from: a config, ``None``, or a model (its ``.config``)."""
    if value is None or isinstance(value, PretrainedConfig):
        return value
    if isinstance(getattr(value, "config", None), PretrainedConfig):  # the model itself: its config is meant
        return value.config
    raise LocksConfigError(
        f"the first argument of a Locks cache is the model's config, e.g. LocksCache(model.config), got "
        f"{type(value).__name__} {_short(value)}; the Locks settings go second (a LocksConfig or a label such as 'r8i4')"
    )


def locks_config(value, where: str) -> LocksConfig | None:
    """A `LocksConfig` given to ``where``: a `LocksConfig`, ``None``, or an arm label (`LocksConfig.from_label`)."""
    if value is None or isinstance(value, LocksConfig):
        return value
    if isinstance(value, str):
        return LocksConfig.from_label(value)
    raise LocksConfigError(
        f"{where} takes a LocksConfig or an arm label such as 'r8i4' or 'quest-b64', got {type(value).__name__} "
        f"{_short(value)}; for changed fields use LocksConfig(**fields) or cache.locks_config.replace(budget=...)"
    )


def max_budget(value, budget: int) -> int | None:
    """``max_budget``: ``None`` or an int at least the budget."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise LocksConfigError(f"max_budget must be an int (tokens) or None, got {value!r} ({type(value).__name__})")
    if value < budget:
        raise LocksConfigError(
            f"max_budget={value} is below the budget {budget}: pass max_budget >= {budget} "
            "(the widest budget set_budget will switch to), or leave it unset"
        )
    return int(value)


def row_indices(indices, batch: int, where: str) -> torch.Tensor:
    """Row indices ``[n]`` (beam reorder, row selection) checked against a batch of ``batch`` rows."""
    rows = torch.as_tensor(indices)
    if rows.dtype in (torch.bool,) or rows.is_floating_point() or rows.is_complex() or rows.dim() != 1:
        raise ValueError(
            f"{where}: row indices must be a 1-D integer tensor, got {rows.dtype} of shape {tuple(rows.shape)}"
        )
    if rows.numel():
        low, high = torch.stack(torch.aminmax(rows)).tolist()  # one host read (a beam search reorders every step)
        if low < 0 or high >= batch:
            raise ValueError(
                f"{where}: row index out of range for a cache of batch size {batch} "
                f"(got {rows.tolist()}); indices must lie in 0..{batch - 1}"
            )
    return rows


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
