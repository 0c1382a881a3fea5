"""The paper's baseline methods as token-level cache policies (`locks_hf.token_policy`).

Each module holds one method; `POLICIES` maps the `LocksConfig.selector` name to its class.
"""

from .rocketkv import RocketKVPolicy

POLICIES = {cls.name: cls for cls in (RocketKVPolicy,)}

__all__ = ["POLICIES", "RocketKVPolicy"]
