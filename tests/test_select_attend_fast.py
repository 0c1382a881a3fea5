"""The selection with a device budget and the fused split-K attention against
brute force: the page sets of the paper's rule (`locks_hf.selectors.select_pages`) and float64
attention over exactly the selected tokens.

Synthetic score tensors with the scoring kernels' partials computed here, so each case is a few
launches; on a machine without CUDA the kernels run in Triton's interpreter (small shapes).
"""

import math
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and Triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from conftest import page_lists_as_mask  # noqa: E402
from selector_lists import selectors

from locks_hf import kernels  # noqa: E402
from locks_hf.kernels._common import (  # noqa: E402
    HISTOGRAM_MASK,
    RADIX_BINS,
    RADIX_BITS,
    radix_round,
    top_keys,
    top_keys_of,
)
from locks_hf.selectors import select_pages as ref_select  # noqa: E402

pytestmark = pytest.mark.interpret
DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
BIG_PAGE = 2**30


class Rows:
    """``b`` batch rows of ``h`` KV heads over pages of ``B`` slots: row ``i`` starts at slot
    ``pad[i]`` (left padding), ``length`` slots are written (the last page may be incomplete)."""

    def __init__(self, seed, *, b=2, h=2, G=4, B=16, pages=24, pad=(0, 37), d=32, dtype=torch.float32):
        g = torch.Generator().manual_seed(seed)
        self.b, self.h, self.G, self.B, self.d = b, h, G, B, d
        self.row_start = torch.tensor([pad[i % len(pad)] for i in range(b)], dtype=torch.int32)
        self.length = int(self.row_start.min()) + pages * B - B // 2
        self.cap = self.length + 2 * B
        self.P = self.cap // B
        self.n_complete = ((self.length - self.row_start) // B).clamp_min(0).to(torch.int32)
        idx = torch.arange(self.P)
        first = self.row_start.long()[:, None] + idx * B  # first slot of each page
        self.page_real = first < self.length
        self.complete = idx[None] < self.n_complete[:, None]
        self.slot_valid = torch.ones(b, self.cap, dtype=torch.bool)
        for i in range(b):
            self.slot_valid[i, : int(self.row_start[i])] = False
        if b > 1:  # a padding slot inside a page
            self.slot_valid[1, int(self.row_start[1]) + B + 1] = False
        self.keys = torch.randn(b, h, self.cap, d, generator=g).to(dtype)
        self.values = torch.randn(b, h, self.cap, d, generator=g).to(dtype)
        self.keys[:, :, self.length :] = float("nan")  # never read
        self.values[:, :, self.length :] = float("nan")
        self.query = torch.randn(b, h * G, 1, d, generator=g).to(dtype)
        self.gen = g

    def scores(self, kind="randn"):
        """``[b*h, G, P]`` float32: random (``"ties"``: rounded, a run of equal pages; ``"flat"``:
        every page equal), ``-inf`` where a page is not a complete real page."""
        rows = self.b * self.h
        s = torch.randn(rows, self.G, self.P, generator=self.gen) * 3
        if kind == "ties":
            s = s.round()
            s[..., 3:9] = 1.5
        elif kind == "flat":
            s = torch.zeros_like(s)
        ok = (self.page_real & self.complete).repeat_interleave(self.h, 0)[:, None]
        return s.masked_fill(~ok, float("-inf"))

    def partials(self, scores, span):
        """What the scoring kernels leave for selection, one program per ``span`` pages: running max
        and sum of ``exp`` over the program's candidates except its first real page (the row's last
        page excluded), that page's scores and its index."""
        rows, G, P = scores.shape
        n_blk = -(-P // span)
        GG = 1 << (G - 1).bit_length()
        part = torch.zeros(rows, n_blk, 4, GG)
        part[:, :, 0] = part[:, :, 2] = float("-inf")
        part[:, :, 3] = BIG_PAGE
        for r in range(rows):
            last = (self.length - 1 - int(self.row_start[r // self.h])) // self.B
            for j in range(n_blk):
                pg = torch.arange(j * span, min(P, (j + 1) * span))
                s = scores[r][:, pg]
                real = s[0] > float("-inf")
                if not real.any():
                    continue
                first = int(pg[real][0])
                keep = real & (pg != first) & (pg != last)
                part[r, j, 2, :G] = scores[r, :, first]
                part[r, j, 3] = float(first)
                if keep.any():
                    m = s[:, keep].amax(-1)
                    part[r, j, 0, :G] = m
                    part[r, j, 1, :G] = torch.exp(s[:, keep] - m[:, None]).sum(-1)
        return part

    def want(self, scores, k, per_head):
        return ref_select(
            scores.view(self.b, self.h, self.G, self.P).double(),
            self.page_real,
            self.complete,
            k,
            "share_average",
            per_head,
        )


def _select(c, scores, k, per_head=False, span=8, **kw):
    return kernels.select_pages(
        scores.to(DEV),
        c.partials(scores, span).to(DEV),
        slots=k,
        per_head=per_head,
        row_start=c.row_start.to(DEV),
        length=c.length,
        heads=c.h,
        page_size=c.B,
        **kw,
    )


def test_selection_short_rows_and_device_budget():
    """A row with fewer complete pages than the budget, a padded row, and the budget read on the
    device (lists sized for a wider one)."""
    c = Rows(5, G=4, B=16, pages=6, pad=(0, 70))
    scores = c.scores()
    for k in (3, 6):
        active = torch.tensor([k], dtype=torch.int32, device=DEV)
        pages = _select(c, scores, 10, chunk=8, active_slots=active)
        assert pages.shape[1] == 10 and (pages[:, k:] == kernels.SENTINEL).all()
        assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), c.want(scores, k, False))


@pytest.mark.parametrize("per_head", [False, True])
def test_selection_marks_its_lists_in_the_mask(per_head):
    """``select_pages(mask=...)``: the launch that writes the lists overwrites a dirty page mask with exactly
    the listed pages (the sink, the recent page and the selected ones), as `mark_lists` does in a launch of its
    own; a mask of another shape is refused, not written past."""
    from locks_hf.paged import pages_to_mask

    c = Rows(13, G=4, B=16, pages=40, pad=(0, 70))
    scores = c.scores()
    gen = torch.Generator().manual_seed(5)
    mask = (torch.rand(c.b * c.h, c.P, generator=gen) > 0.5).to(DEV)
    pages = _select(c, scores, 6, per_head=per_head, chunk=8, mask=mask)
    listed = pages_to_mask(pages.cpu().long(), c.P)
    assert listed.sum(1).min() >= 3 and torch.equal(mask.cpu(), listed)
    if not per_head:
        assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, 6, False))
    with pytest.raises(ValueError, match=rf"mask must be a contiguous bool/int8 \[{c.b * c.h}, {c.P}\]"):
        _select(c, scores, 6, per_head=per_head, mask=mask[:, :-1])


@triton.jit
def _top_keys_rows(key_ptr, k_ptr, out_ptr, N: tl.constexpr):
    i = tl.program_id(0)
    e = tl.arange(0, N)
    keep = top_keys(tl.load(key_ptr + i * N + e), tl.load(k_ptr + i))
    tl.store(out_ptr + i * N + e, keep.to(tl.int8))


@pytest.mark.parametrize("kind", ["distinct", "ties", "narrow", "few", "extremes", "low_bits"])
def test_top_keys_is_a_stable_top_k(kind):
    """The threshold search (with its exact-count exit) against a stable descending sort: keys over the
    whole int32 range, runs of ties, a narrow range, rows with fewer candidates than K, the int32 range's
    ends (next to ``NO_KEY``, around 0, at the largest key) and keys that differ in their lowest bits alone
    (the radix's last round)."""
    no_key = -(2**31)
    g = torch.Generator().manual_seed(7)
    rows, N = 64, 256
    if kind == "distinct":
        key = torch.randperm(2**20, generator=g)[: rows * N].view(rows, N).to(torch.int64) * 4093 - 2**31 + 1
    elif kind == "ties":
        key = torch.randint(-5, 5, (rows, N), generator=g)
    elif kind == "narrow":
        key = torch.randint(1000, 1040, (rows, N), generator=g)
    elif kind == "extremes":
        ends = torch.tensor([no_key + 1, no_key + 2, -2, -1, 0, 1, 2**31 - 2, 2**31 - 1])
        key = ends[torch.randint(0, len(ends), (rows, N), generator=g)]
    elif kind == "low_bits":
        key = (
            0x35000000
            + torch.randint(0, 8, (rows, N), generator=g) * 2**20
            + torch.randint(0, 4, (rows, N), generator=g)
        )
    else:
        key = torch.randint(-(2**30), 2**30, (rows, N), generator=g)
    key = key.to(torch.int32)
    drop = torch.rand(rows, N, generator=g) < (0.9 if kind == "few" else 0.1)
    key = key.masked_fill(drop, no_key)
    k = torch.randint(0, N + 1, (rows,), generator=g, dtype=torch.int32)
    k[:4] = torch.tensor([0, 1, N, int((key[4] != no_key).sum())])
    out = torch.empty(rows, N, dtype=torch.int8, device=DEV)
    _top_keys_rows[(rows,)](key.to(DEV), k.to(DEV), out, N=N)
    want = torch.zeros(rows, N, dtype=torch.bool)
    for r in range(rows):
        cand = (key[r] != no_key).nonzero().flatten().tolist()
        order = sorted(cand, key=lambda i: (-int(key[r, i]), i))  # ties: the earlier position first
        want[r, order[: int(k[r])]] = True
    assert torch.equal(out.cpu().bool(), want)


@triton.jit
def _radix_rows(u_ptr, pre_ptr, shift_ptr, out_ptr, N: tl.constexpr, MASKED: tl.constexpr):
    i = tl.program_id(0)
    u = tl.load(u_ptr + i * N + tl.arange(0, N)).to(tl.uint32)
    hist = radix_round(u, u > 0, tl.load(pre_ptr + i), tl.load(shift_ptr + i), RADIX_BITS, RADIX_BINS, MASKED)
    tl.store(out_ptr + i * RADIX_BINS + tl.arange(0, RADIX_BINS), hist)


@pytest.mark.parametrize("masked", [True, False] if HISTOGRAM_MASK else [False])
def test_radix_round_counts_the_next_bits_of_the_keys_with_the_prefix(masked):
    """One round of the radix search against `torch.bincount`: the next 5 bits of the candidates (unsigned keys
    above 0) whose higher bits are the prefix's, from the top round to the last; with `tl.histogram`'s mask
    (Triton 3.6) and without it (a second half of buckets for the keys left out)."""
    g = torch.Generator().manual_seed(5)
    rows, N = 24, 128
    u = torch.randint(0, 2**32, (rows, N), generator=g, dtype=torch.int64)
    u[::3] = (u[::3] & 0xFFFF0FFF) | 0x00003000  # a common prefix down to bit 12
    u[1::4, :40] = 0  # not candidates
    shift = torch.tensor([30, 25, 20, 15, 10, 5, 0, 10] * 3)
    pre = (u[torch.arange(rows), torch.randint(0, N, (rows,), generator=g)] >> (shift + 5)) << (shift + 5)
    out = torch.empty(rows, 32, dtype=torch.int32, device=DEV)
    _radix_rows[(rows,)](u.to(DEV), pre.to(DEV), shift.to(DEV), out, N=N, MASKED=masked)
    for r in range(rows):
        s = int(shift[r])
        inside = (u[r] > 0) & ((u[r] >> (s + 5)) == (int(pre[r]) >> (s + 5)))
        want = torch.bincount((u[r][inside] >> s) & 31, minlength=32)
        assert torch.equal(out[r].cpu().long(), want), r


@triton.jit
def _top_keys_of_rows(key_ptr, k_ptr, out_ptr, N: tl.constexpr, M: tl.constexpr, TWO: tl.constexpr):
    i = tl.program_id(0)
    e = tl.arange(0, N)
    t = N + tl.arange(0, M)
    key = tl.load(key_ptr + i * (N + M) + e)
    more = tl.load(key_ptr + i * (N + M) + t)
    keep, keep2 = top_keys_of(key, more, tl.load(k_ptr + i), TWO)
    tl.store(out_ptr + i * (N + M) + e, keep.to(tl.int8))
    if TWO:
        tl.store(out_ptr + i * (N + M) + t, keep2.to(tl.int8))


@pytest.mark.parametrize("M", [8, 64, 256])
def test_top_keys_of_two_tiles_is_a_stable_top_k_of_both(M):
    """The threshold search over a tile of 256 keys and a second tile of ``M`` taken as one list of ``256 + M``:
    a stable descending sort of the concatenation (ties: the first tile's positions first), with runs of ties
    across the two tiles and rows whose best keys are all in the second one."""
    no_key = -(2**31)
    g = torch.Generator().manual_seed(11)
    rows, N = 48, 256
    key = torch.randint(-6, 6, (rows, N + M), generator=g)
    key[: rows // 2] = torch.randint(-(2**30), 2**30, (rows // 2, N + M), generator=g)
    key[-4:, N:] += 100  # the second tile holds the best keys
    key = key.to(torch.int32).masked_fill(torch.rand(rows, N + M, generator=g) < 0.2, no_key)
    k = torch.randint(0, N + M + 1, (rows,), generator=g, dtype=torch.int32)
    k[:3] = torch.tensor([0, 1, N + M])
    k[-4:] = torch.tensor([1, M // 2, M, M + 3])
    out = torch.zeros(rows, N + M, dtype=torch.int8, device=DEV)
    _top_keys_of_rows[(rows,)](key.to(DEV), k.to(DEV), out, N=N, M=M, TWO=True)
    want = torch.zeros(rows, N + M, dtype=torch.bool)
    for r in range(rows):
        cand = (key[r] != no_key).nonzero().flatten().tolist()
        order = sorted(cand, key=lambda i: (-int(key[r, i]), i))
        want[r, order[: int(k[r])]] = True
    assert torch.equal(out.cpu().bool(), want)
    one = torch.zeros_like(out)  # without TWO: the first tile alone, as `top_keys`
    _top_keys_of_rows[(rows,)](key.to(DEV), k.to(DEV), one, N=N, M=M, TWO=False)
    for r in range(rows):
        cand = (key[r, :N] != no_key).nonzero().flatten().tolist()
        order = sorted(cand, key=lambda i: (-int(key[r, i]), i))
        assert one[r, :N].cpu().bool().nonzero().flatten().tolist() == sorted(order[: int(k[r])])
    assert not one[:, N:].any()


def test_merge_tiles_cover_the_chunk_lists_with_no_power_of_two_of_padding():
    """17 chunks of 128 winners (512K tokens plus headroom): 2,048 + 128 entries, not 4,096."""
    tiles = kernels.select.merge_tiles
    assert kernels.select.chunks_of(32774, 128) == (2048, 17) and kernels.select.chunks_of(40, 8, 16) == (16, 3)
    assert tiles(17, 128) == (2048, 128)
    assert tiles(16, 128) == (2048, 0) and tiles(1, 128) == (128, 0)
    assert tiles(24, 128) == (2048, 1024) and tiles(31, 128) == (2048, 2048) and tiles(3, 4) == (8, 4)
    for n in range(1, 70):
        M, MT = tiles(n, 16)
        assert M + MT >= 16 * n and M & (M - 1) == 0 and MT & (MT - 1) == 0 and M >= MT


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("pages", "chunk", "chunks"), [(39, 8, 5), (39, 16, 3), (135, 8, 17)])
def test_selection_over_a_chunk_count_that_is_no_power_of_two(per_head, pages, chunk, chunks):
    """5, 3 and 17 chunks of a row (a static cache's capacity is rarely a power of two of pages): the merge takes
    the lists past its first tile in a second one, and the pages, the lists' order and the marked mask are the
    reference's."""
    from locks_hf.paged import pages_to_mask

    c = Rows(17, G=4, B=16, pages=pages, pad=(0, 70))
    scores = c.scores("ties")
    assert -(-c.P // chunk) == chunks and kernels.select.merge_tiles(chunks, 8)[1] > 0
    first_tile = kernels.select.merge_tiles(chunks, 8)[0] // 8 * chunk  # pages whose winners fill the first tile
    scores[..., first_tile:] += 8  # the best candidates are in the second tile (and -inf stays -inf)
    assert (scores[..., first_tile:] > float("-inf")).sum() >= 4
    for k in (4, 9):
        mask = torch.ones(c.b * c.h, c.P, dtype=torch.bool, device=DEV)
        pages = _select(c, scores, k, per_head=per_head, chunk=chunk, mask=mask)
        listed = pages_to_mask(pages.cpu().long(), c.P)
        assert torch.equal(mask.cpu(), listed)
        chosen = pages.cpu()[:, 2:]
        real = chosen[chosen != kernels.SENTINEL]
        assert real.numel() and all((row[row != kernels.SENTINEL].diff() > 0).all() for row in chosen)
        if not per_head:
            assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, k, False))
        else:
            assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, k, True))


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize(("chunk", "group"), [(8, 2), (8, 4), (16, 8), (4, 16)])
def test_selection_with_a_middle_stage_is_the_reference(per_head, chunk, group):
    """Short chunks whose lists a middle stage merges ``group`` at a time before the final merge (10, 10, 5 and
    19 chunks of a row: whole groups, a partial last group, a single group): the reference's pages, in page
    order, with runs of tied scores across the groups, at budgets that a chunk, a group or neither can hold."""
    from locks_hf.paged import pages_to_mask

    c = Rows(23, G=4, B=16, pages=70, pad=(0, 70))
    scores = c.scores("ties")
    for k in (3, 20):
        pages = _select(c, scores, k, per_head=per_head, chunk=chunk, group=group)
        if k == 3:
            assert torch.equal(pages, _select(c, scores, k, per_head=per_head, chunk=chunk)), "as without it"
        listed = pages_to_mask(pages.cpu().long(), c.P)
        chosen = pages.cpu()[:, 2:]
        assert all((row[row != kernels.SENTINEL].diff() > 0).all() for row in chosen)
        assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, k, per_head)), k
    with pytest.raises(ValueError, match="group must be a power of two"):
        _select(c, scores, 4, chunk=chunk, group=3)


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("group", [None, 4])
def test_selection_is_one_launch_that_leaves_its_tickets_zero(monkeypatch, per_head, group):
    """The chunks, the middle stage, the merge and Quest's union in one launch: each later stage runs in the
    last program of its group, row or KV head to finish, found by counters that the launch leaves zero, so one
    buffer of them serves step after step (a captured graph's replays). The reference's pages each time."""
    from locks_hf.kernels import select
    from locks_hf.paged import pages_to_mask

    launched = []
    real_launch = select.launch

    def counted(kernel, grid, *args, **kw):
        launched.append(kernel)
        real_launch(kernel, grid, *args, **kw)

    monkeypatch.setattr(select, "launch", counted)
    c = Rows(29, G=4, B=16, pages=70, pad=(0, 70))
    tickets = torch.zeros(256, dtype=torch.int32, device=DEV)
    for k in (3, 9, 20):
        scores = c.scores("ties")
        pages = _select(c, scores, k, per_head=per_head, chunk=8, group=group, tickets=tickets)
        assert launched == [select._select_kernel] and not tickets.any(), (launched, tickets)
        launched.clear()
        listed = pages_to_mask(pages.cpu().long(), c.P)
        assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, k, per_head)), k
    with pytest.raises(ValueError, match="tickets must be a contiguous int32 tensor of at least"):
        _select(c, c.scores(), 5, per_head=per_head, chunk=8, group=group, tickets=tickets[:2])
    with pytest.raises(ValueError, match="tickets must be a contiguous int32 tensor of at least"):
        _select(c, c.scores(), 5, per_head=per_head, chunk=8, group=group, tickets=tickets.long())


