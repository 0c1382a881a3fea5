"""The selector registry: ``LocksConfig.selector`` names -> `PageSelector` classes.

Everything that depends on which selectors exist reads it here: `LocksConfig` validation, the static
cache's allowed selectors, the kernel dispatch (`locks_hf.backend`), the sweep's arm labels
(`config_for_family`), report ordering (`family_sort_key`) and the demo.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import PageSelector

if TYPE_CHECKING:
    from ..config import LocksConfig

_REGISTRY: dict[str, type[PageSelector]] = {}


def register_selector(cls: type[PageSelector]) -> type[PageSelector]:
    """Class decorator: make ``cls`` available as ``LocksConfig(selector=cls.name)``."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a class attribute `name` (the LocksConfig.selector value)")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"selector {name!r} is already registered by {_REGISTRY[name].__name__}")
    _REGISTRY[name] = cls
    return cls


def unregister_selector(name: str) -> None:
    """Remove a registered selector (tests, plugins); unknown names are ignored."""
    _REGISTRY.pop(name, None)


def selector_names() -> tuple[str, ...]:
    """Every registered selector name, in registration order."""
    return tuple(_REGISTRY)


def selector_class(name: str) -> type[PageSelector]:
    """The class registered as ``name``; `LocksConfigError` listing the names otherwise."""
    cls = _REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        from ..config import LocksConfigError

        raise LocksConfigError(f"selector must be one of {selector_names()}, got {name!r}")
    return cls


def static_selector_names() -> tuple[str, ...]:
    """Selectors `LocksStaticCache` accepts (per-page state only)."""
    return tuple(n for n, cls in _REGISTRY.items() if cls.static_cache)


def make_selector(config: LocksConfig) -> PageSelector | None:
    """The selector for ``config.selector``; ``None`` for a dense one (``"full"``)."""
    cls = selector_class(config.selector)
    return None if cls.dense else cls(config)


def summary_layout(config: LocksConfig) -> tuple:
    """What a cache's summaries depend on: equal layouts share summaries (`LocksCache.fork`)."""
    cls = selector_class(config.selector)
    return (cls.summary_of or config.selector, config.page_size, *(getattr(config, f) for f in cls.summary_fields))


# -- arm labels ----------------------------------------------------------------------------------------
def parse_family(family: str) -> tuple[type[PageSelector], dict]:
    """The selector and `LocksConfig` fields of an arm family label (``"locks-r8i4"``, ``"quest"``,
    with quantized KV ``"locks-r8i4+kv4-post"``, ``"full+kv2"``)."""
    from ..kv_quant import split_kv_label

    base, kv_fields = split_kv_label(family)
    for cls in _REGISTRY.values():
        fields = cls.parse_family(base)
        if fields is not None:
            return cls, {**fields, **kv_fields}
    raise ValueError(f"unknown arm {family!r}: use {family_help()}")


def family_help() -> str:
    """The arm labels every registered selector accepts, in words."""
    from ..kv_quant import LABEL_GRAMMAR

    labels = ", ".join(cls.family_grammar or cls.name for cls in _REGISTRY.values())
    return f"{labels}; each optionally followed by {LABEL_GRAMMAR}"


def config_for_family(family: str, budget: int = 128, page_size: int = 16, **extra) -> LocksConfig:
    """The `LocksConfig` of an arm family at ``budget`` (a dense family ignores the budget)."""
    from ..config import LocksConfig

    cls, fields = parse_family(family)
    if cls.dense:
        budget = max(budget, 2 * page_size)
    return LocksConfig(selector=cls.name, page_size=page_size, budget=budget, **fields, **extra)


def family_of(config: LocksConfig) -> str:
    """The arm family label of ``config`` (`parse_family`'s inverse)."""
    from ..kv_quant import kv_label

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
