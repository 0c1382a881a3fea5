"""Locks page-scoring variants ("mma", "fma", "dot") against a brute-force float64 evaluation of the
packed summaries, on fresh random codes and scales (every code value, not only what the quantizer
writes), at each combination the kernels specialise on: rank, basis bits, GQA group size (powers of
two and not), page size, the query dtype; rows with left padding, a hole and no complete page.

The per-program partials are checked through what the selection kernel makes of them (sink page and
per-head LSE over the candidates), so the contract holds whatever blocking a variant uses.

On a machine without CUDA the kernels run under ``TRITON_INTERPRET=1`` (small shapes, float32 and
float16 queries: the interpreter has no bfloat16 arithmetic); with CUDA they run compiled, bfloat16
included.
"""

import itertools
import math
import os

import pytest
import test_kernels  # noqa: E402,F401  (chooses the interpreter before Triton is imported, or skips)
import torch

from locks_hf import kernels  # noqa: E402
from locks_hf.kernels.score import valid_as_words  # noqa: E402
from locks_hf.kernels.score_tiles import (  # noqa: E402
    MMA_CODE_TILE_BYTES,
    default_variant,
    fma_supported,
    mma_registers,
    mma_supported,
    mma_tiles,
    wgmma_runs,
    wgmma_supported,
)

DEV = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
INTERPRETED = DEV == "cpu"
#: Variant "wgmma" (Gluon, sm_90a) runs here: an H100/H200 with compiled kernels.
WGMMA = wgmma_runs(torch.device(DEV))
SCALE = 0.3