def test_a_static_layers_counters_cover_every_selection_of_its_lists():
    """`locks_hf.buffers.selection_tickets` (a static layer's counter buffer) holds the counters of the default
    selection plan at any page count and budget, with or without a middle stage."""
    from locks_hf.buffers import SELECTION_MIN_CHUNK, selection_tickets
    from locks_hf.kernels import select

    assert SELECTION_MIN_CHUNK == select.MIN_CHUNK
    for rows in (1, 2, 8, 64):
        for n_pages in (1, 255, 256, 257, 4097, 32774, 65542, 131078):
            for slots in (3, 66, 130, 258, 2050, 8194):
                kp = select.next_pow2(max(slots - 2, 1))
                _, n_chunk, group = select.selection_stages(n_pages, kp, rows)
                n_group = -(-n_chunk // group) if group else 0
                assert rows * (n_group + 1) <= selection_tickets(rows, n_pages), (rows, n_pages, slots)


def test_selection_stages_add_a_middle_stage_only_where_long_chunks_leave_few_programs():
    """The default plan: long chunks on few rows (GLM-4-9B at 512K: 2 KV heads, 32,774 pages) become chunks half
    as long whose lists a middle stage merges; many rows, short chunks or given settings keep two stages."""
    from locks_hf.kernels import select

    assert select.selection_stages(32774, 128, 2) == (1024, 33, select.MIDDLE_GROUP)
    assert select.selection_stages(65542, 128, 2) == (2048, 33, select.MIDDLE_GROUP)
    assert select.selection_stages(32774, 128, 8) == (2048, 17, None)  # 136 programs already
    assert select.selection_stages(16390, 128, 2) == (1024, 17, None)  # chunks already short
    assert select.selection_stages(40000, 2048, 2) == (2048, 20, None)  # a half chunk would not hold k-2 pages
    assert select.selection_stages(32774, 128, 2, chunk=2048) == (2048, 17, None)
    assert select.selection_stages(32774, 128, 2, group=4) == (2048, 17, 4)
    assert select.selection_stages(300, 128, 2, group=4) == (256, 2, 4)
    assert select.selection_stages(200, 128, 2, group=4) == (256, 1, None)  # one chunk: nothing to merge
    with pytest.raises(ValueError, match="group must be a power of two"):
        select.selection_stages(32774, 128, 2, group=6)


@pytest.mark.parametrize("per_head", [False, True])
def test_default_selection_of_a_long_cache_on_two_rows_is_the_reference(per_head):
    """32,774 pages on two KV heads, where the default plan adds a middle stage (the shared rule; Quest's per-head
    rows are many and keep two stages): the reference's pages, the same as two stages of 2,048-page chunks."""
    from locks_hf.paged import pages_to_mask

    c = Rows(41, b=1, h=2, G=2, B=16, pages=32770, pad=(0,), d=4)
    scores = c.scores("ties")
    scores[..., -4:] += 20  # winners in the last chunk, alone in the last group
    k = 130
    pages = _select(c, scores, k, per_head=per_head, span=256)
    assert torch.equal(pages, _select(c, scores, k, per_head=per_head, span=256, chunk=2048))
    listed = pages_to_mask(pages.cpu().long(), c.P)
    assert torch.equal(listed.view(c.b, c.h, c.P), c.want(scores, k, per_head))


@pytest.mark.parametrize("G", [4, 16])
def test_selection_folds_the_partials_in_steps_of_any_width(G):
    """Many scoring partials a row (one per 2 pages): folded a few per step (a long dependent loop), in
    one step (the default tile), or wider than there are: the reference's pages every time."""
    c = Rows(9, G=G, B=4, pages=150, pad=(0, 13))
    scores = c.scores()
    want = c.want(scores, 12, False)
    n_blk = -(-c.P // 2)
    assert kernels.select.default_partial_block(G) >= n_blk > 64  # the default folds them in one step
    for nbp in (16, 64, None, 1024):
        pages = _select(c, scores, 12, span=2, partial_block=nbp)
        assert torch.equal(page_lists_as_mask(pages, c.b, c.h, c.P), want), nbp


@triton.jit
def _fold_rows(part_ptr, n_blk, last_ptr, sink_ptr, lse_ptr, GG: tl.constexpr, NBP: tl.constexpr, NBR: tl.constexpr):
    row = tl.program_id(0)
    sink, lse = kernels.select.sink_and_lse(part_ptr, row, n_blk, tl.load(last_ptr + row), GG, NBP, NBR, True)
    tl.store(sink_ptr + row, sink)
    tl.store(lse_ptr + row * GG + tl.arange(0, GG), lse)


@pytest.mark.parametrize(("n_blk", "nbp"), [(13, 4), (16, 8), (5, 16), (33, 16), (100, 64)])
def test_partials_fold_to_the_sink_and_lse(n_blk, nbp):
    """`sink_and_lse` in steps of ``nbp`` and a remainder tile (narrow or wide), against float64: the sink is the
    least first page (the recent page when there is none), and the LSE takes every partial's sum and the other
    first pages except the recent one. Rows whose first pages come in page order (as the scoring kernels leave
    them, with empty programs before the first real page), in any order, with the sink in the remainder tile,
    with the recent page among the first pages, and with no real page at all."""
    g = torch.Generator().manual_seed(n_blk * 100 + nbp)
    G = GG = 4
    rows = 6
    part = torch.empty(rows, n_blk, 4, GG)
    part[:, :, 0] = torch.randn(rows, n_blk, GG, generator=g) * 3
    part[:, :, 1] = torch.rand(rows, n_blk, GG, generator=g) * 5 + 0.5
    part[:, :, 2] = torch.randn(rows, n_blk, GG, generator=g) * 3
    first = torch.arange(n_blk, dtype=torch.float32)[None].repeat(rows, 1) * 7 + 3
    first[1] = first[1].flip(0)  # any order: each step's least page replaces the one put aside
    first[4] = first[4, torch.randperm(n_blk, generator=g)]
    first[2, : n_blk - 1] = BIG_PAGE  # the sink in the last partial (the remainder tile when there is one)
    part[2, : n_blk - 1, 0] = float("-inf")
    part[2, : n_blk - 1, 1] = 0.0
    first[3, :2] = BIG_PAGE  # empty programs first
    first[5] = BIG_PAGE  # no real page
    part[5, :, 0] = float("-inf")
    part[5, :, 1] = 0.0
    part[:, :, 3] = first[:, :, None]
    last = torch.full((rows,), 10**6, dtype=torch.int32)
    last[4] = int(first[4, n_blk // 2])  # the recent page is one program's first page
    last[1] = int(first[1, min(nbp, n_blk) - 1])  # the first step's least page, later replaced
    sink = torch.empty(rows, dtype=torch.int32, device=DEV)
    lse = torch.empty(rows, GG, device=DEV)
    nbp_, nbr = kernels.select.fold_tiles(n_blk, nbp)
    if n_blk <= nbp:  # one step
        assert (nbp_, nbr) == (1 << (n_blk - 1).bit_length(), 0)
    else:
        assert nbr == (0 if n_blk % nbp == 0 else 1 << (n_blk % nbp - 1).bit_length())
    _fold_rows[(rows,)](part.to(DEV), n_blk, last.to(DEV), sink, lse, GG=GG, NBP=nbp_, NBR=nbr)
    p = part.double()
    for r in range(rows):
        f = p[r, :, 3, 0]
        real = f[f < BIG_PAGE]
        want_sink = int(real.min()) if len(real) else int(last[r])
        assert int(sink[r]) == want_sink, r
        add = ((f != want_sink) & (f != int(last[r])) & (f < BIG_PAGE))[:, None]
        terms = torch.cat([p[r, :, 0, :G] + torch.log(p[r, :, 1, :G]), torch.where(add, p[r, :, 2, :G], float("-inf"))])
        want = torch.logsumexp(terms, 0)
        got = lse[r].double().cpu()
        assert torch.equal(torch.isfinite(got), torch.isfinite(want)), r
        fin = torch.isfinite(want)
        assert torch.allclose(got[fin], want[fin], rtol=1e-6, atol=1e-5), (r, got, want)


def test_selection_rejects_bad_input():
    c = Rows(1, pages=4)
    scores = c.scores()
    with pytest.raises(ValueError, match="float32"):
        kernels.select_pages(
            scores.double(),
            c.partials(scores, 8),
            slots=4,
            per_head=False,
            row_start=c.row_start,
            length=c.length,
            heads=c.h,
            page_size=c.B,
        )


def _ref_attention(c, pages, scale):
    """Float64 attention of each query head over exactly the real tokens of its KV head's pages."""
    out = torch.empty(c.b, 1, c.h * c.G, c.d, dtype=torch.float64)
    for r, row in enumerate(pages.cpu().tolist()):
        i, j = divmod(r, c.h)
        slots = [int(c.row_start[i]) + p * c.B + t for p in row if p >= 0 for t in range(c.B)]
        slots = [s for s in slots if s < c.length and c.slot_valid[i, s]]
        k = c.keys[i, j, slots].double()
        v = c.values[i, j, slots].double()
        for g in range(c.G):
            out[i, 0, j * c.G + g] = torch.softmax(scale * k @ c.query[i, j * c.G + g, 0].double(), 0) @ v
    return out, sum(len([p for p in row if p >= 0]) for row in pages.tolist())


@pytest.mark.parametrize(
    "G,B,splits,fused",
    [
        (1, 16, None, True),
        (4, 8, 3, True),
        (8, 32, 2, True),
        (16, 16, None, True),
        (16, 16, 4, False),
        (4, 16, 1, True),
    ],
)
def test_attention_over_the_selected_tokens(G, B, splits, fused):
    c = Rows(G * B, G=G, B=B, pages=12 if B < 32 else 6)
    scores = c.scores()
    k = 5 if B < 32 else 3
    pages = _select(c, scores, k, chunk=16)
    counts = torch.full((2,), 5, dtype=torch.int64, device=DEV)
    row_counts = torch.zeros(c.b, 2, dtype=torch.int64, device=DEV)
    pad = c.row_start.to(DEV)  # every padding slot is before the row's start here, but one hole
    pad = pad + torch.tensor([0, 1], dtype=torch.int32, device=DEV)[: c.b]
    sem = torch.zeros(c.b * c.h, dtype=torch.int32, device=DEV)
    out = kernels.sparse_attention(
        c.query.to(DEV),
        c.keys.to(DEV),
        c.values.to(DEV),
        pages,
        scale=0.3,
        slot_valid=c.slot_valid.to(DEV),
        row_start=c.row_start.to(DEV),
        length=c.length,
        page_size=B,
        splits=splits,
        fused_combine=fused,
        semaphore=sem,
        counts=counts,
        row_counts=row_counts,
        pad=pad,
    )
    ref, _ = _ref_attention(c, pages, 0.3)
    assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5
    assert not sem.any()
    real = [
        sum(
            int(c.slot_valid[i, s])
            for r, row in enumerate(pages.cpu().tolist())
            if r // c.h == i
            for p in row
            if p >= 0
            for s in range(int(c.row_start[i]) + p * B, int(c.row_start[i]) + (p + 1) * B)
            if s < c.length
        )
        for i in range(c.b)
    ]
    cached = [(c.length - int(pad[i])) * c.h for i in range(c.b)]
    assert row_counts.cpu().tolist() == [[a, x] for a, x in zip(real, cached)]
    assert counts.cpu().tolist() == [5 + sum(real), 5 + sum(cached)]


@pytest.mark.parametrize("splits", [3, 45])
def test_dense_attention_with_the_fused_merge(splits):
    """A few splits, and more than the separate merge folds per load (32): its running max crosses
    tiles, some splits past the rows' tokens are empty."""
    c = Rows(2, G=4, B=4, pages=480)
    every = torch.arange(c.P, dtype=torch.int32).expand(c.b * c.h, -1)
    tp = 4  # 16 slots a tile: the products' least K
    per_split = math.ceil(math.ceil(c.P / splits) / tp) * tp
    assert splits < 32 or math.ceil(c.P / per_split) > 32  # the splits that run
    for fused in (True, False):
        out = kernels.sparse_attention(
            c.query.to(DEV),
            c.keys.to(DEV),
            c.values.to(DEV),
            None,
            n_pages=c.P,
            scale=0.3,
            slot_valid=c.slot_valid.to(DEV),
            row_start=c.row_start.to(DEV),
            length=c.length,
            page_size=c.B,
            splits=splits,
            tile_pages=tp,
            fused_combine=fused,
        )
        ref, _ = _ref_attention(c, every, 0.3)
        assert ((out.cpu().double() - ref).norm() / ref.norm()).item() < 1e-5


def test_attention_rejects_bad_input():
    c = Rows(1, pages=4)
    q, k, v = c.query.to(DEV), c.keys.to(DEV), c.values.to(DEV)
    kw = dict(scale=0.3, slot_valid=c.slot_valid.to(DEV), row_start=c.row_start.to(DEV), length=c.length, page_size=c.B)
    pages = torch.zeros(c.b * c.h, 8, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="multiple"):
        kernels.sparse_attention(q[:, :3], k, v, pages, **kw)
    with pytest.raises(ValueError, match="pad"):
        kernels.sparse_attention(q, k, v, pages, pad=c.row_start.to(DEV), **kw)
    with pytest.raises(ValueError, match="semaphore"):
        kernels.sparse_attention(q, k, v, pages, splits=2, semaphore=torch.zeros(1, dtype=torch.int32), **kw)
    with pytest.raises(ValueError, match="power of two"):
        kernels.sparse_attention(q, k, v, pages, tile_pages=3, **kw)
    with pytest.raises(ValueError, match="tile_pages >= 4"):  # 8 slots: under a product's 16
        kernels.sparse_attention(q, k, v, pages, tile_pages=2, **dict(kw, page_size=4))


@pytest.mark.parametrize("rows, P, W", [(3, 1000, 7), (2, 1100, 130), (1, 17, 40)])
def test_mark_lists_is_the_lists_mask(rows, P, W):
    """One launch overwrites a mask with the listed pages (``SENTINEL`` and pages past ``P`` mark none)."""
    from locks_hf.kernels.select import mark_lists
    from locks_hf.paged import pages_to_mask

    gen = torch.Generator().manual_seed(rows * P + W)
    pages = torch.randint(-1, P + 3, (rows, W), generator=gen, dtype=torch.int32)
    mask = torch.rand(rows, P, generator=gen) > 0.5
    got = mark_lists(mask.to(DEV), pages.to(DEV)).cpu()
    assert torch.equal(got, pages_to_mask(torch.where(pages < P, pages, -1), P))
    with pytest.raises(ValueError, match="int32"):
        mark_lists(mask.to(DEV), pages.long().to(DEV))


# static kernel selectors whose step keeps per-page summaries of their own, or none (dense)
@pytest.mark.parametrize("selector", selectors(static_cache=True, kernel=True, reads_keys=False, summary_of=None))
def test_static_layer_step_keeps_its_bookkeeping_in_the_launches(monkeypatch, selector):
    """A static layer with the kernels' buffers (a GPU's; given by hand here): the decode launches
    write what the glue wrote before (page mask, statistics per row and in all, complete pages
    through the page update), equal to the reference path on the same layer."""
    monkeypatch.setenv("LOCKS_HF_KERNELS", "0")  # the reference calls below must not dispatch
    from locks_hf.backends.reference import reference_decode
    from locks_hf.backends.triton import kernel_decode, kernel_update_newest_page
    from locks_hf.config import LocksConfig
    from locks_hf.static_cache import LocksStaticLayer

    c = Rows(21, b=2, h=2, G=4, B=16, pages=12, pad=(0, 0), d=64)
    c.slot_valid[:] = True
    L = (c.length // 16) * 16 - 1  # the first decode step completes a page
    cfg = LocksConfig(rank=4, basis_bits=4, budget=5 * 16, selector=selector)
    layer = LocksStaticLayer(L + 3 * 16, cfg)
    keys, values = c.keys.to(DEV), c.values.to(DEV)
    layer.update(keys[:, :, :L], values[:, :, :L])
    layer.prepare(None, L)
    assert layer.step_tensors()["row_counts"] is layer.row_counts  # the launches keep the statistics
    assert torch.equal(layer.n_complete, layer.row_tensors()[1])
    layer.update(keys[:, :, L : L + 1], values[:, :, L : L + 1])
    if layer.summary:  # the decode step's page update: the completed page, n_complete
        kernel_update_newest_page(layer)
        assert torch.equal(layer.n_complete, layer.row_tensors()[1])
    else:  # no page update writes it: the step reads the count derived from the length
        assert layer.step_tensors()["n_complete"] is not layer.n_complete
    q = c.query.to(DEV)
    if selector != "full":  # the launches overwrite the whole mask, not only the pages they list
        layer.last_selection.fill_(True)
    got = kernel_decode(layer, q, 0.3)
    assert layer.step_tensors()["tickets"] is layer.tickets and not layer.tickets.any()  # left zero for the next
    got_sel, got_counts, got_rows = layer.last_selection.clone(), layer.counts.clone(), layer.row_counts.clone()
    layer.reset_stats()
    layer.last_selection.fill_(True)
    context = ((layer.length_t - layer.pad) * c.h).to(torch.int64)  # what the reference glue's prepare adds
    layer.row_counts[:, 1] += context
    if layer.selector is None:
        layer.row_counts[:, 0] += context
    ref = reference_decode(layer, q, 0.3)
    if selector == "full":
        assert not got_sel.any()
    else:
        assert torch.equal(got_sel, layer.last_selection)
    assert torch.equal(got_counts, layer.counts) and torch.equal(got_rows, layer.row_counts)
    assert ((got.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-5


def test_kernels_compile_for_sm90_without_spills():
    """The interpreter runs what the compiler may reject: `scripts/dev/check_kernels_compile.py` compiles
    the selection and attention kernels for an sm_90 target (no GPU needed) and checks that none
    spills registers."""
    import pathlib
    import subprocess

    import triton

    if torch.cuda.is_available():
        pytest.skip("with a GPU the other tests run the kernels compiled")
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists() or not (ptxas.parent / "cuobjdump").exists():
        pytest.skip("this Triton has no bundled ptxas and cuobjdump (the spilled bytes are read with it)")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "dev" / "check_kernels_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
