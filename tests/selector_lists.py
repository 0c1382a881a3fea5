"""Selector names for parametrized tests, read from the registry (`locks_hf.selectors`), so a newly
registered selector is tested without editing a list: every name, or those of declared capabilities."""

from __future__ import annotations

from locks_hf.config import BudgetDoesNotFit, LocksConfig
from locks_hf.selectors import selector_class, selector_names


def selectors(*, kernel: bool | None = None, **declared) -> list[str]:
    """Registered selector names (registration order) whose declarations match every one given.

    ``kernel``: has Triton kernels (``kernel_method`` set); any other keyword names a declared class
    attribute (`SelectionMethod`'s ``static_cache``, ``token_level``, ``dense``, ``reads_keys``,
    ``summary_of``, ..., or a method's own such as ``needs_context_scores``, absent meaning False):
    booleans match by truth, anything else by equality.
    """
    out = []
    for name in selector_names():
        cls = selector_class(name)
        if kernel is not None and (cls.kernel_method is not None) != kernel:
            continue
        ok = True
        for attr, want in declared.items():
            have = getattr(cls, attr, None)
            if (bool(have) != want) if isinstance(want, bool) else (have != want):
                ok = False
                break
        if ok:
            out.append(name)
    return out


def all_selectors() -> list[str]:
    """Every registered name: page selectors, the dense ``full`` and the token-level baselines."""
    return list(selector_names())


def fits(selector: str, budget: int) -> bool:
    """``selector`` accepts ``budget`` (a method with fixed blocks, such as ShadowKV's, refuses small ones)."""
    try:
        LocksConfig(selector=selector, budget=budget)
    except BudgetDoesNotFit:
        return False
    return True
