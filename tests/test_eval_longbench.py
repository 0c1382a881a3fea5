"""LongBench: official prompt, middle truncation as pred.py, per-task max tokens and metrics."""

import pytest

from locks_hf.eval.longbench import LongBenchBenchmark, build_prompt, load_records, load_spec, truncate_middle_text
from locks_hf.eval.testing import ByteTokenizer

TOK = ByteTokenizer()


@pytest.mark.slow  # ROUGE over a full multi_news record: about a minute of CPU
def test_prompt_truncation_and_score():
    spec = load_spec()
    assert spec["tasks"]["multi_news"]["max_new_tokens"] == 512 and spec["tasks"]["multi_news"]["metric"] == "rouge"
    rec = load_records("multi_news")[0]
    prompt = build_prompt("multi_news", rec, spec)
    assert prompt.startswith("You are given several news passages.") and prompt.endswith("Summary:")
    cut = truncate_middle_text(prompt, TOK, 400)
    raw = prompt.encode()  # byte tokens: keep the first and last max_length // 2 of them
    assert cut == raw[:200].decode("utf-8", "replace") + raw[-200:].decode("utf-8", "replace")
    assert truncate_middle_text("short", TOK, 400) == "short"

    b = LongBenchBenchmark(TOK, ["multi_news"], max_length=600, num_samples=2)
    recs = b.records()
    assert len(recs) == 2 and recs[0]["id"].startswith("multi_news-")
    assert len(TOK.encode(b.prompt_text(recs[0]), add_special_tokens=False)) <= 600 + 6  # (+ replaced partial chars)
    assert b.max_new_tokens(recs[0]) == 512
    assert b.score(recs[0], recs[0]["answers"][0])["score"] > 0.99
    assert b.score(recs[0], "")["score"] == 0.0
