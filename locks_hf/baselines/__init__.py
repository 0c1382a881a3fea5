"""The paper's baseline methods as token-level cache policies (`locks_hf.token_policy`).

Each module holds one method; `POLICIES` maps the `LocksConfig.selector` name to its class.
"""

from .kvzip import KVzipPolicy
from .lazy_eviction import LazyEvictionPolicy
from .rkv import RKVPolicy
from .rocketkv import RocketKVPolicy
from .shadowkv import ShadowKVPolicy
from .triattention import TriAttentionPolicy

POLICIES = {
    cls.name: cls
    for cls in (RocketKVPolicy, RKVPolicy, LazyEvictionPolicy, ShadowKVPolicy, TriAttentionPolicy, KVzipPolicy)
}

__all__ = [
    "POLICIES",
    "KVzipPolicy",
    "LazyEvictionPolicy",
    "RKVPolicy",
    "RocketKVPolicy",
    "ShadowKVPolicy",
    "TriAttentionPolicy",
]