class Summaries:
    """Random packed Locks summaries for ``b`` rows of ``h`` KV heads, with the row tensors of a paged
    cache: row 0 starts at slot 0, row 1 after ``pad`` padding slots with a hole in its third page,
    row 2 (when ``b == 3``) holds fewer tokens than one page (no complete page)."""

    def __init__(self, seed, *, rank, bits, G, B=16, d=64, pages=9, b=2, h=2, dtype=torch.float32, pad=21):
        g = torch.Generator().manual_seed(seed)
        self.rank, self.bits, self.G, self.B, self.d, self.h, self.b = rank, bits, G, B, d, h, b
        starts = [0, pad, 0][:b]
        self.length = pages * B - 5 + pad  # the last page of row 1 is incomplete, of row 0 full pages + 1
        self.cap = self.length + 2 * B
        self.row_start = torch.tensor(starts, dtype=torch.int32)
        self.slot_valid = torch.ones(b, self.cap, dtype=torch.bool)
        for i, s in enumerate(starts):
            self.slot_valid[i, :s] = False
        if b > 1:
            self.slot_valid[1, pad + 2 * B + 3] = False  # a padding slot inside a page
        if b > 2:
            self.slot_valid[2, : self.length - B // 2] = False  # only the newest B/2 slots are real
            self.row_start[2] = self.length - B // 2
        self.n_complete = ((self.length - self.row_start) // B).to(torch.int32)
        self.P = math.ceil((self.length - int(self.row_start.min())) / B)
        P, per = self.P, 8 // bits
        rand8 = lambda *shape: torch.randint(-128, 128, shape, generator=g, dtype=torch.int32).to(torch.int8)
        scale = lambda *shape: (torch.rand(shape, generator=g) * 0.9 + 0.1).to(torch.bfloat16)
        self.summary = {
            "basis": rand8(b, h, P, rank, d // per).view(torch.uint8) if bits < 8 else rand8(b, h, P, rank, d),
            "basis_scale": scale(b, h, P, rank) * (0.3 if bits == 8 else 1.0),
            "coef": rand8(b, h, P, B, rank),
            "coef_scale": scale(b, h, P, B) * 0.02,
            "mu": rand8(b, h, P, d),
            "mu_scale": scale(b, h, P, 1) * 0.02,
        }
        self.query = (torch.randn(b, h * G, 1, d, generator=g) * 2).to(dtype)

    def kw(self):
        return dict(
            slot_valid=self.slot_valid.to(DEV),
            row_start=self.row_start.to(DEV),
            n_complete=self.n_complete.to(DEV),
            length=self.length,
            n_pages=self.P,
            page_size=self.B,
        )

    def on_dev(self):
        return {k: v.to(DEV) for k, v in self.summary.items()}

    def codes(self, name):
        """Signed codes of a packed tensor along its last axis (field 0 in the low bits), float64."""
        x = self.summary[name]
        if name != "basis" or self.bits == 8:
            return x.view(torch.int8).double()
        bits, per = self.bits, 8 // self.bits
        v = x.to(torch.int32)[..., None] >> (torch.arange(per) * bits)
        f = v & ((1 << bits) - 1)
        f = torch.where(f >= 1 << (bits - 1), f - (1 << bits), f)
        return f.flatten(-2).double()

    def logits(self):
        """Every slot's logit ``[b, h, G, P, B]`` (float64) and whether the slot is real ``[b, P, B]``."""
        s, b, h, G, B, P = self.summary, self.b, self.h, self.G, self.B, self.P
        basis = self.codes("basis") * s["basis_scale"].double()[..., None]  # [b, h, P, r, d]
        coef = self.codes("coef") * s["coef_scale"].double()[..., None]  # [b, h, P, B, r]
        mu = self.codes("mu") * s["mu_scale"].double()  # [b, h, P, d]
        q = self.query.double().view(b, h, G, self.d)
        proj = torch.einsum("bhgd,bhprd->bhgpr", q, basis)
        logits = SCALE * (
            torch.einsum("bhgpr,bhptr->bhgpt", proj, coef) + torch.einsum("bhgd,bhpd->bhgp", q, mu)[..., None]
        )
        slot = self.row_start.long()[:, None, None] + torch.arange(P)[None, :, None] * B + torch.arange(B)
        real = self.slot_valid.gather(1, slot.clamp(0, self.cap - 1).view(b, -1)).view(b, P, B) & (slot < self.length)
        return logits, real

    def reference(self):
        """``[b, h, G, P]`` float64 scores: ``-inf`` for pages that are not complete or hold no real token."""
        logits, real = self.logits()
        out = torch.logsumexp(logits.masked_fill(~real[:, None, None], float("-inf")), -1)
        ok = real.any(-1) & (torch.arange(self.P)[None] < self.n_complete[:, None])  # [b, P]
        return out.masked_fill(~ok[:, None, None], float("-inf"))

    def folded(self, scores):
        """What selection reads: per row the sink page and the per-head LSE over the candidate pages
        (complete real pages but the sink and the row's most recent page)."""
        rows = scores.shape[0]
        sink = torch.empty(rows, dtype=torch.long)
        lse = torch.empty(rows, self.G, dtype=torch.float64)
        for r in range(rows):
            s = scores[r].double()
            real = torch.isfinite(s[0]).nonzero().flatten()
            last = (self.length - 1 - int(self.row_start[r // self.h])) // self.B
            sink[r] = int(real[0]) if len(real) else last
            keep = torch.isfinite(s[0]).clone()
            keep[sink[r]] = False
            if last < s.shape[1]:
                keep[last] = False
            lse[r] = torch.logsumexp(s[:, keep], -1) if keep.any() else torch.full((self.G,), float("-inf"))
        return sink, lse


def check_partials(part, summ, want_scores):
    """Partials -> (sink, per-head LSE) as `kernels.select.sink_and_lse` folds them = the reference's."""
    p = part.double().cpu()
    rows, G = p.shape[0], summ.G
    sink_want, lse_want = summ.folded(want_scores)
    for r in range(rows):
        last = (summ.length - 1 - int(summ.row_start[r // summ.h])) // summ.B
        first = p[r, :, 3, 0]
        real = first[first < 2**30]
        sink = int(real.min()) if len(real) else last
        assert sink == int(sink_want[r]), (r, sink, int(sink_want[r]))
        m, l, fs = p[r, :, 0, :G], p[r, :, 1, :G], p[r, :, 2, :G]
        add = ((first != sink) & (first != last) & (first < 2**30))[:, None]
        terms = torch.cat([m + torch.log(l), torch.where(add, fs, float("-inf"))], 0)
        lse = torch.logsumexp(terms, 0)
        want = lse_want[r]
        fin = torch.isfinite(want)
        assert torch.equal(fin, torch.isfinite(lse)), (r, lse, want)
        assert torch.allclose(lse[fin], want[fin], rtol=1e-5, atol=1e-5), (r, lse, want)


def run(summ, variant, small=False, **kw):
    """`score_pages` on the summaries; ``small``: one-warp "mma" tiles under the interpreter (its time grows
    with the block, not the pages; the default tiles run in the tests that do not ask for this)."""
    if small and INTERPRETED and variant == "mma" and not kw:
        kw = dict(num_warps=1)
    return kernels.score_pages(
        "locks",
        summ.query.to(DEV),
        summary=summ.on_dev(),
        scale=SCALE,
        basis_bits=summ.bits,
        variant=variant,
        **kw,
        **summ.kw(),
    )


def page_lists(scores, part, summ):
    """What the selection kernel keeps (6 slots a row, group-averaged) from a variant's scores and partials."""
    where = dict(row_start=summ.kw()["row_start"], length=summ.length, page_size=summ.B)
    return kernels.select_pages(scores, part, slots=6, per_head=False, heads=summ.h, **where).cpu()


def assert_scores(got, want, tol):
    got = got.double().cpu().view(want.shape)
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), "pages that are not complete real pages must score -inf"
    err = ((got[fin] - want[fin]).norm() / want[fin].norm()).item()
    assert err < tol, err


QUERY_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if not INTERPRETED else [])

# (rank, bits, G, page size): every rank x bits at G = 4; every group size at r4i4; every page size;
# a few crossings of the large and odd cases.
CASES = sorted(
    {(r, bits, 4, 16) for r in (2, 4, 8) for bits in (2, 4, 8)}
    | {(4, 4, G, 16) for G in (1, 2, 3, 4, 6, 8, 16)}
    | {(4, 4, 4, B) for B in (8, 32)}
    | {(4, 4, 16, 32)}
    | {(8, 4, 16, 16), (2, 2, 3, 8), (8, 8, 6, 32), (8, 2, 1, 16)}
)


@pytest.mark.parametrize("rank,bits,G,B", CASES)
def test_mma_scores_and_partials_match_float64(rank, bits, G, B):
    summ = Summaries(rank * 100 + bits * 10 + G + B, rank=rank, bits=bits, G=G, B=B, b=3)
    want = summ.reference()
    got, part = run(summ, "mma", small=True)
    assert got.shape == (summ.b * summ.h, G, summ.P)
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, G, summ.P))


#: Every Locks scoring variant at a group size it runs ("wgmma" only where it runs: an H100/H200).
EVERY_VARIANT = [("fma", 4), ("mma", 4), ("mma", 16), ("dot", 4)] + ([("wgmma", 16)] if WGMMA else [])


@pytest.mark.parametrize("variant,G", EVERY_VARIANT)
def test_logits_beyond_float32s_exponent_range_within_a_page(variant, G):
    """Logits spread over hundreds of log2 units inside a page, and padding slots first in a page whose logits
    lie far above its real tokens': the scores of float64 still, on every page (a page LSE taken against any
    one logit rather than the running max of the real ones would overflow or underflow here)."""
    dtype = torch.bfloat16 if variant == "wgmma" else torch.float32
    summ = Summaries(17 + G, rank=4, bits=4, G=G, b=3, pages=24, dtype=dtype)
    summ.query = (summ.query.float() * 300).to(dtype)
    summ.slot_valid[0, 0 : summ.length : 2 * summ.B] = False  # the first slot of every other page of row 0
    logits, real = summ.logits()
    log2 = (logits - logits[..., :1]) / math.log(2)  # against the page's first slot
    top = log2.masked_fill(~real[:, None, None], float("-inf")).amax(-1)  # [b, h, G, P]
    complete = (torch.arange(summ.P)[None] < summ.n_complete[:, None])[:, None, None]
    over = (top > 128) & complete
    under = (top < -64) & ~real[:, None, None, :, 0] & complete
    assert over.any() and under.any(), "the case must reach both ends of the range"
    want = summ.reference()
    got, part = run(summ, variant, small=True)
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, G, summ.P))


@pytest.mark.parametrize("variant,G", EVERY_VARIANT)
def test_pages_past_the_written_slots_are_not_complete(variant, G):
    """``n_complete`` counting more pages than lie wholly inside the written slots (a row's page grid moved, or
    a stale count): the pages that reach ``length`` or past it score ``-inf``, as if the count were capped."""
    dtype = torch.bfloat16 if variant == "wgmma" else torch.float32
    summ = Summaries(23 + G, rank=4, bits=4, G=G, b=3, dtype=dtype)
    capped = summ.reference()
    summ.n_complete = torch.full_like(summ.n_complete, summ.P)
    assert (summ.reference().isfinite() & ~capped.isfinite()).any(), "the count must reach a partly written page"
    got, part = run(summ, variant, small=True)
    assert_scores(got, capped, 1e-5)


@pytest.mark.parametrize("dtype", QUERY_DTYPES[1:])
@pytest.mark.parametrize("G", [4, 16])
def test_mma_16_bit_queries(dtype, G):
    """fp16 codes for an fp16 query (its own magic number), bf16 codes for bf16; exact products."""
    summ = Summaries(7 + G, rank=4, bits=4, G=G, dtype=dtype)
    assert_scores(run(summ, "mma")[0], summ.reference(), 1e-5)


@pytest.mark.parametrize(
    "tiles",
    [
        dict(block_pages=256, num_warps=8),
        dict(head_split=2),
        dict(words_per_chunk=2),
        dict(words_per_chunk=8, sub_blocks=3, block_pages=32, head_split=4),
        dict(num_warps=2, block_pages=16, head_split=4),
        dict(prefetch=False),
        dict(prefetch=False, words_per_chunk=8, maxnreg=128),
        dict(centroid_words_per_chunk=8),
        dict(centroid_words_per_chunk=16, words_per_chunk=2),
        dict(centroid_words_per_chunk=2, prefetch=False),
    ],
)
def test_mma_tiles_give_the_same_scores(tiles):
    summ = Summaries(11, rank=4, bits=4, G=16, pages=20)
    want = summ.reference()
    got, part = run(summ, "mma", **tiles)
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, summ.G, summ.P))


@pytest.mark.parametrize("rank,bits,G", [(8, 2, 4), (8, 2, 1)])
def test_mma_narrow_chunks_of_wide_rows(rank, bits, G):
    """2-word chunks of a 2-bit basis (and of the int8 centroids: 16 codes a product), what the default tiles
    take for float32 queries at rank 8 in 128-page blocks (`score_tiles.mma_chunk_words`)."""
    summ = Summaries(rank * 10 + G, rank=rank, bits=bits, G=G)
    want = summ.reference()
    got, part = run(summ, "mma", words_per_chunk=2, **(dict(num_warps=1) if INTERPRETED else {}))
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, G, summ.P))


