"""`LocksConfig`: every knob of the method, validated once, with labels such as ``r8i4``."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, fields as dataclass_fields, replace

from .kv_quant import validate_kv

GROUP_COMBINES = ("share_average", "group_max", "group_mass")
BASIS_BITS = (2, 4, 8, 16)  # 16 = unquantized (stored in the K/V dtype)
VALUE_BITS = (8, 16)  # for coefficients and centroids
#: Largest page: selection at a coarser grain than this reads most of a 128K context anyway.
MAX_PAGE_SIZE = 1024
_INT_FIELDS = ("page_size", "rank", "basis_bits", "coef_bits", "centroid_bits", "budget", "min_context",
               "rerank", "kv_bits", "kv_group", "kv_residual")



class LocksConfigError(ValueError):
    """A `LocksConfig` field has a value the method cannot run with."""


class BudgetDoesNotFit(LocksConfigError):
    """The method's fixed token blocks do not fit in the budget (e.g. ShadowKV below 424 tokens):
    a sweep reports such an arm as not run."""


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
            ``rerank * k`` candidate pages.
        kv_bits: KIVI quantization of the cached K/V (`locks_hf.kv_quant`): 4 or 2 bits, or 16 (default:
            the K/V dtype). Dynamic layout (the reference path) only, so far.
        kv_group: KIVI group: tokens per key scale (per channel), channels per value scale (per token).
        kv_residual: most recent tokens kept in full precision (KIVI's residual; a multiple of
            ``kv_group`` and of ``page_size``).
        summary_from: ``"post"`` builds each page's summary from the full-precision keys before they
            are quantized, ``"pre"`` from the dequantized keys (the paper's §5.4); both attend the
            quantized K/V.
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
    rerank: int = 8
    kv_bits: int = 16
    kv_group: int = 32
    kv_residual: int = 128
    summary_from: str = "post"

    def __post_init__(self) -> None:
        for name in _INT_FIELDS:  # 4.0 or True would pass the range checks and fail deep in a kernel
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise LocksConfigError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
            object.__setattr__(self, name, int(value))  # numpy ints become plain ints
        for name in ("selector", "group_combine", "summary_from"):
            if not isinstance(getattr(self, name), str):
                raise LocksConfigError(f"{name} must be a str, got {getattr(self, name)!r}")
        B = self.page_size
        if B < 2 or B > MAX_PAGE_SIZE or B & (B - 1):
            raise LocksConfigError(f"page_size must be a power of two in 2..{MAX_PAGE_SIZE} (e.g. 16), got {B!r}")
        selector = _selector_class(self.selector)  # LocksConfigError naming the registered selectors
        if self.group_combine not in GROUP_COMBINES:
            raise LocksConfigError(
                f"group_combine must be one of {GROUP_COMBINES}, got {self.group_combine!r}"
            )
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
            if self.selector != "lazy_eviction":
                raise LocksConfigError(f"lazy_alpha is LazyEviction's threshold; selector {self.selector!r} has none")
            object.__setattr__(self, "lazy_alpha", float(self.lazy_alpha))
        if self.rerank < 1:
            raise LocksConfigError(f"rerank (candidate pages per page slot) must be a positive int, e.g. 4, "
                                   f"got {self.rerank!r}")
        validate_kv(self)
        selector.validate(self)  # last: selector-specific checks see validated generic fields

    @property
    def page_slots(self) -> int:
        """``k = ceil(b / B)``: pages attended per (layer, KV head), sink and recent included."""
        return math.ceil(self.budget / self.page_size)

    @property
    def summary_layout(self) -> tuple:
        """What the per-page summaries depend on (the selector's declared `summary_fields`): configs with
        equal layouts (e.g. differing only in budget or group rule) share the same summaries."""
        from .selectors import summary_layout

        return summary_layout(self)

    @property
    def label(self) -> str:
        """Short name of the arm, e.g. ``locks-r8i4-b128`` or ``quest-b128`` (``full``: no budget)."""
        from .selectors import family_of

        family = family_of(self)
        return family if _selector_class(self.selector).dense else f"{family}-b{self.budget}"

    @classmethod
    def from_label(cls, label: str, **overrides) -> LocksConfig:
        """Parse ``r8i4`` / ``r4i2`` / ``r8bf16`` (optionally prefixed ``locks-``) into a Locks config."""
        if not isinstance(label, str):
            raise LocksConfigError(f"a summary label is a str such as 'r8i4', got {label!r}")
        fields = _selector_class("locks").parse_family(label)
        if fields is None:
            raise LocksConfigError(
                f"cannot parse summary label {label!r}: expected r<rank>i<bits> (e.g. r8i4) or r<rank>bf16"
            )
        return cls(**fields, **overrides)

    def replace(self, **changes) -> LocksConfig:
        """A copy with some fields changed (validated again)."""
        names = [f.name for f in dataclass_fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise LocksConfigError(f"unknown LocksConfig field(s) {unknown}; fields: {names}")
        return replace(self, **changes)


def _selector_class(name: str):
    # Imported here: the selectors' modules may import this one.
    from .selectors import selector_class

    return selector_class(name)


def __getattr__(name: str):
    if name == "SELECTORS":  # the registered selector names (a tuple here before the registry)
        from .selectors import selector_names

        return selector_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
