"""The selector registry: ``LocksConfig.selector`` names -> `PageSelector` classes.

Everything that depends on which selectors exist reads it here: `LocksConfig` validation, the static
cache's allowed selectors, the kernel dispatch (`locks_hf.backends`), the sweep's arm labels
(`labels`), report ordering and the demo. The built-in methods are listed below, in the order of
`selector_names()` and of arm-label parsing (the paper's baselines, token-level policies, after the
page selectors); `register_selector` adds others (plugins, tests) after them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..baselines.kvzip import KVzipPolicy
from ..baselines.lazy_eviction import LazyEvictionPolicy
from ..baselines.rkv import RKVPolicy
from ..baselines.rocketkv import RocketKVPolicy
from ..baselines.shadowkv import ShadowKVPolicy
from ..baselines.triattention import TriAttentionPolicy
from ..errors import LocksConfigError
from .base import PageSelector, SelectionMethod
from .full import FullAttention
from .locks import LocksSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .rerank import LocksRerankSelector
from .shared_basis import SharedAllSelector, SharedBasisSelector

if TYPE_CHECKING:
    from ..config import LocksConfig

#: The built-in methods, in registry order.
BUILTIN: tuple[type[SelectionMethod], ...] = (
    LocksSelector,
    LocksRerankSelector,
    OracleSelector,
    QuestSelector,
    FullAttention,
    SharedBasisSelector,
    SharedAllSelector,
    KVzipPolicy,
    LazyEvictionPolicy,
    RKVPolicy,
    RocketKVPolicy,
    ShadowKVPolicy,
    TriAttentionPolicy,
)

_REGISTRY: dict[str, type[PageSelector]] = {cls.name: cls for cls in BUILTIN}


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


def registered_classes() -> tuple[type[PageSelector], ...]:
    """Every registered class, in registration order."""
    return tuple(_REGISTRY.values())
