"""Triton kernels for Locks sparse decoding on CUDA (``locks_hf.kernels``): tensors in, tensors out.

* `score_pages`  page scores from packed summaries (Locks), key min/max (Quest) or keys (oracle);
* `select_pages` top-(k-2) pages + sink + recent, fixed width, no host sync;
* `rerank_pages` exact page LSE of a short list of candidates, then its best k-2 (``"locks_rerank"``);
* `sparse_attention` split-K flash-decoding over the selected pages;
* `build_summary` batched GPU summary build (Gram matrix eigendecomposition + one quantize pass);
* `update_completed_pages` a decode step's in-place summary of each row's just-completed page (one launch);
* `decode_step` the three chained; `implements` which configurations they cover; `ops` registers
  them as custom ops (``torch.ops.locks_hf.decode_step`` / ``build_summary`` / ``update_completed_pages``).

The glue that reads a cache layer and dispatches to these lives in `locks_hf.backend`.

``HAVE_TRITON`` is False when Triton cannot be imported; `locks_hf` then always runs its PyTorch
reference path. On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import warnings

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    HAVE_TRITON = False

if HAVE_TRITON:
    from . import ops  # noqa: F401  (registers the torch.ops.locks_hf custom ops)
    from ._common import SCAN_METHOD, SENTINEL, SUMMARY_NAMES, on_device
    from .attend import sparse_attention
    from .build import build_summary, fit_pages_eigh, quantize_summary
    from .decode import decode_step, implements
    from .page_update import update_completed_pages
    from .rerank import rerank_pages
    from .score import score_pages
    from .select import select_pages

__all__ = ["HAVE_TRITON", "SCAN_METHOD", "SENTINEL", "SUMMARY_NAMES", "build_summary", "decode_step",
           "fit_pages_eigh", "implements", "on_device", "quantize_summary", "rerank_pages", "score_pages",
           "select_pages", "sparse_attention", "update_completed_pages"]

#: Layer-reading glue that moved to `locks_hf.backend` (old name here -> new name there).
_MOVED_TO_BACKEND = {"sparse_decode": "kernel_decode", "summarize": "kernel_summary",
                     "supports": "layer_supported", "update_newest_page": "kernel_update_newest_page"}


def __getattr__(name: str):
    if name in _MOVED_TO_BACKEND:
        new = _MOVED_TO_BACKEND[name]
        warnings.warn(f"locks_hf.kernels.{name} is deprecated: use locks_hf.backend.{new}",
                      DeprecationWarning, stacklevel=2)
        from .. import backend

        return getattr(backend, new)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `quantized_attention`: sparse decode attention over KIVI-quantized K/V (`attend_quant`), the kernel a
# `QuantizedLocksLayer` is read with (``quantized_attention(query, pages, scale=..., **layer.packed_kv())``);
# ``torch.ops.locks_hf.quantized_attention`` is its custom op.
if HAVE_TRITON:
    from .attend_quant import quantized_attention

    __all__ += ["quantized_attention"]