def test_mma_default_tiles_keep_the_code_tile_within_shared_memory():
    """The default chunk keeps the basis product's code tile (``block_pages * rank`` rows of a chunk's codes
    in the query's dtype, staged in shared memory) within `MMA_CODE_TILE_BYTES` with chunks of at least
    2 words (16 centroid codes), and the timed tiles unchanged: 4-word chunks for bf16 r4i4/r8i4 at
    G = 4 and 16."""
    for GG in (1, 2, 4, 8, 16):
        for rank in (2, 4, 8, 16):
            for bits in (2, 4, 8):
                for qb in (2, 4):
                    bp, hs, kcw, nw, ns = mma_tiles(
                        GG, None, None, None, None, None, rank=rank, basis_bits=bits, query_bytes=qb
                    )
                    codes = kcw * 32 // min(bits, 4)
                    assert kcw >= 2 and bp * rank * codes * qb <= MMA_CODE_TILE_BYTES, (GG, rank, bits, qb, kcw)
                    assert bp * hs == 32 * nw and nw == (2 if (rank, bits, qb) == (16, 2, 4) and GG < 16 else 4)
    for GG, rank in [(4, 4), (4, 8), (16, 4), (16, 8)]:
        want = (128, 1, 4, 4, 1) if GG == 4 else (64, 2, 4, 4, 1)
        assert mma_tiles(GG, None, None, None, None, None, rank=rank, basis_bits=4, query_bytes=2) == want


