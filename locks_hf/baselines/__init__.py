"""The paper's baseline methods as token-level cache policies (`locks_hf.token_policy`).

Each module holds one method and registers it (`locks_hf.selectors.register_selector`) under its
`LocksConfig.selector` name; `POLICIES` maps those names to the classes.
"""

from .rocketkv import RocketKVPolicy

POLICIES = {cls.name: cls for cls in (RocketKVPolicy,)}

__all__ = ["POLICIES", "RocketKVPolicy"]
