"""The one-token projection kernel (`locks_hf.kernels.gemv`) against a float64 product on fresh random inputs."""

import pytest
import torch

from locks_hf.kernels.gemv import gemv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _reference(x, w, b):
    y = w.double() @ x.double()
    return y + b.double() if b is not None else y


@pytest.mark.parametrize(
    ("n", "k", "tile", "bias"),
    [
        (40, 64, (8, 64, 4, 1), False),  # whole tiles
        (37, 80, (8, 32, 4, 1), True),  # rows past N, a remainder K tile
        (5, 300, (16, 128, 4, 1), True),  # fewer rows than a tile
        (64, 96, (4, 64, 8, 2), False),  # a pipelined loop over K
        (33, 4500, None, True),  # the default tile: two whole 2,048-column steps and a partial one
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_matches_float64(n, k, tile, bias, dtype):
    gen = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=gen).to(DEVICE, dtype)
    x = torch.randn(k, generator=gen).to(DEVICE, dtype)
    b = torch.randn(n, generator=gen).to(DEVICE, dtype) if bias else None
    want = _reference(x, w, b)
    got = gemv(x, w, b, tile=tile)
    assert got.dtype == dtype and got.shape == (n,)
    # float32 accumulation: within the output dtype's rounding of the exact product
    tol = (1e-5 if dtype == torch.float32 else 8e-3) * (want.abs() + (k**0.5))
    assert ((got.double().cpu() - want.cpu()).abs() <= tol.cpu()).all()


def test_strided_weight_rows_and_out():
    """A weight viewed out of a wider matrix (row stride > K) and a caller's output buffer."""
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(24, 100, generator=gen).to(DEVICE)
    w = wide[:, 10:74]
    x = torch.randn(64, generator=gen).to(DEVICE)
    out = torch.full((24,), float("nan"), device=DEVICE)
    got = gemv(x, w, out=out, tile=(8, 32, 4, 1))
    assert got.data_ptr() == out.data_ptr()
    torch.testing.assert_close(got.double(), _reference(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("x_shape", "w_shape", "bias_shape", "match"),
    [
        ((2, 8), (4, 8), None, "x \\[K\\]"),
        ((8,), (4, 9), None, "x \\[K\\]"),
        ((8,), (4, 8), (5,), "bias"),
    ],
)
def test_refuses_mismatched_shapes(x_shape, w_shape, bias_shape, match):
    x, w = torch.zeros(x_shape), torch.zeros(w_shape)
    b = torch.zeros(bias_shape) if bias_shape else None
    with pytest.raises(ValueError, match=match):
        gemv(x, w, b)


def test_refuses_a_wrong_out_buffer_and_tile():
    x, w = torch.zeros(8), torch.zeros(4, 8)
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, w, out=torch.zeros(5))
    with pytest.raises(ValueError, match="powers of two"):
        gemv(x, w, tile=(3, 64, 4, 1))


def test_refuses_a_weight_without_unit_column_stride():
    with pytest.raises(ValueError, match="unit column stride"):
        gemv(torch.zeros(8), torch.zeros(8, 4).t())


def test_gemv_projections_refuse_weights_off_cuda():
    from locks_hf.projections import gemv_projections

    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="model.to\\('cuda'\\)"):
        gemv_projections(model)


def test_gemv_projections_refuse_a_model_without_linear_modules():
    from locks_hf.projections import gemv_projections

    with pytest.raises(ValueError, match="no nn.Linear"):
        gemv_projections(torch.nn.Sequential(torch.nn.ReLU()))


def test_linear_projections_put_back_plain_linear_modules_holding_the_same_parameters():
    """`linear_projections` undoes the swap wherever `GemvLinear` sits (nested, the root's own child, biased
    or not): plain ``nn.Linear`` modules holding the very parameters, the same outputs; other modules stay."""
    from locks_hf.projections import GemvLinear, linear_projections

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.Sequential(torch.nn.ReLU(), torch.nn.Linear(16, 4, bias=False))
    )
    x = torch.randn(3, 8)
    want = model(x)
    params = [p for p in model.parameters()]
    model[0] = GemvLinear.from_linear(model[0])
    model[1][1] = GemvLinear.from_linear(model[1][1])
    assert linear_projections(model) is model
    assert type(model[0]) is torch.nn.Linear and type(model[1][1]) is torch.nn.Linear
    assert isinstance(model[1][0], torch.nn.ReLU) and model[1][1].bias is None
    assert all(a is b for a, b in zip(model.parameters(), params, strict=True))
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="no GemvLinear"):
        linear_projections(model)