@pytest.mark.parametrize(
    "variant,kw",
    [
        ("fma", dict(head_split=2)),
        ("fma", dict(words_per_chunk=2)),
        ("fma", dict(centroid_words_per_chunk=8)),
        ("dot", dict(prefetch=False)),
        ("dot", dict(prefetch=True)),
    ],
)
def test_mma_settings_refused_for_other_variants(variant, kw):
    summ = Summaries(3, rank=4, bits=4, G=4, pages=4)
    with pytest.raises(ValueError, match="variant 'mma' only"):
        run(summ, variant, **kw)


@pytest.mark.parametrize("rank,bits,G", [(4, 4, 4), (8, 4, 4), (4, 2, 8), (2, 8, 3)])
def test_fma_codes_loaded_ahead_give_the_same_scores(monkeypatch, rank, bits, G):
    """Variant "fma" with each chunk of codes loaded before the previous chunk's FMAs: the float64 reference's
    scores, and bit for bit the plain loop's scores and partials (the same products in the same order), on
    rows with padding, a hole and no complete page; the default as `score_tiles.FMA_PREFETCH` says."""
    from locks_hf.kernels import score
    from locks_hf.kernels.score_tiles import FMA_PREFETCH

    summ = Summaries(60 + rank + bits + G, rank=rank, bits=bits, G=G, b=3, pages=40)
    want = summ.reference()
    ahead, ahead_part = run(summ, "fma", prefetch=True)
    plain, plain_part = run(summ, "fma", prefetch=False)
    assert torch.equal(ahead, plain) and torch.equal(ahead_part, plain_part)
    assert_scores(ahead, want, 1e-5)
    check_partials(ahead_part, summ, want.view(summ.b * summ.h, G, summ.P))
    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    monkeypatch.setattr(score, "_locks_fma_kernel", Recorder())
    run(summ, "fma")
    run(summ, "fma", prefetch=not FMA_PREFETCH)
    assert [kw["PREFETCH"] for kw in launches] == [FMA_PREFETCH, not FMA_PREFETCH]


