"""The traffic model: what a decode step reads from the cache, written once.

A step reads the K/V of the tokens it attends, plus what choosing them read: for a page selector the
summaries of the pages it scores (with any sequence-level state) and the keys of a re-ranked short
list, or every written key for the oracle. `LocksCache.decode_traffic`, the sweep engine's estimate
for a row run alone and the decode-step benchmark all count bytes with these functions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .selectors.base import SelectionMethod


@dataclass(frozen=True)
class SelectionReads:
    """What one decode step reads to choose its pages, per row and KV head."""

    #: The scored pages' summaries (and the sequence-level state) are read.
    summaries: bool
    #: Keys read besides those of the attended pages.
    key_tokens: int
    #: ``key_tokens`` is every written key (the oracle).
    every_key: bool


NOTHING = SelectionReads(summaries=False, key_tokens=0, every_key=False)


def selection_reads(
    selector: SelectionMethod | None, complete_pages: int, written_tokens: int, page_size: int
) -> SelectionReads:
    """The reads of a page selector's step with ``complete_pages`` pages summarized and
    ``written_tokens`` keys cached (``None``, a dense step: nothing)."""
    if selector is None:
        return NOTHING
    if selector.reads_keys:
        return SelectionReads(summaries=False, key_tokens=written_tokens, every_key=True)
    return SelectionReads(
        summaries=True, key_tokens=selector.candidate_key_pages(complete_pages) * page_size, every_key=False
    )


def selection_read_bytes(reads: SelectionReads, summary_bytes: float, key_bytes: float) -> float:
    """Bytes of ``reads`` with the scored summaries of ``summary_bytes`` and ``key_bytes`` per key."""
    return (summary_bytes if reads.summaries else 0) + reads.key_tokens * key_bytes


def attended_kv_bytes(tokens: float, key_bytes: float, value_bytes: float) -> float:
    """Bytes of the K/V of ``tokens`` attended tokens."""
    return tokens * (key_bytes + value_bytes)
