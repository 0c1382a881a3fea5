#!/usr/bin/env python
"""Complete decode step of a random-weight model (one-token forward with the cache, as generate runs it).

Builds a random-weight model with a real shape (default Llama-3.1-8B: 32 layers, 32 query heads, 8 KV
heads, d=128, bf16), fills the cache with a synthetic prefill of N tokens per layer (structured random
keys: a per-page offset plus per-token noise; summaries built as after a real prefill), then times
one-token forwards for each arm: dense (``full``) and Locks / Quest at budget b (Locks with exact
re-ranking: ``r4i4-rr4``, ...). Each row also gives the bytes the step reads from the cache by the
arm's rule (summaries, re-ranked keys, attended K/V), so that time and traffic can be set side by side.
An arm ending in ``+gemv`` (``r4i4+gemv``, ``full+gemv``) runs with the model's projections on the library's
GEMV kernel (`locks_hf.gemv_projections`), the others on ``nn.Linear`` (cuBLAS). The arm ``no-attention`` is the same model with every attention replaced by a copy of its query (projections,
norms, RoPE, the K/V write, the LM head: the step less its attention), beside the weights' read floor at the
device bandwidth measured in the same run; a compiled run warns when that arm runs fewer matrix products
than the dense one (a projection dropped by the compiler).

``--graphs`` picks how the step runs:

* ``none``    eager, `LocksCache` in its dynamic layout for every arm (dense = ``selector="full"``: SDPA over the cache);
* ``cuda``    static caches (`LocksStaticCache`; dense = ``selector="full"``: flash-decoding over the
              written length on our attention kernel; ``hf-static`` = transformers' `StaticCache`, whose
              SDPA reads the whole capacity through a mask), the whole step captured once in a CUDA graph
              and replayed (gpt-fast style);
* ``compile`` static caches, ``torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``
              (what `generate()` does with a static cache: inductor + CUDA graphs);
* ``compile-cuda`` static caches, the step compiled by inductor without CUDA graphs
              (``torch.compile(model.forward, fullgraph=True)``) and captured by hand in one CUDA graph, as in
              ``cuda``: inductor's fusion with nothing left on the host per step (the floor of ``captured``);
* ``captured`` static caches, ``torch.compile(model.forward, backend=captured_backend, fullgraph=True)``
              (what ``generate(..., compile_config=decode_compile_config())`` does: inductor's kernels
              captured in one CUDA graph by the library, without CUDA-graph trees' per-step checks).

With graphs, the script also checks that a replayed step gives the logits of the same step run
eagerly (the cache rewound by one token in between). CUDA-event medians after warm-up, and the mean over the
same steps (``mean ms/step``): a step that completes a page also summarizes it, so over a multiple of the page
size (the default 32 steps, two pages of 16) the mean is the time a token costs on average. On a GPU each row
also gives the host's median time to queue a step (``host ms/step``): near the step's time, the host bounds it.

    python scripts/bench_decode_step.py --graphs cuda --contexts 128K,512K --out results/h200/decode_step_h200_graphs.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import statistics
import time

import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    GlmConfig,
    LlamaConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    StaticCache,
)
from transformers.masking_utils import AttentionMaskInterface

from locks_hf import LocksCache, LocksConfig, LocksStaticCache, traffic
from locks_hf.captured_step import DECODE_INDUCTOR_OPTIONS, captured_backend, step_stats
from locks_hf.compat import cache_keyword
from locks_hf.kv_quant import kv_token_bytes
from locks_hf.selectors import config_for_family, make_selector

TINY = dict(  # (head_dim 32: quantized-KV arms need a value group of 32 channels)
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=256,
)

GLM4_9B = dict(
    hidden_size=4096,
    intermediate_size=13696,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=2,
    head_dim=128,
    vocab_size=151552,
)

SHAPES = {
    "llama3.1-8b": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    # GLM-4-9B-Chat-1M: the paper's headline efficiency model (40 layers, 32 query / 2 KV heads); a Llama
    # block of its shape (GLM's partial RoPE does not change the cost of a decode step).
    "glm4-9b": GLM4_9B,
    # The same model as transformers builds it from THUDM/glm-4-9b-chat-1m-hf (``GlmForCausalLM``, whose config
    # defaults are GLM-4-9B's): q/k/v projections with biases, gate and up in one projection, RoPE on half of
    # each head. Six projections a layer against the Llama block's seven.
    "glm4-9b-hf": dict(model_type="glm"),
    # GLM-4-9B-Chat-1M's own modules (the paper's model as THUDM/glm-4-9b-chat-1m ships it): q, k and v in one
    # projection (``query_key_value``) and gate and up in one (``dense_h_to_4h``), RoPE on half of each head. Four
    # projections a layer, as transformers' Phi-3 block has them (without GLM-4's q/k/v bias, which costs a
    # decode step nothing measurable); the layout a gpt-fast-style step of the model runs.
    "glm4-9b-fused": dict(
        GLM4_9B,
        model_type="phi3",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        pad_token_id=0,
    ),
    "tiny": TINY,
    "tiny-glm": dict(TINY, model_type="glm", pad_token_id=0),
    "tiny-fused": dict(TINY, model_type="phi3", pad_token_id=0, bos_token_id=0, eos_token_id=0),
}


def model_config(shape: str, **fields) -> PretrainedConfig:
    """The config of ``SHAPES[shape]`` (a Llama block unless the entry names another ``model_type``), with
    a 2M-token position range and ``fields`` on top."""
    spec = dict(SHAPES[shape])
    config_class = {"llama": LlamaConfig, "glm": GlmConfig, "phi3": Phi3Config}[spec.pop("model_type", "llama")]
    return config_class(**{**spec, "max_position_embeddings": 2**21, **fields})


def random_model(shape: str, device: torch.device, **fields) -> PreTrainedModel:
    """A random-weight model of ``SHAPES[shape]`` (`model_config`) on ``device`` with Locks attention: bf16
    on CUDA, float32 elsewhere."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            model_config(shape, **fields), attn_implementation="locks", dtype=dtype
        )
    return model.eval()


