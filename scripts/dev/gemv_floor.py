#!/usr/bin/env python
"""What a decode step's projections cost on their own: every layer's GEMVs (batch 1, bf16, cuBLAS through
``F.linear``) replayed in one CUDA graph, for three ways of laying the same weights out, against the read floor
of those weights at the device bandwidth measured in the same run.

* ``llama-block``: seven projections a layer (q, k, v, o, gate, up, down), as ``bench_decode_step.py --shape
  glm4-9b`` builds GLM-4-9B's size;
* ``glm-hf``: six (q, k, v with biases; gate and up in one), as transformers' ``GlmForCausalLM``;
* ``fused``: four (q/k/v in one with its bias, o, gate/up in one, down), as the original GLM-4 modules.

Each layer has weights of its own (no layer's weights stay in L2 for the next), the LM head last. Prints a
table and writes JSON::

    python scripts/dev/gemv_floor.py --shape glm4-9b --out gemv_floor.json
    python scripts/dev/gemv_floor.py --device cpu --shape tiny        # smoke test (no graph, no timing claim)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/: the benchmarks' shapes
from bench_decode import measure_bandwidth, time_graph  # noqa: E402  (the benchmarks' CUDA-graph timing)
from bench_decode_step import SHAPES, model_config  # noqa: E402

#: layout: (q/k/v in one projection, q/k/v with biases, gate and up in one projection)
LAYOUTS = {"llama-block": (False, False, False), "glm-hf": (False, True, True), "fused": (True, True, True)}


def projections(layout: str, hidden: int, q_out: int, kv_out: int, inter: int) -> list[tuple[str, int, int, bool]]:
    """(name, in, out, bias) of one layer's projections in ``layout``."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}: one of {', '.join(LAYOUTS)}")
    qkv_fused, qkv_bias, mlp_fused = LAYOUTS[layout]
    if qkv_fused:
        attention = [("qkv", hidden, q_out + 2 * kv_out, qkv_bias)]
    else:
        attention = [("q", hidden, q_out, qkv_bias), ("k", hidden, kv_out, qkv_bias), ("v", hidden, kv_out, qkv_bias)]
    mlp = (
        [("gate_up", hidden, 2 * inter, False)]
        if mlp_fused
        else [("gate", hidden, inter, False), ("up", hidden, inter, False)]
    )
    return [*attention, ("o", q_out, hidden, False), *mlp, ("down", inter, hidden, False)]


def config_projections(layout: str, config) -> list[tuple[str, int, int, bool]]:
    """`projections` of one layer of a model ``config`` in ``layout``."""
    q_out = config.num_attention_heads * config.head_dim
    kv_out = config.num_key_value_heads * config.head_dim
    return projections(layout, config.hidden_size, q_out, kv_out, config.intermediate_size)


def parse_shape_args(ap: argparse.ArgumentParser, argv: list[str] | None):
    """``ap`` with the options both projection benchmarks take (``--shape``, ``--reps``, ``--device``, ``--out``)
    parsed from ``argv``: ``(args, device, model config, dtype)`` (bf16 on a GPU, float32 for a CPU smoke test)."""
    ap.add_argument("--shape", default="glm4-9b", choices=[s for s in SHAPES if not s.endswith("-hf")])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    return args, device, model_config(args.shape), torch.bfloat16 if device.type == "cuda" else torch.float32


def build(layout: str, config, device, dtype):
    """Every layer's weights (and biases) of ``layout``, the LM head, and one step's inputs."""
    hidden = config.hidden_size
    spec = config_projections(layout, config)
    layers = []
    for _ in range(config.num_hidden_layers):
        layers.append(
            [
                (
                    name,
                    torch.randn(n_out, n_in, device=device, dtype=dtype) * n_in**-0.5,
                    torch.randn(n_out, device=device, dtype=dtype) if bias else None,
                )
                for name, n_in, n_out, bias in spec
            ]
        )
    head = torch.randn(config.vocab_size, hidden, device=device, dtype=dtype) * hidden**-0.5
    inputs = {n_in: torch.randn(1, n_in, device=device, dtype=dtype) for _, n_in, _, _ in spec}
    return layers, head, inputs


def step(layers, head, inputs) -> torch.Tensor:
    """One decode step's projections, in layer order (each reads a fixed input of its width: the cost of the
    GEMV, not of what feeds it)."""
    for layer in layers:
        for _, w, b in layer:
            F.linear(inputs[w.shape[1]], w, b)
    return F.linear(inputs[head.shape[1]], head)


def weight_bytes(layers, head) -> int:
    total = head.numel() * head.element_size()
    for layer in layers:
        for _, w, b in layer:
            total += w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
    return total


def per_projection_ms(layers, reps: int) -> dict[str, float]:
    """Each projection name's ms over all layers, from a graph of that projection alone."""
    out = {}
    for j, (name, w0, _) in enumerate(layers[0]):
        x = torch.randn(1, w0.shape[1], device=w0.device, dtype=w0.dtype)

        def one(j=j, x=x):
            for layer in layers:
                F.linear(x, layer[j][1], layer[j][2])

        out[name] = time_graph([one], reps=reps)["ms"]
    return out


def measure(layout: str, config, device, dtype, tbps: float | None, reps: int) -> dict:
    """One layout's row: its weights' bytes and, on a GPU, the step's, each projection's and the head's ms."""
    layers, head, inputs = build(layout, config, device, dtype)
    nbytes = weight_bytes(layers, head)
    row = {"layout": layout, "projections_per_layer": len(layers[0]), "weight_bytes": nbytes}
    if device.type != "cuda":
        step(layers, head, inputs)  # runs: shapes and dtypes check out; no timing off the GPU
        return row
    row["step_ms"] = time_graph([lambda: step(layers, head, inputs)], reps=reps)["ms"]
    row["floor_ms"] = nbytes / tbps / 1e9
    row["vs_floor"] = row["step_ms"] / row["floor_ms"]
    row["per_projection_ms"] = per_projection_ms(layers, reps)
    row["head_ms"] = time_graph([lambda: F.linear(inputs[head.shape[1]], head)], reps=reps)["ms"]
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    args, device, config, dtype = parse_shape_args(ap, argv)
    layouts = [s.strip() for s in args.layouts.split(",") if s.strip()]
    for layout in layouts:
        if layout not in LAYOUTS:
            raise SystemExit(f"--layouts: unknown layout {layout!r}; choose from {', '.join(LAYOUTS)}")
    tbps = measure_bandwidth()["read_tbps"] if device.type == "cuda" else None
    rows = [measure(layout, config, device, dtype, tbps, args.reps) for layout in layouts]
    print(f"{args.shape}, batch 1, {dtype}, read bandwidth {tbps or float('nan'):.2f} TB/s")
    print("| layout | projections a layer | GB | step ms | floor ms | vs floor | by projection (ms, all layers) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r.get("per_projection_ms", {}).items())
        if "head_ms" in r:
            parts += f", head {r['head_ms']:.3f}"
        print(
            f"| {r['layout']} | {r['projections_per_layer']} | {r['weight_bytes'] / 1e9:.2f} | "
            f"{r.get('step_ms', float('nan')):.3f} | {r.get('floor_ms', float('nan')):.3f} | "
            f"{r.get('vs_floor', float('nan')):.2f}x | {parts} |"
        )
    if args.out:
        meta = {"shape": args.shape, "read_tbps": tbps, "torch": torch.__version__}
        if device.type == "cuda":
            meta["device"] = torch.cuda.get_device_name()
        Path(args.out).write_text(json.dumps({**meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
