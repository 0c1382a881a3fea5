"""The sweep runner's static engine: one prefill per batch of rows, every arm decoded from it in turn.

A *batch* is a set of rows (records, or the k samples of a record) prefilled together, densely and
eagerly, into one `LocksStaticCache` sized for prompt + generation up front (left padding is exact).
Each arm then decodes the whole batch from that prefill: the cache is switched to the arm's settings
(`LocksStaticCache.set_config`: page summaries are kept per summary layout, built once per layout)
and rewound to the prefix after the arm (`rewind`: no K/V is copied), so one copy of the prompt's
K/V serves every arm.

The decode loop is gpt-fast style: one single-token step (forward, then greedy argmax or seeded
sampling on the device) that advances static buffers in place, run

* ``"graph"`` (CUDA default): captured once per arm in a CUDA graph and replayed, so a step costs one
  launch and gives the eager step's numerics bit for bit (models whose layers are all Locks layers;
  with sliding-window layers "auto" compiles instead);
* ``"compile"``: ``torch.compile(fullgraph=True, mode="reduce-overhead")`` (inductor + CUDA graphs);
* ``"eager"`` (CPU default).

Stop rules (EOS, the runner's text rules) are checked on the host every ``check_every`` steps, not
every step; each row's answer is then cut at the step where it would have stopped, so the tokens
are those of a step-by-step check. Sampling draws Gumbel noise from a hash of (row seed, step,
token id): a row's sample does not depend on the batch it runs in nor on the arm.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from locks_hf import LocksConfig, LocksStaticCache, traffic
from locks_hf.compat import cache_keyword
from locks_hf.kv_quant import kv_token_bytes
from locks_hf.selectors import make_selector, static_selector_names

logger = logging.getLogger(__name__)

STEP_MODES = ("auto", "eager", "graph", "compile")


@dataclass
class Row:
    """One row of a batch: ``prefix`` is prefilled; decode then feeds ``forced`` (at least one token,
    the last fed token's prediction being the first generated one) or, when ``forced`` is empty, starts
    from the prefill's greedy next token (shared by every arm, counted as the first new token)."""

    prefix: torch.Tensor  # [T] token ids
    forced: list[int]
    max_new: int  # new tokens at most (the prefill's token included when ``forced`` is empty)
    finished: Callable[[list[int]], bool]  # True once these new tokens end the answer (stop rules)
    seed: int | None = None  # sampling seed (None: greedy)


@dataclass
class RowResult:
    tokens: list[int]  # new tokens, as generated (an ending EOS included)
    attended: int | None  # tokens attended / cached over the row's decode steps (None: no step)
    context: int | None
    traffic: dict | None = None  # as `LocksCache.decode_traffic` reports it for the row run alone


@dataclass
class ArmRun:
    """What decoding one arm over a batch produced."""

    results: list[RowResult]
    seconds: float  # wall time of the arm (warm-up included)
    warmup_seconds: float  # capture or compile, and the warm-up steps (undone)
    steps: int
    prefill_seconds: float  # the batch's prefill (shared by every arm)
    new_step: bool = True  # built (captured, compiled) its decode step; False: replayed an earlier arm's


class StaticEngine:
    """Batched decoding of arms from one shared prefill (see the module docstring).

    Args:
        model: a causal LM loaded with ``attn_implementation="locks"``.
        step: ``"auto"`` (CUDA graphs on a GPU, eager on the CPU), ``"graph"``, ``"compile"``, ``"eager"``.
        check_every: decode steps between host-side stop checks (the overshoot is discarded).
        sampling: ``{"temperature": t, "top_p": p}`` (None: greedy).
        prefill_chunk: prompt tokens per prefill forward (bounds the prefill's activation memory).
    """

    def __init__(
        self,
        model,
        *,
        step: str = "auto",
        check_every: int = 16,
        sampling: dict | None = None,
        prefill_chunk: int = 8192,
        pad_id: int = 0,
    ) -> None:
        if step not in STEP_MODES:
            raise ValueError(f"step must be one of {STEP_MODES}, got {step!r}")
        self.model = model
        self.cache_keyword = cache_keyword(model)  # asked once, outside the compiled step
        self.device = next(model.parameters()).device
        self.requested_step = step
        if step == "auto":
            step = "graph" if self.device.type == "cuda" else "eager"
        if step in ("graph", "compile") and self.device.type != "cuda":
            raise ValueError(f"step={step!r} needs a CUDA model (CUDA graphs); use step='eager' on {self.device}")
        self.step_mode = step
        self.check_every = max(1, int(check_every))
        self.sampling = _check_sampling(sampling)
        self.prefill_chunk = int(prefill_chunk)
        self.pad_id = pad_id
        self._compiled = None

    # -- batches -------------------------------------------------------------------------------------
    def prepare(
        self, rows: list[Row], locks: LocksConfig, prefill: Callable | None = None, max_budget: int | None = None
    ) -> PrefilledBatch:
        """Prefill ``rows`` (left padded) into a static cache sized for their generation. ``prefill``
        (``cache -> None``, rows with forced tokens only) replaces the model's prefill, e.g. to
        write synthetic K/V for a memory check. ``max_budget``: the widest budget the batch will
        decode with (page lists sized once, so budgets switch without a recompile)."""
        if len({len(r.forced) for r in rows}) != 1:
            raise ValueError("rows of one batch must feed the same number of forced tokens")
        if prefill is not None and not rows[0].forced:
            raise ValueError("a custom prefill gives no first token: rows need forced tokens")
        return PrefilledBatch(self, rows, locks, prefill, max_budget)

    def run(self, rows: list[Row], arms: list) -> Iterator[tuple[object, ArmRun]]:
        """Prefill ``rows`` once, then decode every arm (``arm.config``) from it; yields ``(arm, ArmRun)``."""
        check_arms(arms)
        batch = self.prepare(rows, arms[0].config, max_budget=max(a.config.budget for a in arms))
        for arm in arms:
            yield arm, batch.decode(arm.config)
        batch.close()

    # -- the single-token step -------------------------------------------------------------------------
    def next_token(
        self,
        cache,
        token: torch.Tensor,
        position: torch.Tensor,
        mask: torch.Tensor,
        seeds: torch.Tensor,
        step: torch.Tensor,
    ) -> torch.Tensor:
        """One decode step: the next token ``[b]`` of every row (no host synchronisation)."""
        logits = self.model(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            **{self.cache_keyword: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        return choose_tokens(logits, seeds, step, self.sampling)

    def compiled_next_token(self):
        if self._compiled is None:
            _raise_recompile_limit()
            self._compiled = torch.compile(self.next_token, fullgraph=True, mode="reduce-overhead")
        return self._compiled


def sweep_cache(config, capacity: int, locks: LocksConfig, max_budget: int | None = None) -> LocksStaticCache:
    """The cache a batch decodes on. What the engine uses of it: ``mark_prefix`` / ``rewind`` /
    ``set_config`` / ``set_budget`` / ``row_stats`` / ``locks_config``, and per Locks layer ``keys``,
    ``values``, ``summary`` and ``capacity`` (for the traffic figures and the mask width)."""
    return LocksStaticCache(config, max_cache_len=capacity, locks=locks, max_budget=max_budget)


def runs_static(config: LocksConfig) -> bool:
    """Whether the static engine decodes an arm with these settings (per-page selectors, no dense
    switch on the length, K/V in their dtype: quantized KV is dynamic-only); the runner sends the
    others to its eager path."""
    return config.selector in static_selector_names() and not config.min_context and config.kv_bits == 16


def check_arms(arms) -> None:
    hf = [a.name for a in arms if a.hf_cache is not None]
    if hf:
        raise ValueError(f"arms {hf} decode with transformers' QuantizedCache, which the static engine does not run")
    bad = [a.name for a in arms if not runs_static(a.config)]
    if bad:
        raise ValueError(
            f"the static engine decodes selectors {static_selector_names()} with min_context=0 and "
            f"kv_bits=16; arms {bad} need the eager path"
        )


def step_key(config: LocksConfig) -> LocksConfig:
    """What a decode step is built for: the settings less the budget, which the kernels read from a
    device tensor (arms that differ only in budget replay one captured or compiled step)."""
    return config.replace(budget=LocksConfig().budget)


class PrefilledBatch:
    """A batch after its prefill: `decode` runs one arm from the shared prefix and rewinds after."""

    def __init__(
        self, engine: StaticEngine, rows: list[Row], locks: LocksConfig, prefill=None, max_budget: int | None = None
    ) -> None:
        self.engine, self.rows = engine, rows
        #: (step_key, page-list widths) -> (its static buffers, the callable running one step)
        self._steps: dict[tuple, tuple[_StepState, Callable]] = {}
        model, dev = engine.model, engine.device
        b = len(rows)
        self.n_forced = len(rows[0].forced)
        lengths = [int(r.prefix.numel()) for r in rows]
        L = max(lengths)
        # decode steps: forced tokens after the first, then one per generated token (the last token
        # generated is never fed; with no forced token the prefill's token is the first new one)
        longest = max(r.max_new for r in rows)
        self.steps = max(0, longest - 1 if self.n_forced == 0 else self.n_forced - 1 + longest)
        capacity = L + max(self.steps, 2)  # room for the warm-up steps of a short decode
        self.cache = sweep_cache(model.config, capacity, locks, max_budget)
        capacity = self.cache.locks_layers[0].capacity if self.cache.locks_layers else capacity
        ids = torch.full((b, L), engine.pad_id, dtype=torch.long)
        mask = torch.zeros((b, capacity), dtype=torch.long)
        for i, (r, n) in enumerate(zip(rows, lengths)):
            ids[i, L - n :] = r.prefix
            mask[i, L - n :] = 1
        prefill_mask = mask[:, :L].to(dev)
        mask[:, L:] = 1  # decode slots are real
        self.decode_mask = mask.to(dev)
        t0 = time.perf_counter()
        if prefill is None:
            self.first = self._prefill(ids.to(dev), prefill_mask)
        else:
            self.first = prefill(self.cache)
        self.cache.mark_prefix()  # reads the length: the prefill has finished on the device
        self.prefill_seconds = time.perf_counter() - t0
        self.length = L
        self.pad = torch.tensor([L - n for n in lengths], device=dev)
        self.seeds = torch.tensor([r.seed if r.seed is not None else 0 for r in rows], dtype=torch.long, device=dev)

    def _prefill(self, ids: torch.Tensor, mask: torch.Tensor) -> list[int] | None:
        """Dense, eager prefill in chunks; the greedy next token per row when no token is forced."""
        positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)
        L = ids.shape[1]
        chunk = self.engine.prefill_chunk if self.engine.prefill_chunk > 0 else L
        with torch.no_grad():
            for start in range(0, L, chunk):
                end = min(L, start + chunk)
                out = self.engine.model(
                    input_ids=ids[:, start:end],
                    attention_mask=mask[:, :end],
                    position_ids=positions[:, start:end],
                    **{self.engine.cache_keyword: self.cache},
                    use_cache=True,
                    logits_to_keep=1,
                )
        if self.n_forced:
            return None
        return out.logits[:, -1].argmax(-1).tolist()

    def close(self) -> None:
        """Free the cache (its K/V) and the captured steps now rather than when the batch object goes."""
        self.cache = None
        self._steps.clear()

    # -- one arm ---------------------------------------------------------------------------------------
    @torch.no_grad()
    def decode(self, locks: LocksConfig) -> ArmRun:
        """Decode every row under ``locks`` from the shared prefix (the cache is rewound to it first)."""
        t0 = time.perf_counter()
        cache, engine, rows = self.cache, self.engine, self.rows
        cache.rewind()  # first, so the summaries of a new layout cover the prefix's pages only
        if step_key(locks) == step_key(cache.locks_config):
            cache.set_budget(locks.budget)  # in place: a step built for the previous arm stays valid
        else:
            cache.set_config(locks)
        b = len(rows)
        pre = [[] if self.first is None else [self.first[i]] for i in range(b)]
        results: list[RowResult | None] = [None] * b
        for i, r in enumerate(rows):  # the prefill's token alone may end the answer
            if pre[i] and (r.max_new <= 1 or r.finished(pre[i])):
                results[i] = RowResult(pre[i], None, None)
        if all(results):
            return ArmRun(results, time.perf_counter() - t0, 0.0, 0, self.prefill_seconds)

        # a widened page list (a budget past the batch's max_budget) moves buffers: build the step anew
        key = (step_key(locks), tuple(layer.page_slots()[0] for layer in cache.locks_layers))
        new_step = key not in self._steps
        if not new_step:
            state, run_step = self._steps[key]
            state.restart()
        else:
            state = _StepState(self, max(self.steps, 1))
            run_step = self._stepper(state)
            self._steps[key] = (state, run_step)
        warmup = time.perf_counter() - t0
        done_steps = self.steps
        checked = [len(p) for p in pre]
        host: list[list[int]] = [[] for _ in rows]  # the tokens read back so far, per row
        for t in range(self.steps):
            run_step()
            if state.forced is not None and t + 1 < self.n_forced:
                state.token.copy_(state.forced[:, t + 1 : t + 2])
            if (t + 1) % engine.check_every == 0 or t + 1 == self.steps:
                for got, more in zip(host, state.out[:, len(host[0]) : t + 1].tolist()):  # one sync
                    got.extend(more)
                if self._check(host, pre, checked, results):
                    done_steps = t + 1
                    break
        counts = state.stats.tolist()
        for i, res in enumerate(results):
            if res is None or len(res.tokens) == len(pre[i]):
                continue
            n_steps = max(self.n_forced - 1, 0) + len(res.tokens) - len(pre[i])
            res.attended, res.context = counts[n_steps - 1][i]
            res.traffic = self._traffic(locks, int(rows[i].prefix.numel()), n_steps, res.attended)
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"rows {missing} did not finish within {self.steps} decode steps")
        return ArmRun(results, time.perf_counter() - t0, warmup, done_steps, self.prefill_seconds, new_step)

    def _traffic(self, locks: LocksConfig, prompt: int, steps: int, attended: int) -> dict:
        """Per (layer, KV head) and decode step, what `LocksCache.decode_traffic` reports for this row
        run alone: tokens attended, and bytes read (their K/V, plus the page summaries scored, or every
        key for the oracle, on the steps the dynamic cache selects: those whose context exceeds the
        budget; it attends densely below)."""
        layers = self.cache.locks_layers
        _, h, _, dk = layers[0].keys.shape
        # per token and KV head, at the stored size (packed codes and their scales under quantized KV)
        key_bytes, value_bytes = kv_token_bytes(locks, dk, layers[0].values.shape[-1], layers[0].keys.element_size())
        B = locks.page_size
        page_bytes = sum(t[0, 0, 0].numel() * t.element_size() for t in layers[0].summary.values())
        estimate = 0
        selector = make_selector(locks)
        for length in range(prompt + 1, prompt + steps + 1):  # tokens cached at each step
            if length > locks.page_slots * B:
                reads = traffic.selection_reads(selector, length // B, length, B)
                estimate += h * traffic.selection_read_bytes(reads, length // B * page_bytes, key_bytes)
        head_steps = len(layers) * steps * h
        read = traffic.attended_kv_bytes(attended, key_bytes, value_bytes) + len(layers) * estimate
        return {"attended_tokens": attended / head_steps, "read_bytes": read / head_steps}

    def _check(self, host: list[list[int]], pre, checked, results) -> bool:
        """Finish the rows whose answer ended among the new steps; True when every row is done."""
        skip = self.n_forced - 1 if self.n_forced else 0
        for i, r in enumerate(self.rows):
            if results[i] is not None:
                continue
            new = pre[i] + host[i][skip:]
            for n in range(checked[i] + 1, len(new) + 1):
                if n >= r.max_new or r.finished(new[:n]):
                    results[i] = RowResult(new[:n], None, None)
                    break
            checked[i] = len(new)
        return all(res is not None for res in results)

    def advance(self, state: _StepState, next_token) -> None:
        """One step: the next tokens, recorded with the rows' statistics; the buffers move on by one."""
        b = len(self.rows)
        nxt = next_token(self.cache, state.token, state.position, self.decode_mask, self.seeds, state.step)
        state.out.index_copy_(1, state.step, nxt.view(b, 1))
        state.stats.index_copy_(0, state.step, self.cache.row_stats().unsqueeze(0))
        state.token.copy_(nxt.view(b, 1))
        state.position.add_(1)
        state.step.add_(1)

    def _stepper(self, state: _StepState):
        """A callable that runs one step as the engine's step mode says (warm-up done here)."""
        mode = self.engine.step_mode
        if mode != "eager":
            # the reference path (settings the kernels do not implement) syncs with the host (an SVD
            # per completed page), which neither a captured graph nor cudagraph trees allow
            reference = [layer for layer in self.cache.locks_layers if not layer.backend.graph_safe]
            if reference and self.engine.requested_step != "auto":
                raise ValueError(
                    f"step={mode!r} needs the GPU kernels, which do not implement "
                    f"{self.cache.locks_config.label} here: use step='eager'"
                )
            if reference:
                logger.warning("%s decodes on the reference path: eager steps", self.cache.locks_config.label)
                mode = "eager"
        if mode == "graph" and len(self.cache.locks_layers) < len(self.cache.layers):
            # transformers' sliding-window layers keep a Python counter per step, which a captured
            # graph would freeze
            if self.engine.requested_step == "graph":
                raise ValueError(
                    "step='graph' needs every layer to be a Locks layer (this model has sliding-"
                    "window layers): use step='compile' or 'eager'"
                )
            mode = "compile"
        if mode == "eager":
            return lambda: self.advance(state, self.engine.next_token)
        if mode == "compile":
            fn = self.engine.compiled_next_token()
            run = lambda: self.advance(state, fn)  # noqa: E731
            run()  # compiles this arm's step (its settings are constants of the graph) and warms it up
            run()  # records its CUDA graph
            state.restart()
            return run
        # "graph": warm up on a side stream (lazy initialisations, Triton compiles), undo that step,
        # then capture the step once and replay it
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.advance(state, self.engine.next_token)
        torch.cuda.current_stream().wait_stream(side)
        state.restart()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.advance(state, self.engine.next_token)  # recorded, not run
        state.graph = graph  # keep it (and its memory pool) alive for the replays
        return graph.replay


class _StepState:
    """The static buffers a decode step reads and advances in place (addresses fixed for graphs)."""

    def __init__(self, batch: PrefilledBatch, steps: int) -> None:
        b, dev = len(batch.rows), batch.engine.device
        self.batch = batch
        self.token = torch.zeros((b, 1), dtype=torch.long, device=dev)
        self.position = torch.zeros((b, 1), dtype=torch.long, device=dev)
        self.step = torch.zeros(1, dtype=torch.long, device=dev)
        self.out = torch.zeros((b, steps), dtype=torch.long, device=dev)
        self.stats = torch.zeros((steps, b, 2), dtype=torch.long, device=dev)
        self.forced = (
            torch.tensor([r.forced for r in batch.rows], dtype=torch.long, device=dev) if batch.n_forced > 1 else None
        )
        self.graph = None
        self.restart()

    def restart(self) -> None:
        """Back to the prefix: the cache rewound, the first input token, step 0."""
        batch = self.batch
        batch.cache.rewind()
        first_in = [r.forced[0] for r in batch.rows] if batch.n_forced else batch.first
        self.token.copy_(torch.tensor(first_in, dtype=torch.long).view(-1, 1))
        self.position.copy_((batch.length - batch.pad).view(-1, 1))
        self.step.zero_()


# ----------------------------------------------------------------------------------------------------
# token choice on the device
def _check_sampling(sampling: dict | None) -> dict | None:
    if not sampling:
        return None
    unknown = set(sampling) - {"temperature", "top_p", "do_sample", "top_k"}
    if unknown or sampling.get("top_k") or sampling.get("do_sample") is False:
        raise ValueError(f"the static engine samples with temperature and top_p only (top_k 0), got {sampling}")
    t = float(sampling.get("temperature", 1.0))
    p = float(sampling.get("top_p", 1.0))
    if t <= 0 or not 0 < p <= 1:
        raise ValueError(f"sampling needs temperature > 0 and 0 < top_p <= 1, got {t}, {p}")
    return {"temperature": t, "top_p": p}


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for ``0 <= x < 2**32`` in int64 without overflow (16-bit halves of c)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def hash_uniform(seeds: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[b, vocab]`` uniforms in (0, 1) from a hash of (row seed, step, token id) (murmur3 finalizer)."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.long)
    x = (
        _mul32(seeds.view(-1, 1) & _MASK32, 0x9E3779B1)
        ^ _mul32(step.view(1, 1) & _MASK32, 0x85EBCA77)
        ^ _mul32(ids.view(1, -1), 0xC2B2AE3D)
    )
    for c in (0x85EBCA6B, 0xC2B2AE35):
        x = x ^ (x >> 16)
        x = _mul32(x, c)
    x = x ^ (x >> 16)
    return ((x >> 8).to(torch.float32) + 0.5) / float(1 << 24)


def choose_tokens(logits: torch.Tensor, seeds: torch.Tensor, step: torch.Tensor, sampling: dict | None) -> torch.Tensor:
    """Greedy argmax, or a sample under temperature / top-p (Gumbel-max over the nucleus)."""
    if sampling is None:
        return logits.argmax(-1)
    scaled = logits.float() / sampling["temperature"]
    if sampling["top_p"] < 1.0:
        probs, order = torch.softmax(scaled, -1).sort(-1, descending=True)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above
        drop = torch.zeros_like(before, dtype=torch.bool).scatter(-1, order, before > sampling["top_p"])
        scaled = scaled.masked_fill(drop, float("-inf"))
    gumbel = -torch.log(-torch.log(hash_uniform(seeds, step, logits.shape[-1])))
    return (scaled + gumbel).argmax(-1)


def _raise_recompile_limit() -> None:
    """Each arm's settings are constants of its compiled step: allow one graph per arm of a sweep."""
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < 64:
            setattr(cfg, name, 64)
            logger.info("torch._dynamo.config.%s raised to 64 (one compiled step per arm)", name)
            return
