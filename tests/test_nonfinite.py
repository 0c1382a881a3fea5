"""NaN / Inf inputs propagate as in dense attention: the affected row gives what dense gives, the
other rows of the batch are untouched, and nothing raises."""

import pytest
import torch
from conftest import tiny
from selector_lists import all_selectors

from locks_hf import LocksCache, LocksConfig
from locks_hf.config import BudgetDoesNotFit
from locks_hf.selectors import LocksSelector, select_pages, selector_class
from locks_hf.summaries import build_summary

SELECTORS = all_selectors()  # every registered method: page selectors, dense, token-level baselines


def _fitting_config(selector: str) -> LocksConfig:
    """The smallest power-of-two budget from 32 up that ``selector`` accepts (a method with fixed
    blocks, such as ShadowKV's, refuses small ones)."""
    budget = 32
    while True:
        try:
            return LocksConfig(selector=selector, budget=budget, rank=4)
        except BudgetDoesNotFit:
            budget *= 2


def _needs_context_scores(selector: str) -> bool:
    return bool(getattr(selector_class(selector), "needs_context_scores", False))


@pytest.mark.parametrize("selector,poison", [(s, float("nan")) for s in SELECTORS] + [("locks", float("inf"))])
def test_a_nonfinite_row_decodes_like_dense_and_spares_the_others(selector, poison):
    dense, model = tiny("llama", "sdpa"), tiny("llama")
    for m in (dense, model):
        with torch.no_grad():
            m.model.embed_tokens.weight[7] = poison  # token 7 puts NaN / Inf into the keys of its row
    cfg = _fitting_config(selector)
    length = max(120, 4 * cfg.budget)  # the budget selects: the prompt is longer
    ids = torch.randint(8, 256, (2, length), generator=torch.Generator().manual_seed(0))
    ids[1, 50] = 7
    if _needs_context_scores(selector):  # KVzip scores the context of one row at a time (`score_context`)
        want = dense.generate(
            ids[1:], max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True
        )
        got = _generate_scored(model, ids[1:], cfg)
        assert torch.equal(got.sequences, want.sequences)
        assert all(torch.isnan(s).all() for s in got.scores) == all(torch.isnan(s).all() for s in want.scores)
        clean = _generate_scored(model, ids[:1], cfg)  # the row without the poison stays finite
        assert all(torch.isfinite(s).all() for s in clean.scores)
        return
    want = dense.generate(ids, max_new_tokens=6, do_sample=False, output_scores=True, return_dict_in_generate=True)
    got = model.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        past_key_values=LocksCache(model.config, cfg),
        output_scores=True,
        return_dict_in_generate=True,
    )
    alone = model.generate(ids[:1], max_new_tokens=6, do_sample=False, past_key_values=LocksCache(model.config, cfg))
    assert torch.equal(got.sequences[1], want.sequences[1])
    assert all(torch.isnan(s[1]).all() for s in got.scores) == all(torch.isnan(s[1]).all() for s in want.scores)
    assert torch.equal(got.sequences[:1], alone)


def _generate_scored(model, ids, cfg):
    """Generate from a dense prefill of ``ids`` scored by the method's context pass (`score_context`)."""
    from locks_hf.baselines.kvzip import score_context
    from locks_hf.eval.testing import ByteTokenizer

    base = LocksCache(model.config, LocksConfig(selector="full"))
    with torch.no_grad():
        model(ids[:, :-1], past_key_values=base, use_cache=True)
    score_context(model, ByteTokenizer(), base, ids[:, :-1])
    return model.generate(
        ids,
        max_new_tokens=6,
        do_sample=False,
        past_key_values=base.fork(cfg),
        output_scores=True,
        return_dict_in_generate=True,
    )


def test_summary_of_a_nonfinite_page_scores_nan_and_is_always_selected():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 6, 16, 8, generator=g, dtype=torch.float64)
    keys[0, 0, 3, 5, 2] = float("nan")
    valid = torch.ones(1, 1, 6, 16, dtype=torch.bool)
    cfg = LocksConfig(rank=4, budget=48)
    summary = build_summary(keys, valid, 4)  # no _LinAlgError
    finite_pages = [0, 1, 2, 4, 5]
    clean = build_summary(keys[:, :, finite_pages], valid[:, :, finite_pages], 4)
    for name, tensor in clean.items():  # the finite pages are summarized as without the NaN page
        assert torch.equal(summary[name][:, :, finite_pages], tensor), name
    query = torch.randn(1, 1, 2, 8, generator=g, dtype=torch.float64)
    scores = LocksSelector(cfg).page_scores(summary, None, valid[:, :1], query, 0.3)
    assert torch.isnan(scores[..., 3]).all() and torch.isfinite(scores[..., finite_pages]).all()
    real = torch.ones(1, 6, dtype=torch.bool)
    for per_head in (False, True):
        chosen = select_pages(scores, real, real, cfg.page_slots, "share_average", per_head)
        assert chosen[0, 0].tolist() == [True, False, False, True, False, True]  # sink, NaN page, recent


def test_kernel_summary_build_survives_a_nonfinite_page_and_spares_the_others():
    """The GPU build (run here under Triton's interpreter) takes a NaN page without an error, and the
    other pages' summaries are those built without it."""
    pytest.importorskip("triton")
    from locks_hf.kernels.build import build_summary as kernel_build

    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 1, 4, 16, 64, generator=g)
    keys[0, 0, 2, 5, 3] = float("nan")
    valid = torch.ones(1, 1, 4, 16, dtype=torch.bool)
    summary = kernel_build(keys, valid, 4, 4)
    finite_pages = [0, 1, 3]
    clean = kernel_build(keys[:, :, finite_pages], valid[:, :, finite_pages], 4, 4)
    for name, tensor in clean.items():
        assert torch.equal(summary[name][:, :, finite_pages], tensor), name
