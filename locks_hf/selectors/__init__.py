"""Page selectors behind one interface (`PageSelector`), one module each, found through a registry.

`base` the interface and its declared capabilities; `registry` name -> class (the built-in methods
listed there, in order); `labels` the sweep's arm labels; `selection` the page-set rule shared by all
(sink + most recent + best ``k - 2``); one module per selector: `locks`, `rerank` (Locks + exact
re-ranking of a short list), `oracle`, `quest`, `full` (dense, no selection), `shared_basis`
(+ ``shared_all``). A new built-in selector is a new module here (a `PageSelector` subclass) and its
entry in `registry.BUILTIN`, plus its tests; `register_selector` adds one from outside the package.
"""

from ..config import config_for_family
from .base import PageSelector
from .full import FullAttention
from .labels import family_help, family_of, family_sort_key, parse_family
from .locks import LocksSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .registry import (
    make_selector,
    register_selector,
    selector_class,
    selector_names,
    static_selector_names,
    summary_layout,
    unregister_selector,
)
from .rerank import LocksRerankSelector
from .selection import NEG_INF, combine_group, forced_pages, select_pages
from .shared_basis import SharedAllSelector, SharedBasisSelector

__all__ = [
    "NEG_INF",
    "FullAttention",
    "LocksRerankSelector",
    "LocksSelector",
    "OracleSelector",
    "PageSelector",
    "QuestSelector",
    "SharedAllSelector",
    "SharedBasisSelector",
    "combine_group",
    "config_for_family",
    "family_help",
    "family_of",
    "family_sort_key",
    "forced_pages",
    "make_selector",
    "parse_family",
    "register_selector",
    "select_pages",
    "selector_class",
    "selector_names",
    "static_selector_names",
    "summary_layout",
    "unregister_selector",
]
