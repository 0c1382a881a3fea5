"""The captured decode step (`locks_hf.captured_step`): which inputs are copied in, what is copied back,
when it captures again, and what it refuses.

On the CPU a stand-in for ``torch.cuda.CUDAGraph`` keeps a CUDA graph's semantics: capturing records
the step and its inputs without running it, and a replay runs the recorded step on the recorded
inputs, writing into the outputs made at capture. A step that read its caller's tensors instead of the
graph's buffers, or ran twice, gives other numbers than the plain steps it is compared with.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from locks_hf import captured_step
from locks_hf.captured_step import STEPS_BEFORE_CAPTURE, CapturedStep, captured_backend, decode_compile_config

_capturing: list = []


class _Graph:
    replays = 0

    def __init__(self) -> None:
        self.recorded = None

    def replay(self) -> None:
        fn, args, outputs = self.recorded
        for out, value in zip(outputs, fn(*args, recording=False)):
            out.copy_(value)
        type(self).replays += 1


@contextlib.contextmanager
def _graph(graph):
    _capturing.append(graph)
    try:
        yield
    finally:
        _capturing.pop()


def boxed(body):
    """A step (one argument per input) that, inside a capture, records itself instead of running."""

    def step(*args, recording=True):
        if recording and _capturing:  # outputs of the graph's own, except where the step returns an input
            clones = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
            inputs = {id(c): a for a, c in zip(args, clones)}
            outputs = [inputs.get(id(o), None) if id(o) in inputs else torch.zeros_like(o) for o in body(clones)]
            _capturing[-1].recorded = (step, list(args), outputs)
            return outputs
        return body(list(args))

    return step


@pytest.fixture(autouse=True)
def fake_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _Graph)
    monkeypatch.setattr(torch.cuda, "graph", _graph)
    _Graph.replays = 0


def write_token(args):
    """cache[pos] = token (in place); returns the cache's sum plus the token."""
    token, pos, cache = args
    cache.index_copy_(0, pos, token)
    return [cache.sum(0) + token[0]]


def test_replays_read_the_moving_inputs_and_the_cache_in_place():
    gen = torch.Generator().manual_seed(0)
    cache, reference = torch.zeros(12, 3), torch.zeros(12, 3)
    step = CapturedStep(boxed(write_token))
    for t in range(10):
        token = torch.randn(1, 3, generator=gen)  # a new tensor each step, as generate() makes them
        pos = torch.tensor([t])
        out = step(token, pos, cache)
        expected = write_token([token, pos, reference])
        torch.testing.assert_close(out[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(cache, reference, rtol=0, atol=0)
    assert step.captures == 1
    assert _Graph.replays == 10 - STEPS_BEFORE_CAPTURE
    assert sorted(step.buffers) == [0, 1]  # the token and its position are copied in; the cache is not
    stats = step.stats()
    assert (stats["replays"], stats["eager_runs"], stats["copied_in"]) == (10 - STEPS_BEFORE_CAPTURE, 2, 2)
    assert stats["copied_in_bytes"] == 3 * 4 + 8  # a float32 token row and an int64 position
    assert stats in captured_step.step_stats()


def test_a_moving_input_written_in_place_is_copied_back():
    def bump(args):
        counter, x = args
        counter.add_(1)
        return [x * counter]

    step = CapturedStep(boxed(bump))
    x = torch.ones(2)
    for t in range(6):
        counter = torch.full((2,), float(t))
        out = step(counter, x)
        assert counter.tolist() == [t + 1.0, t + 1.0]  # the caller sees the write
        assert out[0].tolist() == [t + 1.0, t + 1.0]
    assert step.captures == 1 and _Graph.replays == 6 - STEPS_BEFORE_CAPTURE


def test_a_new_cache_of_the_same_shape_is_captured_again(caplog):
    step = CapturedStep(boxed(write_token))
    for cache_no in range(2):
        cache, reference = torch.zeros(8, 2), torch.zeros(8, 2)
        for t in range(5):
            token, pos = torch.full((1, 2), t + 10.0 * cache_no), torch.tensor([t])
            with caplog.at_level(logging.INFO, logger=captured_step.__name__):
                out = step(token, pos, cache)
            torch.testing.assert_close(out[0], write_token([token, pos, reference])[0], rtol=0, atol=0)
        torch.testing.assert_close(cache, reference, rtol=0, atol=0)
    assert step.captures == 2
    assert "capturing again" in caplog.text


def test_a_changing_python_value_is_not_baked_into_a_graph(caplog):
    def scale(args):
        x, k = args
        return [x * k]

    step = CapturedStep(boxed(scale))
    x = torch.ones(3)
    with caplog.at_level(logging.WARNING, logger=captured_step.__name__):
        outs = [step(x, k)[0].clone() for k in range(5)]
    assert [o[0].item() for o in outs] == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert step.captures == 0 and _Graph.replays == 0
    assert "not tensors and change between steps" in caplog.text


def test_an_output_aliasing_a_moving_input_is_not_captured(caplog):
    step = CapturedStep(boxed(lambda args: [args[0]]))
    with caplog.at_level(logging.WARNING, logger=captured_step.__name__):
        outs = [step(torch.full((2,), float(t)))[0] for t in range(4)]
    assert [o[0].item() for o in outs] == [0.0, 1.0, 2.0, 3.0]
    assert step.captures == 0
    assert "aliases an input" in caplog.text


def test_a_step_with_inputs_on_two_devices_is_not_captured(caplog, monkeypatch):
    """A host tensor read by a CUDA graph would be baked in at capture: such a step runs uncaptured."""
    step = CapturedStep(boxed(lambda args: [args[0] * 2]))
    host = torch.ones(2)
    on_meta = torch.empty(2, device="meta")  # any second device type
    with caplog.at_level(logging.WARNING, logger=captured_step.__name__):
        for _ in range(4):
            step(host, on_meta)
    assert step.captures == 0 and not step.capturable and step.eager_runs == 4
    assert "only a step on one device is captured" in caplog.text


def test_the_backend_refuses_inductor_modes():
    with pytest.raises(ValueError, match="takes no mode"):
        captured_backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.ones(1)], mode="reduce-overhead")


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"triton.cudagraphs": True}, "CUDA graphs of its own"),
        ({"combo_kernel": True}, r"\['combo_kernel'\] are not inductor options"),
    ],
)
def test_the_backend_refuses_options_it_cannot_honour(options, match):
    with pytest.raises(ValueError, match=match):
        captured_backend(torch.fx.symbolic_trace(torch.nn.Identity()), [torch.ones(1)], options=options)
    with pytest.raises(ValueError, match=match):
        decode_compile_config(options)


