"""``"full"``: dense attention, no selection (registered so that configs, arms and reports know it)."""

from __future__ import annotations

from .base import PageSelector


class FullAttention(PageSelector):
    """Dense decode: `make_selector` returns ``None`` for it, so it is never instantiated to score."""

    name = "full"
    dense = True
    kernel_method = "full"  # the static cache's dense flash-decoding over every written page
    report_order = 0

    def page_scores(self, summary, keys, valid, query, scale):
        raise TypeError("the 'full' selector attends every page: it has no page scores")