def parse_tokens(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 1024, "M": 1024 * 1024}.get(text[-1], 1)
    return int(text.rstrip("KM")) * mult


def synthetic_prefill(cache, config, n_tokens: int, device, dtype, page_size: int = 16) -> None:
    """Fill every layer with ``n_tokens`` of structured random K/V and summarize the pages."""
    h, d, B = config.num_key_value_heads, config.head_dim, page_size
    gen = torch.Generator(device=device).manual_seed(0)
    for idx in range(config.num_hidden_layers):
        pages = n_tokens // B
        keys = (
            (
                torch.randn(1, h, pages, 1, d, device=device, generator=gen) * 2
                + torch.randn(1, h, pages, B, d, device=device, generator=gen)
            )
            .flatten(2, 3)
            .to(dtype)
        )
        values = torch.randn(1, h, n_tokens, d, device=device, generator=gen, dtype=dtype)
        cache.update(keys, values, idx)
        layer = cache.layers[idx]
        if hasattr(layer, "prepare"):  # a Locks layer: what the attention function does after prefill
            layer.prepare(None, n_tokens)
            # what a real prefill also leaves: the last prompt queries (RocketKV's SnapKV stage, TriAttention's
            # statistics) and, after KVzip's reconstruction passes, its scores (random here: the cost is the same)
            queries = torch.randn(1, config.num_attention_heads, 32, d, device=device, generator=gen).to(dtype)
            layer.observe_prompt_queries(queries, d**-0.5)
            if hasattr(layer, "prefill_scores"):
                layer.prefill_scores["kvzip"] = torch.rand(1, h, n_tokens, device=device, generator=gen)
        del keys, values


HF_STATIC = "hf-static"  # transformers' own StaticCache (dense, masked SDPA over the capacity)
NO_ATTENTION = "no-attention"  # every attention output its query, no K/V read: the step less its attention


