"""The oracle: exact page LSE from every cached key (an upper reference, not a fast method)."""

from __future__ import annotations

from ..summaries import exact_page_lse
from .base import PageSelector


class OracleSelector(PageSelector):
    """Exact page LSE, reading every key (an upper reference, not a fast method)."""

    name = "oracle"
    reads_keys = True
    kernel_method = "oracle"
    report_order = 10

    def page_scores(self, summary, keys, valid, query, scale):
        return exact_page_lse(keys, valid, query, scale)
