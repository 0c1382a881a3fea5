"""Page selectors behind one interface (`PageSelector`), one module each, found through a registry.

`base` the interface and its declared capabilities; `registry` name -> class, arm labels;
`selection` the page-set rule shared by all (sink + most recent + best ``k - 2``); one module per
selector: `locks`, `rerank` (Locks + exact re-ranking of a short list), `oracle`, `quest`, `full`
(dense, no selection), `shared_basis` (+ ``shared_all``).
A new selector is a new module here (a `PageSelector` subclass decorated with `register_selector`)
imported below, plus its tests.
"""

from .base import PageSelector
from .registry import (
    config_for_family,
    family_help,
    family_of,
    family_sort_key,
    make_selector,
    parse_family,
    register_selector,
    selector_class,
    selector_names,
    static_selector_names,
    summary_layout,
    unregister_selector,
)
from .selection import NEG_INF, combine_group, forced_pages, select_pages

# isort: off
# Registered on import, in this order (the order of `selector_names()` and of arm-label parsing);
# the paper's baselines (token-level policies, `locks_hf.baselines`) after the page selectors.
from .locks import LocksSelector
from .rerank import LocksRerankSelector
from .oracle import OracleSelector
from .quest import QuestSelector
from .full import FullAttention
from .shared_basis import SharedAllSelector, SharedBasisSelector
from .. import baselines  # noqa: F401
# isort: on

__all__ = ["NEG_INF", "FullAttention", "LocksRerankSelector", "LocksSelector", "OracleSelector", "PageSelector", "QuestSelector",
           "SharedAllSelector", "SharedBasisSelector", "combine_group", "config_for_family", "family_help", "family_of",
           "family_sort_key", "forced_pages", "make_selector", "parse_family", "register_selector",
           "select_pages", "selector_class", "selector_names", "static_selector_names", "summary_layout",
           "unregister_selector"]