@pytest.mark.gpu
@pytest.mark.parametrize("compiled", [False, True])
def test_gemv_projections_decode_as_the_model_does(compiled):
    """A tiny model's one-token forward with its projections on the kernel gives its logits (bf16
    rounding apart); a prompt's forward runs the original products; the parameters are not copied."""
    from conftest import tiny

    from locks_hf.projections import GemvLinear, gemv_projections, linear_projections

    model = tiny("llama", "sdpa", dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(1, 100, (1, 12), device="cuda")
    with torch.no_grad():
        want_prompt = model(ids).logits
        want_step = model(ids[:, :1]).logits
    weights = {n: p.data_ptr() for n, p in model.named_parameters()}
    gemv_projections(model)
    assert all(type(m) is not torch.nn.Linear for m in model.modules())
    assert sum(isinstance(m, GemvLinear) for m in model.modules()) > 0
    assert weights == {n: p.data_ptr() for n, p in model.named_parameters()}
    forward = torch.compile(model.forward, fullgraph=True) if compiled else model.forward
    with torch.no_grad():
        got_prompt = model(ids).logits
        forward(ids[:, :1])  # a compiled forward's first call compiles
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            got_step = forward(ids[:, :1]).logits
            torch.cuda.synchronize()
    torch.testing.assert_close(got_prompt, want_prompt, rtol=0, atol=0)
    torch.testing.assert_close(got_step.float(), want_step.float(), rtol=2e-2, atol=2e-2)
    assert any("_gemv_kernel" in e.name for e in prof.events())  # the step ran the kernel, not cuBLAS
    linear_projections(model)  # back on cuBLAS: the parameters kept, the step's logits as before the swap
    assert weights == {n: p.data_ptr() for n, p in model.named_parameters()}
    assert not any(isinstance(m, GemvLinear) for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(ids[:, :1]).logits, want_step, rtol=0, atol=0)


def test_a_forward_that_records_gradients_stays_on_linear():
    """The kernel has no backward: with gradients recorded, `GemvLinear` is ``F.linear`` and backpropagates."""
    from locks_hf.projections import GemvLinear

    lin = torch.nn.Linear(16, 8)
    module = GemvLinear.from_linear(lin)
    x = torch.randn(1, 16, requires_grad=True)
    module(x).sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_the_custom_op_matches_its_fake_and_schema():
    """``torch.ops.locks_hf.gemv`` as torch.compile sees it: schema, fake (shape-only) implementation and
    real outputs agree (`torch.library.opcheck`)."""
    from locks_hf.kernels import ops  # noqa: F401  (registers the op)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, generator=gen).to(DEVICE)
    w = torch.randn(24, 64, generator=gen).to(DEVICE)
    b = torch.randn(24, generator=gen).to(DEVICE)
    for args in ((x, w, b), (x, w, None)):
        torch.library.opcheck(torch.ops.locks_hf.gemv.default, args)


def test_the_background_compile_makes_each_projection_launch_once(monkeypatch):
    """`compile_projection_kernels` makes, as warmups, the launch of each distinct projection (same grid, argument
    types, shapes and strides as the one-row forward's) and writes nothing."""
    from locks_hf.kernels import gemv as gemv_module
    from locks_hf.projections import compile_projection_kernels

    log = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: log.append(("launch", grid, _described(args), kw))

        def warmup(self, *args, grid, **kw):
            log.append(("warmup", grid, _described(args), kw))

    monkeypatch.setattr(gemv_module, "_gemv_kernel", Recorder())
    layers = [torch.nn.Linear(64, 48), torch.nn.Linear(64, 48), torch.nn.Linear(48, 64, bias=False)]
    before = [m.weight.clone() for m in layers]
    compile_projection_kernels(layers)
    assert [kind for kind, *_ in log] == ["warmup", "warmup"]  # two distinct projections
    assert all(torch.equal(m.weight, w) for m, w in zip(layers, before))
    warmups = [entry[1:] for entry in log]
    for m in layers[1:]:  # a one-row forward's launch is one the warmups made
        gemv_module.gemv(torch.zeros(m.in_features), m.weight, m.bias)
        assert log[-1][0] == "launch" and log[-1][1:] in warmups


def _described(args):
    return [(a.dtype, tuple(a.shape), a.stride()) if isinstance(a, torch.Tensor) else a for a in args]
