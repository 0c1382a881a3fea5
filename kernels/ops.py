"""The kernels as PyTorch custom ops, so `torch.compile` treats each as one opaque node.

Dynamo cannot see inside a Triton launcher that picks tiles on the host; as custom ops with fake
(shape-only) implementations, a decode step with the kernels traces into one graph and CUDA graphs
capture the launches. Three ops: the decode step (score -> select -> attend), the summary build, and
the in-place summary of the pages a decode step completes (`page_update`).
"""

from __future__ import annotations

import torch

from .build import build_summary, summary_shapes
from .decode import decode_step
from .page_update import update_completed_pages
from .score import SUMMARY_NAMES
from .select import page_list_width


@torch.library.custom_op("locks_hf::decode_step", mutates_args=("counts", "row_counts", "selection"))
def decode_step_op(
    method: str,
    query: torch.Tensor,
    key_buf: torch.Tensor,
    value_buf: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    n_complete: torch.Tensor,
    length: torch.Tensor,
    summary: list[torch.Tensor],
    n_pages: int,
    slots: int,
    scale: float,
    page_size: int,
    basis_bits: int,
    counts: torch.Tensor,
    active_slots: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    pad: torch.Tensor | None,
    selection: torch.Tensor | None,
    per_head: bool,
    rerank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode.decode_step` with the summary passed as the list ``SUMMARY_NAMES[method]``; ``counts[0]``
    (int64) grows by the tokens attended. ``slots`` sizes the page lists; ``active_slots`` (``int32 [1]``
    or ``None`` for ``slots``) is the budget selected with, read on the device. ``row_counts``, ``pad``
    and ``selection``: a static layer's buffers (see `decode.decode_step`); ``per_head`` and ``rerank``
    what the selector declares (per-head lists; the candidate multiple of exact re-ranking, 0 for none).

    The mutated arguments have no defaults on purpose: torch before 2.12 drops trailing arguments equal
    to their default before its in-place version bump, which then indexes past the end of ``args``."""
    named = dict(zip(SUMMARY_NAMES.get(method, ()), summary))
    return decode_step(
        method,
        query,
        key_buf=key_buf,
        value_buf=value_buf,
        slot_valid=slot_valid,
        row_start=row_start,
        n_complete=n_complete,
        length=length,
        n_pages=n_pages,
        slots=slots,
        scale=scale,
        page_size=page_size,
        summary=named,
        basis_bits=basis_bits,
        counts=counts,
        active_slots=active_slots,
        row_counts=row_counts,
        pad=pad,
        selection=selection,
        per_head=per_head,
        rerank=rerank,
    )


@decode_step_op.register_fake
def _(
    method,
    query,
    key_buf,
    value_buf,
    slot_valid,
    row_start,
    n_complete,
    length,
    summary,
    n_pages,
    slots,
    scale,
    page_size,
    basis_bits,
    counts,
    active_slots,
    row_counts,
    pad,
    selection,
    per_head,
    rerank=0,
):
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    h = key_buf.shape[1]
    width = 0 if method == "full" else page_list_width(per_head, slots, hq // h)
    return query.new_empty((b, 1, hq, d)), query.new_empty((b * h, width), dtype=torch.int32)


@torch.library.custom_op("locks_hf::build_summary", mutates_args=())
def build_summary_op(keys: torch.Tensor, valid: torch.Tensor, rank: int, basis_bits: int) -> list[torch.Tensor]:
    """`build.build_summary` as a list in the order ``SUMMARY_NAMES["locks"]``."""
    out = build_summary(keys, valid, rank, basis_bits)
    return [out[n] for n in SUMMARY_NAMES["locks"]]


@build_summary_op.register_fake
def _(keys, valid, rank, basis_bits):
    shapes = summary_shapes(keys.shape[:-2], keys.shape[-2], keys.shape[-1], rank, basis_bits)
    return [keys.new_empty(shape, dtype=dtype) for shape, dtype in (shapes[n] for n in SUMMARY_NAMES["locks"])]


@torch.library.custom_op("locks_hf::update_completed_pages", mutates_args=("summary", "n_complete"))
def update_completed_pages_op(
    method: str,
    key_buf: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    summary: list[torch.Tensor],
    page_size: int,
    rank: int,
    basis_bits: int,
    n_complete: torch.Tensor | None,
) -> None:
    """`page_update.update_completed_pages`: the summary (``SUMMARY_NAMES[method]``) written in place,
    and ``n_complete`` unless it is ``None`` (required, for the reason `decode_step_op` gives)."""
    update_completed_pages(
        method,
        key_buf,
        slot_valid,
        row_start,
        length,
        summary,
        page_size=page_size,
        rank=rank,
        basis_bits=basis_bits,
        n_complete=n_complete,
    )


@update_completed_pages_op.register_fake
def _(method, key_buf, slot_valid, row_start, length, summary, page_size, rank, basis_bits, n_complete):
    return None


@torch.library.custom_op("locks_hf::quantized_attention", mutates_args=("counts",))
def quantized_attention_op(
    query: torch.Tensor,
    pages: torch.Tensor | None,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    quantized: torch.Tensor,
    bits: int,
    group: int,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    scale: float,
    page_size: int,
    counts: torch.Tensor | None,
    n_pages: int | None = None,
) -> torch.Tensor:
    """`attend_quant.quantized_attention` (decode attention over KIVI-packed K/V); ``quantized`` is the
    ``int32 [2]`` device tensor ``(qk, qv)`` and ``length`` the ``int32 [1]`` one; ``counts`` (int64 or
    ``None``, required for the reason `decode_step_op` gives): ``counts[0]`` grows by the tokens attended."""
    from .attend_quant import quantized_attention

    return quantized_attention(
        query,
        pages,
        key_codes=key_codes,
        key_scale=key_scale,
        key_zero=key_zero,
        value_codes=value_codes,
        value_scale=value_scale,
        value_zero=value_zero,
        key_tail=key_tail,
        value_tail=value_tail,
        quantized=quantized,
        bits=bits,
        group=group,
        slot_valid=slot_valid,
        row_start=row_start,
        length=length,
        scale=scale,
        page_size=page_size,
        n_pages=n_pages,
        counts=counts,
    )


@quantized_attention_op.register_fake
def _(
    query,
    pages,
    key_codes,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    key_tail,
    value_tail,
    quantized,
    bits,
    group,
    slot_valid,
    row_start,
    length,
    scale,
    page_size,
    counts,
    n_pages=None,
):
    return torch.empty_like(query, memory_format=torch.contiguous_format)
