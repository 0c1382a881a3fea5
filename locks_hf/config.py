"""`LocksConfig`: every knob of the method, validated once, with labels such as ``r8i4``."""

from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass, fields as dataclass_fields, replace

from .errors import BudgetDoesNotFit, LocksConfigError  # noqa: F401  (BudgetDoesNotFit: public here too)
from .kv_quant import validate_kv

GROUP_COMBINES = ("share_average", "group_max", "group_mass")
BASIS_BITS = (2, 4, 8, 16)  # 16 = unquantized (stored in the K/V dtype)
VALUE_BITS = (8, 16)  # for coefficients and centroids
#: Largest page: selection at a coarser grain than this reads most of a 128K context anyway.
MAX_PAGE_SIZE = 1024
_INT_FIELDS = (
    "page_size",
    "rank",
    "basis_bits",
    "coef_bits",
    "centroid_bits",
    "budget",
    "min_context",
    "kv_bits",
    "kv_group",
    "kv_residual",
)
#: Fields that only some selectors read (each declares them in `own_settings`); ``None`` = not set.
SELECTOR_SETTINGS = ("lazy_alpha", "rerank")
#: An arm label's budget suffix, as in ``locks-r8i4-b128`` (`LocksConfig.label`).
_BUDGET_SUFFIX = re.compile(r"^(?P<family>.+)-b(?P<budget>\d+)$")


