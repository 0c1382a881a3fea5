"""The kernel path of a Locks decode step: score -> select -> attend on explicit tensors.

`decode_step` chains the three kernels; `implements` says which configurations they cover. The
glue that reads a cache layer and calls these through their custom ops (`ops`) is on the library
side, in `locks_hf.backends.triton`.
"""

from __future__ import annotations

import torch

from ._common import as_length, compiling_only
from .attend import sparse_attention
from .attend_quant import quantized_attention
from .page_update import update_completed_pages
from .rerank import rerank_pages
from .score import SUMMARY_NAMES, score_pages, scores
from .select import mark_lists, mask_fits, select_pages

__all__ = ["SUMMARY_NAMES", "choose_pages", "decode_step", "implements", "quantized_decode_step"]

#: Page sizes: the attention tiles need >= 4 tokens, the Jacobi eigensolver a power of two <= 32.
_PAGE_SIZES = (4, 8, 16, 32)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_step(
    method: str,
    query: torch.Tensor,
    *,
    key_buf: torch.Tensor,
    value_buf: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    n_complete: torch.Tensor,
    length: int | torch.Tensor,
    n_pages: int,
    slots: int,
    scale: float,
    page_size: int,
    summary: dict[str, torch.Tensor] | None = None,
    basis_bits: int = 4,
    counts: torch.Tensor | None = None,
    active_slots: torch.Tensor | None = None,
    row_counts: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    per_head: bool = False,
    rerank: int = 0,
    update_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse decode step on explicit tensors: ``(output [b, 1, Hq, d], pages [b*h, W])``.

    ``method`` is the scoring mode of `score_pages` (``"locks"``, ``"quest"``, ``"oracle"``: what the
    selector declares; see `score_pages` for the inputs), or ``"full"``: dense attention over every
    written page (no scoring, no selection; ``W = 0``). ``per_head``: each query head selects its own
    pages and the group attends their union (Quest's GQA port), else the group's scores are combined.
    ``rerank`` > 0: the scores shortlist ``rerank * k`` candidates, their exact page LSE picks (see
    `rerank.rerank_pages`). ``counts`` (int64, optional): ``counts[0]`` grows by the real tokens attended.
    ``active_slots`` (``int32 [1]``, optional): the page slots ``k <= slots`` to select, read on the
    device (``slots`` then only sizes the page lists).

    The rest lets a static cache's layer keep its bookkeeping in the step: ``row_counts`` (int64
    ``[b, 2]``) and ``pad`` (int32 ``[b]``): the per-row statistics (see `sparse_attention`; ``counts``
    needed); ``selection`` (bool ``[b, h, P]``): overwritten with the pages attended (not for
    ``"full"``); ``tickets``: the selection's counters, zeros that its launch leaves zero (see
    `select.select_pages`; ``None``: a new zeroed buffer). ``update_rank`` > 0: the step also writes the
    summary of each row's page that the newest token completed, and ``n_complete``, as a static layer's
    per-step page update at that rank (`summarize_newest_page`), launched first.
    """
    length = as_length(length, query.device)  # one device tensor for the three kernels
    summarize_newest_page(
        method,
        update_rank,
        key_buf,
        slot_valid=slot_valid,
        row_start=row_start,
        length=length,
        summary=summary,
        page_size=page_size,
        basis_bits=basis_bits,
        n_complete=n_complete,
    )
    pages = choose_pages(
        method,
        query,
        heads=key_buf.shape[1],
        keys=key_buf,
        slot_valid=slot_valid,
        row_start=row_start,
        n_complete=n_complete,
        length=length,
        n_pages=n_pages,
        slots=slots,
        scale=scale,
        page_size=page_size,
        summary=summary,
        basis_bits=basis_bits,
        active_slots=active_slots,
        selection=selection,
        tickets=tickets,
        per_head=per_head,
        rerank=rerank,
    )
    out = sparse_attention(
        query,
        key_buf,
        value_buf,
        pages,
        n_pages=n_pages,
        slot_valid=slot_valid,
        row_start=row_start,
        length=length,
        scale=scale,
        page_size=page_size,
        counts=counts,
        row_counts=row_counts,
        pad=pad,
    )
    return out, _listed(pages, query.shape[0] * key_buf.shape[1], row_start)


def summarize_newest_page(
    method: str,
    rank: int,
    keys: torch.Tensor,
    *,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    summary: dict[str, torch.Tensor] | None,
    page_size: int,
    basis_bits: int,
    n_complete: torch.Tensor,
    ring: int = 0,
) -> None:
    """A static layer's per-step page update inside its decode step: `page_update.update_completed_pages` at
    ``rank`` (the summary of each row's page that the newest token completed, and ``n_complete``); nothing
    for ``rank`` 0 or a method that keeps no summary.

    Its place among the step's launches does not change the step: the page the newest token completes is
    that step's most recent page, which the step attends unconditionally and the scoring never takes as a
    candidate (nor as a block's first page, which the selection might); and ``n_complete`` read before or
    after the update leaves every other page as it was (the scoring caps it at the pages complete at the
    current length). So the pages chosen are the same whether the update lands before the scoring or after
    the attention (`tests/test_page_update.py` checks both), and the summary is first read as a candidate's
    at the next step."""
    names = SUMMARY_NAMES.get(method, ())
    if rank <= 0 or not names:
        return
    if summary is None:
        raise ValueError(f"decode_step({method!r}): update_rank={rank} needs the summary it writes")
    update_completed_pages(
        method,
        keys,
        slot_valid,
        row_start,
        length,
        [summary[n] for n in names],
        page_size=page_size,
        rank=rank,
        basis_bits=basis_bits,
        n_complete=n_complete,
        ring=ring,
    )


def quantized_decode_step(
    method: str,
    query: torch.Tensor,
    packed: dict,
    *,
    n_complete: torch.Tensor,
    n_pages: int,
    slots: int,
    scale: float,
    summary: dict[str, torch.Tensor] | None = None,
    basis_bits: int = 4,
    counts: torch.Tensor | None = None,
    active_slots: torch.Tensor | None = None,
    row_counts: torch.Tensor | None = None,
    pad: torch.Tensor | None = None,
    selection: torch.Tensor | None = None,
    tickets: torch.Tensor | None = None,
    per_head: bool = False,
    update_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_step` over KIVI-packed K/V: the pages chosen from the summaries as there (``"locks"`` /
    ``"quest"``: scoring reads no key), attended by `attend_quant.quantized_attention`. ``packed`` holds
    that function's storage arguments (codes, scales, zero points, tails, ``quantized``, ``bits``,
    ``group``, ``ring``, ``slot_valid``, ``row_start``, ``length``, ``page_size``). ``update_rank`` as
    there, the page's keys read from the full-precision tail (``key_tail``, a ring of ``ring`` slots)."""
    if method == "oracle":
        raise ValueError("quantized_decode_step: the oracle reads every key; it selects on the reference path")
    length = as_length(packed["length"], query.device)
    packed = {**packed, "length": length}
    heads = packed["key_codes"].shape[1]
    summarize_newest_page(
        method,
        update_rank,
        packed["key_tail"],
        slot_valid=packed["slot_valid"],
        row_start=packed["row_start"],
        length=length,
        summary=summary,
        page_size=packed["page_size"],
        basis_bits=basis_bits,
        n_complete=n_complete,
        ring=packed.get("ring", 0),
    )
    pages = choose_pages(
        method,
        query,
        heads=heads,
        keys=None,
        slot_valid=packed["slot_valid"],
        row_start=packed["row_start"],
        n_complete=n_complete,
        length=length,
        n_pages=n_pages,
        slots=slots,
        scale=scale,
        page_size=packed["page_size"],
        summary=summary,
        basis_bits=basis_bits,
        active_slots=active_slots,
        selection=selection,
        tickets=tickets,
        per_head=per_head,
    )
    out = quantized_attention(
        query, pages, n_pages=n_pages, counts=counts, row_counts=row_counts, pad=pad, scale=scale, **packed
    )
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    return out.reshape(b, 1, hq, d), _listed(pages, b * heads, packed["row_start"])


def choose_pages(
    method: str,
    query: torch.Tensor,
    *,
    heads: int,
    keys: torch.Tensor | None,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    n_complete: torch.Tensor,
    length: torch.Tensor,
    n_pages: int,
    slots: int,
    scale: float,
    page_size: int,
    summary: dict[str, torch.Tensor] | None,
    basis_bits: int,
    active_slots: torch.Tensor | None,
    selection: torch.Tensor | None,
    per_head: bool,
    rerank: int = 0,
    tickets: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Steps 1-2 of a decode step: the page lists ``[b*h, W]`` (``None`` for ``"full"``: every page),
    marked in ``selection`` when given. ``keys`` (the key buffer) for the oracle and re-ranking."""
    if rerank < 0:
        raise ValueError(f"decode_step: rerank (candidates per page slot) must be >= 0, got {rerank}")
    if method == "full":
        return None
    page_scores, partials = score_pages(
        method,
        query,
        slot_valid=slot_valid,
        row_start=row_start,
        n_complete=n_complete,
        length=length,
        n_pages=n_pages,
        scale=scale,
        page_size=page_size,
        summary=summary,
        keys=keys,
        basis_bits=basis_bits,
    )
    where = dict(row_start=row_start, length=length, page_size=page_size)
    if rerank:
        # the short list: rerank * k candidates (+ the forced pages), at the budget in use
        wide = None if active_slots is None else active_slots * rerank + 2
        shortlist = select_pages(
            page_scores,
            partials,
            slots=rerank * slots + 2,
            per_head=False,
            heads=heads,
            active_slots=wide,
            tickets=tickets,
            **where,
        )
        pages = rerank_pages(
            query,
            keys,
            shortlist,
            page_scores,
            partials,
            slot_valid=slot_valid,
            scale=scale,
            slots=slots,
            active_slots=active_slots,
            **where,
        )
        if selection is not None:  # the selection keeps no mask of its own
            _mark_attended(selection.view(pages.shape[0], -1), pages)
    else:
        # the launch that writes the lists marks them in the mask too, where it is laid out as the lists
        rows, P = page_scores.shape[0], page_scores.shape[-1]
        marks = selection.view(rows, -1) if selection is not None else None
        fused = marks is not None and mask_fits(marks, rows, P)
        pages = select_pages(
            page_scores,
            partials,
            slots=slots,
            per_head=per_head,
            heads=heads,
            active_slots=active_slots,
            mask=marks if fused else None,
            tickets=tickets,
            **where,
        )
        if marks is not None and not fused:
            _mark_attended(marks, pages)
    return pages


def _listed(pages: torch.Tensor | None, rows: int, like: torch.Tensor) -> torch.Tensor:
    """The step's page lists, or an empty ``[rows, 0]`` for a dense step."""
    return like.new_empty((rows, 0)) if pages is None else pages


def _mark_attended(mask: torch.Tensor, pages: torch.Tensor) -> None:
    """Overwrite ``mask [rows, P]`` with the pages of the lists ``pages [rows, W]`` (``SENTINEL`` < 0
    skipped): one launch (`select.mark_lists`), not a memset, scatter and copy through a scratch mask."""
    if mask.is_contiguous() and pages.is_contiguous() and pages.dtype == torch.int32:
        mark_lists(mask, pages)
        return
    if compiling_only():  # no kernel here, and the mask must stay as it is
        return
    n = mask.shape[1]
    hit = torch.zeros((mask.shape[0], n + 1), dtype=torch.bool, device=mask.device)
    hit.scatter_(1, torch.where(pages >= 0, pages, n).long(), True)
    mask.copy_(hit[:, :n])


def implements(
    method: str,
    *,
    dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    per_head: bool = False,
    group_combine: str = "share_average",
    basis_bits: int = 4,
    coef_bits: int = 8,
    centroid_bits: int = 8,
) -> bool:
    """Whether the kernels run scoring mode ``method`` (``"locks"``, ``"quest"``, ``"oracle"``, or
    ``"full"`` for dense decode) for keys of ``dtype`` and ``head_dim`` in pages of ``page_size`` tokens.

    A shared selection (``per_head`` False) combines a GQA group's scores with ``share_average``; the
    scoring kernel says which summaries it reads (`score.scores`).
    """
    if method != "full" and not scores(
        method, head_dim=head_dim, basis_bits=basis_bits, coef_bits=coef_bits, centroid_bits=centroid_bits
    ):
        return False
    if not per_head and group_combine != "share_average":
        return False
    d = head_dim
    return dtype in _DTYPES and not (d & (d - 1)) and d >= 16 and page_size in _PAGE_SIZES
