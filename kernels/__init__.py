"""Triton kernels for Locks sparse decoding on CUDA (``locks_hf.kernels``).

* `score_pages`  page scores from packed summaries (Locks), key min/max (Quest) or keys (oracle);
* `select_pages` top-(k-2) pages + sink + recent, fixed width, no host sync;
* `sparse_attention` split-K flash-decoding over the selected pages;
* `build_summary` batched GPU summary build (Gram matrix eigendecomposition + one quantize pass);
* `update_completed_pages` a decode step's in-place summary of each row's just-completed page (one launch);
* `decode_step` the three chained; `sparse_decode` / `summarize` the cache-layer glue, which calls
  the kernels as custom ops (`ops`: ``torch.ops.locks_hf.decode_step`` / ``build_summary``).

``HAVE_TRITON`` is False when Triton cannot be imported; `locks_hf` then always runs its PyTorch
reference path. On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

try:
    import triton  # noqa: F401
    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is absent
    HAVE_TRITON = False

if HAVE_TRITON:
    from . import ops  # noqa: F401  (registers the torch.ops.locks_hf custom ops)
    from ._common import SENTINEL
    from .attend import sparse_attention
    from .build import build_summary, fit_pages_eigh, quantize_summary
    from .decode import decode_step, sparse_decode, summarize, supports, update_newest_page
    from .page_update import update_completed_pages
    from .score import score_pages
    from .select import select_pages

__all__ = ["HAVE_TRITON", "SENTINEL", "build_summary", "decode_step", "fit_pages_eigh", "quantize_summary",
           "score_pages", "select_pages", "sparse_attention", "sparse_decode", "summarize", "supports",
           "update_completed_pages", "update_newest_page"]
