"""The kernels against float64 references at real attention shapes: 128K tokens of one layer of
Llama-3.1-8B (32 query / 8 KV heads) and GLM-4-9B (32 / 2), head_dim 128, 16-token pages, bf16.

GPU only (``-m gpu``; skipped without CUDA or under the Triton interpreter): the small-shape tests
in test_kernels.py cover the same kernels on the CPU. Inputs are synthetic (random keys with a
per-page offset, so that pages differ); the references are the library's PyTorch code in float64.
"""

import pytest
import torch

from locks_hf.config import LocksConfig
from locks_hf.selectors import QuestSelector, select_pages as reference_select
from locks_hf.summaries import build_summary as reference_build, dequantize_summary, estimated_page_lse, exact_page_lse

pytestmark = pytest.mark.gpu  # real shapes need a CUDA GPU (the interpreter tests use small shapes)

DEV = "cuda"
SHAPES = {"llama3.1-8b": (32, 8, 128), "glm4-9b": (32, 2, 128)}  # query heads, KV heads, head_dim
CONTEXT = 128 << 10
B = 16
SLOTS = 2048 // B  # a 2048-token budget
LABELS = [(8, 4), (4, 4), (2, 4), (4, 2), (4, 8)]  # (rank, basis bits)
ORACLE_PAGES = 2048  # the oracle and the build are checked on the first pages (float64 keys are large)


def rel(a, b) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


class RealCache:
    """One layer's cache at a real shape, its decode query and every summary the checks score."""

    def __init__(self, model: str, length: int = CONTEXT, seed: int = 1, dtype: torch.dtype = torch.bfloat16):
        from locks_hf.kernels import fit_pages_eigh, quantize_summary

        hq, h, d = SHAPES[model]
        gen = torch.Generator(device=DEV).manual_seed(seed)
        P = length // B
        self.hq, self.h, self.d, self.G, self.P, self.length = hq, h, d, hq // h, P, length
        self.scale = d**-0.5
        self.keys = torch.randn((1, h, length, d), device=DEV, dtype=dtype, generator=gen)
        offsets = torch.randn((1, h, P, 1, d), device=DEV, dtype=dtype, generator=gen)
        self.keys.view(1, h, P, B, d).add_(offsets * 1.5)
        self.values = torch.randn((1, h, length, d), device=DEV, dtype=dtype, generator=gen)
        self.query = torch.randn((1, hq, 1, d), device=DEV, dtype=dtype, generator=gen)
        self.q64 = self.query.view(1, h, self.G, d).double()
        self.pages = self.keys.view(1, h, P, B, d)
        self.valid = torch.ones((1, 1, P, B), device=DEV, dtype=torch.bool)
        self.page_real = torch.ones((1, P), device=DEV, dtype=torch.bool)
        self.row_start = torch.zeros((1,), device=DEV, dtype=torch.int32)
        valid = self.valid.expand(1, h, P, B)
        mu, basis, coef = fit_pages_eigh(self.pages, valid, max(r for r, _ in LABELS))
        self.summaries = {
            f"r{r}i{bits}": quantize_summary(mu, basis[..., :r, :], coef[..., :r], bits) for r, bits in LABELS
        }
        self.summaries["quest"] = {"upper": self.pages.amax(-2), "lower": self.pages.amin(-2)}

    def kw(self, pages: int | None = None) -> dict:
        n = self.P if pages is None else pages
        return dict(
            slot_valid=torch.ones((1, self.length), device=DEV, dtype=torch.bool),
            row_start=self.row_start,
            n_complete=torch.full((1,), n, device=DEV, dtype=torch.int32),
            length=n * B,
            n_pages=n,
            page_size=B,
        )

    def as_mask(self, pages: torch.Tensor) -> torch.Tensor:
        """Kernel page lists ``[h, W]`` (``< 0`` = none) as ``[1, h, P]``."""
        mask = torch.zeros((self.h, self.P + 1), device=DEV, dtype=torch.bool)
        mask.scatter_(1, torch.where(pages >= 0, pages, self.P).long(), True)
        return mask[:, : self.P].view(1, self.h, self.P)


@pytest.fixture(scope="module", params=sorted(SHAPES))
def cache(request):
    c = RealCache(request.param)
    yield c
    del c
    torch.cuda.empty_cache()


