"""A torch.compile backend that replays inductor's decode step from one CUDA graph.

``generate()`` on a static cache compiles its decode step with ``mode="reduce-overhead"``: inductor's
kernels in CUDA graphs managed by torch's CUDA-graph trees. Each step still runs Python before the
graph starts: dynamo gathers every input (weights and cache buffers, some 760 for a 40-layer model
with a Locks cache), the trees check their addresses and bump the version of each one written in
place. ``generate()`` reads each new token on the host, so that time leaves the GPU idle.

`captured_backend` compiles with inductor without CUDA graphs and captures the compiled step itself,
once, the way gpt-fast or a hand-written decode loop would. Per step it compares the inputs' addresses
with the captured ones in one pass, copies the few inputs that move between steps (the token, its
position) into the graph's own buffers, and replays. When an input that did not move does move (a
new cache of the same shapes, a re-allocated buffer), it runs the compiled step without the graph
for two steps and captures again. Dynamo still gathers the inputs; the trees' checks are gone. A
step with inputs on two devices (a host tensor would be baked into the graph) is not captured.

Use it through ``generate(..., compile_config=decode_compile_config())``, or as
``torch.compile(fn, backend=captured_backend, fullgraph=True)`` for a decode loop of your own. As with
``reduce-overhead``, the tensors a step returns are the graph's own buffers: the next step overwrites
them (``generate()`` copies the logits it keeps). Off CUDA the backend is plain inductor.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

logger = logging.getLogger(__name__)

#: `decode_compile_config`'s inductor options when none are given. ``combo_kernels``: the step's independent small
#: kernels (the query's and the key's RoPE, the new token's cache writes, the length counters) become one launch a
#: layer; a batch-1 step is bound by its launches' latency, not their bytes.
DECODE_INDUCTOR_OPTIONS: dict[str, Any] = {"combo_kernels": True}

#: eager (compiled, not captured) steps before a capture: the first finds what is written in place,
#: the second which inputs move between steps.
STEPS_BEFORE_CAPTURE = 2

_live: weakref.WeakSet = weakref.WeakSet()


def step_stats() -> list[dict]:
    """What each captured step alive in this process has done: ``captures``, ``replays``, ``eager_runs``
    (steps run without the graph: before a capture, or all of them where capture was refused),
    ``inputs`` and the inputs ``copied_in`` each replay (count and bytes). A step that keeps being
    captured again, or runs eagerly, shows here and in the log (``locks_hf.captured_step``, INFO)."""
    return [step.stats() for step in _live]


def captured_backend(
    gm: torch.fx.GraphModule, example_inputs: list, *, options: dict[str, Any] | None = None, mode: str | None = None
) -> Callable:
    """A ``torch.compile`` backend: inductor (no CUDA graphs of its own), the result captured in one CUDA
    graph after `STEPS_BEFORE_CAPTURE` steps when the inputs live on a CUDA device.

    ``options`` are inductor's (``torch.compile(..., options=...)``, `decode_compile_config`'s ``options``),
    for instance `DECODE_INDUCTOR_OPTIONS`; those that would give inductor CUDA graphs of its own are refused, as
    is a ``mode``: this backend captures the step itself."""
    if mode:
        raise ValueError(
            f"captured_backend takes no mode (got mode={mode!r}): it captures the CUDA graph itself; "
            "pass mode=None (inductor's options go in options=...), or use backend='inductor' for inductor's modes"
        )
    options = _inductor_options(options)
    from torch._inductor import compile as inductor_compile

    compiled = inductor_compile(gm, example_inputs, options=options or None)
    if not _on_cuda(example_inputs):
        return compiled
    return CapturedStep(compiled)


def _inductor_options(options: dict[str, Any] | None) -> dict[str, Any]:
    """A copy of ``options`` once every key is one of inductor's and none gives it CUDA graphs of its own."""
    from torch._inductor import config

    options = dict(options or {})
    known = config.get_config_copy()
    if unknown := sorted(key for key in options if key not in known):
        raise ValueError(
            f"captured_backend: {unknown} are not inductor options of torch {torch.__version__} "
            "(torch._inductor.config); check their spelling, e.g. 'combo_kernels'"
        )
    if options.get("triton.cudagraphs"):
        raise ValueError(
            "captured_backend: options {'triton.cudagraphs': True} would give inductor CUDA graphs of its own inside "
            "the one this backend captures; leave it out, or use backend='inductor' with mode='reduce-overhead'"
        )
    return options


def decode_compile_config(options: dict[str, Any] | None = None):
    """transformers' ``CompileConfig`` for `captured_backend`:
    ``model.generate(ids, past_key_values=cache, compile_config=decode_compile_config())``.

    ``options``: inductor's options for the decode step; `DECODE_INDUCTOR_OPTIONS` where ``None``, inductor's own
    defaults with ``{}``."""
    from transformers import CompileConfig

    options = _inductor_options(DECODE_INDUCTOR_OPTIONS if options is None else options)
    # mode=None (no inductor mode: the backend captures the graph itself), which CompileConfig's annotation omits
    settings: dict[str, Any] = {"fullgraph": True, "dynamic": False, "backend": captured_backend, "mode": None}
    return CompileConfig(**settings, options=options or None)


