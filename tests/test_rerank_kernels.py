"""The kernel path of ``selector="locks_rerank"`` (locks_hf.kernels.rerank) against the PyTorch reference
(`locks_hf.selectors.rerank`); under ``TRITON_INTERPRET=1`` on a CPU machine (see test_kernels)."""

import pytest
import torch
from conftest import page_lists_as_mask

# test_kernels chooses the interpreter before Triton is imported (or skips without Triton): first.
from test_kernels import DEV, B, Cache, _ref_attention, generate_both_paths

from locks_hf import kernels
from locks_hf.config import LocksConfig
from locks_hf.selectors.rerank import rerank_pages as ref_rerank
from locks_hf.summaries import exact_page_lse

SCALE = 0.3


def _scored(c, block_pages=None):
    summ = {n: v.to(DEV) for n, v in c.summary(4, 4).items()}
    kw = {} if block_pages is None else dict(block_pages=block_pages, sub_blocks=1)
    return kernels.score_pages(
        "locks", c.dev("query"), summary=summ, scale=SCALE, basis_bits=4, variant="dot", **kw, **c.kw()
    )


def _reference(c, scores, k, M):
    """The reference rule on the kernel's own estimates (so only the re-ranking is compared)."""
    est = scores.cpu().double().view(c.b, c.h, c.G, c.P)
    q = c.query.view(c.b, c.h, c.G, c.d).double()
    return ref_rerank(est, c.page_keys.double(), c.valid[:, None], q, SCALE, c.complete, k, M, "share_average")


@pytest.mark.parametrize("seed,k,m", [(0, 4, 1), (1, 4, 2), (2, 4, 4), (3, 6, 2), (4, 3, 8), (5, 5, 40)])
def test_rerank_stage_matches_reference(seed, k, m):
    """Short list from the selection kernel, exact LSE of its pages, final pick: the reference's page
    set, and the candidates' exact page LSE (read back) equal to `exact_page_lse`. Scored in blocks
    of 16 pages: the normaliser is folded from several programs' partials."""
    c = Cache(seed, pages=20 + 3 * seed)
    scores, partials = _scored(c, block_pages=16)
    assert partials.shape[1] > 1
    kw = dict(row_start=c.dev("row_start"), length=c.length, page_size=B)
    short = kernels.select_pages(scores, partials, slots=m * k + 2, per_head=False, heads=c.h, **kw)
    exact = torch.empty(c.b * c.h, c.G, m * k, device=DEV)
    pages = kernels.rerank_pages(
        c.dev("query"),
        c.dev("keys"),
        short,
        scores,
        partials,
        slot_valid=c.dev("slot_valid"),
        scale=SCALE,
        slots=k,
        exact=exact,
        **kw,
    )
    assert pages.shape == (c.b * c.h, k)
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), _reference(c, scores, k, m * k))
    listed = short[:, 2:].long().cpu()
    q = c.query.view(c.b, c.h, c.G, c.d).double()
    want = exact_page_lse(c.page_keys.double(), c.valid[:, None], q, SCALE).view(c.b * c.h, c.G, c.P)
    ok = listed >= 0
    got = exact.cpu().double()
    ref = want.gather(-1, listed.clamp_min(0)[:, None].expand(-1, c.G, -1))
    assert ok.any() and torch.allclose(got[ok[:, None].expand_as(got)], ref[ok[:, None].expand_as(ref)], atol=1e-4)


def test_rerank_with_a_device_budget_matches_reference():
    """Lists sized for k = 9 (short list 2 * 9), the budget k = 4 read on the device: the reference at k = 4
    with a short list of 2 * 4, the rest of the list SENTINEL."""
    c = Cache(8, pages=30)
    scores, partials = _scored(c)
    kw = dict(row_start=c.dev("row_start"), length=c.length, page_size=B)
    active = torch.tensor([4], dtype=torch.int32, device=DEV)
    short = kernels.select_pages(
        scores, partials, slots=2 * 9 + 2, per_head=False, heads=c.h, active_slots=active * 2 + 2, **kw
    )
    pages = kernels.rerank_pages(
        c.dev("query"),
        c.dev("keys"),
        short,
        scores,
        partials,
        slot_valid=c.dev("slot_valid"),
        scale=SCALE,
        slots=9,
        active_slots=active,
        **kw,
    )
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), _reference(c, scores, 4, 8))
    assert (pages[:, 4:] == kernels.SENTINEL).all()


