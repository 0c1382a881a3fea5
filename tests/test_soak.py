"""Soak: a long sparse decode on the CPU keeps its memory flat per token beyond the K/V and the page
summaries the cache must hold (sized for CI: a few thousand tokens; the GPU soak is
``scripts/dev/soak_decode.py``)."""

import gc

import psutil
import torch

from locks_hf import LocksCache
from locks_hf.models import tiny_model

STEPS = 1500
WARMUP = 200
#: Bytes per decoded token the process may grow beyond the cache's buffers (allocator noise).
SLACK_PER_TOKEN = 512
SLACK = 8 << 20


def _cache_bytes(cache) -> int:
    """Bytes of every tensor the Locks layers hold (K/V buffers, slot validity, summaries)."""
    total = 0
    for layer in cache.locks_layers:
        for tensor in (layer._kbuf, layer._vbuf, layer.slot_valid, *layer.summary.values(), *layer.shared.values()):
            total += tensor.nbytes
    return total


def _sample(cache, step):
    gc.collect()
    return {
        "step": step,
        "rss": psutil.Process().memory_info().rss,
        "cache": _cache_bytes(cache),
        "objects": len(gc.get_objects()),
    }


@torch.no_grad()
def test_long_decode_memory_is_flat_beyond_kv_and_summaries():
    model = tiny_model("llama")
    cache = LocksCache(model.config, budget=64)
    ids = torch.randint(3, 256, (1, 64), generator=torch.Generator().manual_seed(0))
    token = model(ids, past_key_values=cache).logits[:, -1:].argmax(-1)
    samples = []
    for step in range(STEPS):
        token = model(token, past_key_values=cache).logits[:, -1:].argmax(-1)
        if step >= WARMUP and (step - WARMUP) % 300 == 0 or step == STEPS - 1:
            samples.append(_sample(cache, step))
    first, last = samples[0], samples[-1]
    steps = last["step"] - first["step"]
    assert cache.get_seq_length() == 64 + STEPS and cache.attended_fraction() < 0.2  # sparse decode ran
    # no Python object accumulates per step (a list of per-step tensors, a growing dict...)
    assert last["objects"] - first["objects"] < 100, samples
    # resident memory grows by the cache's own buffers, and not per token otherwise
    beyond = (last["rss"] - first["rss"]) - (last["cache"] - first["cache"])
    assert beyond < SLACK + SLACK_PER_TOKEN * steps, samples
