"""LongBench and InfiniteBench scorers against hand-computed cases."""

import pytest

from locks_hf.eval import metrics as M


def test_qa_f1():
    # "The cat sat." -> "cat sat"; "cat sat on the mat" -> "cat sat on mat": P=1, R=1/2, F1=2/3
    assert M.qa_f1_score("The cat sat.", "cat sat on the mat") == pytest.approx(2 / 3)
    assert M.qa_f1_score("dog", "cat") == 0.0
    assert M.longbench_sample_score("hotpotqa", "qa_f1", "Paris", ["London", "paris"]) == 1.0


def test_retrieval_count_classification_codesim():
    assert M.retrieval_score("Paragraph 3, or maybe 5", "Paragraph 3") == 0.5
    assert M.retrieval_score("none", "Paragraph 3") == 0.0
    assert M.retrieval_zh_score("段落2", "段落2") == 1.0
    assert M.count_score("There are 7 or 8 or 7", 7) == pytest.approx(2 / 3)
    classes = ["Location", "Abbreviation", "Description", "Entity", "Human", "Numeric value", "value"]
    assert M.classification_score("Numeric value", "Numeric value", all_classes=classes) == 1.0  # 'value' dropped
    assert M.classification_score("Human or Entity", "Human", all_classes=classes) == 0.5
    assert M.classification_score("Location", "Human", all_classes=classes) == 0.0
    # upstream quirk: two consecutive removable matches, the second survives
    assert M._upstream_remove(["ab", "abc", "x"], "abcd") == ["abc", "x"]
    assert M.code_sim_score("```python\nreturn x + 1\n", "return x + 1") == 1.0
    assert M.code_sim_score("# c\nabcd", "abce") == 0.75


def test_first_line_rule_and_rouge():
    assert (
        M.longbench_sample_score(
            "trec", "classification", "\nHuman\nLocation", ["Human"], all_classes=["Human", "Location"]
        )
        == 1.0
    )
    assert M.rouge_score("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    assert M.rouge_score("", "the cat") == 0.0
    r = M.rouge_score("the cat sat", "the cat sat on the mat")
    try:
        import rouge  # noqa: F401  (LongBench's package: R divides by the *unique* reference words)

        # LCS 3; P = 3/3; R = 3/|{the,cat,sat,on,mat}| = 3/5; F = 2PR/(P+R) = 0.75
        assert r == pytest.approx(0.75, abs=1e-6)
    except ImportError:  # rouge-score fallback: R = 3/6, F = 2/3
        assert r == pytest.approx(2 / 3, abs=1e-6)


def test_zh_metrics():
    pytest.importorskip("jieba")
    assert M.qa_f1_zh_score("北京", "北京。") == 1.0
    assert M.normalize_zh_answer("你好，世界！ A") == "你好世界a"


def test_infinitebench_scorers():
    assert M.ib_passkey(" 12345. The pass key", ["12345"]) is True
    assert M.ib_passkey("key 1234 5", "12345") is False
    assert M.ib_number_string("3000077442.", ["3000077442"]) is True
    assert M.ib_kv_retrieval('"abc-1": "x"', "x") is True
    assert M.ib_kv_retrieval("abc-12", "abc-1") is False
    assert M.ib_longbook_choice_eng(" C", ["Snowfield", "C"]) is True
    assert M.ib_longbook_choice_eng("the answer is: B", ["x", "C"]) is False
    assert M.ib_longbook_choice_eng("I think the answer is C yes", ["x", "C"]) is True
    assert M.ib_code_run(" -5.", [-5]) is True
    assert M.ib_code_debug("B. because", ["f", "B"]) is True
    assert M.ib_code_debug("the answer is: f is wrong", ["f", "B"]) is True
    assert M.ib_math_find("94.", [94]) is True
    assert M.ib_math_calc("[1, 4, 8, 9]", [[1, 4, 7, 9]]) == 0.5
    assert M.ib_math_calc("0, 1, 4", [1, 4, 7, 9], model_name="gpt4") == 0.5
    assert M.ib_longdialogue_qa_eng(" ace rothstein.", ["ACE"]) is True
    assert M.ib_qa_f1_zh("北京大学", ["北京"]) == pytest.approx(2 / 3)
    assert M.ib_rouge_lsum("a b c", ["a b c"]) == pytest.approx(1.0)