def _recording_inductor(monkeypatch) -> list:
    import torch._inductor

    seen: list = []
    inductor_compile = torch._inductor.compile

    def recording(gm, inputs, options=None):
        seen.append(options)
        return inductor_compile(gm, inputs, options=options)

    monkeypatch.setattr(torch._inductor, "compile", recording)
    return seen


def test_the_backend_hands_inductor_the_options_of_torch_compile(monkeypatch):
    seen = _recording_inductor(monkeypatch)
    options = {"combo_kernels": True}
    compiled = torch.compile(lambda x: x.sin() + 1, backend=captured_backend, fullgraph=True, options=options)
    x = torch.randn(7)
    torch.testing.assert_close(compiled(x), x.sin() + 1)
    assert seen == [{"combo_kernels": True}] and seen[0] is not options  # inductor gets a copy it may change
    torch._dynamo.reset()
    plain = torch.compile(lambda x: x.cos(), backend=captured_backend, fullgraph=True)
    torch.testing.assert_close(plain(x), x.cos())
    assert seen[1] is None  # no options: inductor's defaults, as before


def test_off_cuda_the_backend_is_inductor():
    def f(x, y):
        y.add_(x)
        return x * 2 + y

    compiled = torch.compile(f, backend=captured_backend, fullgraph=True)
    x, y, y_ref = torch.randn(5), torch.zeros(5), torch.zeros(5)
    for _ in range(4):
        torch.testing.assert_close(compiled(x, y), f(x, y_ref))
    torch.testing.assert_close(y, y_ref)


def test_decode_compile_config_names_the_backend():
    config = decode_compile_config()
    assert config.backend is captured_backend and config.mode is None and config.fullgraph
    assert config.options == captured_step.DECODE_INDUCTOR_OPTIONS and config.options["combo_kernels"] is True
    assert config.options is not captured_step.DECODE_INDUCTOR_OPTIONS  # inductor may change its copy
    assert decode_compile_config({}).options is None  # {}: inductor's own defaults
    asked = {"combo_kernels": False}
    config = decode_compile_config(asked)
    assert config.options == asked and config.options is not asked and config.mode is None
    # transformers compiles with torch.compile(fn, **config.to_dict()): torch hands the options to the backend
    assert config.to_dict()["options"] == asked
