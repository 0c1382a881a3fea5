"""Summaries against float64 brute force: exactness at full rank, Thm 1(i), quantization, bytes."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from locks_hf import LocksConfig, summary_bytes
from locks_hf.quant import pack, qmax, quantize, unpack
from locks_hf.selectors import LocksSelector
from locks_hf.summaries import build_summary, dequantize_summary, estimated_page_lse, exact_page_lse, fit_pages


def _random_pages(b=2, h=3, P=5, B=16, d=32, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, h, P, B, d, generator=g, dtype=dtype) * 2 + torch.randn(
        1, 1, P, 1, d, generator=g, dtype=dtype
    )
    query = torch.randn(b, h, 4, d, generator=g, dtype=dtype)
    return keys, query


def _brute_lse(keys, valid, query, scale):
    """Direct per-page LSE with Python loops over pages (float64)."""
    b, h, P, B, d = keys.shape
    out = torch.full((b, h, query.shape[2], P), float("-inf"), dtype=torch.float64)
    for i in range(b):
        for j in range(h):
            for p in range(P):
                ks = keys[i, j, p][valid[i, 0, p]]
                if len(ks):
                    out[i, j, :, p] = torch.logsumexp(scale * query[i, j] @ ks.T, dim=-1)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_full_rank_unquantized_summary_is_exact(seed):
    keys, query = _random_pages(seed=seed)
    valid = torch.ones(keys.shape[0], 1, *keys.shape[2:4], dtype=torch.bool)
    B = keys.shape[3]
    summary = build_summary(
        keys, valid.expand(-1, keys.shape[1], -1, -1), rank=B, basis_bits=16, coef_bits=16, centroid_bits=16
    )
    mu, basis, coef = dequantize_summary(summary, 16, torch.float64)
    scale = 0.37
    est = estimated_page_lse(mu, basis, coef, valid, query, scale)
    exact = _brute_lse(keys, valid, query, scale)
    assert torch.allclose(est, exact, atol=1e-10, rtol=0)
    assert torch.allclose(exact_page_lse(keys, valid, query, scale), exact, atol=1e-10, rtol=0)


@pytest.mark.parametrize("rank", [1, 2, 4, 8])
def test_theorem_1i_score_error_bound(rank):
    """|s_hat - s| <= scale * ||(I - V V^T) q|| * sigma_{r+1} on every page and query head."""
    keys, query = _random_pages(seed=rank, P=7)
    b, h, P, B, d = keys.shape
    valid = torch.ones(b, 1, P, B, dtype=torch.bool)
    mu, basis, coef = fit_pages(keys, valid.expand(-1, h, -1, -1), rank)
    scale = 1 / math.sqrt(d)
    est = estimated_page_lse(mu, basis, coef, valid, query, scale)
    exact = exact_page_lse(keys, valid, query, scale)
    sigma = torch.linalg.svdvals(keys - keys.mean(-2, keepdim=True))[..., rank]  # [b, h, P]
    proj = torch.eye(d, dtype=torch.float64) - basis.transpose(-1, -2) @ basis  # [b, h, P, d, d]
    q_perp = torch.einsum("bhpde,bhge->bhgpd", proj, query).norm(dim=-1)
    bound = scale * q_perp * sigma[:, :, None]
    err = (est - exact).abs()
    assert (err <= bound + 1e-9).all()
    assert err.max() > 0  # rank < B: the bound is exercised, not trivially 0


def test_padding_slots_enter_no_summary():
    keys, query = _random_pages(seed=5, P=3)
    b, h, P, B, d = keys.shape
    valid = torch.ones(b, 1, P, B, dtype=torch.bool)
    valid[0, 0, 0, :5] = False  # left padding in row 0, page 0
    poisoned = keys.clone()
    poisoned[0, :, 0, :5] = float("nan")  # pad (or unwritten) slots must not matter, even NaN
    full = build_summary(poisoned, valid.expand(-1, h, -1, -1), rank=B, basis_bits=16, coef_bits=16, centroid_bits=16)
    mu, basis, coef = dequantize_summary(full, 16, torch.float64)
    assert torch.allclose(mu[0, :, 0], keys[0, :, 0, 5:].mean(-2))
    est = estimated_page_lse(mu, basis, coef, valid, query, 0.3)
    assert torch.allclose(est, _brute_lse(poisoned, valid, query, 0.3), atol=1e-9, rtol=0)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([2, 4, 8]),
    rows=st.integers(1, 6),
    cols=st.sampled_from([8, 16, 64]),
    scale=st.floats(1e-3, 1e3),
    seed=st.integers(0, 2**31 - 1),
)
def test_quantization_round_trip_within_half_step(bits, rows, cols, scale, seed):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    codes, s = quantize(x, bits, dim=-1)
    assert codes.abs().max() <= qmax(bits)
    assert torch.equal(unpack(pack(codes, bits), bits), codes)
    err = (codes.double() * s.double() - x).abs()
    assert (err <= s.double() / 2 * (1 + 1e-6)).all()


@pytest.mark.parametrize("bits", [2, 4])
def test_unpack_reads_every_byte_as_its_signed_fields_in_order(bits):
    """Every byte value, in a sliced and in a transposed view: field ``i`` (bits ``i*bits ...``, element 0 in
    the low bits) sign-extended, against Python integers."""
    per_byte, half = 8 // bits, 1 << (bits - 1)

    def fields(byte: int) -> list[int]:
        return [((byte >> (bits * i)) & ((1 << bits) - 1) ^ half) - half for i in range(per_byte)]

    values = torch.randperm(256, generator=torch.Generator().manual_seed(bits)).to(torch.uint8)
    rows = torch.zeros(4, 128, dtype=torch.uint8)
    rows[::2] = values.view(2, 128)
    sliced = rows[::2]  # [2, 128], every value once, rows 256 bytes apart
    transposed = values.view(64, 4).t()  # [4, 64], last dim of stride 4
    for packed in (sliced, transposed):
        want = torch.tensor([sum((fields(int(v)) for v in row), []) for row in packed.reshape(-1, packed.shape[-1])])
        got = unpack(packed, bits)
        assert got.dtype == torch.int8 and got.shape == (*packed.shape[:-1], packed.shape[-1] * per_byte)
        assert torch.equal(got.reshape(want.shape), want.to(torch.int8))
    assert sorted(sliced.flatten().tolist()) == list(range(256))


@pytest.mark.parametrize("rank,expected", [(8, 818), (4, 490), (2, 326)])
def test_summary_bytes_match_paper_and_storage(rank, expected):
    assert summary_bytes(128, 16, rank) == expected
    assert expected / 8192 == pytest.approx({8: 0.100, 4: 0.060, 2: 0.040}[rank], abs=5e-4)
    # The stored tensors of one page and KV head really take that many bytes.
    keys = torch.randn(1, 2, 3, 16, 128).to(torch.bfloat16)
    valid = torch.ones(1, 2, 3, 16, dtype=torch.bool)
    summary = LocksSelector(LocksConfig.from_label(f"r{rank}i4")).summarize(keys, valid)
    stored = sum(t.nbytes for t in summary.values()) // (2 * 3)
    assert stored == expected


@pytest.mark.parametrize("label", ["r8i2", "r8i8", "r8bf16", "r4i4"])
def test_quantized_summary_scores_close_to_unquantized(label):
    cfg = LocksConfig.from_label(label)
    keys, query = _random_pages(seed=11, d=64)
    b, h, P, B, d = keys.shape
    valid = torch.ones(b, 1, P, B, dtype=torch.bool)
    sel = LocksSelector(cfg)
    q_summary = sel.summarize(keys.float(), valid.expand(-1, h, -1, -1))
    assert (
        summary_bytes(d, B, cfg.rank, cfg.basis_bits) == sum(t.nbytes for t in q_summary.values()) // (b * h * P)
        or cfg.basis_bits == 16
    )
    approx = sel.page_scores(q_summary, keys, valid, query.float(), 0.125)
    mu, basis, coef = fit_pages(keys, valid.expand(-1, h, -1, -1), cfg.rank)
    exact_fit = estimated_page_lse(mu, basis, coef, valid, query, 0.125)
    tol = {2: 3.0, 4: 0.6, 8: 0.05, 16: 0.05}[cfg.basis_bits]
    assert (approx.double() - exact_fit).abs().max() < tol


@pytest.mark.parametrize("label", ["r8i4", "r4i2", "r2i8"])
def test_factored_scores_equal_scores_of_dequantized_summary(label):
    """Scales applied after projection (the fast path) = scoring the dequantized summary."""
    cfg = LocksConfig.from_label(label)
    keys, query = _random_pages(seed=4, d=64)
    b, h, P, B, d = keys.shape
    valid = torch.ones(b, 1, P, B, dtype=torch.bool)
    summary = LocksSelector(cfg).summarize(keys.float(), valid.expand(-1, h, -1, -1))
    fast = LocksSelector(cfg).page_scores(summary, None, valid, query, 0.2)
    mu, basis, coef = dequantize_summary(summary, cfg.basis_bits, torch.float64)
    slow = estimated_page_lse(mu, basis, coef, valid, query, 0.2)
    assert torch.allclose(fast, slow, atol=1e-9, rtol=1e-9)
