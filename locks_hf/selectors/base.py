"""`PageSelector`: the interface of a page selector, and the capabilities it declares.

A selector sees one layer's paged cache at a decode step:

* ``keys``   ``[b, h, P, B, d]`` cached post-RoPE keys, split into pages (the last may be partial),
  given only to selectors that set ``reads_keys`` (the oracle); ``None`` for the others;
* ``valid``  ``[b, 1, P, B]`` which slots hold real tokens (False for padding and unwritten slots);
* ``summary`` its own per-page tensors ``[b, h, P, ...]`` built by `summarize` (complete pages only);
* ``query``  ``[b, h, G, d]`` the step's query heads grouped by KV head.

`page_scores` returns ``[b, h, G, P]`` per query head; `selection.select_pages` turns them into the
page set of the paper's §2 and §4: sink and most recent page forced, the best ``k - 2`` remaining complete
pages added.

What a selector can do is declared on its class (read by `LocksConfig` validation, the static
cache, the kernel dispatch in `locks_hf.backends`, the sweep's arm labels and the reports), so a new
selector is one module that subclasses `PageSelector`, listed in `registry.BUILTIN`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:
    from ..config import LocksConfig


class SelectionMethod:
    """What every registered method declares (page selectors and token-level policies alike): read by
    `LocksConfig` validation, the caches, the kernel dispatch, the sweep's arm labels and the reports."""

    #: The `LocksConfig.selector` value (set by each registered class).
    name: ClassVar[str]
    #: Each query head picks its own pages and the group attends their union (Quest's GQA port).
    per_head: ClassVar[bool] = False
    #: Scoring reads every cached key (the exact oracle) rather than summaries only.
    reads_keys: ClassVar[bool] = False
    #: Selection reads the keys of a short list of candidate pages (exact re-ranking): `choose_pages`
    #: is given the keys, and the step's traffic counts `candidate_key_pages` pages of them.
    reads_candidate_keys: ClassVar[bool] = False
    #: Usable by `LocksStaticCache`: per-page state only, no state fitted on the whole sequence.
    static_cache: ClassVar[bool] = True
    #: The scoring kernel's mode for this selector's page scan (``locks_hf.kernels.score_pages``:
    #: ``"locks"``, ``"quest"``, ``"oracle"``; ``"full"`` for dense decode), or ``None``: reference path
    #: only. The kernels read it with `per_head` and, for `reads_candidate_keys`, ``LocksConfig.rerank``.
    kernel_method: ClassVar[str | None] = None
    #: `LocksConfig` fields (besides ``page_size``) that define the summary layout: a cache fork
    #: rebuilds its summaries when one of them changes.
    summary_fields: ClassVar[tuple[str, ...]] = ()
    #: The selector whose summaries this one keeps (``None``: its own): equal layouts are shared by forks,
    #: and the kernels build them as that selector's.
    summary_of: ClassVar[str | None] = None
    #: The selector has a rank ``r`` (``LocksConfig.rank``), which must fit the model's head_dim.
    uses_rank: ClassVar[bool] = False
    #: Dense attention, no selection (``"full"``): `make_selector` gives ``None`` and arms take no budget.
    dense: ClassVar[bool] = False
    #: Position of the family in reports (smaller first).
    report_order: ClassVar[int] = 100
    #: The arm label grammar in words, for error messages and ``--help``.
    family_grammar: ClassVar[str] = ""
    #: The selector-specific `LocksConfig` fields this method reads (``config.SELECTOR_SETTINGS``), with
    #: the value an unset (``None``) one takes; such a field set on any other selector is refused.
    own_settings: ClassVar[dict[str, object]] = {}
    #: Chooses single tokens through a keep mask (`locks_hf.token_policy.TokenPolicy`) instead of pages.
    token_level: ClassVar[bool] = False

    def __init__(self, config: LocksConfig) -> None:
        self.config = config

    # -- declarations -----------------------------------------------------------------------------
    @classmethod
    def validate(cls, config: LocksConfig, head_dim: int | None = None) -> None:
        """Selector-specific checks of ``config`` (and of the model's ``head_dim`` once known);
        raise `LocksConfigError` with what to change."""
        if head_dim is not None and cls.uses_rank and config.rank > head_dim:
            from ..errors import LocksConfigError

            raise LocksConfigError(
                f"rank={config.rank} exceeds the model's head_dim={head_dim}; choose rank <= {head_dim}"
            )

    @classmethod
    def parse_family(cls, family: str) -> dict | None:
        """`LocksConfig` fields for an arm family label of this selector (``None``: not this selector's).
        The default grammar is the bare name (``"oracle"``)."""
        return {} if family == cls.name else None

    @classmethod
    def family(cls, config: LocksConfig) -> str:
        """The arm family label of ``config`` (its label without the budget); `parse_family`'s inverse."""
        return cls.name

    @classmethod
    def family_sort_key(cls, fields: dict) -> tuple:
        """Order of this selector's families in reports (larger summaries first)."""
        return (-fields.get("rank", 0), -fields.get("basis_bits", 0))

    def candidate_key_pages(self, pages: int) -> int:
        """Pages whose keys a decode step reads to choose its pages, besides those it attends, with
        ``pages`` complete pages cached (per row and KV head; the oracle's whole-cache read is counted
        apart, through `reads_keys`)."""
        return 0