def test_mma_register_cap_only_where_measured():
    """The default register cap applies to the measured configuration alone (16 heads, 8 a thread, int4
    basis of rank <= 4, 16-bit query) and leaves every other one to the compiler."""
    assert mma_registers(16, 2, rank=4, basis_bits=4, query_bytes=2) == 128
    assert mma_registers(16, 2, rank=2, basis_bits=4, query_bytes=2) == 128
    for args, kw in [
        ((16, 2), dict(rank=8, basis_bits=4, query_bytes=2)),
        ((16, 4), dict(rank=4, basis_bits=4, query_bytes=2)),
        ((16, 2), dict(rank=4, basis_bits=4, query_bytes=4)),
        ((16, 2), dict(rank=4, basis_bits=2, query_bytes=2)),
        ((4, 1), dict(rank=4, basis_bits=4, query_bytes=2)),
    ]:
        assert mma_registers(*args, **kw) is None, (args, kw)


@pytest.mark.parametrize("rank,want", [(4, 128), (2, 128), (8, None)])
def test_mma_default_launch_carries_the_register_cap(monkeypatch, rank, want):
    """`score_pages` launches the GLM-4-9B shape (16 heads a KV head, bf16 query, int4 basis) with the cap of
    `mma_registers` and the codes prefetched, and rank 8 uncapped."""
    from locks_hf.kernels import score

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    monkeypatch.setattr(score, "_locks_mma_kernel", Recorder())
    run(Summaries(5, rank=rank, bits=4, G=16, dtype=torch.bfloat16), None)
    (kw,) = launches
    assert kw.get("maxnreg") == want and kw["PREFETCH"] is True and kw["HS"] == 2


