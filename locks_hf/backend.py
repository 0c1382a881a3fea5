"""Where a Locks layer's work runs: the PyTorch reference or the Triton kernels (`locks_hf.kernels`).

The one place that decides it (`kernels_for`): CUDA tensors of a configuration the kernels implement
go to the kernels; CPU tensors, other settings, a missing Triton, or ``LOCKS_HF_KERNELS=0`` in the
environment keep the reference path. The kernels take and return tensors only; the glue here reads a
layer through its public accessors (`locks_hf.paged.PagedLayer`), calls the kernels through their
custom ops (``torch.ops.locks_hf.*``, one opaque node each for `torch.compile`) and keeps the layer's
bookkeeping (selection, attended-token statistics) identical to the reference path.
"""

from __future__ import annotations

import os

import torch

from .selectors import selector_class

#: Set to ``0`` to keep the PyTorch reference path on the GPU too.
KERNELS_ENV = "LOCKS_HF_KERNELS"


def kernels_enabled() -> bool:
    """False when the environment turns the kernels off (``LOCKS_HF_KERNELS=0``)."""
    return os.environ.get(KERNELS_ENV, "1") != "0"


def kernels_available() -> bool:
    """Whether `locks_hf.kernels` imports with Triton (the environment not consulted)."""
    try:
        from . import kernels
    except ImportError:
        return False
    return kernels.HAVE_TRITON


def kernel_method(selector: str) -> str | None:
    """The kernels' scoring mode for a selector name (``None``: reference only)."""
    return selector_class(selector).kernel_method


def supports(config, key_buffer: torch.Tensor | None, query: torch.Tensor | None = None) -> bool:
    """Whether the kernels implement ``config`` on this key buffer (and query), Triton available."""
    method = kernel_method(config.selector)
    if method is None or key_buffer is None or not key_buffer.is_cuda or not kernels_available():
        return False
    from . import kernels

    if not kernels.implements(
            method, dtype=key_buffer.dtype, head_dim=key_buffer.shape[-1], page_size=config.page_size,
            group_combine=config.group_combine, basis_bits=config.basis_bits, coef_bits=config.coef_bits,
            centroid_bits=config.centroid_bits):
        return False
    return query is None or (query.is_cuda and query.dtype == key_buffer.dtype)


def layer_supported(layer, query: torch.Tensor | None = None) -> bool:
    """`supports` for a layer's settings and buffers (environment not consulted)."""
    return supports(layer.config, layer.key_buffer(), query)


def kernels_for(layer, query: torch.Tensor | None = None):
    """The kernels module when this layer's step runs there, else ``None`` (the reference path).

    ``query=None`` asks about the layer's settings and buffers alone.
    """
    keys = layer.key_buffer()
    on_cuda = keys is not None and keys.is_cuda if query is None else query.is_cuda
    if not on_cuda or not kernels_enabled() or not supports(layer.config, keys, query):
        return None
    from . import kernels

    return kernels


def uses_kernels(layer, query: torch.Tensor | None = None) -> bool:
    return kernels_for(layer, query) is not None


def build_summary(layer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor]:
    """The layer's selector's per-page tensors for ``keys [b, h, n, B, d]`` (``valid [b, h, n, B]``):
    the GPU build kernel for CUDA keys where it applies, else the selector's reference `summarize`."""
    new = kernel_summary(layer, keys, valid) if keys.is_cuda and kernels_enabled() else None
    return new if new is not None else layer.selector.summarize(keys, valid, layer.shared)


# -- the kernel path (callers have checked `kernels_for`) ------------------------------------------------
def _summary_list(layer) -> list[torch.Tensor]:
    from . import kernels

    return [layer.summary[n] for n in kernels.SUMMARY_NAMES[kernel_method(layer.config.selector)]]


def kernel_decode(layer, query: torch.Tensor, scale: float) -> torch.Tensor:
    """Kernel twin of `locks_hf.attention.reference_decode`: ``query [b, Hq, 1, d]`` -> ``[b, 1, Hq, d]``.

    A layer with `PagedLayer.kernel_buffers` (the static layer) has the launches keep its
    bookkeeping too: the statistics, the selected-page mask, and the selection's state left zero
    for the next step; no other launch runs here. Otherwise the glue records them.
    """
    from . import kernels

    cfg = layer.config
    keys = layer.key_buffer()
    b, h = query.shape[0], keys.shape[1]
    method = kernel_method(cfg.selector)
    width, active = layer.page_slots()  # page-list width, and the budget as a device tensor (or None)
    bufs = layer.kernel_buffers()
    if bufs is not None:
        n_complete = bufs["n_complete"]
        row_start = bufs["row_start"]
        if n_complete is None:
            row_start, n_complete = layer.row_tensors()
        extra = dict(workspace=bufs["workspace"], row_counts=bufs["row_counts"], pad=bufs["pad"],
                     selection=None if method == "full" else bufs["selection"])
    else:
        row_start, n_complete = layer.row_tensors()
        extra = dict(workspace=None, row_counts=None, pad=None, selection=None)
    # Triton launches on the *current* device; with a model split over GPUs (device_map) this layer's
    # tensors may live on another one. The kernels count the tokens they attend into the statistics.
    with kernels.on_device(query.device):
        out, pages = torch.ops.locks_hf.decode_step(
            method, query, keys, layer.value_buffer(), layer.slot_valid, row_start, n_complete,
            layer.length_tensor(), _summary_list(layer), layer.num_pages, width, float(scale),
            cfg.page_size, cfg.basis_bits, layer.count_buffer(), active, rerank=cfg.rerank or 0, **extra)
    if bufs is not None:
        return out
    if pages.shape[1]:  # dense ("full") selects no list: every page
        layer.note_selection(pages.view(b, h, -1))
    layer.record_step(None, layer.real_tokens() * h)
    return out


def kernel_update_newest_page(layer) -> None:
    """Kernel twin of `LocksStaticLayer`'s per-step page summary: one launch that writes the page the
    newest token completed, in place, and does nothing on the other ``B - 1`` steps of a page (and
    writes the layer's complete-page counts, where `PagedLayer.kernel_buffers` keeps them)."""
    cfg = layer.config
    bufs = layer.kernel_buffers()
    row_start = layer.row_tensors()[0] if bufs is None else bufs["row_start"]
    torch.ops.locks_hf.update_completed_pages(
        kernel_method(cfg.selector), layer.key_buffer(), layer.slot_valid, row_start, layer.length_tensor(),
        _summary_list(layer), cfg.page_size, cfg.rank, cfg.basis_bits, None if bufs is None else bufs["n_complete"])


def kernel_summary(layer, keys: torch.Tensor, valid: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """GPU summary build for ``keys [b, h, n, B, d]``; ``None`` when the reference must run (the kernels
    build the Locks summary only, which re-ranking keeps too)."""
    method = kernel_method(layer.config.selector)
    if not keys.is_cuda or not layer_supported(layer):
        return None
    from . import kernels

    if kernels.SCAN_METHOD.get(method, method) != "locks":
        return None
    cfg = layer.config
    with kernels.on_device(keys.device):
        parts = torch.ops.locks_hf.build_summary(keys, valid, cfg.rank, cfg.basis_bits)
    return dict(zip(kernels.SUMMARY_NAMES[method], parts))