def skip_attention(module, query, key, value, attention_mask, **kwargs):
    """An attention function that reads no K/V: its output is the (roped) query itself, of the output's shape
    ``[b, q_len, heads, d]``, so that no compiler can drop the query's projection or RoPE. Zeros leave that to
    the compiler: zeros of the shape alone let inductor drop ``q_proj`` on the CPU, and ``query * 0`` lets its
    CUDA build do the same (242 of 282 matrix products for GLM-4-9B, about 0.6 ms of the step on an H100)."""
    return query.transpose(1, 2), None


AttentionInterface.register(NO_ATTENTION, skip_attention)
AttentionMaskInterface.register(NO_ATTENTION, lambda *args, **kwargs: None)  # nothing to mask


#: Arm suffix: the model's projections on the GEMV kernel (`locks_hf.gemv_projections`), e.g. ``r4i4+gemv``.
GEMV_SUFFIX = "+gemv"


def arm_family(name: str) -> str:
    """The arm without its `GEMV_SUFFIX`."""
    return name.removesuffix(GEMV_SUFFIX)


def make_arm(name: str, budget: int) -> LocksConfig:
    # any registered arm family: r4i4 / locks-r8i4, full, quest, oracle, the baselines (eager: --graphs none)
    name = arm_family(name)
    return config_for_family("full" if name in (HF_STATIC, NO_ATTENTION) else name, budget=budget)


def set_projections(model, gemv: bool) -> None:
    """The model's projections on the GEMV kernel (``gemv``: `locks_hf.gemv_projections`) or on ``nn.Linear``
    (`locks_hf.linear_projections`), from whichever they are on."""
    from locks_hf import gemv_projections, linear_projections
    from locks_hf.projections import GemvLinear

    on_gemv = any(isinstance(m, GemvLinear) for m in model.modules())
    if gemv and not on_gemv:
        gemv_projections(model)
    elif on_gemv and not gemv:
        linear_projections(model)


def weight_read_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter, less the input embedding's table (one row
    is read) unless the LM head reads it as its own."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    return total if embed is head else total - embed.numel() * embed.element_size()


