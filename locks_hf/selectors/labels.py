"""Arm labels: the sweep's family names of `LocksConfig` settings (``"locks-r8i4"``, ``"quest"``,
``"full+kv2"``), parsed by the registered selectors, and their report order."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..kv_quant import LABEL_GRAMMAR, kv_label, split_kv_label
from .base import PageSelector
from .registry import registered_classes, selector_class

if TYPE_CHECKING:
    from ..config import LocksConfig


def parse_family(family: str) -> tuple[type[PageSelector], dict]:
    """The selector and `LocksConfig` fields of an arm family label (``"locks-r8i4"``, ``"quest"``,
    with quantized KV ``"locks-r8i4+kv4-post"``, ``"full+kv2"``)."""
    base, kv_fields = split_kv_label(family)
    for cls in registered_classes():
        fields = cls.parse_family(base)
        if fields is not None:
            return cls, {**fields, **kv_fields}
    raise ValueError(f"unknown arm {family!r}: use {family_help()}")


def family_help() -> str:
    """The arm labels every registered selector accepts, in words."""
    labels = ", ".join(cls.family_grammar or cls.name for cls in registered_classes())
    return f"{labels}; each optionally followed by {LABEL_GRAMMAR}"


def family_of(config: LocksConfig) -> str:
    """The arm family label of ``config`` (`parse_family`'s inverse)."""
    cls = selector_class(config.selector)
    return cls.family(config) + kv_label(config, cls)


def family_sort_key(family: str) -> tuple:
    """Report order of arm families: by selector (``report_order``), then larger summaries first;
    labels no selector parses go last, by name."""
    try:
        cls, fields = parse_family(family)
    except ValueError:
        return (float("inf"), (), family)
    return (cls.report_order, cls.family_sort_key(fields), family)
