#!/usr/bin/env python
"""Is dense decode (PyTorch SDPA) token-identical on one GPU and on a model split over two?

Companion of scripts/multi_gpu_generate.py (same model, prompt and helpers; dense arm only, 16 tokens):
run to run on one GPU, with and without the cuDNN SDPA backend, and split over 2 GPUs without it.

    python scripts/dev/check_dense_placement.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: multi_gpu_generate
from multi_gpu_generate import (  # noqa: E402
    SHAPES,
    LlamaConfig,
    LlamaForCausalLM,
    LocksConfig,
    run_arm,
    split_over_gpus,
)

config = LlamaConfig(**SHAPES["llama3.1-8b"], max_position_embeddings=2**21, bos_token_id=1, eos_token_id=2)
torch.manual_seed(0)
with torch.device("cuda:0"):
    model = LlamaForCausalLM._from_config(config, attn_implementation="locks", dtype=torch.bfloat16).eval()
ids = torch.randint(3, config.vocab_size, (1, 131072), generator=torch.Generator().manual_seed(0)).to("cuda:0")
full = LocksConfig(selector="full")
with torch.no_grad():
    a = run_arm(model, config, ids, full, 16)["tokens"]
    b = run_arm(model, config, ids, full, 16)["tokens"]
    print("1 GPU run-to-run identical:", a == b, [i for i, (p, q) in enumerate(zip(a, b)) if p != q][:3], flush=True)
    torch.backends.cuda.enable_cudnn_sdp(False)
    c = run_arm(model, config, ids, full, 16)["tokens"]
    d = run_arm(model, config, ids, full, 16)["tokens"]
    print("1 GPU, cuDNN SDPA off, run-to-run identical:", c == d, "same as with cuDNN:", c == a, flush=True)
    model, _ = split_over_gpus(model, "LlamaDecoderLayer")
    e = run_arm(model, config, ids, full, 16)["tokens"]
    print(
        "split, cuDNN off, identical to 1 GPU cuDNN off:",
        e == c,
        [i for i, (p, q) in enumerate(zip(c, e)) if p != q][:3],
        flush=True,
    )
