"""The kernels as PyTorch custom ops, so `torch.compile` treats each as one opaque node.

Dynamo cannot see inside a Triton launcher that picks tiles on the host; as custom ops with fake
(shape-only) implementations, a decode step with the kernels traces into one graph and CUDA graphs
capture the launches. The ops: the decode step (score -> select -> attend) over bf16 K/V and over
KIVI-packed K/V, the attention over packed K/V alone, the summary build, the in-place summary of the
pages a decode step completes (`page_update`, for one layer or several in one launch), a static quantized layer's per-step KIVI schedule
(`kivi`) and the one-token projection (`gemv`). The decode-time ops first join a background compile of their kernels
(`_common.join_before_decode`).
"""

from __future__ import annotations

import torch

from ._common import join_pending_compiles, on_device
from .build import build_summary, summary_shapes
from .decode import decode_step, quantized_decode_step
from .gemv import gemv
from .page_update import update_completed_pages, update_completed_pages_of_layers
from .score import SUMMARY_NAMES
from .select import page_list_width


def _launched(device: torch.device, kernel, *args, **kwargs):
    """``kernel(*args, **kwargs)`` for a decode-time op: after a background compile of these kernels ends
    (`locks_hf.precompile`), with ``device`` current (Triton launches on the current CUDA device, and a
    model split over GPUs has its layers on several). Here rather than in the caller, so that a compiled
    step's trace sees one opaque op."""
    join_pending_compiles()
    with on_device(device):
        return kernel(*args, **kwargs)


