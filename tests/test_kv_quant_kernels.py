"""The quantized-KV decode attention kernel (`locks_hf.kernels.quantized_attention`) against float64.

The reference dequantizes the stored codes with `locks_hf.kv_quant`'s functions in float64 and attends
exactly; the kernel (Triton's interpreter on a CPU machine, compiled with CUDA) must match at every
bits x group setting, with every slot quantized and with a full-precision tail that pages straddle,
padding rows and holes, GQA groups of 1, 4 and 16, page lists and dense calls, one split and several.
"""

import os
import re
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip(
            "no CUDA and Triton was imported before TRITON_INTERPRET=1 was set: run the tests with "
            "TRITON_INTERPRET=1 in the environment",
            allow_module_level=True,
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from locks_hf import LocksConfig, kernels  # noqa: E402
from locks_hf.cache import LocksLayer  # noqa: E402
from locks_hf.kv_cache import QuantizedLocksLayer  # noqa: E402
from locks_hf.kv_quant import dequantize_keys, dequantize_values, quantize_keys, quantize_values  # noqa: E402

pytestmark = pytest.mark.interpret

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
B = 16
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}  # as tests/test_kernels.py and the real-shape tests


def rel(a, b) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return ((a - b).norm() / b.norm()).item()


class QuantCache:
    """KIVI-packed K/V in `QuantizedLocksLayer`'s layout: keys of slots ``< qk`` and values of slots ``< qv``
    quantized, the rest in full precision; row 1 left-padded (its pages start at slot ``pad``) with a hole
    in its quantized slots and one in its tail. What the kernel must not read is NaN (unwritten codes'
    scales, padding in the tails, slots past the length)."""

    def __init__(self, bits, group, tail, seed=0, b=2, h=2, d=128, dtype=torch.float32, pad=21):
        g = torch.Generator().manual_seed(seed)
        self.b, self.h, self.d, self.bits, self.group, self.dtype = b, h, d, bits, group, dtype
        if tail == "empty":  # every written slot quantized
            L = 256
            qk = qv = L
        elif tail == "all":  # nothing quantized yet (a short context)
            L = 150
            qk = qv = 0
        else:  # keys up to a group boundary, values up to any slot: pages straddle both boundaries
            L = 293
            qk, qv = 256 - group, L - 70
        self.L, self.qk, self.qv = L, qk, qv
        cap = L + 40
        channel = torch.where(torch.rand(d, generator=g) < 0.1, 12.0, 1.0)
        keys = (
            torch.randn(b, h, L, d, generator=g, dtype=torch.float64) * channel
            + torch.randn(d, generator=g, dtype=torch.float64)
        ).to(dtype)
        values = (torch.randn(b, h, L, d, generator=g, dtype=torch.float64) * 2 + 0.5).to(dtype)
        self.slot_valid = torch.ones(b, cap, dtype=torch.bool)
        self.row_start = torch.zeros(b, dtype=torch.int32)
        if b > 1:
            self.slot_valid[1, :pad] = False
            self.slot_valid[1, pad + 2 * B + 3] = False  # a hole among the quantized slots
            self.slot_valid[1, L - 20] = False  # and one in the tail (when there is a tail)
            self.row_start[1] = pad
        valid = self.slot_valid[:, :L]
        per = 8 // bits
        # capacity-wide storage, garbage where nothing is written
        self.key_codes = torch.randint(0, 256, (b, h, cap, d // per), generator=g, dtype=torch.uint8)
        self.key_scale = torch.full((b, h, -(-cap // group), d), float("nan"), dtype=dtype)
        self.key_zero = self.key_scale.clone()
        self.value_codes = torch.randint(0, 256, (b, h, cap, d // per), generator=g, dtype=torch.uint8)
        self.value_scale = torch.full((b, h, cap, d // group), float("nan"), dtype=dtype)
        self.value_zero = self.value_scale.clone()
        codes, scale, zero = quantize_keys(keys[:, :, :qk], bits, group, valid[:, :qk])
        self.key_codes[:, :, :qk], self.key_scale[:, :, : qk // group], self.key_zero[:, :, : qk // group] = (
            codes,
            scale,
            zero,
        )
        codes, scale, zero = quantize_values(values[:, :, :qv], bits, group, valid[:, :qv])
        self.value_codes[:, :, :qv], self.value_scale[:, :, :qv], self.value_zero[:, :, :qv] = codes, scale, zero
        nan = torch.full((b, h, 5, d), float("nan"), dtype=dtype)  # past the length

        def tail_of(x, q):
            t = torch.where(valid[:, None, q:, None], x[:, :, q:], float("nan"))  # padding slots: NaN
            return torch.cat([t, nan], dim=2)

        self.key_tail, self.value_tail = tail_of(keys, qk), tail_of(values, qv)
        # the float64 reference K/V: codes dequantized by kv_quant, then the tail as stored
        k64 = dequantize_keys(
            self.key_codes[:, :, :qk],
            self.key_scale[:, :, : qk // group].repeat_interleave(group, 2),
            self.key_zero[:, :, : qk // group].repeat_interleave(group, 2),
            bits,
            torch.float64,
        )
        v64 = dequantize_values(
            self.value_codes[:, :, :qv], self.value_scale[:, :, :qv], self.value_zero[:, :, :qv], bits, torch.float64
        )
        self.k64 = torch.cat([k64, self.key_tail[:, :, : L - qk].double()], dim=2)
        self.v64 = torch.cat([v64, self.value_tail[:, :, : L - qv].double()], dim=2)
        self.P = -(-(L - int(self.row_start.min())) // B)

    def query(self, G, seed=1):
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.b, self.h * G, self.d, generator=g, dtype=torch.float64).to(self.dtype)

    def kwargs(self):
        names = (
            "key_codes",
            "key_scale",
            "key_zero",
            "value_codes",
            "value_scale",
            "value_zero",
            "key_tail",
            "value_tail",
            "slot_valid",
            "row_start",
        )
        return dict(
            {n: getattr(self, n).to(DEV) for n in names},
            quantized=(self.qk, self.qv),
            bits=self.bits,
            group=self.group,
            length=self.L,
            page_size=B,
        )

    def real_tokens(self, pages):
        """Real slots of the listed pages ``[b, h, W]``, summed over rows and KV heads."""
        n = 0
        for i in range(self.b):
            for j in range(self.h):
                for p in pages[i, j].tolist():
                    slots = int(self.row_start[i]) + p * B + torch.arange(B)
                    if p >= 0:
                        n += int(((slots < self.L) & self.slot_valid[i, slots.clamp(max=self.L - 1)]).sum())
        return n

    def reference(self, query, pages, scale):
        """Float64 attention of ``query [b, Hq, d]`` over ``pages [b, h, W]`` (``< 0`` = none), with the
        K/V rounded to the query's dtype as the kernel rounds them before its products (for a bf16 query
        that rounding alone is ~5e-3 of the output, as large as the products' tolerance)."""
        b, hq, d = query.shape
        G = hq // self.h
        out = torch.empty(b, hq, d, dtype=torch.float64)
        for i in range(b):
            for j in range(self.h):
                sel = [p for p in pages[i, j].tolist() if p >= 0]
                slots = (
                    int(self.row_start[i]) + torch.tensor(sel, dtype=torch.long)[:, None] * B + torch.arange(B)
                ).flatten()
                ok = (slots < self.L) & self.slot_valid[i, slots.clamp(max=self.L - 1)]
                slots = slots[ok]
                k, v = (x[i, j, slots].to(query.dtype).double() for x in (self.k64, self.v64))
                for gq in range(G):
                    logits = scale * k @ query[i, j * G + gq].double()
                    out[i, j * G + gq] = torch.softmax(logits, 0) @ v
        return out


def _sparse_pages(c, seed):
    """Page lists ``[b, h, W]``: the first page, pages straddling the quantized/full boundaries, the last
    page, random others and ``-1`` entries."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(c.b):
        rs = int(c.row_start[i])
        last = (c.L - 1 - rs) // B
        boundary = sorted({max(q - rs, 0) // B for q in (c.qk, c.qv)} | {last})
        for _ in range(c.h):
            others = torch.randperm(last, generator=g)[:3].tolist()
            row = list(dict.fromkeys([0, *boundary, *others]))
            rows.append(row + [-1] * 2)
    W = max(len(r) for r in rows)
    pages = torch.tensor([r + [-1] * (W - len(r)) for r in rows], dtype=torch.int32)
    return pages.view(c.b, c.h, W)


@pytest.mark.parametrize("tail", ["empty", "partial"])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("bits", [2, 4])
def test_quantized_attention_matches_float64(bits, group, tail):
    c = QuantCache(bits, group, tail, seed=100 * bits + group + (tail == "empty"))
    if tail == "partial":  # some listed page holds slots on both sides of each boundary
        pages = _sparse_pages(c, seed=1)
        for q in (c.qk, c.qv):
            assert any(
                s + p * B < q < s + (p + 1) * B
                for i, s in enumerate(c.row_start.tolist())
                for p in pages[i, 0].tolist()
                if p >= 0
            )
    dense_pages = torch.arange(c.P, dtype=torch.int32).expand(c.b, c.h, -1)
    for G, splits in ((1, None), (4, 3)):
        q = c.query(G, seed=G)
        pages = _sparse_pages(c, seed=G)
        counts = torch.full((2,), 5, dtype=torch.int64, device=DEV)
        got = kernels.quantized_attention(
            q.to(DEV), pages.to(DEV), scale=0.3, splits=splits, counts=counts, **c.kwargs()
        )
        assert got.shape == q.shape and got.dtype == q.dtype
        assert rel(got, c.reference(q, pages, 0.3)) < TOL[c.dtype], (G, "sparse")
        assert counts.tolist() == [5 + c.real_tokens(pages), 5]  # padding, holes, unwritten slots excluded
        # dense: every written page (pages past the length in n_pages are skipped)
        got = kernels.quantized_attention(
            q.to(DEV), None, n_pages=c.P + 2, scale=0.3, splits=splits and 2, **c.kwargs()
        )
        assert rel(got, c.reference(q, dense_pages, 0.3)) < TOL[c.dtype], (G, "dense")


@pytest.mark.parametrize(
    "query_dtype",
    [
        torch.float32,
        pytest.param(
            torch.bfloat16,
            marks=pytest.mark.skipif(
                DEV != "cuda", reason="Triton's interpreter computes bf16 products wrongly (sparse_attention's too)"
            ),
        ),
    ],
)
@pytest.mark.parametrize("bits,group", [(4, 32), (2, 128)])
def test_quantized_attention_over_bf16_storage(bits, group, query_dtype):
    """bf16 scales, zero points and tails (the models' K/V dtype); a bf16 query (the products on tensor
    cores) only where it runs compiled."""
    c = QuantCache(bits, group, "partial", seed=7 + bits, dtype=torch.bfloat16)
    q = c.query(16).to(query_dtype)  # GQA groups of 16 (GLM-4)
    pages = _sparse_pages(c, seed=3)
    got = kernels.quantized_attention(q[:, :, None].to(DEV), pages.to(DEV), scale=0.3, **c.kwargs())
    assert got.shape == (c.b, 16 * c.h, 1, c.d) and got.dtype == query_dtype
    assert rel(got[:, :, 0], c.reference(q, pages, 0.3)) < TOL[query_dtype]


def test_nothing_quantized_yet():
    """Every slot in the full-precision tail (``qk = qv = 0``): the packed storage is never read."""
    c = QuantCache(4, 32, "all", seed=9)
    q = c.query(4)
    pages = _sparse_pages(c, seed=2)
    got = kernels.quantized_attention(q.to(DEV), pages.to(DEV), scale=0.3, **c.kwargs())
    assert rel(got, c.reference(q, pages, 0.3)) < TOL[c.dtype]


def test_a_swapped_code_order_is_caught():
    """The comparison sees the packing: the same storage with each byte's fields reversed (element 0 in
    the high bits) is far from the reference."""
    c = QuantCache(4, 32, "partial", seed=5)
    swapped = (c.key_codes >> 4) | (c.key_codes << 4)
    q = c.query(4)
    pages = _sparse_pages(c, seed=4)
    kw = c.kwargs()
    kw["key_codes"] = swapped.to(DEV)
    got = kernels.quantized_attention(q.to(DEV), pages.to(DEV), scale=0.3, **kw)
    assert rel(got, c.reference(q, pages, 0.3)) > 1e-2


def _padding_mask(valid: torch.Tensor) -> torch.Tensor:
    b, T = valid.shape
    return torch.zeros(b, 1, T, T, device=valid.device).masked_fill(
        ~valid[:, None, None, :], torch.finfo(torch.float32).min
    )


def test_a_quantized_layer_is_read_through_packed_kv():
    """`QuantizedLocksLayer.packed_kv` is what the kernel takes: after a padded prefill and decode steps,
    the kernel over page lists equals float64 attention over the layer's own dequantized pages; the
    custom op gives the same output and its fake kernel the shape."""
    b, h, d, G, T, steps = 2, 2, 64, 2, 150, 5
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(b, h, T + steps, d, generator=g) * torch.where(torch.rand(d, generator=g) < 0.1, 8.0, 1.0)
    values = torch.randn(b, h, T + steps, d, generator=g)
    keys, values = keys.to(DEV), values.to(DEV)  # the layer keeps its K/V where they come from
    valid = torch.ones(b, T, dtype=torch.bool, device=DEV)
    valid[1, :11] = False
    layer = LocksLayer(
        LocksConfig(selector="quest", budget=64, kv_bits=4, kv_group=32, kv_residual=64, summary_from="pre")
    )
    assert isinstance(layer, QuantizedLocksLayer)
    layer.update(keys[:, :, :T], values[:, :, :T])
    layer.prepare(_padding_mask(valid), T)
    for i in range(T, T + steps):
        layer.update(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        layer.prepare(None, 1)
    packed = layer.packed_kv()
    qk, qv = packed["quantized"].tolist()
    assert 0 < qk < layer.length and 0 < qv < layer.length
    pages = torch.tensor([[[0, 4, 8, -1], [1, 7, 9, 3]], [[0, 8, 2, -1], [-1, 6, 9, 5]]], dtype=torch.int32, device=DEV)
    q = torch.randn(b, h * G, d, generator=g).to(DEV)
    got = kernels.quantized_attention(q, pages, scale=0.3, **packed)

    k = layer.page_keys(pages.clamp(min=0)).flatten(2, 3).double()  # [b, h, W*B, d]
    v = layer.page_keys(pages.clamp(min=0), values=True).flatten(2, 3).double()
    ok = (layer.page_validity_of(pages.clamp(min=0)) & (pages >= 0).unsqueeze(-1)).flatten(2)
    logits = 0.3 * q.double().view(b, h, G, d) @ k.transpose(-1, -2)
    want = torch.softmax(logits.masked_fill(~ok[:, :, None], float("-inf")), -1) @ v
    assert rel(got, want.view(b, h * G, d)) < 1e-5

    # the custom op takes the same keywords: wiring a decode step is one call
    counts = torch.zeros(2, dtype=torch.int64, device=DEV)
    assert torch.equal(
        torch.ops.locks_hf.quantized_attention(q, pages, scale=0.3, counts=counts, row_counts=None, pad=None, **packed),
        got,
    )
    assert counts[0] == int(ok.sum())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        fake = torch.ops.locks_hf.quantized_attention(
            q, pages, scale=0.3, counts=None, row_counts=None, pad=None, **packed
        )
    assert fake.shape == got.shape and fake.dtype == got.dtype
    assert layer.packed_kv()["quantized"] is packed["quantized"]  # sent once while (qk, qv) stay
    # schema, fake tensor, autograd registration and the mutated counts
    torch.library.opcheck(
        torch.ops.locks_hf.quantized_attention.default,
        (q, pages),
        dict(scale=0.3, counts=counts, row_counts=None, pad=None, **packed),
    )


def test_refusals():
    c = QuantCache(4, 32, "empty", b=1, h=1, d=64)
    kw = c.kwargs()
    with pytest.raises(ValueError, match="n_pages"):
        kernels.quantized_attention(c.query(1), None, scale=0.3, **kw)
    with pytest.raises(ValueError, match="bits"):
        kernels.quantized_attention(c.query(1), None, n_pages=2, scale=0.3, **dict(kw, bits=8))
    with pytest.raises(ValueError, match="packed codes"):
        kernels.quantized_attention(c.query(1), None, n_pages=2, scale=0.3, **dict(kw, bits=2))


def test_tiles_fit_the_dtypes():
    """bf16 keeps `attend.sparse_attention`'s tiles and two pipeline stages; 4-byte operands (whose stages
    need twice the shared memory) take tiles of fewer slots, large pages one stage; what is given stays."""
    from locks_hf.kernels.attend_quant import launch_tiles

    bf, f32 = torch.bfloat16, torch.float32
    assert [launch_tiles(B, 128, bf, bf) for B in (8, 16, 32, 64)] == [(4, 2), (4, 2), (2, 2), (1, 2)]
    assert launch_tiles(16, 256, bf, bf) == (4, 2) and launch_tiles(128, 256, bf, bf) == (1, 1)
    assert launch_tiles(16, 128, f32, bf) == (4, 2) and launch_tiles(16, 256, f32, bf) == (2, 2)
    assert [launch_tiles(16, d, f32, f32) for d in (64, 128, 256)] == [(4, 2), (2, 2), (1, 2)]
    assert launch_tiles(64, 128, f32, f32) == (1, 1)
    assert launch_tiles(16, 128, f32, f32, tile_pages=4, num_stages=3) == (4, 3)


def test_launches_it_cannot_run_are_refused(monkeypatch):
    """Tiles Triton cannot build and the GPU's out-of-resources error come back as ValueErrors naming
    the arguments to change."""
    from triton.runtime.errors import OutOfResources

    from locks_hf.kernels import attend_quant

    c = QuantCache(4, 32, "empty", b=1, h=1, d=64)
    q, kw = c.query(1).to(DEV), dict(c.kwargs(), n_pages=2, scale=0.3)
    with pytest.raises(ValueError, match="power of two"):
        kernels.quantized_attention(q, None, tile_pages=3, **kw)
    with pytest.raises(ValueError, match="tile_pages >= 2"):
        kernels.quantized_attention(q, None, **dict(kw, page_size=8), tile_pages=1)
    with pytest.raises(ValueError, match="num_stages"):
        kernels.quantized_attention(q, None, num_stages=0, **kw)

    class OutOfShared:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                raise OutOfResources(249952, 232448, "shared memory")

            return launch

    monkeypatch.setattr(attend_quant, "_quant_attn_kernel", OutOfShared())
    with pytest.raises(ValueError, match=r"shared memory .*249952 > 232448.*smaller tile_pages.*num_stages=1"):
        kernels.quantized_attention(q, None, tile_pages=8, **kw)


def test_compiles_for_sm90_within_shared_memory():
    """The interpreter runs tiles the GPU cannot launch (float32's took 250 KB of shared memory, over an
    H200's 227 KB): `scripts/dev/check_quant_attention_compile.py` compiles the kernel for sm_90 (no GPU
    needed) at these tests' launches and checks each compiles and fits."""
    import pathlib
    import subprocess

    import triton

    if DEV == "cuda":
        pytest.skip("with a GPU the other tests run the kernel compiled")
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas: it cannot compile for CUDA here")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "dev" / "check_quant_attention_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    launches = int(re.search(r"(\d+) launches", run.stdout).group(1))
    assert launches >= 9 and run.stdout.count("ok  ") == launches, run.stdout


# -- the static layout: the per-step write, rings --------------------------------------------------------------
def _static_layer(bits, group, dtype, selector="locks", T=150, pads=(0, 11, 40), seed=0, d=64):
    """A static quantized layer after a padded prefill of ``T`` slots (reference path), and the K/V of
    later steps."""
    from locks_hf.static_layer import LocksStaticLayer

    b, h = len(pads), 2
    g = torch.Generator().manual_seed(seed)
    channel = torch.where(torch.rand(d, generator=g) < 0.1, 8.0, 1.0)
    keys = (torch.randn(b, h, T + 80, d, generator=g) * channel + torch.randn(d, generator=g)).to(dtype).to(DEV)
    values = (torch.randn(b, h, T + 80, d, generator=g) * 2).to(dtype).to(DEV)
    valid = torch.ones(b, T, dtype=torch.bool, device=DEV)
    for row, pad in enumerate(pads):
        valid[row, :pad] = False
    cfg = LocksConfig(selector=selector, budget=64, kv_bits=bits, kv_group=group, kv_residual=group)
    layer = LocksStaticLayer(T + 100, cfg)
    layer.update(keys[:, :, :T], values[:, :, :T])
    layer.prepare(_padding_mask(valid), T)
    return layer, keys, values


def _state(layer):
    return [t.clone() for t in (*layer._kv_tensors(), layer.quantized)]


@pytest.mark.parametrize(
    "bits,group,dtype",
    [(4, 32, torch.float32), (2, 32, torch.bfloat16), (4, 64, torch.bfloat16), (2, 64, torch.float32)],
)
def test_the_append_kernel_writes_what_the_reference_writes(bits, group, dtype):
    """`kernels.kivi.kivi_append` against `reference_append_kv`, step by step over slots where key groups
    fall due (held by the padded rows' incomplete pages, "post") and one value a step: every buffer equal,
    codes bit-exact (float64 arithmetic, the scales rounded to bf16 as torch rounds them)."""
    import copy

    from locks_hf.backends.reference import reference_append_kv
    from locks_hf.kernels.kivi import kivi_append

    T = 150
    layer, keys, values = _static_layer(bits, group, dtype)
    twin = copy.deepcopy(layer)
    seen = set()
    for i in range(T, T + 70):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        s = layer.append_buffers()
        kivi_append(
            k,
            v,
            **{n: s[n] for n in ("key_codes", "key_scale", "key_zero", "value_codes", "value_scale", "value_zero")},
            key_ring=s["key_tail"],
            value_ring=s["value_tail"],
            slot_valid=s["slot_valid"],
            row_start=s["row_start"],
            length=s["length"],
            quantized=s["quantized"],
            counter=s["counter"],
            bits=bits,
            group=group,
            residual=group,
            page_size=16,
            post=True,
        )
        reference_append_kv(twin, k, v)
        for mine, ref in zip(_state(layer), _state(twin)):
            assert torch.equal(mine, ref), i
        assert layer.counter.item() == 0
        seen.add((i + 1, *layer.quantized.tolist()))  # (slots written, qk, qv)
        for t in (layer, twin):
            t.cumulative_length.add_(1)
            t.length_t.add_(1)
    qks = sorted({qk for _, qk, _ in seen})
    assert len(qks) >= 2 and all(b - a == group for a, b in zip(qks, qks[1:]))  # key groups fell due
    assert all(qv == n - 1 - group for n, _, qv in seen)  # a value a step
    # the padded rows' incomplete pages held key groups back past length // residual * residual
    assert any(qk < (n - 1) // group * group for n, qk, _ in seen)


def test_the_ring_tails_read_as_offset_tails():
    """Attention over tails held as rings (``ring``) equals attention over the same slots as tails that
    start at ``qk`` / ``qv``; a page update from a ring equals one from a full key buffer."""
    c = QuantCache(4, 32, "partial", seed=11)
    ring = 128
    kw = c.kwargs()
    rings = {}
    for name, first in (("key_tail", c.qk), ("value_tail", c.qv)):
        tail = kw[name]
        r = torch.full((c.b, c.h, ring, c.d), float("nan"), dtype=tail.dtype, device=tail.device)
        slots = torch.arange(first, c.L)
        r[:, :, slots % ring] = tail[:, :, : c.L - first]
        rings[name] = r
    q = c.query(4)
    pages = _sparse_pages(c, seed=6)
    want = kernels.quantized_attention(q.to(DEV), pages.to(DEV), scale=0.3, **kw)
    got = kernels.quantized_attention(q.to(DEV), pages.to(DEV), scale=0.3, ring=ring, **{**kw, **rings})
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="ring must be 0 or a power of two"):
        kernels.quantized_attention(q.to(DEV), pages.to(DEV), scale=0.3, ring=96, **{**kw, **rings})

    # the page update reads a completed page from the ring as from the buffer
    from locks_hf.kernels.build import summary_shapes

    b, h, d, B = 1, 2, 64, 16
    L = 160  # page 9 (slots 144-159) just completed
    full = torch.randn(b, h, L + 16, d, generator=torch.Generator().manual_seed(2)).to(DEV)
    ring_keys = torch.zeros(b, h, ring, d, device=DEV)
    ring_keys[:, :, torch.arange(L - 100, L) % ring] = full[:, :, L - 100 : L]
    valid = torch.ones(b, L + 16, dtype=torch.bool, device=DEV)
    row_start = torch.zeros(b, dtype=torch.int32, device=DEV)
    length = torch.full((1,), L, dtype=torch.int32, device=DEV)
    out = []
    for keys, r in ((full, 0), (ring_keys, ring)):
        shapes = summary_shapes((b, h, 11), B, d, 4, 4)
        summary = [torch.zeros(s, dtype=t, device=DEV) for s, t in (shapes[n] for n in kernels.SUMMARY_NAMES["locks"])]
        kernels.update_completed_pages(
            "locks", keys, valid, row_start, length, summary, page_size=B, rank=4, basis_bits=4, ring=r
        )
        out.append(summary)
    for a, b_ in zip(*out):
        assert torch.equal(a, b_) and a[:, :, 9].abs().sum() > 0
