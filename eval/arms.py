"""Sweep arms: (selector, rank/bits, budget) -> `LocksConfig`, with stable names."""

from __future__ import annotations

import re
from dataclasses import dataclass

from locks_hf.config import BASELINE_POLICIES, BudgetDoesNotFit, LocksConfig

DEFAULT_ARMS = ("full", "oracle", "locks-r8i4", "locks-r4i4", "quest")
DEFAULT_BUDGETS = (64, 128, 256, 512)


@dataclass(frozen=True)
class Arm:
    """One configuration of the sweep. ``family`` is the arm without its budget (``locks-r8i4``)."""

    family: str
    budget: int | None
    config: LocksConfig

    @property
    def name(self) -> str:
        return self.family if self.budget is None else f"{self.family}-b{self.budget}"

    @property
    def selector(self) -> str:
        return self.config.selector


def family_config(family: str, budget: int, page_size: int = 16, **extra) -> LocksConfig:
    """``full`` | ``oracle`` | ``quest`` | ``locks-r8i4`` / ``r4i4`` / ``locks-r8bf16`` | ``shared_basis-r20`` /
    ``shared_all-r28`` (Table 1 controls) | a baseline policy (``rocketkv``, ...)."""
    if family == "full":
        return LocksConfig(selector="full", page_size=page_size, budget=max(budget, 2 * page_size), **extra)
    if family in ("oracle", "quest", *BASELINE_POLICIES):
        return LocksConfig(selector=family, page_size=page_size, budget=budget, **extra)
    m = re.match(r"^(shared_basis|shared_all)-r(\d+)(?:i(\d+))?$", family)
    if m:  # the paper's Table 1 shared-basis controls, e.g. shared_basis-r20 (int4 basis by default)
        return LocksConfig(selector=m[1], rank=int(m[2]), basis_bits=int(m[3] or 4), page_size=page_size,
                           budget=budget, **extra)
    if family.startswith("locks-") or family.startswith("r"):
        return LocksConfig.from_label(family, page_size=page_size, budget=budget, selector="locks", **extra)
    raise ValueError(f"unknown arm {family!r}: use full, oracle, quest, locks-r<rank>i<bits> (e.g. locks-r8i4), "
                     f"shared_basis-r<rank>, shared_all-r<rank>, or a baseline: {', '.join(BASELINE_POLICIES)}")


def parse_arms(families, budgets, page_size: int = 16, not_run: list | None = None) -> list[Arm]:
    """Expand arm families x budgets (``full`` once, without a budget).

    An arm whose method does not fit its budget (`BudgetDoesNotFit`, e.g. ShadowKV below 424 tokens)
    raises, or with a ``not_run`` list is left out and appended there as ``(name, reason)``.
    """
    arms: list[Arm] = []
    for fam in families:
        fam = fam.strip()
        if not fam:
            continue
        if fam not in BASELINE_POLICIES and not fam.startswith(("full", "oracle", "quest", "locks-", "shared")) \
                and fam.startswith("r"):
            fam = "locks-" + fam
        if fam == "full":
            arms.append(Arm("full", None, family_config("full", 128, page_size)))
            continue
        for b in budgets:
            try:
                arms.append(Arm(fam, int(b), family_config(fam, int(b), page_size)))
            except BudgetDoesNotFit as err:
                if not_run is None:
                    raise
                not_run.append((f"{fam}-b{b}", str(err)))
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