class PageSelector(SelectionMethod, ABC):
    """Base class: a new selector is a `summarize` (optional) and a `page_scores`, plus its declarations."""

    def fit_sequence(self, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
        """Sequence-level state ``[b, h, ...]`` fitted once on the prompt's pages, then frozen.

        ``keys [b, h, n, B, d]``, ``valid [b, h, n, B]``. Only the shared-basis controls use it.
        """
        return {}

    def summarize(
        self, keys: torch.Tensor, valid: torch.Tensor, shared: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Per-page state from ``keys [b, h, n, B, d]`` and ``valid [b, h, n, B]`` (complete pages),
        given the sequence-level state ``shared`` from `fit_sequence`."""
        return {}

    @abstractmethod
    def page_scores(
        self,
        summary: dict[str, torch.Tensor],
        keys: torch.Tensor | None,
        valid: torch.Tensor,
        query: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Scores ``[b, h, G, P]``; larger means the page should be kept. ``summary`` holds the
        per-page tensors and the sequence-level ones of `fit_sequence`."""

    def choose_pages(
        self,
        summary: dict[str, torch.Tensor],
        keys: torch.Tensor | None,
        valid: torch.Tensor,
        query: torch.Tensor,
        scale: float,
        page_complete: torch.Tensor,
        config: LocksConfig,
    ) -> torch.Tensor:
        """The page set ``[b, h, P]`` of a decode step: `page_scores`, then the shared rule
        (`selection.select_pages`: sink + most recent + best ``k - 2``). ``keys`` as for `page_scores`
        (also given to selectors that set `reads_candidate_keys`); ``page_complete [b, P]``; ``config``
        the layer's settings now (its budget may have moved since the selector was made:
        `LocksCache.set_budget`)."""
        from .selection import select_pages

        scores = self.all_page_scores(summary, keys, valid, query, scale)
        return select_pages(
            scores, valid[:, 0].any(-1), page_complete, config.page_slots, config.group_combine, self.per_head
        )

    def all_page_scores(
        self,
        summary: dict[str, torch.Tensor],
        keys: torch.Tensor | None,
        valid: torch.Tensor,
        query: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """`page_scores` over every page of ``valid [b, 1, P, B]``: ``-inf`` for pages past the
        summarized ones."""
        scores = self.page_scores(summary, keys, valid, query, scale)
        return torch.nn.functional.pad(scores, (0, valid.shape[2] - scores.shape[-1]), value=float("-inf"))
