"""The kernel path of a Locks decode step: score -> select -> attend on explicit tensors.

`decode_step` chains the three kernels; `implements` says which configurations they cover. The
glue that reads a cache layer and calls these through their custom ops (`ops`) is on the library
side, in `locks_hf.backend`.
"""

from __future__ import annotations

import torch

from ._common import SCAN_METHOD, SUMMARY_NAMES, as_length
from .attend import sparse_attention
from .rerank import rerank_pages
from .score import score_pages
from .select import STATE_WIDTH, mark_lists, select_pages

__all__ = ["SUMMARY_NAMES", "decode_step", "implements", "workspace_size"]


def workspace_size(rows: int) -> int:
    """int32 entries of `decode_step`'s ``workspace`` for ``rows = b*h``: the radix selection's state
    (shared rule) and the attention's merge counters."""
    return rows * (STATE_WIDTH + 1)

#: Basis bits the Locks scoring kernels unpack (coefficients and centroids are int8).
_QUANTIZED = (2, 4, 8)
#: Page sizes: the attention tiles need >= 4 tokens, the Jacobi eigensolver a power of two <= 32.
_PAGE_SIZES = (4, 8, 16, 32)
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def decode_step(method: str, query: torch.Tensor, *, key_buf: torch.Tensor, value_buf: torch.Tensor,
                slot_valid: torch.Tensor, row_start: torch.Tensor, n_complete: torch.Tensor, length: int | torch.Tensor,
                n_pages: int, slots: int, scale: float, page_size: int,
                summary: dict[str, torch.Tensor] | None = None, basis_bits: int = 4,
                counts: torch.Tensor | None = None, active_slots: torch.Tensor | None = None,
                workspace: torch.Tensor | None = None, row_counts: torch.Tensor | None = None,
                pad: torch.Tensor | None = None, selection: torch.Tensor | None = None,
                rerank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse decode step on explicit tensors: ``(output [b, 1, Hq, d], pages [b*h, W])``.

    ``method`` is ``"locks"``, ``"quest"`` or ``"oracle"`` (see `score_pages` for the inputs),
    ``"locks_rerank"`` (Locks scores shortlist ``rerank * k`` candidates, their exact page LSE picks;
    see `rerank.rerank_pages`), or ``"full"``: dense attention over every written page (no scoring, no selection;
    ``W = 0``). ``counts`` (int64, optional): ``counts[0]`` grows by the real tokens attended.
    ``active_slots`` (``int32 [1]``, optional): the page slots ``k <= slots`` to select, read on the
    device (``slots`` then only sizes the page lists).

    The rest lets a static cache's layer keep its bookkeeping in the step: ``workspace`` (int32,
    zeros, `workspace_size` entries; the kernels leave it zero) holds the radix selection's state and
    the fused merge's counters where those run (`select.select_pages`, `attend.sparse_attention`:
    neither is the default); ``row_counts`` (int64
    ``[b, 2]``) and ``pad`` (int32 ``[b]``): the per-row statistics (see `sparse_attention`; ``counts``
    needed); ``selection`` (bool ``[b, h, P]``): overwritten with the pages attended (not for
    ``"full"``).
    """
    length = as_length(length, query.device)  # one device tensor for the three kernels
    b, h = query.shape[0], key_buf.shape[1]
    rows = b * h
    state = semaphore = None
    if workspace is not None:
        if workspace.dtype != torch.int32 or workspace.numel() < workspace_size(rows) or not workspace.is_contiguous():
            raise ValueError(f"decode_step: workspace must be a contiguous int32 tensor of >= {workspace_size(rows)} "
                             f"entries (workspace_size), got {workspace.dtype} {tuple(workspace.shape)}")
        flat = workspace.view(-1)
        state = flat[: rows * STATE_WIDTH].view(rows, STATE_WIDTH) if method != "quest" else None
        semaphore = flat[rows * STATE_WIDTH: rows * (STATE_WIDTH + 1)]
    stats = dict(counts=counts, row_counts=row_counts, pad=pad, semaphore=semaphore)
    if method == "full":
        out = sparse_attention(query, key_buf, value_buf, None, n_pages=n_pages, slot_valid=slot_valid,
                               row_start=row_start, length=length, scale=scale, page_size=page_size, **stats)
        return out, row_start.new_empty((rows, 0))
    scan = SCAN_METHOD.get(method, method)
    scores, partials = score_pages(scan, query, slot_valid=slot_valid, row_start=row_start,
                                   n_complete=n_complete, length=length, n_pages=n_pages, scale=scale,
                                   page_size=page_size, summary=summary, keys=key_buf, basis_bits=basis_bits)
    where = dict(row_start=row_start, length=length, page_size=page_size)
    if method == "locks_rerank":
        if rerank < 1:
            raise ValueError(f"decode_step('locks_rerank'): rerank (candidates per page slot) must be >= 1, got {rerank}")
        # the short list: rerank * k candidates (+ the forced pages), at the budget in use
        wide = None if active_slots is None else active_slots * rerank + 2
        shortlist = select_pages(scores, partials, slots=rerank * slots + 2, per_head=False, heads=h, state=state,
                                 active_slots=wide, **where)
        pages = rerank_pages(query, key_buf, shortlist, scores, partials, slot_valid=slot_valid, scale=scale,
                             slots=slots, active_slots=active_slots, **where)
    else:
        pages = select_pages(scores, partials, slots=slots, per_head=method == "quest", heads=h, state=state,
                             active_slots=active_slots, **where)
    if selection is not None:  # the chunked selection (the default) keeps no mask of its own
        _mark_attended(selection.view(rows, -1), pages)
    out = sparse_attention(query, key_buf, value_buf, pages, slot_valid=slot_valid, row_start=row_start,
                           length=length, scale=scale, page_size=page_size, **stats)
    return out, pages


def _mark_attended(mask: torch.Tensor, pages: torch.Tensor) -> None:
    """Overwrite ``mask [rows, P]`` with the pages of the lists ``pages [rows, W]`` (``SENTINEL`` < 0
    skipped): one launch (`select.mark_lists`), not a memset, scatter and copy through a scratch mask."""
    if mask.is_contiguous() and pages.is_contiguous() and pages.dtype == torch.int32:
        mark_lists(mask, pages)
        return
    n = mask.shape[1]
    hit = torch.zeros((mask.shape[0], n + 1), dtype=torch.bool, device=mask.device)
    hit.scatter_(1, torch.where(pages >= 0, pages, n).long(), True)
    mask.copy_(hit[:, :n])


def implements(method: str, *, dtype: torch.dtype, head_dim: int, page_size: int,
               group_combine: str = "share_average", basis_bits: int = 4, coef_bits: int = 8,
               centroid_bits: int = 8) -> bool:
    """Whether the kernels run scoring mode ``method`` (``"locks"``, ``"locks_rerank"``, ``"quest"``,
    ``"oracle"``, ``"full"``) for keys of ``dtype`` and ``head_dim`` in pages of ``page_size`` tokens.

    Every mode but Quest (each query head selects its own pages) combines a GQA group's scores with
    ``share_average``; Locks summaries must be int4/int2/int8-packed bases with int8 coefficients
    and centroids.
    """
    if method not in SUMMARY_NAMES:
        return False
    method = SCAN_METHOD.get(method, method)
    if method != "quest" and group_combine != "share_average":
        return False
    if method == "locks" and (basis_bits not in _QUANTIZED or coef_bits != 8 or centroid_bits != 8):
        return False
    if dtype not in _DTYPES:
        return False
    per = 8 // basis_bits if method == "locks" else 1
    d = head_dim
    return not (d & (d - 1)) and d // per >= 16 and page_size in _PAGE_SIZES