def read_bytes_per_step(locks: LocksConfig, config, context: int, dtype: torch.dtype) -> int | None:
    """Bytes one decode step reads from the cache over all layers and KV heads, from the arm's rule
    (``None`` for the token-level baselines): dense K/V; or the scored pages' summaries (the oracle:
    every key), the keys of a re-ranked short list and the K/V of the ``k`` attended pages, at their
    stored size (packed codes with their scales and zero points for quantized KV)."""
    h, d, n = config.num_key_value_heads, config.head_dim, config.num_hidden_layers
    key, value = kv_token_bytes(locks, d, d, torch.finfo(dtype).bits // 8)  # one token's stored key, value
    selector = make_selector(locks)
    if selector is None:
        return n * h * traffic.attended_kv_bytes(context, key, value)
    if selector.token_level:
        return None
    B = locks.page_size
    pages = context // B
    reads = traffic.selection_reads(selector, pages, context, B)
    probe = selector.summarize(torch.zeros(1, 1, 1, B, d, dtype=dtype), torch.ones(1, 1, 1, B, dtype=torch.bool))
    estimate = traffic.selection_read_bytes(
        reads, pages * sum(t.numel() * t.element_size() for t in probe.values()), key
    )
    return n * h * (estimate + traffic.attended_kv_bytes(locks.page_slots * B, key, value))


def make_cache(graphs: str, config, name: str, locks: LocksConfig, capacity: int):
    if name == NO_ATTENTION:  # nothing reads it: a few slots for the steps' K/V writes
        return StaticCache(config, max_cache_len=capacity)
    if graphs == "none":
        return LocksCache(config, locks, layout="dynamic")
    if name == HF_STATIC:
        return StaticCache(config, max_cache_len=capacity)
    return LocksStaticCache(config, max_cache_len=capacity, locks=locks)


def tokens_label(n: int) -> str:
    """``131072`` -> ``"128K"``; a count that is not a multiple of 1024 as it is."""
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def rewind(cache, n: int = 1) -> None:
    """Move a static cache's length back by ``n`` tokens (the next step rewrites those slots)."""
    for layer in cache.layers:
        layer.cumulative_length.sub_(n)
        if hasattr(layer, "length_t"):
            layer.length_t.sub_(n)


#: ``--graphs`` modes compiled by inductor (its generated code can be read back).
INDUCTOR_GRAPHS = ("compile", "compile-cuda")
#: A matrix product in inductor's generated code: a call of an extern kernel (cuBLAS, oneDNN) or of a template.
_PRODUCT = re.compile(
    r"extern_kernels\.(?:mm|addmm|bmm|baddbmm|_int_mm)\(|\b(?:triton|cpp)_tem_\w+\.run\(|\bcpp_tem_\w+\("
)


def matrix_products(codes: list[str]) -> int:
    """Matrix products that inductor's generated ``codes`` (one string a compiled graph) run: what shows
    whether a projection the step does not need was dropped (the ``no-attention`` arm must keep ``q_proj``)."""
    return sum(len(_PRODUCT.findall(code)) for code in codes)


def lost_products(rows: list[dict]) -> list[dict]:
    """The ``no-attention`` rows whose compiled step runs fewer matrix products than the dense (``full``) step of
    the same context, each given ``lost_products`` (how many fewer): what a compiler dropped from the arm."""
    full = {r["context"]: r.get("matrix_products") for r in rows if r["arm"] == "full"}
    lost = []
    for r in rows:
        dense, own = full.get(r["context"]), r.get("matrix_products")
        if r["arm"] == NO_ATTENTION and dense is not None and own is not None and own < dense:
            r["lost_products"] = dense - own
            lost.append(r)
    return lost


class Stepper:
    """One-token forwards on ``cache``: eager, a captured CUDA graph, or torch.compile."""

    def __init__(self, model, cache, graphs: str, inductor_options: dict | None = None) -> None:
        self.model, self.cache, self.graphs = model, cache, graphs
        self.token = torch.ones(1, 1, dtype=torch.long, device=model.device)
        self.cache_kw = {cache_keyword(model): cache}  # transformers >= 5.24 names it `cache`
        self.fn = lambda: model(self.token, **self.cache_kw, logits_to_keep=1).logits
        compile_options = {
            "compile": {"mode": "reduce-overhead"},
            "compile-cuda": {"options": inductor_options or None},
            "captured": {"backend": captured_backend, "options": inductor_options or None},
        }
        if graphs in compile_options:
            compiled = torch.compile(model.forward, fullgraph=True, **compile_options[graphs])
            # the replayed graphs of "compile" and "captured" overwrite their logits at the next step (as generate()
            # does, keep a copy); "compile-cuda" is captured below, where the logits are the graph's own output
            keep = (lambda t: t) if graphs == "compile-cuda" else torch.clone
            self.fn = lambda: keep(compiled(self.token, **self.cache_kw, logits_to_keep=1).logits)
        self.graph = None
        self.products: int | None = None  # matrix products in the compiled step (`matrix_products`)

    def warm_up(self, n: int) -> None:
        for i in range(n):
            if i == 0 and self.graphs in INDUCTOR_GRAPHS:  # the compiling call: keep what inductor generated
                from torch._inductor.utils import run_and_get_code

                codes = run_and_get_code(self.fn)[1]
                self.products = matrix_products(codes) if codes else None  # None: no code came back to read
            else:
                self.fn()
        if self.graphs in ("cuda", "compile-cuda"):
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.fn()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.out = self.fn()  # recorded, not run: the cache does not advance here

    def step(self) -> torch.Tensor:
        if self.graph is not None:
            self.graph.replay()
            return self.out
        return self.fn()


def check_replay(stepper: Stepper) -> float:
    """Max |logit difference| between a graph/compiled step and the same step run eagerly."""
    eager = stepper.model(stepper.token, **stepper.cache_kw, logits_to_keep=1).logits.float()
    rewind(stepper.cache)
    replayed = stepper.step().float()
    return float((replayed - eager).abs().max())


def time_steps(stepper: Stepper, steps: int, host: list[float] | None = None) -> list[float]:
    """Each step's time in ms (CUDA events on a GPU, wall clock on a CPU). On a GPU, ``host`` (if given)
    gets each step's host time in ms: from the call until its last launch is queued. A step whose host
    time is near its measured time is bound by the host (launch latency, guards, Python), not by its
    kernels."""
    times = []
    for _ in range(steps):
        if stepper.model.device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            stepper.step()
            stop.record()
            if host is not None:
                host.append(1e3 * (time.perf_counter() - t0))
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            t0 = time.perf_counter()
            stepper.step()
            times.append(1e3 * (time.perf_counter() - t0))
    return times


#: Kernel groups of `profile_step`, by name: the library's Triton kernels (``_..._kernel``), inductor's generated
#: ones, the vendor's matrix products; anything else (copies, torch's own kernels) is "other".
KERNEL_GROUPS = (
    ("library", re.compile(r"^_\w+_kernel$")),
    ("inductor", re.compile(r"^triton_")),
    ("matrix products", re.compile(r"nvjet|gemv|gemm|cublas|cutlass|splitk|xmma", re.IGNORECASE)),
)


def kernel_group(name: str) -> str:
    """The `KERNEL_GROUPS` group of a kernel's name."""
    return next((group for group, pattern in KERNEL_GROUPS if pattern.search(name)), "other")


def profile_step(stepper: Stepper, steps: int, top: int = 12) -> dict:
    """Kernels of ``steps`` eager one-token forwards (torch.profiler): count per step and the top ones
    by GPU kernel time, so a step's time can be attributed (graph replays hide their kernels)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            stepper.fn()
            if stepper.graphs != "none":
                rewind(stepper.cache)  # a static cache stays within its capacity
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events) / steps / 1e3
    kernels = sum(e.count for e in events) / steps
    rows = [
        {"name": e.key[:90], "ms_per_step": e.device_time_total / steps / 1e3, "per_step": e.count / steps}
        for e in events[: top or None]
    ]
    groups: dict[str, dict] = {}
    for e in events:
        g = groups.setdefault(kernel_group(e.key), {"ms_per_step": 0.0, "per_step": 0.0})
        g["ms_per_step"] += e.device_time_total / steps / 1e3
        g["per_step"] += e.count / steps
    print(f"  profile: {kernels:.0f} kernels/step, {total:.2f} ms GPU kernel time/step")
    for name, g in groups.items():
        print(f"    {name}: {g['ms_per_step']:.3f} ms in {g['per_step']:.0f} kernels a step")
    for r in rows:
        print(f"    {r['ms_per_step']:8.3f} ms  x{r['per_step']:5.0f}  {r['name']}")
    return {"kernels_per_step": kernels, "device_ms_per_step": total, "groups": groups, "top": rows}


def host_profile(stepper: Stepper, steps: int, top: int = 15) -> list[dict]:
    """Where the host's time goes over ``steps`` timed-path steps (cProfile, which slows Python down, so read
    the shares rather than the absolute times): the functions with the most time of their own per step."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        stepper.step()
        prof.disable()
        rewind(stepper.cache)  # a static cache stays within its capacity
    if stepper.model.device.type == "cuda":
        torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (calls, prim calls, own s, cumulative s, callers)}
    rows = sorted(
        (
            {
                "function": f"{name} ({os.path.basename(file)}:{line})",
                "own_ms_per_step": 1e3 * own / steps,
                "calls_per_step": calls / steps,
            }
            for (file, line, name), (_, calls, own, _, _) in stats.items()
        ),
        key=lambda r: -r["own_ms_per_step"],
    )[:top]
    total = sum(1e3 * st[2] for st in stats.values()) / steps
    print(f"  host profile: {total:.2f} ms of Python per step under cProfile")
    for r in rows:
        print(f"    {r['own_ms_per_step']:7.3f} ms  x{r['calls_per_step']:6.0f}  {r['function']}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama3.1-8b", choices=list(SHAPES))
    ap.add_argument("--contexts", default="128K,512K")
    ap.add_argument("--budget", type=int, default=2048)
    ap.add_argument(
        "--arms",
        default="full,r4i4,r8i4,quest",
        help=f"comma list: full (dense), {HF_STATIC} (transformers' StaticCache; with graphs), {NO_ATTENTION} (the "
        "step less its attention, with the weights' read floor), quest, "
        "oracle, Locks labels (r4i4, ...), the baselines (rocketkv, shadowkv, kvzip, rkv, triattention, "
        "lazy_eviction; eager only); an arm ending in +gemv runs with the model's projections on the GEMV kernel "
        "(locks_hf.gemv_projections; CUDA), e.g. r4i4+gemv",
    )
    ap.add_argument("--graphs", default="none", choices=["none", "cuda", "compile", "compile-cuda", "captured"])
    ap.add_argument("--steps", type=int, default=32, help="timed steps (a multiple of the page size for the mean)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="decode_step.json")
    ap.add_argument("--profile", type=int, default=0, help="also profile this many eager steps per arm")
    ap.add_argument("--profile-top", type=int, default=12, help="kernels listed by --profile (0: all of them)")
    ap.add_argument(
        "--inductor-options",
        type=json.loads,
        default=None,
        help="with --graphs compile-cuda or captured: inductor options as JSON, e.g. '{\"max_autotune\": true}' (GEMV "
        "templates); default: the library's decode options (captured_step.DECODE_INDUCTOR_OPTIONS), '{}': inductor's",
    )
    ap.add_argument(
        "--host-profile", type=int, default=0, help="with graphs: cProfile this many steps per arm (host time)"
    )
    ap.add_argument(
        "--isolate",
        action="store_true",
        help="run each arm in a process of its own (the same options), so that no arm runs after another "
        "arm's compiled graphs; the table and the JSON gather them",
    )
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (use --shape tiny)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.graphs in ("cuda", "compile-cuda", "captured") and device.type != "cuda":
        raise SystemExit(f"--graphs {args.graphs} needs a CUDA device")
    if args.inductor_options and args.graphs not in ("compile-cuda", "captured"):
        raise SystemExit(
            "--inductor-options applies to --graphs compile-cuda and captured (inductor without its own CUDA graphs)"
        )
    if args.inductor_options is None and args.graphs in ("compile-cuda", "captured"):
        args.inductor_options = dict(DECODE_INDUCTOR_OPTIONS)
    if args.host_profile and args.graphs == "none":
        raise SystemExit("--host-profile needs --graphs (it rewinds a static cache between steps)")

    rows = run_isolated(args) if args.isolate else run_arms(args, device, dtype)
    report(rows, args, dtype, torch.cuda.get_device_name() if device.type == "cuda" else "CPU")


def run_isolated(args) -> list[dict]:
    """Each arm in a child process running this script with the same options; rows in the order one
    process would give (context, then arm)."""
    import subprocess
    import sys
    import tempfile

    arms = args.arms.split(",")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, arm in enumerate(arms):
            out = os.path.join(tmp, f"{i}.json")
            cmd = [sys.executable, __file__, "--arms", arm, "--out", out, "--shape", args.shape]
            cmd += ["--contexts", args.contexts, "--budget", str(args.budget), "--graphs", args.graphs]
            cmd += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--profile", str(args.profile)]
            cmd += ["--profile-top", str(args.profile_top)]
            if args.inductor_options is not None:
                cmd += ["--inductor-options", json.dumps(args.inductor_options)]
            cmd += ["--host-profile", str(args.host_profile), "--device", args.device]
            print(f"--isolate: arm {arm} in a process of its own", flush=True)
            subprocess.run(cmd, check=True)
            with open(out) as f:
                rows += json.load(f)["rows"]
    contexts = list(map(parse_tokens, args.contexts.split(",")))
    return sorted(rows, key=lambda r: (contexts.index(r["context"]), arms.index(r["arm"])))


def run_arms(args, device: torch.device, dtype: torch.dtype) -> list[dict]:
    """Every arm at every context in this process."""
    model = random_model(args.shape, device)
    config = model.config
    arms = {a: make_arm(a, args.budget) for a in args.arms.split(",")}

    rows = []
    with torch.no_grad():
        for ctx in map(parse_tokens, args.contexts.split(",")):
            capacity = ctx + args.warmup + args.steps + 64
            shared = None
            for name, locks in arms.items():
                family = arm_family(name)
                set_projections(model, name != family)
                model.set_attn_implementation(NO_ATTENTION if family == NO_ATTENTION else "locks")
                if family == NO_ATTENTION:
                    cache = make_cache(args.graphs, config, family, locks, args.warmup + args.steps + args.profile + 64)
                elif args.graphs == "none" and locks.kv_bits != 16:  # quantized KV: a cache of its own
                    cache = make_cache("none", config, name, locks, capacity)
                    synthetic_prefill(cache, config, ctx, device, dtype)
                elif args.graphs == "none":  # one dynamic cache, re-configured per arm
                    if shared is None:
                        shared = make_cache("none", config, "full", make_arm("full", args.budget), capacity)
                        synthetic_prefill(shared, config, ctx, device, dtype)
                    cache = shared
                    for layer in cache.locks_layers:
                        layer.set_config(locks)
                        layer.summarize_completed()  # rebuilt only when the summary layout changed
                else:  # static caches are built per arm (their layout is fixed at creation)
                    cache = make_cache(args.graphs, config, family, locks, capacity)
                    synthetic_prefill(cache, config, ctx, device, dtype)
                torch._dynamo.reset()
                stepper = Stepper(model, cache, args.graphs, args.inductor_options)
                stepper.warm_up(args.warmup)
                diff = check_replay(stepper) if args.graphs != "none" else None
                if hasattr(cache, "reset_stats"):
                    cache.reset_stats()
                host: list[float] = []
                times = time_steps(stepper, args.steps, host)
                med = statistics.median(times)
                if family == NO_ATTENTION:  # reads no K/V
                    attended, read_bytes = 0.0, 0
                else:
                    attended = cache.attended_fraction() if hasattr(cache, "attended_fraction") else 1.0
                    read_bytes = read_bytes_per_step(locks, config, ctx, dtype)
                rows.append(
                    {
                        "context": ctx,
                        "arm": name,
                        "median_ms": med,
                        "mean_ms": statistics.fmean(times),
                        "tokens_per_s": 1e3 / med,
                        "attended": attended,
                        "read_bytes": read_bytes,
                        "replay_vs_eager_max_abs": diff,
                        "all_ms": times,
                        "host_ms": statistics.median(host) if host else None,
                        "pid": os.getpid(),
                        "captured_steps": step_stats() if args.graphs == "captured" else None,
                        "matrix_products": stepper.products,
                        "layers": config.num_hidden_layers,
                    }
                )
                if family == NO_ATTENTION:  # the step less its attention, against the weights' read floor
                    rows[-1]["weight_read_bytes"] = weight_read_bytes(model)
                    if device.type == "cuda":
                        from bench_decode import measure_bandwidth  # a 2 GiB read, as the attention floors use

                        tbps = measure_bandwidth()["read_tbps"]
                        rows[-1]["read_tbps"] = tbps
                        rows[-1]["weight_floor_ms"] = rows[-1]["weight_read_bytes"] / tbps / 1e9
                if args.graphs == "captured":  # whether the timed steps replayed the graph, and what they copied in
                    print("  captured steps:", rows[-1]["captured_steps"], flush=True)
                host_note = f", host {rows[-1]['host_ms']:.2f} ms" if host else ""
                print(rows[-1]["context"], name, f"{med:.2f} ms{host_note}", f"replay diff {diff}", flush=True)
                if args.profile and device.type == "cuda":
                    prof = rows[-1]["profile"] = profile_step(stepper, args.profile, args.profile_top)
                    # a replayed step's time past its kernels' own: the gaps between them (launch, dependencies)
                    prof["between_kernels_ms_per_step"] = med - prof["device_ms_per_step"]
                    print(f"    between kernels: {prof['between_kernels_ms_per_step']:.3f} ms a step", flush=True)
                if args.host_profile:
                    rows[-1]["host_profile"] = host_profile(stepper, args.host_profile)
                if args.graphs == "none" and cache is shared:
                    cache.reset_stats()
                    cache.crop(
                        -(args.steps + args.warmup + args.profile)
                    )  # back to the prefilled length for the next arm
                del stepper, cache
                gc.collect()  # the stepper's closures form a cycle: free the cache before the next arm's
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            del shared
    return rows


def report(rows: list[dict], args, dtype: torch.dtype, where: str) -> None:
    """The markdown table on stdout and the rows as JSON in ``args.out``."""
    mode = {
        "none": "eager",
        "cuda": "CUDA graph",
        "compile": "torch.compile reduce-overhead",
        "compile-cuda": "torch.compile captured by hand in one CUDA graph",
        "captured": "torch.compile, captured_backend",
    }[args.graphs]
    print(
        f"\nComplete decode step, {args.shape} random weights, {dtype}, batch 1, b={args.budget}, {mode}, "
        f"median and mean of {args.steps} steps ({where})\n"
    )
    print(
        f"| context | arm | ms/step | mean ms/step | host ms/step | tokens/s | vs dense (full) | vs {HF_STATIC} "
        "| tokens attended | MB read/step | replay vs eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ratios = []
        for base in ("full", HF_STATIC):
            ms = next((x["median_ms"] for x in rows if x["context"] == r["context"] and x["arm"] == base), None)
            ratios.append(f"{ms / r['median_ms']:.2f}x" if ms else "-")
        diff = "-" if r["replay_vs_eager_max_abs"] is None else f"{r['replay_vs_eager_max_abs']:.2g}"
        mb = "-" if r["read_bytes"] is None else f"{r['read_bytes'] / 2**20:.1f}"
        host = "-" if r["host_ms"] is None else f"{r['host_ms']:.2f}"
        print(
            f"| {tokens_label(r['context'])} | {r['arm']} | {r['median_ms']:.2f} | {r['mean_ms']:.2f} | {host} | "
            f"{r['tokens_per_s']:.1f} | "
            f"{ratios[0]} | {ratios[1]} | {r['attended']:.4f} | {mb} | {diff} |"
        )
    for r in rows:
        if r.get("weight_floor_ms"):
            print(
                f"{tokens_label(r['context'])} {NO_ATTENTION}: {r['median_ms']:.2f} ms against the weights' read floor "
                f"{r['weight_floor_ms']:.2f} ms ({r['weight_read_bytes'] / 1e9:.2f} GB at {r['read_tbps']:.2f} TB/s "
                f"measured): {r['median_ms'] / r['weight_floor_ms']:.2f}x"
            )
    for r in rows:
        if r.get("matrix_products") is not None:
            print(
                f"{tokens_label(r['context'])} {r['arm']}: {r['matrix_products']} matrix products in the compiled step "
                f"({r['layers']} layers)"
            )
    for r in lost_products(rows):
        print(
            f"WARNING {tokens_label(r['context'])} {NO_ATTENTION}: {r['lost_products']} matrix products fewer than "
            "the dense step's: the compiler dropped a projection, so this row is not the step less its attention"
        )
    with open(args.out, "w") as f:
        json.dump(
            {
                "shape": args.shape,
                "budget": args.budget,
                "graphs": args.graphs,
                "inductor_options": args.inductor_options,
                "isolated": args.isolate,
                "rows": rows,
            },
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
