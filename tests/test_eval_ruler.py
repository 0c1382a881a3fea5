"""RULER generation: seeded, reproducible, hits the target length with a given tokenizer; RULER metrics."""

import pytest

from locks_hf.eval.ruler import (
    TASKS,
    RulerGenerator,
    postprocess_pred,
    score_record,
    split_sentences,
    string_match_all,
    string_match_part,
)
from locks_hf.eval.testing import ByteTokenizer

TOK = ByteTokenizer()
count = lambda s: len(TOK.encode(s, add_special_tokens=False))


def test_thirteen_tasks_generate_and_fit():
    gen = RulerGenerator(TOK)
    L = 16384
    for task in TASKS:
        rec = gen.record(task, L, 0)
        n = count(rec["input"] + rec["answer_prefix"])
        assert rec["length_tokens"] == n, task
        assert n + rec["tokens_to_generate"] <= L, (task, n)
        if not task.startswith("qa"):  # the packaged QA samples may hold too few documents
            assert n + rec["tokens_to_generate"] >= 0.7 * L, (task, n)
        assert rec["outputs"] and all(isinstance(o, str) and o for o in rec["outputs"]), task
        if task.startswith("niah") or task == "vt":
            # every reference answer is planted in the context
            assert all(o in rec["input"] for o in rec["outputs"]), task


def test_seeded_and_reproducible():
    a = RulerGenerator(TOK).generate("niah_multikey_1", 4096, 3)
    b = RulerGenerator(TOK).generate("niah_multikey_1", 4096, 3)
    assert a == b
    # a record does not depend on which others were generated (shards see identical records)
    assert RulerGenerator(TOK).record("niah_multikey_1", 4096, 2) == a[2]
    c = RulerGenerator(TOK, seed=7).generate("niah_multikey_1", 4096, 3)
    assert [r["outputs"] for r in c] != [r["outputs"] for r in a]
    assert len({r["outputs"][0] for r in a}) == 3


def test_templates_follow_spec():
    gen = RulerGenerator(TOK)
    single = gen.record("niah_single_1", 2048, 0)
    assert single["input"].startswith("A special magic number is hidden within the following text.")
    assert single["answer_prefix"].endswith("mentioned in the provided text is")
    assert single["metric"] == "string_match_all"
    mv = gen.record("niah_multivalue", 4096, 0)
    assert len(mv["outputs"]) == 4 and mv["answer_prefix"].endswith("are")
    vt = gen.record("vt", 4096, 0)
    assert len(vt["outputs"]) == 5 and "VAR " + vt["outputs"][0] + " = " in vt["input"]
    assert vt["input"].count("Memorize and track the chain(s)") == 2  # one-shot example + task
    assert gen.record("qa_1", 4096, 0)["metric"] == "string_match_part"
    fwe = gen.record("fwe", 4096, 0)
    words = fwe["input"].split()
    counts = [words.count(w) for w in fwe["outputs"]]
    assert counts == sorted(counts, reverse=True) and counts[0] > 0


def test_metrics_hand_computed():
    assert string_match_all("the numbers are 123 and 456", ["123", "456", "789"]) == pytest.approx(2 / 3)
    assert string_match_all("ABC", ["abc"]) == 1.0
    assert string_match_part("x 456", ["123", "456"]) == 1.0
    assert string_match_part("nothing", ["123", "456"]) == 0.0
    assert postprocess_pred("  12\x0034\t ") == "12\n34"
    assert score_record("niah_single_1", " 7045277.\n", ["7045277"]) == 1.0
    assert score_record("niah_multivalue", "1, 2", ["1", "2", "3", "4"]) == 0.5


def test_sentence_split():
    assert split_sentences("Hi there. This is it! Ok? yes. 42 is. ") == [
        "Hi there.",
        "This is it!",
        "Ok? yes.",
        "42 is.",
    ]


def _gemma_tokenizer():
    try:
        from transformers import AutoTokenizer

        from locks_hf.models import model_cache_dir

        folder = model_cache_dir("gemma3-270m")
        return AutoTokenizer.from_pretrained(folder) if (folder / "tokenizer_config.json").exists() else None
    except Exception:
        return None


@pytest.mark.slow  # tokenizes full-length haystacks with the real Gemma 3 tokenizer
def test_hits_length_with_real_tokenizer():
    tok = _gemma_tokenizer()
    if tok is None:
        pytest.skip("Gemma 3 tokenizer not converted yet (locks_hf.models.load_model('gemma3-270m') caches it)")
    gen = RulerGenerator(tok)
    for task in ("niah_single_1", "niah_single_2", "niah_multikey_2", "vt"):
        rec = gen.record(task, 4096, 0)
        n = len(tok.encode(rec["input"] + rec["answer_prefix"], add_special_tokens=False))
        assert n == rec["length_tokens"] and 0.8 * 4096 <= n + rec["tokens_to_generate"] <= 4096, (task, n)


def test_records_do_not_depend_on_the_hash_seed():
    """A sweep in another interpreter (another PYTHONHASHSEED) writes the records written here."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    tasks, n = ("vt", "fwe", "niah_multikey_2"), 3
    code = (
        "import json; from locks_hf.eval.ruler import RulerGenerator; from locks_hf.eval.testing import ByteTokenizer; "
        f"print(json.dumps([RulerGenerator(ByteTokenizer()).record(t, 4096, i) for t in {tasks!r} for i in range({n})]))"
    )
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": seed},
    ).stdout
    here = [RulerGenerator(TOK).record(t, 4096, i) for t in tasks for i in range(n)]
    assert json.loads(out) == json.loads(json.dumps(here))
