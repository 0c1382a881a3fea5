#!/usr/bin/env python
"""How long dynamo takes to trace a decode step's forward, and whether marking the decoder layer as a
nested compile region (``torch.compiler.nested_compile_region``) lets it trace one layer and reuse it.

The warm first ``generate()`` of a static cache is nearly all dynamo's trace of the whole forward
(docs/performance.md). torch >= 2.9 can trace a region marked with ``nested_compile_region`` once and
stamp it out for the next identical calls; this probe times the trace (a backend that runs the traced graph: no
inductor) of one decode step of a random-weight Llama, with transformers' `StaticCache` and with a
static-layout `LocksCache`, each plain and with the layer class's ``forward`` marked (done here, on
this probe's own model, only to measure), and counts the region's reuses and refusals from torch's
``hierarchical_compile`` log.

    python scripts/dev/trace_time.py --layers 32 --out runs/trace_time.json
    python scripts/dev/trace_time.py --device cuda --out runs/trace_time_gpu.json   # the Triton backend
    TRITON_INTERPRET=1 python scripts/dev/trace_time.py --caches hf-static,locks-kernels   # its graph, on a CPU

On the CPU a `LocksCache` decodes on the PyTorch reference path, which the trace inlines op by op (about
six times the graph of `StaticCache`); on a GPU its decode is one custom op a layer, as in `generate()`,
which ``locks-kernels`` traces on the CPU (the graph then runs under Triton's interpreter: slow; the
dynamo seconds are torch's own count, apart from the run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from pathlib import Path

import torch
from transformers import StaticCache

from locks_hf import LocksCache
from locks_hf.backends import TRITON
from locks_hf.models import tiny_model


class _Reuses(logging.Handler):
    """Counts torch's ``hierarchical_compile`` messages: reuses and refusals, with the first reason."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.hits = self.refusals = 0
        self.reason = ""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if " hit " in message:  # "cache hit for ...", "hash key N hit for ..."
            self.hits += 1
        elif "not eligible" in message or "reuse failed" in message:
            self.refusals += 1
            self.reason = self.reason or message.split("--", 1)[-1].strip().splitlines()[0]


def _model(layers: int):
    return tiny_model(
        "llama",
        attn_implementation="sdpa",
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=8,
        head_dim=32,
        vocab_size=1000,
    )


def make_cache(kind: str, model, max_cache_len: int):
    """The probe's cache: transformers' `StaticCache` (``hf-static``) or a static `LocksCache` (``locks*``; the
    model's attention is switched to Locks)."""
    if kind.startswith("locks"):
        model.set_attn_implementation("locks")
        return LocksCache(model.config, layout="static", max_cache_len=max_cache_len, page_size=16, budget=64)
    return StaticCache(config=model.config, max_cache_len=max_cache_len)


def on_kernels(cache) -> None:
    """Decode through the kernels' custom ops (one a layer), as on a GPU; on a CPU they run interpreted."""
    import locks_hf.kernels  # noqa: F401  (registers the custom ops)

    for layer in cache.locks_layers:
        layer.backend, layer.kernel_plan = TRITON, TRITON.plan(layer.config)


@contextlib.contextmanager
def _layer_marked(layer_class: type, marked: bool):
    """The layer class's ``forward`` marked as a nested compile region within the block (restored after)."""
    forward = layer_class.forward
    if marked:
        layer_class.forward = torch.compiler.nested_compile_region(forward)
    try:
        yield
    finally:
        layer_class.forward = forward


def trace_once(cache_kind: str, layers: int, marked: bool, device: str) -> dict:
    torch._dynamo.reset()
    model = _model(layers).to(device, torch.bfloat16 if device == "cuda" else torch.float32)
    cache = make_cache(cache_kind, model, 512)
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(1)).to(device)
    reuses = _Reuses()
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm  # run as traced: the time measured is dynamo's alone

    log = logging.getLogger("torch._dynamo.variables.invoke_subgraph.__hierarchical_compile")
    torch._logging.set_logs(hierarchical_compile=True)
    log.addHandler(reuses)
    try:
        with torch.no_grad(), _layer_marked(type(model.model.layers[0]), marked):
            model(ids, past_key_values=cache, use_cache=True)
            if cache_kind == "locks-kernels":  # the GPU's decode (one custom op a layer), run by the interpreter
                on_kernels(cache)
            step = torch.compile(model.__call__, backend=backend, fullgraph=True, dynamic=False)
            token, position = ids[:, -1:], torch.tensor([64], device=device)
            before = dict(torch._dynamo.utils.calculate_time_spent())
            start = time.perf_counter()
            step(token, past_key_values=cache, cache_position=position, use_cache=True)
            first = time.perf_counter() - start
            spent = {k: v - before.get(k, 0.0) for k, v in torch._dynamo.utils.calculate_time_spent().items()}
            nodes = sum(len(g.graph.nodes) for g in graphs)
            inputs = sum(1 for g in graphs for n in g.graph.nodes if n.op == "placeholder")
            start = time.perf_counter()
            step(token, past_key_values=cache, cache_position=position + 1, use_cache=True)
            second = time.perf_counter() - start
    finally:
        log.removeHandler(reuses)
        torch._logging.set_logs()
    return {
        "cache": cache_kind,
        "layers": layers,
        "marked": marked,
        "device": device,
        "graph_nodes": nodes,
        "graph_inputs": inputs,
        "dynamo_s": round(spent.get("entire_frame_compile", 0.0) - spent.get("backend_compile", 0.0), 3),
        "first_call_s": round(first, 3),
        "second_call_s": round(second, 4),
        "region_reuses": reuses.hits,
        "region_refusals": reuses.refusals,
        "refusal_reason": reuses.reason,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument(
        "--caches",
        default="hf-static,locks",
        help="comma list of hf-static, locks, locks-kernels (on the CPU: the kernels' custom ops, TRITON_INTERPRET=1)",
    )
    ap.add_argument(
        "--marked",
        choices=("both", "no", "yes"),
        default="both",
        help="trace with the decoder layer plain (no), marked as a nested compile region (yes), or both",
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    marks = {"both": (False, True), "no": (False,), "yes": (True,)}[args.marked]
    rows = [trace_once(kind, args.layers, marked, args.device) for kind in args.caches.split(",") for marked in marks]
    print(
        f"{'cache':<10} {'marked':<7} {'dynamo s':>8} {'call s':>7} {'nodes':>6} {'inputs':>6} {'reuses':>7} "
        f"{'refusals':>9}  reason"
    )
    for r in rows:
        print(
            f"{r['cache']:<10} {r['marked']!s:<7} {r['dynamo_s']:>8.2f} {r['first_call_s']:>7.2f} {r['graph_nodes']:>6} "
            f"{r['graph_inputs']:>6} {r['region_reuses']:>7} "
            f"{r['region_refusals']:>9}  {r['refusal_reason']}"
        )
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "transformers": __import__("transformers").__version__}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