def test_mma_compiles_for_sm90_within_shared_memory():
    """The interpreter runs tiles the GPU cannot launch (float32 queries on a 2-bit rank-8 basis took 256 KB
    of shared memory, over an H200's 227 KB): `scripts/dev/check_score_mma_compile.py` compiles the kernel
    for sm_90 (no GPU needed) at the widest default tiles and checks each compiles and fits."""
    import pathlib
    import subprocess
    import sys

    import triton

    if DEV == "cuda":
        pytest.skip("with a GPU the other tests run the kernel compiled")
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas: it cannot compile for CUDA here")
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    run = subprocess.run(
        [sys.executable, str(root / "scripts" / "dev" / "check_score_mma_compile.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert run.stdout.count("ok  ") == 6, run.stdout
    # each case as a CUDA launch compiles it (the L2 prefetch as by default), and one with it, whose PTX asks
    lines = [line for line in run.stdout.splitlines() if line.startswith("ok  ")]
    default = "l2_prefetches=0 " not in lines[0]
    assert all(("l2_prefetches=0 " not in line) == default for line in lines[:5]), run.stdout
    assert "l2_prefetch:" in lines[5] and "l2_prefetches=0 " not in lines[5], run.stdout


def test_l2_prefetch_lines_cover_every_range_of_a_block():
    """`l2_prefetch_lines`: the fewest power-of-two count of 128-byte lines holding each of a block's ranges
    (basis codes, centroid codes, coefficients, coefficient scales), against a brute-force search."""
    from locks_hf.kernels.score_tiles import l2_prefetch_lines

    for bp, d, page, rank, bits in itertools.product(
        (32, 64, 128), (64, 128), (8, 16, 32, 48), (2, 4, 8, 16), (2, 4, 8)
    ):
        ranges = (bp * rank * d * bits // 8, bp * d, bp * page * rank, bp * 2 * page)
        want = next(n for n in (1 << k for k in range(20)) if all(r <= n * 128 for r in ranges))
        assert l2_prefetch_lines(bp, d, page, rank, bits) == want, (bp, d, page, rank, bits)


@pytest.mark.parametrize("variant", ["mma", "fma"])
def test_l2_prefetch_reaches_the_launch(monkeypatch, variant):
    """Where the device can prefetch, ``l2_prefetch=True`` launches with ``PF_LINES`` of `l2_prefetch_lines`
    and the default as `score_tiles.L2_PREFETCH` says; ``False`` and a device that cannot, with 0."""
    from locks_hf.kernels import score
    from locks_hf.kernels.score_tiles import L2_PREFETCH, l2_prefetch_lines

    launches = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kw: launches.append(kw)

    kernel = "_locks_mma_kernel" if variant == "mma" else "_locks_fma_kernel"
    monkeypatch.setattr(score, kernel, Recorder())
    summ = Summaries(7, rank=4, bits=4, G=4, dtype=torch.float16)
    run(summ, variant)
    run(summ, variant, l2_prefetch=False)
    monkeypatch.setattr(score, "l2_prefetch_runs", lambda device: True)
    run(summ, variant)
    run(summ, variant, l2_prefetch=False)
    run(summ, variant, l2_prefetch=True)
    lines = l2_prefetch_lines(launches[0]["BP"], summ.d, summ.B, summ.rank, summ.bits)
    default = lines if L2_PREFETCH else 0
    assert lines > 0
    assert [kw["PF_LINES"] for kw in launches] == [default if DEV == "cuda" else 0, 0, default, 0, lines]


def test_l2_prefetch_refused_where_it_cannot_run():
    """``l2_prefetch=True`` on a variant without it, or where the kernels cannot ask the L2 (the CPU, the
    interpreter), is an error that names the setting, not a silent plain launch."""
    summ = Summaries(8, rank=4, bits=4, G=4)
    with pytest.raises(ValueError, match="l2_prefetch: a setting of the Locks variants"):
        run(summ, "dot", l2_prefetch=True)
    if DEV != "cuda":
        with pytest.raises(ValueError, match="l2_prefetch=True needs a CUDA device"):
            run(summ, "mma", l2_prefetch=True)


@pytest.mark.skipif(DEV != "cuda", reason="the L2 prefetch is inline PTX: compiled for a CUDA GPU only")
@pytest.mark.parametrize("variant,G,rank", [("mma", 16, 4), ("mma", 4, 8), ("fma", 4, 4), ("fma", 8, 2)])
def test_l2_prefetch_leaves_scores_and_partials_unchanged(variant, G, rank):
    """A hint, not a load: the same scores and partials bit for bit with and without it, and the float64
    reference's scores, on rows with padding, a hole and no complete page."""
    summ = Summaries(40 + G + rank, rank=rank, bits=4, G=G, b=3, pages=150, dtype=torch.bfloat16)
    want = summ.reference()
    got, part = run(summ, variant, l2_prefetch=True)
    plain, plain_part = run(summ, variant, l2_prefetch=False)
    assert torch.equal(got, plain) and torch.equal(part, plain_part)
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, G, summ.P))


@pytest.mark.parametrize("rank,bits,G", [(4, 4, 4), (8, 4, 16), (2, 8, 3)])
def test_variants_agree_and_select_the_same_pages(rank, bits, G):
    """ "mma", "fma" and "dot" on the same inputs: the same scores (float32 rounding) and, through the
    unchanged selection kernel, the same page lists."""
    summ = Summaries(5 + G, rank=rank, bits=bits, G=G, pages=14)
    want = summ.reference()
    lists = {}
    for variant in ("mma", "fma", "dot"):
        if variant == "fma" and not fma_supported(summ.d, summ.B, rank, bits):
            continue
        got, part = run(summ, variant)
        assert_scores(got, want, 1e-5)
        lists[variant] = page_lists(got, part, summ)
    ref = lists.pop("mma")
    for variant, pages in lists.items():
        assert torch.equal(pages, ref), variant


def test_mma_refuses_what_it_cannot_score():
    summ = Summaries(3, rank=4, bits=4, G=4)
    with pytest.raises(ValueError, match="head_split"):
        run(summ, "mma", head_split=3)
    with pytest.raises(ValueError, match="block_pages"):
        run(summ, "mma", block_pages=48)
    with pytest.raises(ValueError, match="words_per_chunk"):
        run(summ, "mma", words_per_chunk=16)  # an int4 row of d = 64 holds 8 words
    for bad in (1, 3, 32):  # an int8 centroid of d = 64 holds 16 words; a product takes at least 2
        with pytest.raises(ValueError, match="centroid_words_per_chunk must be at least 2 and divide"):
            run(summ, "mma", centroid_words_per_chunk=bad)
    with pytest.raises(ValueError, match="variant must be one of"):
        run(summ, "tensor")
    assert not mma_supported(64, 16, 3, 4) and not mma_supported(32, 16, 4, 2) and mma_supported(64, 16, 4, 2)
    odd = Summaries(3, rank=2, bits=4, G=4, B=4)  # 4-token pages, rank 2: 8 coefficient bytes a page
    with pytest.raises(ValueError, match="variant 'mma' needs"):
        run(odd, "mma")


# (rank, G, page size, d, query dtype, pages, sub_blocks): every rank at the GLM-4 group; groups that are not
# powers of two (heads past G zeroed); page sizes; head dims 32-256 (1-8 words a thread and basis row);
# fp16; rows of several 64-page blocks and programs of several blocks.
WGMMA_CASES = [
    (4, 16, 16, 128, torch.bfloat16, 9, 1),
    (1, 16, 16, 128, torch.bfloat16, 9, 1),
    (2, 16, 16, 64, torch.bfloat16, 9, 1),
    (8, 16, 16, 128, torch.bfloat16, 9, 1),
    (4, 12, 16, 128, torch.bfloat16, 9, 1),
    (4, 8, 16, 64, torch.float16, 9, 1),
    (4, 5, 8, 32, torch.bfloat16, 9, 1),
    (8, 16, 32, 256, torch.float16, 9, 1),
    (4, 16, 16, 128, torch.bfloat16, 150, 1),
    (4, 16, 16, 128, torch.float16, 150, 2),
    (8, 6, 4, 64, torch.bfloat16, 200, 3),
]
# (head_split, maxnreg): a group's heads over two programs, a register cap
WGMMA_SPLITS = [(1, None), (2, None), (2, 128), (1, 168)]


@pytest.mark.parametrize("split", WGMMA_SPLITS)
@pytest.mark.parametrize("rank,G,B,d,dtype,pages,sub", WGMMA_CASES)
def test_wgmma_scores_and_partials_match_float64(rank, G, B, d, dtype, pages, sub, split):
    if not WGMMA:
        pytest.skip("variant 'wgmma' runs on a compute capability 9.0 GPU only (the interpreter has no Gluon)")
    head_split, maxnreg = split
    if (1 << (G - 1).bit_length()) // head_split < 8:
        pytest.skip(f"{G} heads do not split over {head_split} programs of 8+")
    summ = Summaries(
        rank * 1000 + G * 10 + B + d + pages, rank=rank, bits=4, G=G, B=B, d=d, b=3, pages=pages, dtype=dtype
    )
    want = summ.reference()
    got, part = run(summ, "wgmma", sub_blocks=sub, head_split=head_split, maxnreg=maxnreg)
    assert got.shape == (summ.b * summ.h, G, summ.P)
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, G, summ.P))
    # the same pages as variant "mma" through the selection
    ref, ref_part = run(summ, "mma")
    assert torch.equal(page_lists(got, part, summ), page_lists(ref, ref_part, summ))


