"""The paper's baseline methods as token-level cache policies (`locks_hf.token_policy`).

Each module holds one method and registers it (`locks_hf.selectors.register_selector`) under its
`LocksConfig.selector` name; `POLICIES` maps those names to the classes.
"""

from .kvzip import KVzipPolicy
from .lazy_eviction import LazyEvictionPolicy
from .rkv import RKVPolicy
from .rocketkv import RocketKVPolicy
from .shadowkv import ShadowKVPolicy
from .triattention import TriAttentionPolicy

POLICIES = {cls.name: cls for cls in (RocketKVPolicy, RKVPolicy, LazyEvictionPolicy, ShadowKVPolicy, TriAttentionPolicy, KVzipPolicy)}

__all__ = ["POLICIES", "KVzipPolicy", "LazyEvictionPolicy", "RKVPolicy", "RocketKVPolicy", "ShadowKVPolicy", "TriAttentionPolicy"]
