"""Triton kernels (locks_hf.kernels) against the PyTorch reference.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` on small shapes (set here
before Triton is imported); with CUDA they run compiled on the GPU. Skipped, with the reason, when
Triton is not importable.
"""

import math
import os
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

from conftest import page_lists_as_mask  # noqa: E402
from selector_lists import selectors

from locks_hf import kernels  # noqa: E402
from locks_hf.config import LocksConfig  # noqa: E402
from locks_hf.selectors import QuestSelector, select_pages as ref_select  # noqa: E402
from locks_hf.summaries import (  # noqa: E402
    build_summary as ref_build,
    dequantize_summary,
    estimated_page_lse,
    exact_page_lse,
)

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
B = 16


class Cache:
    """A small paged cache in the layout of `LocksLayer`: rows paged from their first real slot."""

    def __init__(self, seed, b=2, h=2, G=4, d=64, pages=12, pad=(0, 21), hole=True, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.b, self.h, self.G, self.d = b, h, G, d
        self.row_start = torch.tensor(list(pad[:b]), dtype=torch.int32)
        self.length = int(self.row_start.min()) + pages * B - 5  # the last page is incomplete
        self.cap = self.length + 40
        self.P = math.ceil((self.length - int(self.row_start.min())) / B)
        # keys with page structure (a per-page offset), values plain
        base = torch.randn(b, h, self.cap // B + 1, 1, d, generator=g).expand(-1, -1, -1, B, -1)
        self.keys = (torch.randn(b, h, self.cap // B + 1, B, d, generator=g) + 2 * base).flatten(2, 3)[:, :, : self.cap]
        self.values = torch.randn(b, h, self.cap, d, generator=g)
        self.slot_valid = torch.ones(b, self.cap, dtype=torch.bool)
        for i, p in enumerate(pad[:b]):
            self.slot_valid[i, :p] = False
        if hole and b > 1:
            self.slot_valid[1, int(self.row_start[1]) + 2 * B + 3] = False  # a padding slot inside a page
        self.query = torch.randn(b, h * G, 1, d, generator=g)
        self.n_complete = ((self.length - self.row_start) // B).to(torch.int32)
        slot = self.row_start.long()[:, None, None] + torch.arange(self.P)[None, :, None] * B + torch.arange(B)
        clamped = slot.clamp(0, self.cap - 1)
        self.page_keys = self.keys.gather(2, clamped.reshape(b, 1, -1, 1).expand(-1, h, -1, d)).view(b, h, self.P, B, d)
        self.page_values = self.values.gather(2, clamped.reshape(b, 1, -1, 1).expand(-1, h, -1, d)).view(
            b, h, self.P, B, d
        )
        self.valid = self.slot_valid.gather(1, clamped.view(b, -1)).view(b, self.P, B) & (slot < self.length)
        self.page_real = self.valid.any(-1)
        self.complete = torch.arange(self.P)[None] < self.n_complete[:, None]
        self.dtype = dtype

    def dev(self, name):
        t = getattr(self, name)
        if t.is_floating_point():
            t = t.to(self.dtype)
        return t.to(DEV)

    def kw(self):
        return dict(
            slot_valid=self.dev("slot_valid"),
            row_start=self.dev("row_start"),
            n_complete=self.dev("n_complete"),
            length=self.length,
            n_pages=self.P,
            page_size=B,
        )

    def summary(self, rank, bits):
        n = int(self.n_complete.max())
        return ref_build(self.page_keys[:, :, :n], self.valid[:, None, :n].expand(-1, self.h, -1, -1), rank, bits)


def _scores_ok(got, ref, mask, tol):
    got = got.double().cpu()
    assert torch.isneginf(got[~mask.expand_as(got)]).all(), "pages that are not complete real pages must score -inf"
    ref = ref[mask.expand_as(ref)]
    err = ((got[mask.expand_as(got)] - ref).norm() / ref.norm()).item()
    assert err < tol, err


def _complete_real(c):
    return (c.page_real & c.complete)[:, None, None]  # [b, 1, 1, P]


def _locks_case(rank: int, bits: int, G: int):
    """A cache, its summaries (on the device) and the float64 reference scores at scale 0.3."""
    c = Cache(rank + bits, G=G)
    summ = c.summary(rank, bits)
    mu, basis, coef = dequantize_summary(summ, bits, torch.float64)
    n = mu.shape[2]
    ref = estimated_page_lse(mu, basis, coef, c.valid[:, None, :n], c.query.view(c.b, c.h, G, c.d).double(), 0.3)
    ref = torch.nn.functional.pad(ref, (0, c.P - n), value=float("-inf"))
    return c, {k: v.to(DEV) for k, v in summ.items()}, ref


@pytest.mark.parametrize(
    "rank,bits,G,by_token",
    [
        (4, 4, 4, False),
        (8, 4, 4, True),
        (2, 4, 16, False),
        (4, 2, 4, False),
        (4, 8, 3, True),
        (4, 4, 16, True),
        (4, 4, 16, None),
    ],
)
def test_locks_scores_match_reference(rank, bits, G, by_token):
    c, summ, ref = _locks_case(rank, bits, G)
    got, _ = kernels.score_pages(
        "locks",
        c.dev("query"),
        summary=summ,
        scale=0.3,
        basis_bits=bits,
        sub_blocks=1,
        variant="dot",
        by_token=by_token,
        **c.kw(),
    )
    _scores_ok(got.view(c.b, c.h, G, c.P), ref, _complete_real(c), 1e-5)


def test_dot_scoring_defaults_follow_the_group_size():
    """Per-token epilogue with 32-page blocks for groups of 16+ heads (GLM) over many pages, per page
    otherwise; whatever the caller sets is kept."""
    from locks_hf.kernels.score_dot import LOCKS, QUEST
    from locks_hf.kernels.score_tiles import BY_TOKEN_MIN_PAGE_ROWS as many, dot_tiles

    assert dot_tiles(LOCKS, 16, 16, 4, many, None, None, None, None, None) == (True, 32, 8, 4, 2)
    assert dot_tiles(LOCKS, 16, 16, 4, many - 1, None, None, None, None, None) == (False, 16, 8, 8, 2)
    assert dot_tiles(LOCKS, 4, 16, 4, many, None, None, None, None, None) == (False, 32, 8, 4, 2)
    assert dot_tiles(LOCKS, 8, 16, 8, many, None, None, None, None, None) == (False, 16, 8, 8, 2)
    assert dot_tiles(QUEST, 16, 16, 1, many, None, None, None, None, None)[0] is False
    assert dot_tiles(LOCKS, 16, 16, 4, many, False, 64, 4, 8, 3) == (False, 64, 4, 8, 3)


def test_quest_and_oracle_scores_match_reference():
    c = Cache(7)
    n = int(c.n_complete.max())
    qsel = QuestSelector(LocksConfig())
    summ = qsel.summarize(c.page_keys[:, :, :n], c.valid[:, None, :n].expand(-1, c.h, -1, -1))
    ref = qsel.page_scores(
        {k: v.double() for k, v in summ.items()}, None, None, c.query.view(c.b, c.h, c.G, c.d).double(), 0.3
    )
    ref = torch.nn.functional.pad(ref, (0, c.P - n), value=float("-inf"))
    got, _ = kernels.score_pages(
        "quest", c.dev("query"), summary={k: v.to(DEV) for k, v in summ.items()}, scale=0.3, sub_blocks=1, **c.kw()
    )
    _scores_ok(got.view(c.b, c.h, c.G, c.P), ref, _complete_real(c), 1e-5)

    ref = exact_page_lse(c.page_keys.double(), c.valid[:, None], c.query.view(c.b, c.h, c.G, c.d).double(), 0.3)
    got, _ = kernels.score_pages("oracle", c.dev("query"), keys=c.dev("keys"), scale=0.3, sub_blocks=1, **c.kw())
    _scores_ok(got.view(c.b, c.h, c.G, c.P), ref, _complete_real(c), 1e-5)


def _partials(scores, c):
    """The scoring kernel's partials for one program per row (what `score_pages` would write)."""
    rows, G, P = scores.shape
    part = torch.empty(rows, 1, 4, G)
    for r in range(rows):
        last = (c.length - 1 - int(c.row_start[r // c.h])) // B
        real = torch.isfinite(scores[r, 0])
        idx = torch.nonzero(real).flatten()
        first = int(idx[0]) if len(idx) else 2**30
        keep = real.clone()
        if len(idx):
            keep[first] = False
        if last < P:
            keep[last] = False
        s = scores[r][:, keep]
        m = s.amax(-1) if s.shape[1] else torch.full((G,), float("-inf"))
        part[r, 0, 0] = m
        part[r, 0, 1] = torch.exp(s - m[:, None]).sum(-1) if s.shape[1] else 0.0
        part[r, 0, 2] = scores[r, :, first] if len(idx) else float("-inf")
        part[r, 0, 3] = float(first)
    return part


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("k", [2, 5, 9, 40])
def test_selection_matches_reference(per_head, ties, k):
    c = Cache(k + 10 * ties + 100 * per_head, pages=30)
    g = torch.Generator().manual_seed(k)
    scores = torch.randn(c.b * c.h, c.G, c.P, generator=g) * 3
    if ties:
        scores = scores.round()
        scores[..., 5:9] = 1.5
    ok = (c.page_real & c.complete).repeat_interleave(c.h, 0)[:, None]
    scores = scores.masked_fill(~ok, float("-inf"))
    pages = kernels.select_pages(
        scores.to(DEV),
        _partials(scores, c).to(DEV),
        slots=k,
        per_head=per_head,
        row_start=c.dev("row_start"),
        length=c.length,
        heads=c.h,
        page_size=B,
    )
    assert pages.shape[1] == (c.G * (k - 2) + 2 if per_head else k)
    want = ref_select(scores.view(c.b, c.h, c.G, c.P).double(), c.page_real, c.complete, k, "share_average", per_head)
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("k", [2, 5, 9])
def test_selection_with_a_device_budget_matches_reference(per_head, k):
    """The budget read from a device tensor (``active_slots``) selects what the reference selects at
    that budget, in lists sized for a wider one (the rest ``SENTINEL``): one captured graph serves
    every budget up to the widest."""
    widest = 12
    c = Cache(k + 100 * per_head, pages=30)
    g = torch.Generator().manual_seed(k + 7)
    scores = torch.randn(c.b * c.h, c.G, c.P, generator=g) * 3
    ok = (c.page_real & c.complete).repeat_interleave(c.h, 0)[:, None]
    scores = scores.masked_fill(~ok, float("-inf"))
    active = torch.tensor([k], dtype=torch.int32, device=DEV)
    pages = kernels.select_pages(
        scores.to(DEV),
        _partials(scores, c).to(DEV),
        slots=widest,
        per_head=per_head,
        row_start=c.dev("row_start"),
        length=c.length,
        heads=c.h,
        page_size=B,
        active_slots=active,
    )
    assert pages.shape[1] == (c.G * (widest - 2) + 2 if per_head else widest)
    want = ref_select(scores.view(c.b, c.h, c.G, c.P).double(), c.page_real, c.complete, k, "share_average", per_head)
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want)
    if not per_head:  # [sink, recent, k - 2 winners] then padding
        assert (pages[:, k:] == kernels.SENTINEL).all()


# the kernels' scoring modes: every kernel selector that keeps its own summaries (not dense)
@pytest.mark.parametrize("method", selectors(kernel=True, dense=False, summary_of=None))
def test_score_then_select_over_many_blocks(method):
    """Partials folded over several scoring programs and selection chunks (sink kept out of the LSE)."""
    c = Cache(3, pages=70, G=4)
    kw = dict(scale=0.3, block_pages=16, sub_blocks=1)
    if method == "locks":
        kw.update(summary={k: v.to(DEV) for k, v in c.summary(4, 4).items()}, basis_bits=4, variant="dot")
    elif method == "quest":
        n = int(c.n_complete.max())
        summ = QuestSelector(LocksConfig()).summarize(
            c.page_keys[:, :, :n], c.valid[:, None, :n].expand(-1, c.h, -1, -1)
        )
        kw.update(summary={k: v.to(DEV) for k, v in summ.items()})
    else:
        kw.update(keys=c.dev("keys"), block_pages=8)
    scores, part = kernels.score_pages(method, c.dev("query"), **kw, **c.kw())
    assert part.shape[1] > 1
    for k in (3, 12):
        pages = kernels.select_pages(
            scores,
            part,
            slots=k,
            per_head=method == "quest",
            row_start=c.dev("row_start"),
            length=c.length,
            heads=c.h,
            page_size=B,
            chunk=256 if k == 3 else None,
        )
        want = ref_select(
            scores.cpu().view(c.b, c.h, c.G, c.P).double(),
            c.page_real,
            c.complete,
            k,
            "share_average",
            method == "quest",
        )
        assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want)


def _ref_attention(c, pages, scale):
    out = torch.empty(c.b, 1, c.h * c.G, c.d, dtype=torch.float64)
    for r, row in enumerate(pages.cpu().tolist()):
        i, j = divmod(r, c.h)
        sel = [p for p in row if p >= 0]
        k = c.page_keys[i, j, sel].flatten(0, 1).double()
        v = c.page_values[i, j, sel].flatten(0, 1).double()
        ok = c.valid[i, sel].flatten()
        for g in range(c.G):
            logits = (scale * k @ c.query[i, j * c.G + g, 0].double()).masked_fill(~ok, float("-inf"))
            out[i, 0, j * c.G + g] = torch.softmax(logits, 0) @ v
    return out


@pytest.mark.parametrize("splits", [None, 1, 3])
@pytest.mark.parametrize("G", [4, 3])
def test_sparse_attention_matches_reference(splits, G):
    c = Cache(splits or 0, G=G, d=32)
    pages = torch.tensor(
        [[0, 7, 3, 5, -1, 9], [0, -1, 2, 4, 6, 8], [0, 10, 1, -1, -1, -1], [0, 10, 9, 8, 7, -1]], dtype=torch.int32
    )
    counts = torch.full((2,), 7, dtype=torch.int64, device=DEV)
    out = kernels.sparse_attention(
        c.dev("query"),
        c.dev("keys"),
        c.dev("values"),
        pages.to(DEV),
        scale=0.3,
        splits=splits,
        slot_valid=c.dev("slot_valid"),
        row_start=c.dev("row_start"),
        length=c.length,
        page_size=B,
        counts=counts,
    )
    ref = _ref_attention(c, pages, 0.3)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
    # counts[0] grew by the real tokens of the listed pages (padding, holes, unwritten slots excluded)
    real = sum(int(c.valid[r // c.h, [p for p in row if p >= 0]].sum()) for r, row in enumerate(pages.tolist()))
    assert counts.tolist() == [7 + real, 7]


@pytest.mark.parametrize("splits", [None, 1, 4])
@pytest.mark.parametrize("G", [4, 3])
def test_dense_attention_matches_reference(splits, G):
    """``pages=None``: every written page (rows paged from their first real slot; padding, a hole and
    the unwritten tail of the last page masked), with pages past the length in ``n_pages`` skipped."""
    c = Cache(20 + (splits or 0), G=G, d=32)
    counts = torch.zeros(2, dtype=torch.int64, device=DEV)
    unwritten = c.dev("keys").clone()
    unwritten[:, :, c.length :] = float("nan")  # neither K nor V past the length may be read
    values = c.dev("values").clone()
    values[:, :, c.length :] = float("nan")
    out = kernels.sparse_attention(
        c.dev("query"),
        unwritten,
        values,
        None,
        n_pages=c.cap // B,
        scale=0.3,
        splits=splits,
        slot_valid=c.dev("slot_valid"),
        row_start=c.dev("row_start"),
        length=c.length,
        page_size=B,
        counts=counts,
    )
    every = torch.arange(c.P, dtype=torch.int32).expand(c.b * c.h, -1)
    ref = _ref_attention(c, every, 0.3)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
    assert counts.tolist() == [int(c.valid.sum()) * c.h, 0]
    with pytest.raises(ValueError, match="n_pages"):
        kernels.sparse_attention(
            c.dev("query"),
            unwritten,
            values,
            None,
            scale=0.3,
            slot_valid=c.dev("slot_valid"),
            row_start=c.dev("row_start"),
            length=c.length,
            page_size=B,
        )


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_build_matches_reference(bits):
    g = torch.Generator().manual_seed(bits)
    keys = torch.randn(2, 3, 5, B, 64, generator=g) + torch.randn(2, 3, 5, 1, 64, generator=g)
    valid = torch.rand(2, 3, 5, B, generator=g) > 0.2
    valid[0, 0, 0, 3:] = False  # a page of 3 real tokens: rank-deficient
    got = kernels.build_summary(keys.to(DEV), valid.to(DEV), 4, bits)
    want = ref_build(keys, valid, 4, bits)
    for name, t in want.items():
        assert got[name].shape == t.shape and got[name].dtype == t.dtype, name
    assert torch.equal(got["mu"].cpu(), want["mu"]) and torch.equal(got["mu_scale"].cpu(), want["mu_scale"])
    # same scores (up to quantization noise) for random queries
    q = torch.randn(2, 3, 4, 64, generator=g, dtype=torch.float64)
    s = [
        estimated_page_lse(
            *dequantize_summary({k: v.cpu() for k, v in x.items()}, bits, torch.float64), valid[:, :1], q, 0.125
        )
        for x in (got, want)
    ]
    exact = exact_page_lse(keys.double(), valid[:, :1], q, 0.125)
    err_got, err_want = ((s[0] - exact).norm() / exact.norm()).item(), ((s[1] - exact).norm() / exact.norm()).item()
    assert err_got < 1.1 * err_want + 1e-4, (err_got, err_want)


def test_decode_step_matches_reference_pipeline():
    """Score + select + attend chained, against the reference selector and a float64 attention."""
    c = Cache(11, pages=40, G=4)
    k = 6
    summ = c.summary(4, 4)
    out, pages = kernels.decode_step(
        "locks",
        c.dev("query"),
        key_buf=c.dev("keys"),
        value_buf=c.dev("values"),
        summary={n: v.to(DEV) for n, v in summ.items()},
        slots=k,
        scale=0.3,
        basis_bits=4,
        **c.kw(),
    )
    mu, basis, coef = dequantize_summary(summ, 4, torch.float64)
    n = mu.shape[2]
    scores = estimated_page_lse(mu, basis, coef, c.valid[:, None, :n], c.query.view(c.b, c.h, c.G, c.d).double(), 0.3)
    scores = torch.nn.functional.pad(scores, (0, c.P - n), value=float("-inf"))
    want = ref_select(scores, c.page_real, c.complete, k, "share_average", False)
    assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want)
    ref = _ref_attention(c, pages, 0.3)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5


@pytest.mark.parametrize(
    "static,selector",
    [
        (False, "locks"),
        (True, "locks"),
        (False, "quest"),
        (True, "quest"),
        (True, "full"),
        ("wide", "locks"),
        ("wide", "quest"),
    ],
)
def test_layer_glue_matches_reference_path(monkeypatch, static, selector):
    """`backends.triton.kernel_decode` on a `LocksLayer` / `LocksStaticLayer` (run directly, on this device) =
    the reference path on the same layer: output, page set, token statistics. (``"full"`` decodes on
    the page path only in the static cache: a dynamic cache hands it to SDPA.) ``"wide"``: a static
    layer whose page lists are sized for a larger budget, decoding at its own (read on the device)."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the reference calls below must not dispatch
    from locks_hf.backends.reference import reference_decode
    from locks_hf.backends.triton import kernel_decode
    from locks_hf.cache import LocksLayer
    from locks_hf.static_cache import LocksStaticLayer

    c = Cache(5, b=2, pages=20, pad=(0, 0), hole=False)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=5 * B, selector=selector)
    layer = (
        LocksStaticLayer(c.length + 3 * B, cfg, max_slots=9 if static == "wide" else None)
        if static
        else LocksLayer(cfg)
    )
    layer.update(c.dev("keys")[:, :, : c.length], c.dev("values")[:, :, : c.length])
    # Slots past the length are unwritten memory: poison them, neither path may read them.
    layer.key_buffer()[:, :, c.length :] = float("nan")
    layer.value_buffer()[:, :, c.length :] = float("nan")
    layer.prepare(None, c.length)  # what the attention function does after a prefill
    q = c.dev("query")
    ref = reference_decode(layer, q, 0.3)
    ref_sel, ref_stats = layer.last_selection.clone(), layer.counts.clone()
    assert 0 < ref_stats[0] <= ref_stats[1] and (selector != "full") == bool(ref_sel.any())
    layer.reset_stats()
    got = kernel_decode(layer, q, 0.3)
    assert torch.equal(layer.last_selection.cpu(), ref_sel.cpu())
    assert torch.equal(layer.counts, ref_stats)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5


def test_layer_keeps_the_kernel_plan_of_its_current_settings(monkeypatch):
    """A layer on a kernel backend keeps `KernelPlan.of` its settings (`PagedLayer.refresh_backend`): after
    `set_config` its next step's launches take the new scoring mode and summary (a stale plan would score
    Quest's summary as Locks'), a budget change keeps the plan, and a step through the kept plan equals
    the reference path on the same layer."""
    import locks_hf.paged
    from locks_hf.backends import TRITON
    from locks_hf.backends.reference import reference_decode
    from locks_hf.backends.triton import KernelPlan, kernel_decode
    from locks_hf.static_cache import LocksStaticLayer

    monkeypatch.setattr(locks_hf.paged, "choose_backend", lambda layer: TRITON)  # the GPU's choice, here
    c = Cache(11, b=2, pages=20, pad=(0, 0), hole=False)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=5 * B, selector="locks")
    layer = LocksStaticLayer(c.length + 3 * B, cfg)
    layer.update(c.dev("keys")[:, :, : c.length], c.dev("values")[:, :, : c.length])
    layer.prepare(None, c.length)
    assert layer.backend is TRITON and layer.kernel_plan == KernelPlan.of(cfg)
    assert layer.kernel_plan.method == "locks" and "basis" in layer.kernel_plan.summary_names

    quest = cfg.replace(selector="quest")
    layer.set_config(quest)
    assert layer.kernel_plan == KernelPlan.of(quest)
    assert (layer.kernel_plan.method, layer.kernel_plan.summary_names) == ("quest", ("upper", "lower"))
    kept = layer.kernel_plan
    layer.set_budget(quest.replace(budget=3 * B))
    assert layer.kernel_plan is kept

    q = c.dev("query")
    ref = reference_decode(layer, q, 0.3)
    ref_sel, ref_stats = layer.last_selection.clone(), layer.counts.clone()
    layer.reset_stats()
    got = kernel_decode(layer, q, 0.3)
    assert torch.equal(layer.last_selection.cpu(), ref_sel.cpu()) and ref_sel.any()
    assert torch.equal(layer.counts, ref_stats)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5


# every kernel selector the static layout serves, dense "full" included
@pytest.mark.parametrize("selector", selectors(kernel=True, static_cache=True, reads_keys=False))
def test_decode_step_op_schema_and_fake_match_what_selectors_declare(monkeypatch, selector):
    """The custom op with the arguments the Triton backend derives from a selector's declarations
    (scan mode, per-head lists, re-ranking) and a static layer's buffers: its schema holds (the
    mutated buffers declared) and its fake implementation gives the real outputs' shapes."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the layer's prefill takes the reference path
    from locks_hf.backends.triton import KernelPlan
    from locks_hf.selectors import selector_class
    from locks_hf.static_cache import LocksStaticLayer

    declared = selector_class(selector)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=3 * B, selector=selector)
    length, h, d = 5 * B + 3, 2, 64
    gen = torch.Generator().manual_seed(3)
    layer = LocksStaticLayer(length + 2 * B, cfg)
    layer.update(*(torch.randn(1, h, length, d, generator=gen).to(DEV) for _ in range(2)))
    layer.prepare(None, length)
    io = layer.step_tensors()
    plan = KernelPlan.of(cfg)
    assert (plan.method, plan.per_head, plan.dense) == (declared.kernel_method, declared.per_head, declared.dense)
    args = (
        plan.method,
        torch.randn(1, 2 * h, 1, d, generator=gen).to(DEV),
        io["keys"],
        io["values"],
        io["slot_valid"],
        io["row_start"],
        io["n_complete"],
        io["length"],
        [layer.summary[n] for n in kernels.SUMMARY_NAMES.get(plan.method, ())],
        io["n_pages"],
        io["width"],
        0.125,
        B,
        4,
        io["counts"],
        io["active"],
        io["row_counts"],
        io["pad"],
        None if declared.dense else io["selection"],
        plan.tickets(io),
        declared.per_head,
        cfg.rerank or 0,
    )
    torch.library.opcheck(torch.ops.locks_hf.decode_step.default, args, test_utils=("test_schema", "test_faketensor"))


# the kernel selectors with per-page summaries of their own (the oracle reads keys, no summary)
@pytest.mark.parametrize("selector", selectors(kernel=True, dense=False, reads_keys=False, summary_of=None))
def test_static_per_step_page_summary_glue(monkeypatch, selector):
    """`backends.triton.kernel_update_newest_page` on a `LocksStaticLayer` = the layer's reference per-step summary
    for the page a step completes; on a step that completes none it writes nothing."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the layer's own calls take the reference path
    from locks_hf.backends.triton import kernel_update_newest_page
    from locks_hf.static_cache import LocksStaticLayer

    c = Cache(7, b=2, pages=20, pad=(0, 0), hole=False)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=5 * B, selector=selector)
    L = (c.length // B) * B - 2  # two tokens short of a page boundary
    keys, values = c.dev("keys"), c.dev("values")
    ref, ker = (LocksStaticLayer(L + 3 * B, cfg) for _ in range(2))
    for layer in (ref, ker):
        layer.update(keys[:, :, :L], values[:, :, :L])
        layer.prepare(None, L)
    for step in range(2):  # the first step completes no page, the second completes page L // B
        before = {n: t.clone() for n, t in ker.summary.items()}
        for layer in (ref, ker):
            layer.update(keys[:, :, L + step : L + step + 1], values[:, :, L + step : L + step + 1])
        ref.prepare(None, 1)
        kernel_update_newest_page(ker)
        done = (L + step + 1) % B == 0
        page = (L + step + 1) // B - 1
        for name, t in ker.summary.items():
            others = torch.ones(t.shape[2], dtype=torch.bool)
            if done:
                others[page] = False
            assert torch.equal(t[:, :, others], before[name][:, :, others]), name
            assert torch.equal(ref.summary[name][:, :, :page], t[:, :, :page]), name
        if not done:
            continue
        got, want = ({n: t[:, :, page : page + 1] for n, t in x.summary.items()} for x in (ker, ref))
        if selector == "quest":
            assert all(torch.equal(got[n], want[n]) for n in got)
        else:  # the fused build and the reference (its own eigensolver: basis signs may differ)
            assert torch.equal(got["mu"], want["mu"]) and torch.equal(got["mu_scale"], want["mu_scale"])
            (_, bg, cg), (_, bw, cw) = (dequantize_summary(x, 4, torch.float64) for x in (got, want))
            rec_g, rec_w = cg @ bg, cw @ bw  # the page's rank-r centered keys
            assert ((rec_g - rec_w).norm() / rec_w.norm()).item() < 1e-2
    assert done


# generate() dispatches to the kernels only for CUDA tensors; on the CPU each kernel is checked above
# under the interpreter.
@pytest.mark.gpu
@pytest.mark.parametrize("selector", selectors(kernel=True, dense=False, summary_of=None))
def test_generate_on_gpu_matches_reference_path(monkeypatch, selector):
    """A left-padded batch through generate(): kernels and the PyTorch reference give the same tokens."""
    from locks_hf.config import LocksConfig

    kernel_out, reference_out = generate_both_paths(monkeypatch, LocksConfig(selector=selector, rank=4, budget=6 * B))
    assert torch.equal(kernel_out, reference_out)


def generate_both_paths(monkeypatch, cfg):
    """Greedy tokens of a left-padded batch of a tiny GQA Llama on ``DEV`` with ``cfg``: through the
    kernels, then through the PyTorch reference (``LOCKS_HF_KERNELS``)."""
    from locks_hf import LocksCache
    from locks_hf.models import tiny_model

    model = tiny_model("llama", head_dim=64, num_attention_heads=8, num_key_value_heads=2, hidden_size=512).to(DEV)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 700), generator=g).to(DEV)
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    outs = []
    for flag in ("1", "0"):
        monkeypatch.setenv("LOCKS_HF_KERNELS", flag)
        outs.append(
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=24,
                do_sample=False,
                past_key_values=LocksCache(model.config, cfg),
                pad_token_id=0,
            )
        )
    return outs


@pytest.mark.parametrize("rank,bits,G", [(4, 4, 4), (8, 4, 4), (2, 4, 16), (4, 2, 4), (4, 8, 3), (4, 4, 16)])
def test_locks_fma_scores_match_reference(rank, bits, G):
    """Variant "fma" (one thread per page): scores as the reference, partials as one program's."""
    c, summ, ref = _locks_case(rank, bits, G)
    kw = c.kw()
    if rank == 8:  # the cache's int32 [1] length tensor instead of an int
        kw["length"] = torch.tensor([c.length], dtype=torch.int32, device=DEV)
    got, part = kernels.score_pages(
        "locks", c.dev("query"), summary=summ, scale=0.3, basis_bits=bits, variant="fma", **kw
    )
    _scores_ok(got.view(c.b, c.h, G, c.P), ref, _complete_real(c), 1e-5)
    assert part.shape[1] == 1
    part = part.cpu()
    assert torch.allclose(part[..., :G], _partials(got.cpu(), c), rtol=1e-5, atol=1e-6)
    # heads padding the group to a power of two take no part: empty LSE, no first score
    assert torch.isneginf(part[:, :, [0, 2], G:]).all() and (part[:, :, 1, G:] == 0).all()


def test_locks_fma_score_then_select_over_many_blocks():
    """Variant "fma" over several programs (32-page blocks): the selection equals the reference's."""
    c = Cache(3, pages=70, G=4)
    summ = {k: v.to(DEV) for k, v in c.summary(4, 4).items()}
    scores, part = kernels.score_pages(
        "locks",
        c.dev("query"),
        summary=summ,
        basis_bits=4,
        scale=0.3,
        variant="fma",
        block_pages=32,
        num_warps=1,
        **c.kw(),
    )
    assert part.shape[1] > 1
    for k in (3, 12):
        pages = kernels.select_pages(
            scores, part, slots=k, per_head=False, row_start=c.dev("row_start"), length=c.length, heads=c.h, page_size=B
        )
        want = ref_select(
            scores.cpu().view(c.b, c.h, c.G, c.P).double(), c.page_real, c.complete, k, "share_average", False
        )
        assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want)


def test_locks_fma_rejects_bad_tiles():
    c = Cache(1)
    summ = {k: v.to(DEV) for k, v in c.summary(4, 4).items()}
    with pytest.raises(ValueError, match="multiple of 32"):
        kernels.score_pages(
            "locks",
            c.dev("query"),
            summary=summ,
            basis_bits=4,
            scale=0.3,
            variant="fma",
            block_pages=48,
            num_warps=1,
            **c.kw(),
        )
    with pytest.raises(ValueError, match="variant"):
        kernels.score_pages("locks", c.dev("query"), summary=summ, basis_bits=4, scale=0.3, variant="tensor", **c.kw())


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("selector", selectors(kernel=True, dense=False))
@pytest.mark.parametrize("rows", ["with_a_long_row", "padded_row_only"])
def test_left_padding_filling_whole_pages_on_the_kernels(monkeypatch, static, selector, rows):
    """A row of 5 real tokens behind 6 whole pages of left padding, at a budget of two pages: paged
    from its first real token it has no complete page, and the kernels' decode (and, on the static
    layer, the per-step page update) attend exactly its real tokens, as the reference path does. Next
    to a long row that selects pages, both paths agree on that row too. A dynamic layer holding only
    the padded row decodes densely (SDPA), as the row alone would."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the layer's own calls take the reference path
    from locks_hf.backends.reference import reference_decode
    from locks_hf.backends.triton import kernel_decode, kernel_update_newest_page
    from locks_hf.cache import LocksLayer
    from locks_hf.static_cache import LocksStaticLayer

    c = Cache(13, b=2, pages=7, pad=(0, 0), hole=False)
    L = c.length  # 6 complete pages + 11 slots
    pad = L - 5
    valid = torch.ones(2, L, dtype=torch.bool)
    valid[1, :pad] = False
    keep = [0, 1] if rows == "with_a_long_row" else [1]
    valid = valid[keep].to(DEV)
    keys, values = (c.dev(n)[keep][:, :, :L] for n in ("keys", "values"))
    b = len(keep)
    cfg = LocksConfig(rank=4, basis_bits=4, budget=2 * B, selector=selector)
    layer = LocksStaticLayer(L + 2 * B, cfg) if static else LocksLayer(cfg)
    layer.update(keys, values)
    layer.prepare(valid[:, None, None, :].expand(b, 1, L, L), L)  # prefill, padding read off the mask
    step_k, step_v = (torch.randn(b, c.h, 1, c.d, generator=torch.Generator().manual_seed(s)).to(DEV) for s in (1, 2))
    layer.update(step_k, step_v)  # one decode token
    if static:
        layer.prepare(None, 1)
        kernel_update_newest_page(layer)  # must leave the padded row's summaries as the reference wrote them
    else:
        layer.prepare(None, 1)
        if rows == "padded_row_only":
            assert layer.attends_densely(1)  # 1 page: every page fits the budget
            return
        assert not layer.attends_densely(1)
    q = c.dev("query")[keep]
    ref = reference_decode(layer, q, 0.3)
    ref_sel = layer.last_selection.clone()
    got = kernel_decode(layer, q, 0.3)
    assert torch.equal(layer.last_selection.cpu(), ref_sel.cpu())
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5
    # the padded row (the last) attends its 5 real tokens and the step's own, densely
    r = b - 1
    k_real = torch.cat([keys[r, :, pad:], step_k[r]], 1).double()
    v_real = torch.cat([values[r, :, pad:], step_v[r]], 1).double()
    qr = q[r, :, 0].double().view(c.h, c.G, c.d)
    dense = torch.einsum("hgn,hnd->hgd", torch.softmax(0.3 * torch.einsum("hgd,hnd->hgn", qr, k_real), -1), v_real)
    for out in (ref, got):
        assert torch.allclose(out[r, 0].double().view(c.h, c.G, c.d), dense, atol=1e-5)