def test_decode_step_matches_reference_pipeline():
    """Score + short list + re-rank + attend, chained."""
    c = Cache(11, pages=70)
    summ = {n: v.to(DEV) for n, v in c.summary(4, 4).items()}
    out, pages = kernels.decode_step(
        "locks",
        c.dev("query"),
        key_buf=c.dev("keys"),
        value_buf=c.dev("values"),
        summary=summ,
        slots=4,
        scale=SCALE,
        basis_bits=4,
        rerank=3,
        **c.kw(),
    )
    scores, _ = _scored(c)
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), _reference(c, scores, 4, 12))
    ref = _ref_attention(c, pages, SCALE)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize("static", [False, True, "wide"])
def test_layer_glue_matches_reference_path(monkeypatch, static):
    """`backends.triton.kernel_decode` on a dynamic / static / wide-list static layer = the reference path:
    output, page set, token statistics."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the reference calls below must not dispatch
    from locks_hf.backends.reference import reference_decode
    from locks_hf.backends.triton import kernel_decode
    from locks_hf.cache import LocksLayer
    from locks_hf.static_cache import LocksStaticLayer

    c = Cache(5, b=2, pages=20, pad=(0, 0), hole=False)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=4 * B, selector="locks_rerank", rerank=2)
    layer = (
        LocksStaticLayer(c.length + 3 * B, cfg, max_slots=7 if static == "wide" else None)
        if static
        else LocksLayer(cfg)
    )
    layer.update(c.dev("keys")[:, :, : c.length], c.dev("values")[:, :, : c.length])
    layer.key_buffer()[:, :, c.length :] = float("nan")  # unwritten slots: neither path may read them
    layer.value_buffer()[:, :, c.length :] = float("nan")
    layer.prepare(None, c.length)
    q = c.dev("query")
    ref = reference_decode(layer, q, SCALE)
    ref_sel, ref_stats = layer.last_selection.clone(), layer.counts.clone()
    layer.reset_stats()
    got = kernel_decode(layer, q, SCALE)
    assert torch.equal(layer.last_selection.cpu(), ref_sel.cpu())
    assert torch.equal(layer.counts, ref_stats)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5


def test_kernels_build_and_update_the_locks_summaries(monkeypatch):
    """Re-ranking keeps the Locks layout: the custom ops build it and the per-step update writes it."""
    from locks_hf.backends.triton import kernel_update_newest_page
    from locks_hf.static_cache import LocksStaticLayer

    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")
    c = Cache(7, b=1, pages=12, pad=(0,), hole=False)
    L = (c.length // B) * B - 1
    layers = {
        s: LocksStaticLayer(L + 2 * B, LocksConfig(rank=4, budget=4 * B, selector=s)) for s in ("locks", "locks_rerank")
    }
    for layer in layers.values():
        layer.update(c.dev("keys")[:, :, : L + 1], c.dev("values")[:, :, : L + 1])
        layer.prepare(None, L + 1)
        layer.summary = {n: torch.zeros_like(t) for n, t in layer.summary.items()}
        kernel_update_newest_page(layer)  # completes page L // B
    (a, b) = layers.values()
    assert set(a.summary) == set(b.summary) and a.summary["coef"].abs().sum() > 0
    assert all(torch.equal(a.summary[n], b.summary[n]) for n in a.summary)
    assert kernels.implements("locks", dtype=torch.float32, head_dim=64, page_size=16)
    assert not kernels.implements("locks", dtype=torch.float32, head_dim=64, page_size=16, group_combine="group_max")


@pytest.mark.gpu
@pytest.mark.parametrize("rerank", [2, 8])
def test_generate_on_gpu_matches_reference_path(monkeypatch, rerank):
    """A left-padded batch through generate() (on the GPU: the static layout, compiled decode):
    kernels and the PyTorch reference give the same tokens."""
    cfg = LocksConfig(selector="locks_rerank", rank=4, budget=4 * B, rerank=rerank)
    kernel_out, reference_out = generate_both_paths(monkeypatch, cfg)
    assert torch.equal(kernel_out, reference_out)
