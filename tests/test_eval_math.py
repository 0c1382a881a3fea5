"""Answer checking with math-verify on MATH-500 answers (equivalent forms pass, wrong answers fail)."""

import pytest

pytest.importorskip("math_verify")

from locks_hf.eval.mathbench import MathBenchmark, build_prompt, check_answer, load_problems
from locks_hf.eval.testing import ByteTokenizer


def test_math500_answers():
    rows = {r["answer"]: r for r in load_problems("math500")[:8]}
    assert "\\frac{14}{3}" in rows
    assert check_answer("so the result is \\boxed{\\frac{14}{3}}", "\\frac{14}{3}")["score"] == 1.0
    assert check_answer("\\boxed{\\dfrac{14}{3}}", "\\frac{14}{3}")["score"] == 1.0
    assert check_answer("\\boxed{4.67}", "\\frac{14}{3}")["score"] == 0.0
    assert (
        check_answer("\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}", "\\left( 3, \\frac{\\pi}{2} \\right)")["score"]
        == 1.0
    )
    assert check_answer("\\boxed{(3, \\pi)}", "\\left( 3, \\frac{\\pi}{2} \\right)")["score"] == 0.0
    assert check_answer("The answer is $\\boxed{0.5}$", "\\frac{1}{2}")["score"] == 1.0
    assert check_answer("no answer here", "9")["score"] == 0.0


def test_aime_and_prompt():
    p = load_problems("aime2024")
    assert p[0]["answer"] == "204"
    assert check_answer("Thus \\boxed{204}.", "204")["score"] == 1.0
    assert check_answer("Thus \\boxed{205}.", "204")["score"] == 0.0
    text, chat = build_prompt(ByteTokenizer(), p[0]["problem"])
    assert not chat and "\\boxed{}" in text
    b = MathBenchmark(ByteTokenizer(), ["aime2024"], num_samples=2, k=4, temperature=0.6)
    assert b.samples == 4 and b.sampling["temperature"] == 0.6 and len(b.records()) == 2