# (variant, rank, G, d, query dtype) of the alignment test: "fma" at ranks whose coefficient chunks hold 2, 4 and
# 8 tokens; "wgmma" where it runs
ALIGNMENT_CASES = [("fma", r, 4, 64, torch.float32) for r in (2, 4, 8)] + (
    [("wgmma", 4, 16, 128, torch.bfloat16)] if WGMMA else []
)


@pytest.mark.parametrize("variant,rank,G,d,dtype", ALIGNMENT_CASES)
@pytest.mark.parametrize("valid_layout", ["words", "odd offset", "odd row length"])
@pytest.mark.parametrize("pad", [21, 22, 23, 24])
def test_valid_flags_read_at_every_alignment(variant, rank, G, d, dtype, pad, valid_layout):
    """Variants "fma" and "wgmma" read the valid flags as aligned words where `score.valid_as_words` allows it,
    from row starts at each misalignment (``pad``), and a byte a token from a view at an odd offset or rows of a
    length that is no multiple of 4: the same scores and partials as float64 either way."""
    summ = Summaries(pad * 31 + rank, rank=rank, bits=4, G=G, B=16, d=d, b=3, pages=9, dtype=dtype, pad=pad)
    cols = -(-summ.cap // 4) * 4
    start, width = {"words": (0, cols), "odd offset": (1, cols), "odd row length": (0, cols + 1)}[valid_layout]
    buf = torch.zeros(summ.b, start + width, dtype=torch.bool, device=DEV)
    valid = buf[:, start:]
    valid[:, : summ.cap] = summ.slot_valid.to(DEV)
    assert valid_as_words(valid) == (valid_layout == "words")
    got, part = kernels.score_pages(
        "locks",
        summ.query.to(DEV),
        summary=summ.on_dev(),
        scale=SCALE,
        basis_bits=4,
        variant=variant,
        **{**summ.kw(), "slot_valid": valid},
    )
    want = summ.reference()
    assert_scores(got, want, 1e-5)
    check_partials(part, summ, want.view(summ.b * summ.h, summ.G, summ.P))


def test_wgmma_refuses_what_it_cannot_run():
    summ = Summaries(5, rank=4, bits=4, G=16, d=128, dtype=torch.bfloat16)
    if not WGMMA:
        with pytest.raises(ValueError, match="variant 'wgmma' runs on a compute capability 9.0 GPU"):
            run(summ, "wgmma")
        return
    for kw in (dict(block_pages=128), dict(num_warps=8), dict(words_per_chunk=4), dict(head_split=3)):
        with pytest.raises(ValueError, match=next(iter(kw))):
            run(summ, "wgmma", **kw)
    with pytest.raises(ValueError, match="head_split"):  # 4 programs of 4 heads: below a product's 8
        run(summ, "wgmma", head_split=4)
    for odd in (
        Summaries(5, rank=4, bits=2, G=16, d=128, dtype=torch.bfloat16),  # 2-bit basis
        Summaries(5, rank=4, bits=4, G=4, d=128, dtype=torch.bfloat16),  # a group of 4: "fma"'s
        Summaries(5, rank=4, bits=4, G=16, d=128, dtype=torch.float32),  # float32 query
    ):
        with pytest.raises(ValueError, match="variant 'wgmma' needs"):
            run(odd, "wgmma")
    assert wgmma_supported(128, 16, 4, 4, 16, torch.bfloat16) and not wgmma_supported(96, 16, 4, 4, 16, torch.bfloat16)


def test_default_variant_takes_wgmma_only_where_it_was_timed():
    """The GLM-4 shape (16 heads, d = 128, 16-token pages, r4i4 / r8i4, bf16) on an H100/H200; "mma" elsewhere:
    off such a device, at other ranks, for float32 queries; "fma" for small groups."""
    from locks_hf.kernels.score_dot import LOCKS

    dev = torch.device(DEV)
    for rank in (4, 8):
        want = "wgmma" if WGMMA else "mma"
        assert default_variant(LOCKS, 16, 128, 16, rank, 4, device=dev, query_dtype=torch.bfloat16) == want
    assert default_variant(LOCKS, 16, 128, 16, 2, 4, device=dev, query_dtype=torch.bfloat16) == "mma"
    assert default_variant(LOCKS, 16, 128, 16, 4, 4, device=dev, query_dtype=torch.float32) == "mma"
    assert default_variant(LOCKS, 16, 128, 16, 4, 4) == "mma"
    assert default_variant(LOCKS, 4, 128, 16, 4, 4, device=dev, query_dtype=torch.bfloat16) == "fma"