@pytest.mark.parametrize("rank,bits", LABELS)
def test_locks_scores_and_selection(cache, rank, bits):
    """Both scoring epilogues = the float64 estimated page LSE; the selection kernel = the reference
    selection on the same scores (no page differs)."""
    from locks_hf.kernels import score_pages, select_pages

    c = cache
    summary = c.summaries[f"r{rank}i{bits}"]
    want = estimated_page_lse(*dequantize_summary(summary, bits, torch.float64), c.valid, c.q64, c.scale)
    got, partials = score_pages("locks", c.query, summary=summary, scale=c.scale, basis_bits=bits, **c.kw())
    assert rel(got.view(1, c.h, c.G, c.P), want) < 1e-5
    by_token, _ = score_pages(
        "locks", c.query, summary=summary, scale=c.scale, basis_bits=bits, variant="dot", by_token=True, **c.kw()
    )
    assert rel(by_token.view(1, c.h, c.G, c.P), want) < 1e-5
    pages = select_pages(
        got, partials, slots=SLOTS, per_head=False, row_start=c.row_start, length=c.length, heads=c.h, page_size=B
    )
    ref = reference_select(got.view(1, c.h, c.G, c.P).double(), c.page_real, c.page_real, SLOTS, "share_average", False)
    assert torch.equal(c.as_mask(pages), ref)


def test_sparse_attention_over_the_selected_pages(cache):
    """Split-K attention over a Locks r4i4 page set = float64 softmax attention over those pages."""
    from locks_hf.kernels import score_pages, select_pages, sparse_attention

    c = cache
    scores, partials = score_pages("locks", c.query, summary=c.summaries["r4i4"], scale=c.scale, basis_bits=4, **c.kw())
    pages = select_pages(
        scores, partials, slots=SLOTS, per_head=False, row_start=c.row_start, length=c.length, heads=c.h, page_size=B
    )
    out = sparse_attention(
        c.query,
        c.keys,
        c.values,
        pages,
        slot_valid=c.kw()["slot_valid"],
        row_start=c.row_start,
        length=c.length,
        scale=c.scale,
        page_size=B,
    )
    index = pages.long().view(1, c.h, -1)
    taken = index >= 0
    at = index.clamp_min(0)[..., None, None].expand(-1, -1, -1, B, c.d)
    k = c.pages.gather(2, at).double().flatten(2, 3)
    v = c.values.view(1, c.h, c.P, B, c.d).gather(2, at).double().flatten(2, 3)
    tok = taken[..., None].expand(-1, -1, -1, B).flatten(2)
    logits = c.scale * torch.einsum("bhgd,bhnd->bhgn", c.q64, k)
    probs = torch.softmax(logits.masked_fill(~tok[:, :, None], float("-inf")), -1)
    want = torch.einsum("bhgn,bhnd->bhgd", probs, v).reshape(1, 1, c.hq, c.d)
    assert rel(out, want) < 5e-3  # bf16 output (about 2e-3 measured)


def test_quest_scores_and_per_head_selection(cache):
    from locks_hf.kernels import score_pages, select_pages

    c = cache
    summary = c.summaries["quest"]
    got, partials = score_pages("quest", c.query, summary=summary, scale=c.scale, **c.kw())
    want = QuestSelector(LocksConfig(selector="quest")).page_scores(
        {k: v.double() for k, v in summary.items()}, None, None, c.q64, c.scale
    )
    assert rel(got.view(1, c.h, c.G, c.P), want) < 1e-5
    pages = select_pages(
        got, partials, slots=SLOTS, per_head=True, row_start=c.row_start, length=c.length, heads=c.h, page_size=B
    )
    ref = reference_select(got.view(1, c.h, c.G, c.P).double(), c.page_real, c.page_real, SLOTS, "share_average", True)
    assert torch.equal(c.as_mask(pages), ref)


def test_oracle_scores(cache):
    from locks_hf.kernels import score_pages

    c = cache
    n = min(c.P, ORACLE_PAGES)
    got, _ = score_pages("oracle", c.query, keys=c.keys, scale=c.scale, **c.kw(n))
    want = exact_page_lse(c.pages[:, :, :n].double(), c.valid[:, :, :n], c.q64, c.scale)
    assert rel(got.view(1, c.h, c.G, n), want) < 1e-5


@pytest.mark.parametrize("rank", [8, 4, 2])
def test_gpu_build_scores_as_well_as_the_reference_build(cache, rank):
    """The GPU summary build (Jacobi eigensolver) vs the reference SVD build: page-score error against
    the exact page LSE within 1% (bases may differ in sign and within repeated eigenvalues)."""
    from locks_hf.kernels import build_summary

    c = cache
    n = min(c.P, ORACLE_PAGES)
    keys = c.pages[:, :, :n].float()
    valid = c.valid[:, :, :n].expand(1, c.h, n, B)
    exact = exact_page_lse(c.pages[:, :, :n].double(), c.valid[:, :, :n], c.q64, c.scale)
    errors = []
    for summary in (build_summary(keys, valid, rank, 4), reference_build(keys, valid, rank, 4)):
        scores = estimated_page_lse(*dequantize_summary(summary, 4, torch.float64), c.valid[:, :, :n], c.q64, c.scale)
        errors.append(rel(scores, exact))
    kernel, reference = errors
    assert kernel <= 1.01 * reference + 1e-4, (kernel, reference)
