"""Triton kernels for Locks sparse decoding on CUDA (``locks_hf.kernels``): tensors in, tensors out.

* `score_pages`  page scores from packed summaries (Locks), key min/max (Quest) or keys (oracle);
* `select_pages` top-(k-2) pages + sink + recent, fixed width, no host sync;
* `rerank_pages` exact page LSE of a short list of candidates, then its best k-2 (``"locks_rerank"``);
* `sparse_attention` split-K flash-decoding over the selected pages;
* `quantized_attention` the same over KIVI-packed K/V, dequantized in registers (``attend_quant``);
* `build_summary` batched GPU summary build (Gram matrix eigendecomposition + one quantize pass);
* `update_completed_pages` a decode step's in-place summary of each row's just-completed page (one launch;
  `update_completed_pages_of_layers` the same for several layers in one launch);
* ``gemv.gemv`` a one-token projection (``x W^T + b`` for one row) that streams its weights (`locks_hf.gemv_projections`);
* `compile_only` a block in which the launches compile their kernels and run nothing;
  `join_before_decode` has the next decode-time op join such a compile running in another thread;
* `decode_step` the three chained; `implements` / `implements_quantized` which configurations they
  cover; `ops` registers them as custom ops (``torch.ops.locks_hf.decode_step`` / ``build_summary`` /
  ``update_completed_pages``).

The glue that reads a cache layer and dispatches to these lives in `locks_hf.backends.triton`.

``HAVE_TRITON`` is False when Triton cannot be imported; `locks_hf` then always runs its PyTorch
reference path. On CPU the kernels run only under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

if __name__ == "kernels":
    # This folder imported as a top-level package: a shell, notebook or ``python -m`` started in the
    # source tree's root puts that root on sys.path, where this folder shadows Hugging Face's ``kernels``
    # package, which transformers imports (a dependency from 5.25 on; earlier releases look for it at
    # import). The folder is only ever ``locks_hf.kernels``: the import is handed to the installed
    # package, and where none is installed it gets an empty stand-in that transformers reads as "not
    # installed" (no file, no version), as it reads a namespace folder, rather than an import error.
    import importlib.machinery
    import importlib.util
    import os
    import sys
    import types

    _tree = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _tree]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        _sources = os.path.dirname(__file__)

        def _missing(name: str):
            raise AttributeError(
                f"no installed package named `kernels` provides {name!r}: {_sources} is locks-hf's kernel "
                "sources, imported as `locks_hf.kernels`"
            )

        _stand_in = types.ModuleType("kernels")
        _stand_in.__getattr__ = _missing  # type: ignore[method-assign]
        sys.modules["kernels"] = _stand_in  # what this import statement returns
    else:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _installed
        _spec.loader.exec_module(_installed)
else:
    try:
        import triton  # noqa: F401

        HAVE_TRITON = True
    except ImportError:  # pragma: no cover - exercised where triton is absent
        HAVE_TRITON = False

    if HAVE_TRITON:
        from . import ops  # noqa: F401  (registers the torch.ops.locks_hf custom ops)
        from ._common import SENTINEL, compile_only, join_before_decode, on_device
        from .attend import sparse_attention
        from .attend_quant import implements_quantized, quantized_attention
        from .build import build_summary, fit_pages_eigh, quantize_summary
        from .decode import decode_step, implements
        from .page_update import update_completed_pages, update_completed_pages_of_layers
        from .rerank import rerank_pages
        from .score import SUMMARY_NAMES, score_pages
        from .select import select_pages

__all__ = [
    "HAVE_TRITON",
    "SENTINEL",
    "SUMMARY_NAMES",
    "build_summary",
    "compile_only",
    "decode_step",
    "fit_pages_eigh",
    "implements",
    "implements_quantized",
    "join_before_decode",
    "on_device",
    "quantize_summary",
    "quantized_attention",
    "rerank_pages",
    "score_pages",
    "select_pages",
    "sparse_attention",
    "update_completed_pages",
    "update_completed_pages_of_layers",
]
