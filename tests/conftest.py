"""Shared fixtures (the package's tiny random-weight models, in float64 so comparisons are exact) and
the markers that split the suite.

Markers (registered in pyproject.toml): ``interpret`` for the Triton kernel tests, which run in
Triton's CPU interpreter without a GPU and take most of the suite's time; ``slow`` for tests that load
a real model or run a long job; ``gpu`` for the GPU suite (``python -m pytest -m gpu -n auto`` on a
CUDA machine): a test marked ``gpu`` in its file needs CUDA with compiled kernels and is skipped
without (here, not by a ``skipif`` of its own; tests/test_gpu_markers.py checks), and every test of the
kernel test files (`KERNEL_TEST_FILES`) is marked ``gpu`` here: compiled on a GPU, interpreted without
one. CI runs everything; the fast developer loop is ``python -m pytest -m "not interpret and not slow"``.
"""

import os
import shutil
from pathlib import Path

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is
# imported (transformers imports it), hence here, first.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The team's full evaluation data, when it sits beside the clone (here and in CI): the harness reads a
# data folder only when it is named, so the tests name it; a developer's own $LOCKS_HF_DATA wins.
# Without it the tests run on the packaged samples (the few that need the full data skip).
if (Path(__file__).resolve().parents[2] / "shared" / "data").is_dir():
    os.environ.setdefault("LOCKS_HF_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "data"))

import pytest
import torch

from locks_hf.models import TINY_ARCHS, tiny_model

#: Test files whose tests run Triton kernels (interpreted on a CPU machine): marked ``interpret``.
INTERPRETER_TEST_FILES = frozenset(
    {
        "test_kernels.py",
        "test_page_update.py",
        "test_eigh.py",
        "test_score_variants.py",
        "test_rerank_kernels.py",
        "test_kv_quant_kernels.py",
        "test_kv_quant_backend.py",
        "test_gemv.py",
    }
)
#: Test files that run the kernels compiled on a GPU and interpreted without one: in the GPU suite
#: (marked ``gpu``) without needing CUDA.
KERNEL_TEST_FILES = INTERPRETER_TEST_FILES | {"test_select_attend_fast.py"}
#: The kernels are compiled (not run by Triton's interpreter) on a CUDA device.
COMPILED_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


def pytest_collection_modifyitems(config, items):
    for item in items:
        needs_cuda = item.get_closest_marker("gpu") is not None  # marked in its file
        if item.path.name in INTERPRETER_TEST_FILES:
            item.add_marker(pytest.mark.interpret)
        if item.path.name in KERNEL_TEST_FILES:
            item.add_marker(pytest.mark.gpu)
        if needs_cuda and not COMPILED_CUDA:
            item.add_marker(
                pytest.mark.skip(reason="needs a CUDA device and compiled kernels (TRITON_INTERPRET unset)")
            )


def tiny(arch: str, attn: str = "locks", dtype=torch.float64, seed: int = 0, **overrides):
    """A seeded random tiny model; ``tiny(a, "sdpa")`` and ``tiny(a, "locks")`` share weights.
    ``overrides`` change config fields (e.g. ``head_dim=32``)."""
    model = tiny_model(arch, attn_implementation=attn, seed=seed, **overrides).to(dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None  # random models: always generate max_new_tokens
    return model


@pytest.fixture(params=TINY_ARCHS)
def arch(request):
    return request.param


def count_forwards(model, monkeypatch) -> dict:
    """Count ``model.forward`` calls in ``calls["n"]`` until ``monkeypatch.undo()``."""
    calls = {"n": 0}
    forward = model.forward

    def counting(*a, **k):
        calls["n"] += 1
        return forward(*a, **k)

    monkeypatch.setattr(model, "forward", counting)
    return calls


def page_lists_as_mask(pages, b, h, P):
    """Page lists ``[b*h, W]`` (``< 0`` = none) as a mask ``[b, h, P]``, checking no page is listed twice."""
    mask = torch.zeros(b, h, P, dtype=torch.bool)
    for r, row in enumerate(pages.cpu().tolist()):
        for p in row:
            if p >= 0:
                assert not mask[r // h, r % h, p], f"page {p} listed twice: {row}"
                mask[r // h, r % h, p] = True
    return mask
