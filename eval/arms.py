"""Sweep arms: (selector, rank/bits, budget) -> `LocksConfig`, with stable names."""

from __future__ import annotations

from dataclasses import dataclass

from locks_hf.config import BudgetDoesNotFit, LocksConfig
from locks_hf.selectors import config_for_family, family_of, parse_family

from .hf_quantized import HFQuantized, parse_hf_quantized

DEFAULT_ARMS = ("full", "oracle", "locks-r8i4", "locks-r4i4", "quest")
DEFAULT_BUDGETS = (64, 128, 256, 512)


@dataclass(frozen=True)
class Arm:
    """One configuration of the sweep. ``family`` is the arm without its budget (``locks-r8i4``). An arm
    decoded by transformers' own `QuantizedCache` (``hf-quanto4``, `hf_quantized`) has its settings in
    ``hf_cache`` and a dense ``config``."""

    family: str
    budget: int | None
    config: LocksConfig
    hf_cache: HFQuantized | None = None

    @property
    def name(self) -> str:
        return self.family if self.budget is None else f"{self.family}-b{self.budget}"

    @property
    def selector(self) -> str:
        return self.config.selector


def family_config(family: str, budget: int, page_size: int = 16, **extra) -> LocksConfig:
    """The config of an arm family at ``budget``: ``full`` | ``oracle`` | ``quest`` | ``locks-r8i4`` /
    ``r4i4`` / ``locks-r8bf16`` | ``shared_basis-r20`` / ``shared_all-r28`` (Table 1 controls), or any
    other registered selector's label (`locks_hf.selectors.parse_family`)."""
    return config_for_family(family, budget=budget, page_size=page_size, **extra)


def parse_arms(families, budgets, page_size: int = 16, not_run: list | None = None) -> list[Arm]:
    """Expand arm families x budgets (a dense family such as ``full``, or transformers' ``hf-quanto4``,
    once, without a budget).

    An arm whose method does not fit its budget (`BudgetDoesNotFit`, e.g. ShadowKV below 424 tokens)
    raises, or with a ``not_run`` list is left out and appended there as ``(name, reason)``.
    """
    arms: list[Arm] = []
    for fam in families:
        fam = fam.strip()
        if not fam:
            continue
        hf_cache = parse_hf_quantized(fam)
        if hf_cache is not None:
            arms.append(Arm(hf_cache.label, None, LocksConfig(selector="full", page_size=page_size), hf_cache))
            continue
        selector, _ = parse_family(fam)
        if selector.dense:
            config = family_config(fam, 128, page_size)
            arms.append(Arm(family_of(config), None, config))
            continue
        for b in budgets:
            try:
                config = family_config(fam, int(b), page_size)
            except BudgetDoesNotFit as err:
                if not_run is None:
                    raise
                not_run.append((f"{fam}-b{b}", str(err)))
                continue
            arms.append(Arm(family_of(config), int(b), config))
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate arms in {names}")
    return arms


def split_list(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        out = []
        for v in value:
            out += split_list(v)
        return out
    return [v for v in str(value).replace(" ", ",").split(",") if v]
