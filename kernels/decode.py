"""The kernel path of a Locks decode step, and the glue that `locks_hf` dispatches CUDA tensors to.

`decode_step` chains the three kernels (score -> select -> attend) on explicit tensors; the
`sparse_decode` / `summarize` functions read a Locks layer's buffers (`LocksLayer` or
`LocksStaticLayer`), call the kernels through their custom ops (`ops`, so `torch.compile` sees one
node each) and keep the layer's bookkeeping (selection, attended-token statistics) identical to the
reference path.
"""

from __future__ import annotations

import contextlib

import torch

from ._common import as_length
from .attend import sparse_attention
from .score import score_pages
from .select import select_pages

_QUANTIZED = (2, 4, 8)

#: Per-page summary tensors each method reads, in the order the custom ops (`ops`) take them.
SUMMARY_NAMES = {"locks": ("basis", "basis_scale", "coef", "coef_scale", "mu", "mu_scale"),
                 "quest": ("upper", "lower"), "oracle": (), "full": ()}


def decode_step(method: str, query: torch.Tensor, *, key_buf: torch.Tensor, value_buf: torch.Tensor,
                slot_valid: torch.Tensor, row_start: torch.Tensor, n_complete: torch.Tensor, length: int | torch.Tensor,
                n_pages: int, slots: int, scale: float, page_size: int,
                summary: dict[str, torch.Tensor] | None = None, basis_bits: int = 4,
                counts: torch.Tensor | None = None,
                active_slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One sparse decode step on explicit tensors: ``(output [b, 1, Hq, d], pages [b*h, W])``.

    ``method`` is ``"locks"``, ``"quest"`` or ``"oracle"`` (see `score_pages` for the inputs), or
    ``"full"``: dense attention over every written page (no scoring, no selection; ``W = 0``).
    ``counts`` (int64, optional): ``counts[0]`` grows by the real tokens attended.
    ``active_slots`` (``int32 [1]``, optional): the page slots ``k <= slots`` to select, read on the
    device (``slots`` then only sizes the page lists).
    """
    length = as_length(length, query.device)  # one device tensor for the three kernels
    h = key_buf.shape[1]
    if method == "full":
        out = sparse_attention(query, key_buf, value_buf, None, n_pages=n_pages, slot_valid=slot_valid,
                               row_start=row_start, length=length, scale=scale, page_size=page_size, counts=counts)
        return out, row_start.new_empty((query.shape[0] * h, 0))
    scores, partials = score_pages(method, query, slot_valid=slot_valid, row_start=row_start,
                                   n_complete=n_complete, length=length, n_pages=n_pages, scale=scale,
                                   page_size=page_size, summary=summary, keys=key_buf, basis_bits=basis_bits)
    pages = select_pages(scores, partials, slots=slots, per_head=method == "quest", row_start=row_start,
                         length=length, heads=h, page_size=page_size, active_slots=active_slots)
    out = sparse_attention(query, key_buf, value_buf, pages, slot_valid=slot_valid, row_start=row_start,
                           length=length, scale=scale, page_size=page_size, counts=counts)
    return out, pages


def _on_device(device: torch.device):
    """Make ``device`` current for the launches (Triton launches on the current CUDA device)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def supports(layer, query: torch.Tensor | None = None) -> bool:
    """Whether the kernels implement this layer's settings (else the reference path runs)."""
    cfg = layer.config
    if cfg.selector not in ("locks", "quest", "oracle", "full"):
        return False
    if cfg.selector != "quest" and cfg.group_combine != "share_average":
        return False
    if cfg.selector == "locks" and (cfg.basis_bits not in _QUANTIZED or cfg.coef_bits != 8 or cfg.centroid_bits != 8):
        return False
    kbuf = layer._kbuf
    if kbuf is None or not kbuf.is_cuda or kbuf.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    d = kbuf.shape[-1]
    per = 8 // cfg.basis_bits if cfg.selector == "locks" else 1
    # page_size: the attention tiles need >= 4 tokens, the Jacobi eigensolver a power of two <= 32
    if d & (d - 1) or d // per < 16 or cfg.page_size not in (4, 8, 16, 32):
        return False
    return query is None or (query.is_cuda and query.dtype == kbuf.dtype)


def sparse_decode(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `locks_hf.attention.sparse_decode`: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``."""
    # Triton launches on the *current* device; with a model split over GPUs (device_map) this layer's
    # tensors may live on another one.
    with _on_device(query.device):
        return _sparse_decode(layer, query, scale)


def _sparse_decode(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    cfg = layer.config
    b = query.shape[0]
    h = layer._kbuf.shape[1]
    row_start, n_complete = layer.row_tensors()
    summary = [layer.summary[n] for n in SUMMARY_NAMES[cfg.selector]]
    width, active = layer.page_slots()
    # the kernels count the tokens they attend into the layer's statistics (no bookkeeping ops here)
    out, pages = torch.ops.locks_hf.decode_step(cfg.selector, query, layer._kbuf, layer._vbuf, layer.slot_valid,
                                                row_start, n_complete, layer.length_tensor(), summary,
                                                layer.num_pages, width, float(scale), cfg.page_size,
                                                cfg.basis_bits, layer.count_buffer(), active)
    if pages.shape[1]:  # "full" selects no list: every page
        layer.note_selection(pages.view(b, h, -1))
    layer.record_step(None, layer.real_tokens() * h)
    return out


def update_newest_page(layer) -> None:
    """Kernel twin of `LocksStaticLayer`'s per-step page summary: one launch that writes the page the
    newest token completed, in place, and does nothing on the other ``B - 1`` steps of a page."""
    cfg = layer.config
    summary = [layer.summary[n] for n in SUMMARY_NAMES[cfg.selector]]
    torch.ops.locks_hf.update_completed_pages(cfg.selector, layer._kbuf, layer.slot_valid, layer.row_start,
                                              layer.length_tensor(), summary, cfg.page_size, cfg.rank, cfg.basis_bits)


def summarize(layer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """GPU summary build for `LocksLayer.summarize_completed`; ``None`` when the reference must run."""
    cfg = layer.config
    if not keys.is_cuda or cfg.selector != "locks" or not supports(layer):
        return None
    with _on_device(keys.device):
        parts = torch.ops.locks_hf.build_summary(keys, valid, cfg.rank, cfg.basis_bits)
    return dict(zip(SUMMARY_NAMES["locks"], parts))