@dataclass(frozen=True)
class LocksConfig:
    """What a `LocksCache` selects and how it summarises pages.

    Attributes:
        page_size: tokens per page ``B`` (a power of two).
        rank: rank ``r`` of each page's key basis (Locks only).
        basis_bits: bits per basis entry: 4 (paper default), 2 or 8, or 16 for unquantized.
        coef_bits: 8 (int8, one scale per token row) or 16 (unquantized).
        centroid_bits: 8 (int8, one scale per page) or 16 (unquantized).
        budget: token budget ``b`` per (layer, KV head); ``k = ceil(b / B)`` page slots.
        selector: ``"locks"``, ``"oracle"`` (exact page LSE), ``"quest"``, ``"full"`` (dense), or the
            shared-basis controls of the paper's Table 1: ``"shared_basis"`` (page centroid + one
            rank-r basis fitted on the prompt, frozen after prefill; paper ranks 20 / 40) and
            ``"shared_all"`` (centroid and basis both fitted on the prompt; ranks 28 / 48).
        group_combine: how the query heads of a GQA group agree on one page set (not Quest).
        min_context: decode steps with fewer cached tokens run dense (0 = always select).
        lazy_alpha: LazyEviction's attention threshold (``selector="lazy_eviction"`` only); ``None``:
            the published value of the model's family (`locks_hf.baselines.lazy_eviction.family_alpha`).
        rerank: ``"locks_rerank"`` only: the short list re-ranked by exact page LSE holds
            ``rerank * k`` candidate pages (``None``: 8 for ``locks_rerank``).
        kv_bits: KIVI quantization of the cached K/V (`locks_hf.kv_quant`): 4 or 2 bits, or 16 (default:
            the K/V dtype). Dynamic layout (the reference path) only, so far.
        kv_group: KIVI group: tokens per key scale (per channel), channels per value scale (per token).
        kv_residual: most recent tokens kept in full precision (KIVI's residual; a multiple of
            ``kv_group`` and of ``page_size``).
        summary_from: ``"post"`` builds each page's summary from the full-precision keys before they
            are quantized, ``"pre"`` from the dequantized keys (the paper's §5.4); both attend the
            quantized K/V.

    A selector-specific setting (``lazy_alpha``, ``rerank``: the selectors' declared `own_settings`)
    given to a selector that does not read it is refused rather than ignored.
    """

    page_size: int = 16
    rank: int = 8
    basis_bits: int = 4
    coef_bits: int = 8
    centroid_bits: int = 8
    budget: int = 128
    selector: str = "locks"
    group_combine: str = "share_average"
    min_context: int = 0
    lazy_alpha: float | None = None
    rerank: int | None = None
    kv_bits: int = 16
    kv_group: int = 32
    kv_residual: int = 128
    summary_from: str = "post"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:  # 4.0 or True would pass the range checks and fail deep in a kernel
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                hint = " (for a label such as 'r8i4' use LocksConfig.from_label)" if isinstance(value, str) else ""
                raise LocksConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__}){hint}")
            object.__setattr__(self, name, int(value))  # numpy ints become plain ints
        for name in ("selector", "group_combine", "summary_from"):
            if not isinstance(getattr(self, name), str):
                raise LocksConfigError(f"{name} must be a str, got {getattr(self, name)!r}")
        B = self.page_size
        if B < 2 or B > MAX_PAGE_SIZE or B & (B - 1):
            raise LocksConfigError(f"page_size must be a power of two in 2..{MAX_PAGE_SIZE} (e.g. 16), got {B!r}")
        selector = _selector_class(self.selector)  # LocksConfigError naming the registered selectors
        if self.group_combine not in GROUP_COMBINES:
            raise LocksConfigError(f"group_combine must be one of {GROUP_COMBINES}, got {self.group_combine!r}")
        if self.rank < 1:
            raise LocksConfigError(f"rank must be a positive int, got {self.rank!r}")
        if self.basis_bits not in BASIS_BITS:
            raise LocksConfigError(f"basis_bits must be one of {BASIS_BITS}, got {self.basis_bits!r}")
        for name in ("coef_bits", "centroid_bits"):
            if getattr(self, name) not in VALUE_BITS:
                raise LocksConfigError(f"{name} must be one of {VALUE_BITS}, got {getattr(self, name)!r}")
        if self.budget < 2 * B:
            raise LocksConfigError(
                f"budget must be at least two pages (2 * page_size = {2 * B} tokens) so the sink and "
                f"most recent pages fit, got {self.budget!r}"
            )
        if self.min_context < 0:
            raise LocksConfigError(f"min_context must be a non-negative int, got {self.min_context!r}")
        if self.lazy_alpha is not None:
            if isinstance(self.lazy_alpha, bool) or not isinstance(self.lazy_alpha, numbers.Real):
                raise LocksConfigError(f"lazy_alpha must be a float or None, got {self.lazy_alpha!r}")
            object.__setattr__(self, "lazy_alpha", float(self.lazy_alpha))
        if self.rerank is not None:
            if isinstance(self.rerank, bool) or not isinstance(self.rerank, numbers.Integral):
                raise LocksConfigError(f"rerank must be an int, got {self.rerank!r} ({type(self.rerank).__name__})")
            if self.rerank < 1:
                raise LocksConfigError(
                    f"rerank (candidate pages per page slot) must be a positive int, e.g. 4, got {self.rerank!r}"
                )
            object.__setattr__(self, "rerank", int(self.rerank))
        self._check_selector_settings(selector)
        validate_kv(self)
        selector.validate(self)  # last: selector-specific checks see validated generic fields

    def _check_selector_settings(self, selector) -> None:
        """Refuse a selector-specific setting on a selector that would ignore it; fill in the defaults
        of the selector's own settings that were left unset."""
        for name in SELECTOR_SETTINGS:
            if name in selector.own_settings:
                if getattr(self, name) is None and selector.own_settings[name] is not None:
                    object.__setattr__(self, name, selector.own_settings[name])
            elif getattr(self, name) is not None:
                from .selectors.registry import selector_names

                owners = [n for n in selector_names() if name in _selector_class(n).own_settings]
                raise LocksConfigError(
                    f"{name}={getattr(self, name)!r} is a setting of selector {' / '.join(map(repr, owners))} only; "
                    f"selector {self.selector!r} would ignore it: leave {name} unset (None) or choose "
                    f"selector={owners[0]!r}"
                )

    @property
    def page_slots(self) -> int:
        """``k = ceil(b / B)``: pages attended per (layer, KV head), sink and recent included."""
        return math.ceil(self.budget / self.page_size)

    @property
    def summary_layout(self) -> tuple:
        """What the per-page summaries depend on (the selector's declared `summary_fields`): configs with
        equal layouts (e.g. differing only in budget or group rule) share the same summaries."""
        from .selectors.registry import summary_layout

        return summary_layout(self)

    @property
    def label(self) -> str:
        """Short name of the arm, e.g. ``locks-r8i4-b128`` or ``quest-b128`` (``full``: no budget)."""
        from .selectors.labels import family_of

        family = family_of(self)
        return family if _selector_class(self.selector).dense else f"{family}-b{self.budget}"

    @classmethod
    def from_label(cls, label: str, **overrides) -> LocksConfig:
        """The config of an arm label: a Locks summary label ``r8i4`` / ``r4i2`` / ``r8bf16`` (optionally
        prefixed ``locks-``), any selector's family label (``quest``, ``locks-r4i4-rr4``, ``rkv``), each
        optionally with a budget suffix (``quest-b64``: `label`'s inverse)."""
        if not isinstance(label, str):
            raise LocksConfigError(f"a summary label is a str such as 'r8i4', got {label!r}")
        from .selectors.labels import family_help, parse_family

        family, fields = label, {}
        suffix = _BUDGET_SUFFIX.match(label)
        if suffix is not None:
            family, fields = suffix["family"], {"budget": int(suffix["budget"])}
        try:
            selector, family_fields = parse_family(family)
        except ValueError:
            raise LocksConfigError(
                f"cannot parse label {label!r}: expected a summary label r<rank>i<bits> (e.g. r8i4) or r<rank>bf16, "
                f"or an arm label ({family_help()}), optionally ending in -b<budget>"
            ) from None
        return cls(selector=selector.name, **{**family_fields, **fields, **overrides})

    def replace(self, **changes) -> LocksConfig:
        """A copy with some fields changed (validated again)."""
        names = [f.name for f in dataclass_fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise LocksConfigError(f"unknown LocksConfig field(s) {unknown}; fields: {names}")
        return replace(self, **changes)


def _selector_class(name: str):
    # Imported here: the registry imports every selector module, which a config need not load to exist.
    from .selectors.registry import selector_class

    return selector_class(name)


def config_for_family(family: str, budget: int = 128, page_size: int = 16, **extra) -> LocksConfig:
    """The `LocksConfig` of an arm family at ``budget`` (a dense family ignores the budget)."""
    from .selectors.labels import parse_family

    cls, fields = parse_family(family)
    if cls.dense:
        budget = max(budget, 2 * page_size)
    return LocksConfig(selector=cls.name, page_size=page_size, budget=budget, **fields, **extra)