class CapturedStep:
    """A compiled step replayed from a CUDA graph (called as dynamo calls a backend's result: one
    argument per graph input).

    Inputs are told apart by what they do between steps: an input whose address changes from one step to
    the next (a new token tensor) is copied into a buffer of the graph's each step; one whose address
    stays (weights, cache buffers written in place) is read where it is. A moving input that the step
    writes in place is copied back after the replay."""

    def __init__(self, compiled: Callable[..., Sequence]) -> None:
        self.compiled = compiled
        self.captures = self.replays = self.eager_runs = 0
        self.capturable = True  # False once a capture was refused: the compiled step then runs as it is
        self.buffers: dict[int, torch.Tensor] = {}
        self.inputs = 0
        self._reset()
        _live.add(self)

    def stats(self) -> dict:
        return {
            "captures": self.captures,
            "replays": self.replays,
            "eager_runs": self.eager_runs,
            "capturable": self.capturable,
            "inputs": self.inputs,
            "copied_in": len(self.buffers),
            "copied_in_bytes": sum(b.numel() * b.element_size() for b in self.buffers.values()),
        }

    def _reset(self) -> None:
        self.graph: torch.cuda.CUDAGraph | None = None
        self.keys: list | None = None  # each input's address (a tensor) or value (anything else), last step
        self.moving: set[int] = set()
        self.written: set[int] = set()
        self.eager_steps = 0

    def __call__(self, *args: Any) -> Sequence:
        if self.graph is not None:
            if [args[i].data_ptr() for i in self.fixed_tensors] == self.fixed_pointers and all(
                args[i] == value for i, value in self.fixed_values
            ):
                return self._replay(args)
            moved = [i for i, ptr in zip(self.fixed_tensors, self.fixed_pointers) if args[i].data_ptr() != ptr]
            logger.info(
                "captured step: inputs %s of %d, in place until now, moved (a new cache?); capturing again",
                moved[:8],
                len(args),
            )
            self._reset()
        keys = [_key(a) for a in args]
        if self.keys is not None:
            self.moving |= {i for i, (k, old) in enumerate(zip(keys, self.keys)) if k != old}
        self.keys = keys
        if self.capturable and self.eager_steps >= STEPS_BEFORE_CAPTURE and self._capture(args):
            return self._replay(args)
        versions = [a._version if isinstance(a, torch.Tensor) else None for a in args]
        out = self.compiled(*args)
        self.written |= {i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a._version != versions[i]}
        self.eager_steps += 1
        self.eager_runs += 1
        self.inputs = len(args)
        return out

    def _capture(self, args: tuple) -> bool:
        """Record the step on ``args`` (not run); False, and no graph, where a graph would not replay it."""
        devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
        if len(devices) > 1:  # a graph would bake in a host tensor's value, as CUDA-graph trees refuse to
            logger.warning("captured step: inputs on %s; only a step on one device is captured", sorted(devices))
            self.capturable = False
            return False
        moving_values = sorted(i for i in self.moving if not isinstance(args[i], torch.Tensor))
        if moving_values:  # a graph would bake them in
            logger.warning(
                "captured step: inputs %s are not tensors and change between steps; not capturing", moving_values
            )
            self.capturable = False
            return False
        buffers = {i: _like(args[i]) for i in self.moving}
        for i, buf in buffers.items():
            buf.copy_(args[i])
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                outputs = self.compiled(*[buffers.get(i, a) for i, a in enumerate(args)])  # recorded, not run
        except RuntimeError as e:
            raise RuntimeError(
                f"captured_backend: the compiled step cannot be captured in a CUDA graph ({e}); compile it with "
                "backend='inductor' (mode='reduce-overhead' lets torch decide what to capture)"
            ) from e
        moved = {buf.untyped_storage().data_ptr() for buf in buffers.values()}
        if any(isinstance(o, torch.Tensor) and o.untyped_storage().data_ptr() in moved for o in outputs):
            logger.warning("captured step: an output aliases an input that moves between steps; not capturing")
            self.capturable = False
            return False
        fixed = [i for i in range(len(args)) if i not in self.moving]
        self.fixed_tensors = [i for i in fixed if isinstance(args[i], torch.Tensor)]
        self.fixed_pointers = [args[i].data_ptr() for i in self.fixed_tensors]
        self.fixed_values = [(i, args[i]) for i in fixed if not isinstance(args[i], torch.Tensor)]
        self.buffers, self.outputs, self.graph = buffers, outputs, graph
        self.written_moving = sorted(self.written & self.moving)
        self.captures += 1
        logger.info(
            "captured step: %d inputs, %d of them copied in each step (%d bytes)",
            len(args),
            len(buffers),
            self.stats()["copied_in_bytes"],
        )
        return True

    def _replay(self, args: tuple) -> Sequence:
        for i, buf in self.buffers.items():
            buf.copy_(args[i])
        self.graph.replay()  # type: ignore[union-attr]
        self.replays += 1
        for i in self.written_moving:
            args[i].copy_(self.buffers[i])
        return self.outputs


def _on_cuda(example_inputs: list) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in example_inputs)


def _key(value: Any) -> Any:
    return ("tensor", value.data_ptr()) if isinstance(value, torch.Tensor) else ("value", value)


def _like(t: torch.Tensor) -> torch.Tensor:
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
