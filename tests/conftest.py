"""Shared fixtures: the package's tiny random-weight models, in float64 so comparisons are exact."""

import os
import shutil

# Without a GPU the Triton kernels run in Triton's interpreter; it must be chosen before triton is
# imported (transformers imports it), hence here, first.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from locks_hf.models import TINY_ARCHS, tiny_model


def tiny(arch: str, attn: str = "locks", dtype=torch.float64, seed: int = 0):
    """A seeded random tiny model; ``tiny(a, "sdpa")`` and ``tiny(a, "locks")`` share weights."""
    model = tiny_model(arch, attn_implementation=attn, seed=seed).to(dtype)
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
