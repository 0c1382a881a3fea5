"""The fused in-place page summary (locks_hf.kernels.page_update) against the batched build.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` (set by conftest, or in the environment) on
small shapes; with CUDA it runs compiled on the GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no CUDA: run the Triton kernel tests with TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed: the Triton kernels cannot be tested")

from selector_lists import selectors  # noqa: E402

from locks_hf import kernels  # noqa: E402
from locks_hf.config import LocksConfig  # noqa: E402
from locks_hf.kernels.build import summary_shapes  # noqa: E402
from locks_hf.kernels.decode import SUMMARY_NAMES  # noqa: E402
from locks_hf.quant import unpack  # noqa: E402
from locks_hf.selectors import QuestSelector  # noqa: E402
from locks_hf.summaries import dequantize_summary, estimated_page_lse, exact_page_lse  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
D, P = 64, 4  # head dim, pages per row
#: The kernel selectors that keep per-page summaries of their own (the page update builds them).
SUMMARY_METHODS = selectors(kernel=True, dense=False, reads_keys=False, summary_of=None)


class Paged:
    """Two rows of a static cache (``P`` pages of ``B`` slots after each row's first real slot) and
    summary buffers filled with random bytes."""

    def __init__(self, seed, B, method, rank=4, bits=4, row_start=(0, 5), h=2, n_pages=P):
        g = torch.Generator().manual_seed(seed)
        self.B, self.method, self.rank, self.bits, self.h, self.pages = B, method, rank, bits, h, n_pages
        self.row_start = torch.tensor(row_start, dtype=torch.int32)
        self.cap = max(row_start) + n_pages * B + 3
        pages = torch.randn(2, h, self.cap // B + 1, D, generator=g).repeat_interleave(B, 2)[:, :, : self.cap]
        self.keys = torch.randn(2, h, self.cap, D, generator=g) + 2 * pages  # page structure, as real keys
        self.slot_valid = torch.ones(2, self.cap, dtype=torch.bool)
        for i, s in enumerate(row_start):
            self.slot_valid[i, :s] = False  # left padding
            self.slot_valid[i, s + B + 2] = False  # a padding slot inside page 1
        if method == "locks":
            shapes = summary_shapes((2, h, n_pages), B, D, rank, bits)
            shapes = [shapes[n] for n in SUMMARY_NAMES["locks"]]
        else:
            shapes = [((2, h, n_pages, D), self.keys.dtype)] * len(SUMMARY_NAMES[method])
        self.sentinel = []
        for shape, dtype in shapes:
            n = torch.Size(shape).numel() * dtype.itemsize
            self.sentinel.append(torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).view(shape))

    def run(self, length, op=False):
        """The summary buffers after one update at ``length`` (on the CPU)."""
        summary = [t.clone().to(DEV) for t in self.sentinel]
        args = (
            self.method,
            self.keys.to(DEV),
            self.slot_valid.to(DEV),
            self.row_start.to(DEV),
            torch.tensor([length], dtype=torch.int32, device=DEV),
            summary,
        )
        if op:
            torch.ops.locks_hf.update_completed_pages(*args, self.B, self.rank, self.bits, None)
        else:
            kernels.update_completed_pages(*args, page_size=self.B, rank=self.rank, basis_bits=self.bits)
        return [t.cpu() for t in summary]

    def completed(self, length):
        """``{row: page}`` of the rows whose newest page ``length`` completes."""
        out = {}
        for i, s in enumerate(self.row_start.tolist()):
            n = length - s
            if n > 0 and n % self.B == 0:
                out[i] = n // self.B - 1
        return out

    def page(self, i, p):
        """Keys ``[h, 1, B, D]`` and validity ``[h, 1, B]`` of page ``p`` of row ``i``."""
        slots = int(self.row_start[i]) + p * self.B + torch.arange(self.B)
        return self.keys[i, :, slots].unsqueeze(1), self.slot_valid[i, slots].expand(self.h, 1, -1)

    def check_untouched(self, got, written):
        mask = torch.zeros(2, self.h, self.pages, dtype=torch.bool)
        for i, p in written.items():
            mask[i, :, p] = True
        for name, t, s in zip(SUMMARY_NAMES[self.method], got, self.sentinel):
            assert torch.equal(t.view(torch.uint8)[~mask], s.view(torch.uint8)[~mask]), name


def _as_dict(c, summary, i, p):
    """The summary of page ``p`` of row ``i`` as a dict of ``[1, h, 1, ...]`` tensors."""
    return {n: t[i, :, p].unsqueeze(1).unsqueeze(0) for n, t in zip(SUMMARY_NAMES[c.method], summary)}


def _check_locks_page(c, got, keys, valid, seed):
    want = kernels.build_summary(keys.to(DEV), valid.to(DEV), c.rank, c.bits)
    want = {k: v.cpu().unsqueeze(0) for k, v in want.items()}
    if DEV == "cpu":  # the same float32 sums in the same order (on a GPU: up to their order)
        assert torch.equal(got["mu"], want["mu"]) and torch.equal(got["mu_scale"], want["mu_scale"])
    # codes and scales: the same up to the summation order of the products (exact in practice)
    parts = (dequantize_summary(x, c.bits, torch.float64) for x in (got, want))
    for g, w, name in zip(*parts, ("mu", "basis", "coef")):
        step = torch.maximum(got[f"{name}_scale"], want[f"{name}_scale"]).double()
        assert ((g - w).abs() <= 1.001 * (step if name == "mu" else step.unsqueeze(-1))).all(), name
    codes = [
        (got["mu"], want["mu"]),
        (unpack(got["basis"], c.bits), unpack(want["basis"], c.bits)),
        (got["coef"], want["coef"]),
    ]
    same = sum((a == b).sum().item() for a, b in codes) / sum(a.numel() for a, _ in codes)
    assert same >= 0.99, same
    # and the same page scores
    q = torch.randn(1, c.h, 4, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    v = valid[:1].unsqueeze(0)
    s_got, s_want = (
        estimated_page_lse(*dequantize_summary(x, c.bits, torch.float64), v, q, 0.125) for x in (got, want)
    )
    exact = exact_page_lse(keys.unsqueeze(0).double(), v, q, 0.125)
    err_got, err_want = ((s - exact).norm() / exact.norm() for s in (s_got, s_want))
    assert err_got < 1.1 * err_want + 1e-4, (err_got, err_want)


def _check_step(c, length, seed=0, op=False):
    got = c.run(length, op=op)
    written = c.completed(length)
    c.check_untouched(got, written)
    for i, p in written.items():
        page = _as_dict(c, got, i, p)
        keys, valid = c.page(i, p)
        if c.method == "quest":
            want = QuestSelector(LocksConfig()).summarize(keys, valid)
            for name in SUMMARY_NAMES["quest"]:
                assert torch.equal(page[name], want[name].unsqueeze(0)), name
        else:
            _check_locks_page(c, page, keys, valid, seed)
    return got, written


# (page size, method, rank, basis bits)
CASES = [
    (16, "locks", 4, 4),
    (16, "locks", 8, 2),
    (16, "locks", 4, 8),
    (8, "locks", 8, 4),
    (8, "locks", 4, 2),
    (4, "locks", 8, 8),
    (32, "locks", 4, 4),
    (16, "quest", 0, 0),
    (8, "quest", 0, 0),
]


@pytest.mark.parametrize("B,method,rank,bits", CASES)
def test_every_row_completes_a_page(B, method, rank, bits):
    """Both rows (one left-padded by two pages) complete a page: each is written at its own index;
    the page holds a padding slot."""
    for seed in (0, 1) if B <= 16 else (0,):
        c = Paged(seed, B, method, rank, bits, row_start=(0, 2 * B))
        _, written = _check_step(c, 4 * B, seed)
        assert written == {0: 3, 1: 1}


@pytest.mark.parametrize("B,method", [(16, "locks"), (8, "quest")])
def test_only_rows_that_complete_a_page_are_written(B, method):
    c = Paged(2, B, method, rank=4, bits=4, row_start=(0, 5), h=3)
    assert c.completed(2 * B) == {0: 1}
    _check_step(c, 2 * B)  # row 0 completes page 1 (with a padding slot), row 1 does not
    assert c.completed(B + 5) == {1: 0}
    _check_step(c, B + 5)  # row 1 completes page 0, row 0 does not
    for length in (1, B - 1, 2 * B + 3):  # neither: byte-identical buffers
        assert c.completed(length) == {}
        _check_step(c, length)


@pytest.mark.parametrize("method", SUMMARY_METHODS)
def test_rows_with_no_tokens_are_untouched(method):
    """n = length - row_start <= 0 (a row whose first real slot lies at or past the length)."""
    for row_start in ((0, 32), (0, 40)):
        c = Paged(3, 8, method, rank=4, bits=4, row_start=row_start)
        assert c.completed(32) == {0: 3}
        _check_step(c, 32)


@pytest.mark.parametrize("method", SUMMARY_METHODS)
def test_custom_op_matches_launcher(method):
    c = Paged(4, 16, method, rank=8, bits=4, row_start=(0, 16))
    for length in (32, 40):
        got = c.run(length, op=True)
        want = c.run(length)
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    if method == "quest":  # schema, fake tensor and functionalization (the mutated summary list)
        args = (
            method,
            c.keys.to(DEV),
            c.slot_valid.to(DEV),
            c.row_start.to(DEV),
            torch.tensor([32], dtype=torch.int32, device=DEV),
            [t.to(DEV) for t in c.sentinel],
            16,
            8,
            4,
            None,
        )
        torch.library.opcheck(torch.ops.locks_hf.update_completed_pages.default, args)


def test_oracle_and_bad_arguments():
    c = Paged(5, 16, "locks")
    args = (
        c.keys.to(DEV),
        c.slot_valid.to(DEV),
        c.row_start.to(DEV),
        torch.tensor([32], dtype=torch.int32, device=DEV),
    )
    kernels.update_completed_pages("oracle", *args, [], page_size=16, rank=4, basis_bits=4)  # nothing to build
    torch.ops.locks_hf.update_completed_pages("oracle", *args, [], 16, 4, 4, None)
    summary = [t.to(DEV) for t in c.sentinel]
    with pytest.raises(ValueError, match="page_size"):
        kernels.update_completed_pages("locks", *args, summary, page_size=12, rank=4, basis_bits=4)
    with pytest.raises(ValueError, match="basis"):
        kernels.update_completed_pages("locks", *args, summary, page_size=16, rank=8, basis_bits=4)  # rank 4 buffers
    with pytest.raises(ValueError, match="contiguous"):
        kernels.update_completed_pages(
            "locks", *args, summary[:-1] + [summary[-1].transpose(0, 1)], page_size=16, rank=4, basis_bits=4
        )
    with pytest.raises(ValueError, match="sweeps"):
        kernels.update_completed_pages("locks", *args, summary, page_size=16, rank=4, basis_bits=4, sweeps=0)


@pytest.mark.parametrize("method", SUMMARY_METHODS)
def test_a_decode_step_writes_the_page_update_in_any_order(method):
    """`decode_step(update_rank=r)` (a static layer's step, its page update inside) leaves the summary and
    the complete-page counts of the update's own launch, and every step's pages and output are the same
    whether that update lands before the page choice or after the attention (the scoring then reads the
    previous step's counts): what lets the update join any of the step's launches. Over steps that complete
    pages of both rows, one left-padded, with fewer page slots than pages."""
    B, rank, bits, G = 4, 4, 4, 2
    c = Paged(6, B, method, rank, bits, row_start=(0, 5), n_pages=8)
    g = torch.Generator().manual_seed(7)
    values = torch.randn(c.keys.shape, generator=g).to(DEV)
    keys, valid, row_start = c.keys.to(DEV), c.slot_valid.to(DEV), c.row_start.to(DEV)
    names = SUMMARY_NAMES[method]
    start, stop = 19, 27  # both rows complete two pages on the way (row 1 at lengths 21 and 25)

    def at(length):
        return torch.tensor([length], dtype=torch.int32, device=DEV)

    def update(state, length):
        kernels.update_completed_pages(
            method,
            keys,
            valid,
            row_start,
            at(length),
            state["summary"],
            page_size=B,
            rank=rank,
            basis_bits=bits,
            n_complete=state["n_complete"],
        )

    def step(state, length, query, update_rank):
        return kernels.decode_step(
            method,
            query,
            key_buf=keys,
            value_buf=values,
            slot_valid=valid,
            row_start=row_start,
            n_complete=state["n_complete"],
            length=at(length),
            n_pages=c.pages,
            slots=4,
            scale=D**-0.5,
            page_size=B,
            summary=dict(zip(names, state["summary"])),
            basis_bits=bits,
            per_head=method == "quest",
            update_rank=update_rank,
        )

    def fresh():
        state = {
            "summary": [t.clone().to(DEV) for t in c.sentinel],
            "n_complete": torch.zeros(2, dtype=torch.int32, device=DEV),
        }
        for length in range(1, start):  # the pages complete before the first step, as decoding got there
            update(state, length)
        return state

    before, in_step, after = fresh(), fresh(), fresh()
    completions = 0
    for length in range(start, stop):
        completions += len(c.completed(length))
        query = torch.randn(2, c.h * G, 1, D, generator=g).to(DEV)
        update(before, length)
        want = step(before, length, query, 0)
        got = step(in_step, length, query, rank)
        late = step(after, length, query, 0)
        update(after, length)
        for other in (got, late):
            assert torch.equal(other[1], want[1]) and torch.equal(other[0], want[0]), length
        for state in (in_step, after):
            assert torch.equal(state["n_complete"], before["n_complete"]), length
            for a, b in zip(state["summary"], before["summary"]):
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), length
        assert before["n_complete"].tolist() == [(length - s) // B for s in (0, 5)]
    assert completions == 4
    # the pages really were chosen: the last step left pages of every row out
    written = torch.tensor([(stop - 2 - s) // B + 1 for s in (0, 5)], device=DEV).repeat_interleave(c.h)
    assert ((want[1] >= 0).sum(-1) < written).all()


@pytest.mark.parametrize("method,B,rank,bits", [("locks", 16, 4, 4), ("locks", 8, 8, 2), ("quest", 16, 0, 0)])
def test_one_launch_for_several_layers_is_one_a_layer(method, B, rank, bits):
    """`update_completed_pages_of_layers` (and its custom op) writes each layer's summaries and complete-page
    counts exactly as that layer's own `update_completed_pages` does, over layers of other keys, padding and
    lengths: one whose rows both complete a page, one where only a row does, one where none does."""
    layers = [Paged(11 + i, B, method, rank, bits, row_start=rs) for i, rs in enumerate([(5, 5), (5, 0), (5, 3)])]
    lengths = [2 * B + 5, 3 * B, 2 * B + 4]
    assert [len(c.completed(n)) for c, n in zip(layers, lengths)] == [2, 1, 0]
    at = [torch.tensor([n], dtype=torch.int32, device=DEV) for n in lengths]

    def fresh():
        return [[t.clone().to(DEV) for t in c.sentinel] for c in layers], [
            torch.full((2,), -7, dtype=torch.int32, device=DEV) for _ in layers
        ]

    args = [[c.keys.to(DEV) for c in layers], [c.slot_valid.to(DEV) for c in layers]]
    args.append([c.row_start.to(DEV) for c in layers])
    want, want_n = fresh()
    for i in range(len(layers)):
        kernels.update_completed_pages(
            method, *(a[i] for a in args), at[i], want[i], page_size=B, rank=rank, basis_bits=bits, n_complete=want_n[i]
        )
    got, got_n = fresh()
    kernels.update_completed_pages_of_layers(
        method, *args, at, got, page_size=B, rank=rank, basis_bits=bits, n_complete=got_n
    )
    flat, op_n = fresh()
    torch.ops.locks_hf.update_pages_of_layers(method, *args, at, [t for s in flat for t in s], B, rank, bits, op_n)
    for i, c in enumerate(layers):
        assert torch.equal(want_n[i].cpu(), (torch.tensor(lengths[i]) - c.row_start).clamp_min(0) // B)
        assert torch.equal(got_n[i], want_n[i]) and torch.equal(op_n[i], want_n[i])
        changed = False
        for name, w, g, o, s in zip(SUMMARY_NAMES[method], want[i], got[i], flat[i], c.sentinel):
            assert torch.equal(g.view(torch.uint8), w.view(torch.uint8)), (i, name)
            assert torch.equal(o.view(torch.uint8), w.view(torch.uint8)), (i, name)
            changed |= not torch.equal(w.cpu().view(torch.uint8), s.view(torch.uint8))
        assert changed == bool(c.completed(lengths[i])), i  # the launch wrote what completed, only that


def test_one_launch_for_several_layers_refuses_layers_of_other_layouts():
    a, b = Paged(1, 16, "locks"), Paged(2, 16, "locks", row_start=(0, 9))  # b holds more slots
    at = torch.tensor([40], dtype=torch.int32, device=DEV)

    def call(layers, **kw):
        summaries = [[t.clone().to(DEV) for t in c.sentinel] for c in layers]
        kernels.update_completed_pages_of_layers(
            "locks",
            [c.keys.to(DEV) for c in layers],
            [c.slot_valid.to(DEV) for c in layers],
            [c.row_start.to(DEV) for c in layers],
            kw.pop("length", [at] * len(layers)),
            summaries,
            page_size=16,
            rank=4,
            basis_bits=4,
            **kw,
        )

    with pytest.raises(ValueError, match="layer 1's keys.*one launch serves layers of one layout"):
        call([a, b])
    with pytest.raises(ValueError, match="2 key buffers but 1 length"):
        call([a, a], length=[at])
    with pytest.raises(ValueError, match="n_complete"):
        call([a, a], n_complete=[torch.zeros(2, dtype=torch.int32, device=DEV), torch.zeros(2, device=DEV)])
    call([])  # no layer: nothing to launch