@torch.library.custom_op(
    "locks_hf::decode_step", mutates_args=("n_complete", "summary", "counts", "row_counts", "selection", "tickets")
)
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
    tickets: torch.Tensor | None,
    per_head: bool,
    rerank: int = 0,
    update_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode.decode_step` with the summary passed as the list ``SUMMARY_NAMES[method]``; ``counts[0]``
    (int64) grows by the tokens attended. ``slots`` sizes the page lists; ``active_slots`` (``int32 [1]``
    or ``None`` for ``slots``) is the budget selected with, read on the device. ``row_counts``, ``pad``
    and ``selection``: a static layer's buffers (see `decode.decode_step`), ``tickets`` its selection
    counters (or ``None``); ``per_head`` and ``rerank`` what the selector declares (per-head lists; the
    candidate multiple of exact re-ranking, 0 for none). ``update_rank`` > 0: the step also writes the
    summary of the page the newest token completed and ``n_complete`` (a static layer's page update).

    The mutated arguments have no defaults on purpose: torch before 2.12 drops trailing arguments equal
    to their default before its in-place version bump, which then indexes past the end of ``args``."""
    named = dict(zip(SUMMARY_NAMES.get(method, ()), summary))
    return _launched(
        query.device,
        decode_step,
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
        tickets=tickets,
        per_head=per_head,
        rerank=rerank,
        update_rank=update_rank,
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
    tickets,
    per_head,
    rerank=0,
    update_rank=0,
):
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    h = key_buf.shape[1]
    width = 0 if method == "full" else page_list_width(per_head, slots, hq // h)
    return query.new_empty((b, 1, hq, d)), query.new_empty((b * h, width), dtype=torch.int32)


@torch.library.custom_op("locks_hf::build_summary", mutates_args=())
def build_summary_op(keys: torch.Tensor, valid: torch.Tensor, rank: int, basis_bits: int) -> list[torch.Tensor]:
    """`build.build_summary` as a list in the order ``SUMMARY_NAMES["locks"]``."""
    with on_device(keys.device):
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
    ring: int = 0,
) -> None:
    """`page_update.update_completed_pages`: the summary (``SUMMARY_NAMES[method]``) written in place,
    and ``n_complete`` unless it is ``None`` (required, for the reason `decode_step_op` gives); ``ring``
    > 0: ``key_buf`` is a static quantized layer's full-precision ring of that many slots."""
    join_pending_compiles()
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
        ring=ring,
    )


@update_completed_pages_op.register_fake
def _(method, key_buf, slot_valid, row_start, length, summary, page_size, rank, basis_bits, n_complete, ring=0):
    return None


@torch.library.custom_op("locks_hf::update_pages_of_layers", mutates_args=("summaries", "n_complete"))
def update_pages_of_layers_op(
    method: str,
    key_bufs: list[torch.Tensor],
    slot_valid: list[torch.Tensor],
    row_start: list[torch.Tensor],
    length: list[torch.Tensor],
    summaries: list[torch.Tensor],
    page_size: int,
    rank: int,
    basis_bits: int,
    n_complete: list[torch.Tensor],
) -> None:
    """`page_update.update_completed_pages_of_layers`: the per-step page update of ``len(key_bufs)`` layers in
    one launch. ``summaries`` holds layer 0's ``SUMMARY_NAMES[method]`` tensors, then layer 1's, ...
    (flat: an op takes no nested lists); ``n_complete`` one tensor a layer, each overwritten."""
    per = len(SUMMARY_NAMES.get(method, ()))
    grouped = [summaries[i * per : (i + 1) * per] for i in range(len(key_bufs))]
    _launched(
        key_bufs[0].device if key_bufs else torch.device("cpu"),
        update_completed_pages_of_layers,
        method,
        key_bufs,
        slot_valid,
        row_start,
        length,
        grouped,
        page_size=page_size,
        rank=rank,
        basis_bits=basis_bits,
        n_complete=n_complete,
    )


@update_pages_of_layers_op.register_fake
def _(method, key_bufs, slot_valid, row_start, length, summaries, page_size, rank, basis_bits, n_complete):
    return None


#: The packed storage a quantized layer hands the kernels (`PagedLayer.packed_kv`), in the order the
#: quantized-KV custom ops take its tensors.
PACKED_TENSORS = (
    "key_codes",
    "key_scale",
    "key_zero",
    "value_codes",
    "value_scale",
    "value_zero",
    "key_tail",
    "value_tail",
    "quantized",
    "slot_valid",
    "row_start",
    "length",
)


@torch.library.custom_op("locks_hf::quantized_attention", mutates_args=("counts", "row_counts"))
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
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    bits: int,
    group: int,
    scale: float,
    page_size: int,
    counts: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    pad: torch.Tensor | None,
    n_pages: int | None = None,
    ring: int = 0,
) -> torch.Tensor:
    """`attend_quant.quantized_attention` (decode attention over KIVI-packed K/V); ``quantized`` is the
    ``int32 [2]`` device tensor ``(qk, qv)`` and ``length`` the ``int32 [1]`` one; ``counts`` (int64 or
    ``None``, required for the reason `decode_step_op` gives): ``counts[0]`` grows by the tokens attended;
    ``row_counts`` / ``pad``: a static layer's per-row statistics; ``ring``: the tails' ring size (0: none)."""
    from .attend_quant import quantized_attention

    return _launched(
        query.device,
        quantized_attention,
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
        row_counts=row_counts,
        pad=pad,
        ring=ring,
    )


@quantized_attention_op.register_fake
def _(query, pages, *args, n_pages=None, ring=0):
    return torch.empty_like(query, memory_format=torch.contiguous_format)


@torch.library.custom_op(
    "locks_hf::quantized_decode_step",
    mutates_args=("n_complete", "summary", "counts", "row_counts", "selection", "tickets"),
)
def quantized_decode_step_op(
    method: str,
    query: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    key_tail: torch.Tensor,
    value_tail: torch.Tensor,
    quantized: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    bits: int,
    group: int,
    ring: int,
    page_size: int,
    n_complete: torch.Tensor,
    summary: list[torch.Tensor],
    n_pages: int,
    slots: int,
    scale: float,
    basis_bits: int,
    counts: torch.Tensor,
    active_slots: torch.Tensor | None,
    row_counts: torch.Tensor | None,
    pad: torch.Tensor | None,
    selection: torch.Tensor | None,
    tickets: torch.Tensor | None,
    per_head: bool,
    update_rank: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode.quantized_decode_step`: `decode_step_op` over a quantized layer's packed storage (the
    tensors of `PACKED_TENSORS`, then ``bits``, ``group``, ``ring``, ``page_size``)."""
    packed = dict(
        zip(
            PACKED_TENSORS,
            (
                key_codes,
                key_scale,
                key_zero,
                value_codes,
                value_scale,
                value_zero,
                key_tail,
                value_tail,
                quantized,
                slot_valid,
                row_start,
                length,
            ),
        )
    )
    return _launched(
        query.device,
        quantized_decode_step,
        method,
        query,
        {**packed, "bits": bits, "group": group, "ring": ring, "page_size": page_size},
        n_complete=n_complete,
        n_pages=n_pages,
        slots=slots,
        scale=scale,
        summary=dict(zip(SUMMARY_NAMES.get(method, ()), summary)),
        basis_bits=basis_bits,
        counts=counts,
        active_slots=active_slots,
        row_counts=row_counts,
        pad=pad,
        selection=selection,
        tickets=tickets,
        per_head=per_head,
        update_rank=update_rank,
    )


@quantized_decode_step_op.register_fake
def _(
    method,
    query,
    key_codes,
    key_scale,
    key_zero,
    value_codes,
    value_scale,
    value_zero,
    key_tail,
    value_tail,
    quantized,
    slot_valid,
    row_start,
    length,
    bits,
    group,
    ring,
    page_size,
    n_complete,
    summary,
    n_pages,
    slots,
    scale,
    basis_bits,
    counts,
    active_slots,
    row_counts,
    pad,
    selection,
    tickets,
    per_head,
    update_rank=0,
):
    b, hq, d = query.shape[0], query.shape[1], query.shape[-1]
    h = key_codes.shape[1]
    width = 0 if method == "full" else page_list_width(per_head, slots, hq // h)
    return query.new_empty((b, 1, hq, d)), query.new_empty((b * h, width), dtype=torch.int32)


@torch.library.custom_op(
    "locks_hf::kivi_append",
    mutates_args=(
        "key_ring",
        "value_ring",
        "key_codes",
        "key_scale",
        "key_zero",
        "value_codes",
        "value_scale",
        "value_zero",
        "quantized",
        "counter",
    ),
)
def kivi_append_op(
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    key_ring: torch.Tensor,
    value_ring: torch.Tensor,
    key_codes: torch.Tensor,
    key_scale: torch.Tensor,
    key_zero: torch.Tensor,
    value_codes: torch.Tensor,
    value_scale: torch.Tensor,
    value_zero: torch.Tensor,
    slot_valid: torch.Tensor,
    row_start: torch.Tensor,
    length: torch.Tensor,
    quantized: torch.Tensor,
    counter: torch.Tensor,
    bits: int,
    group: int,
    residual: int,
    page_size: int,
    post: bool,
) -> None:
    """`kivi.kivi_append`: KIVI's decode-step schedule on a static quantized layer's buffers, in place."""
    join_pending_compiles()
    from .kivi import kivi_append

    kivi_append(
        new_keys,
        new_values,
        key_ring=key_ring,
        value_ring=value_ring,
        key_codes=key_codes,
        key_scale=key_scale,
        key_zero=key_zero,
        value_codes=value_codes,
        value_scale=value_scale,
        value_zero=value_zero,
        slot_valid=slot_valid,
        row_start=row_start,
        length=length,
        quantized=quantized,
        counter=counter,
        bits=bits,
        group=group,
        residual=residual,
        page_size=page_size,
        post=post,
    )


@kivi_append_op.register_fake
def _(*args):
    return None


@torch.library.custom_op("locks_hf::gemv", mutates_args=())
def gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`gemv.gemv`: ``x [K] @ weight.T + bias`` for one row, ``[N]`` (a decode-time op: it joins a background
    compile first, `_launched`)."""
    return _launched(x.device, gemv, x, weight, bias)


@gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty(weight.shape[0])
