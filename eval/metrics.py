"""Scorers shipped with the package (nothing fetched at run time).

* LongBench-v1 (THUDM/LongBench ``LongBench/metrics.py`` + ``eval.py`` @ 2e00731): qa_f1, qa_f1_zh, rouge,
  rouge_zh, classification, retrieval, retrieval_zh, count, code_sim, and the per-task ``scorer``.
* InfiniteBench (OpenBMB/InfiniteBench ``src/compute_scores.py`` @ 88b3daa): one ``get_score_one_*``
  per task, same string handling as upstream (the README figures are reproduced by the tests).

ROUGE: LongBench uses the ``rouge`` package (ROUGE-L F); InfiniteBench uses HF ``evaluate``'s
``rouge`` = Google ``rouge-score`` ``rougeLsum`` F, called here directly (no Hub download).
"""

from __future__ import annotations

import re
import string
from collections import Counter

CN_PUNCT = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."


# -------------------------------------------------------------------------------------------------
# shared helpers
def normalize_answer(s: str) -> str:
    """SQuAD normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def normalize_zh_answer(s: str) -> str:
    s = s.lower()
    punct = set(string.punctuation + CN_PUNCT)
    s = "".join(ch for ch in s if ch not in punct)
    return "".join(s.split())


def f1_tokens(prediction: list, ground_truth: list) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def _jieba_cut(text: str) -> list[str]:
    try:
        import jieba
    except ImportError as err:  # pragma: no cover
        raise ImportError("Chinese LongBench metrics need jieba: pip install 'locks-hf[eval]'") from err
    jieba.setLogLevel(60)
    return list(jieba.cut(text, cut_all=False))


# -------------------------------------------------------------------------------------------------
# LongBench metrics (prediction, one ground truth) -> float in [0, 1]
def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return f1_tokens(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    p = [normalize_zh_answer(t) for t in _jieba_cut(prediction)]
    g = [normalize_zh_answer(t) for t in _jieba_cut(ground_truth)]
    return f1_tokens([t for t in p if t], [t for t in g if t])


def rouge_l_f(prediction: str, ground_truth: str) -> float:
    """ROUGE-L F as LongBench computes it (``rouge`` package; rouge-score rougeL F as a fallback)."""
    try:
        from rouge import Rouge
    except ImportError:
        from rouge_score import rouge_scorer

        if not prediction.strip() or not ground_truth.strip():
            return 0.0
        return rouge_scorer.RougeScorer(["rougeL"]).score(ground_truth, prediction)["rougeL"].fmeasure
    try:
        return Rouge().get_scores([prediction], [ground_truth], avg=True)["rouge-l"]["f"]
    except Exception:  # upstream: empty or degenerate strings score 0
        return 0.0


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return rouge_l_f(prediction, ground_truth)


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return rouge_l_f(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    em = _upstream_remove([c for c in kwargs["all_classes"] if c in prediction], ground_truth)
    return 1.0 / len(em) if ground_truth in em else 0.0


def _upstream_remove(em: list[str], ground_truth: str) -> list[str]:
    """``for m in em: if m in gt and m != gt: em.remove(m)`` with Python's list-mutation semantics."""
    em = list(em)
    i = 0
    while i < len(em):
        m = em[i]
        if m in ground_truth and m != ground_truth:
            em.remove(m)  # removes the first equal element; the iterator index still advances
        i += 1
    return em


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    gold = re.findall(r"Paragraph (\d+)", ground_truth)[0]
    nums = re.findall(r"\d+", prediction)
    return 0.0 if not nums else sum(n == gold for n in nums) / len(nums)


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    gold = re.findall(r"段落(\d+)", ground_truth)[0]
    nums = re.findall(r"\d+", prediction)
    return 0.0 if not nums else sum(n == gold for n in nums) / len(nums)


def count_score(prediction: str, ground_truth, **kwargs) -> float:
    nums = re.findall(r"\d+", prediction)
    return 0.0 if not nums else sum(n == str(ground_truth) for n in nums) / len(nums)


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    line = ""
    for l in prediction.lstrip("\n").split("\n"):
        if "`" not in l and "#" not in l and "//" not in l:
            line = l
            break
    try:
        from fuzzywuzzy import fuzz
    except ImportError:  # same ratio: round(100 * SequenceMatcher.ratio())
        from difflib import SequenceMatcher

        return round(100 * SequenceMatcher(None, line, ground_truth).ratio()) / 100
    return fuzz.ratio(line, ground_truth) / 100


LONGBENCH_METRICS = {
    "qa_f1": qa_f1_score,
    "qa_f1_zh": qa_f1_zh_score,
    "rouge": rouge_score,
    "rouge_zh": rouge_zh_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "retrieval_zh": retrieval_zh_score,
    "count": count_score,
    "code_sim": code_sim_score,
}
FIRST_LINE_TASKS = ("trec", "triviaqa", "samsum", "lsht")


def longbench_sample_score(task: str, metric: str, prediction: str, answers: list[str], all_classes=None) -> float:
    """Max over references (eval.py ``scorer``), first line only for trec/triviaqa/samsum/lsht."""
    if task in FIRST_LINE_TASKS:
        prediction = prediction.lstrip("\n").split("\n")[0]
    fn = LONGBENCH_METRICS[metric]
    return max((fn(prediction, gt, all_classes=all_classes) for gt in answers), default=0.0)


def longbench_task_score(
    task: str, metric: str, predictions: list[str], answers: list[list[str]], all_classes=None
) -> float:
    total = sum(longbench_sample_score(task, metric, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)


# -------------------------------------------------------------------------------------------------
# InfiniteBench (compute_scores.py)
def first_int_match(prediction: str) -> str:
    for item in re.split("[^0-9]", prediction):
        if item != "":
            return item
    return ""


def _split_words(pred: str, chars) -> list[str]:
    for c in chars:
        pred = pred.replace(c, " ")
    return pred.split()


_KV_CHARS = ["\n", ":", '"', "'", ".", ",", "?", "!", "{", "}"]


def ib_kv_retrieval(pred, label, model_name=None) -> bool:
    if isinstance(label, list):
        label = label[0]
    return label in _split_words(pred, _KV_CHARS)


def ib_passkey(pred, label, model_name=None) -> bool:
    if isinstance(label, list):
        label = label[0]
    return label == first_int_match(pred)


ib_number_string = ib_passkey


def ib_code_run(pred, label, model_name=None) -> bool:
    if isinstance(label, list):
        label = label[0]
    words = _split_words(pred.strip(), ["\n", ".", "`", "'", '"', ":"])
    if not words:
        return False
    try:
        return label == int(words[-1])
    except ValueError:
        return False


def ib_code_debug(pred, label, model_name=None) -> bool:
    pred = pred.strip()
    label_c, fn_name = label[1], label[0]
    if pred[:2] in (f"{label_c}.", f"{label_c}:"):
        return True
    pred = _squash(pred, ["\n", "`", "'", '"', "-", "*", "Option", "option"])
    rest = _after_prefix(pred, ["answer is:", "is:", "answer:", "correct option is:"])
    return rest is not None and any(rest.startswith(s) for s in (label_c, fn_name))


def _squash(pred: str, chars: list[str]) -> str:
    """Replace each of ``chars`` by a space, then collapse runs of spaces (upstream's clean-up)."""
    for c in chars:
        pred = pred.replace(c, " ")
    while "  " in pred:
        pred = pred.replace("  ", " ")
    return pred


def _after_prefix(pred: str, prefixes: list[str]) -> str | None:
    """Text after the first listed prefix found (in list order), past one separator; ``""`` when the
    prediction ends there; ``None`` when no prefix occurs. Mirrors upstream's prefix search."""
    for prefix in prefixes:
        idx = pred.find(prefix)
        if idx == -1:
            continue
        if len(pred) < idx + len(prefix) + 1:
            return ""
        return pred[idx + len(prefix) + 1 :]
    return None


def ib_math_find(pred, label, model_name=None) -> bool:
    if isinstance(label, list):
        label = label[0]
    m = re.search(r"\d+\.\d+|\d+", pred)
    if m is None:
        return False
    if isinstance(label, int):
        # upstream int()s the match and would crash on "94.5"; a float match is compared as a float
        return float(m.group(0)) == label if "." in m.group(0) else int(m.group(0)) == label
    if isinstance(label, float):
        return float(m.group(0)) == label
    raise TypeError(f"Expected int or float, got {type(label)}")


def ib_longdialogue_qa_eng(pred, label, model_name=None) -> bool:
    label = label[0]
    words = [w.upper() for w in _split_words(pred.strip(), _KV_CHARS)]
    return label in words


def ib_longbook_choice_eng(pred, label, model_name=None) -> bool:
    pred = pred.strip()
    if pred == "":
        return False
    if pred[0] in "ABCD":
        return pred[0] in label
    if pred in label:
        return True
    pred = _squash(pred, ["\n", '"', "'", ".", ",", "?", "!", "{", "}"])
    after = _after_prefix(pred, ["answer is:", "answer:", "answer is", "option is"])
    if after is not None:
        return after != "" and any(after.startswith(s) for s in label)
    for word in pred.split():
        if word in "ABCD":
            return word in label
    return False


def ib_qa_f1(pred, labels, model_name=None) -> float:
    if isinstance(labels, str):
        labels = [labels]
    return max((f1_tokens(normalize_answer(pred).split(), normalize_answer(g).split()) for g in labels), default=0.0)


def ib_qa_f1_zh(pred, labels, model_name=None) -> float:
    if isinstance(labels, str):
        labels = [labels]
    return max((f1_tokens(list(normalize_zh_answer(pred)), list(normalize_zh_answer(g))) for g in labels), default=0.0)


def ib_rouge_lsum(pred, labels, model_name=None) -> float:
    """HF evaluate 'rouge' rougeLsum F (use_aggregator=False) = rouge-score, max over references."""
    from rouge_score import rouge_scorer

    if isinstance(labels, str):
        labels = [labels]
    scorer = rouge_scorer.RougeScorer(["rougeLsum"], use_stemmer=False)
    return max(scorer.score(g, pred)["rougeLsum"].fmeasure for g in labels)


def ib_math_calc(pred, label, model_name=None) -> float:
    nums = [int(x) for x in re.split("[^0-9]", pred) if x != ""]
    if model_name == "gpt4":
        nums = nums[1:]
    if label and isinstance(label[0], list):
        label = label[0]
    cnt = 0
    for i in range(len(label)):
        if i >= len(nums) or label[i] != nums[i]:
            break
        cnt += 1
    return cnt / len(label)


INFINITEBENCH_SCORERS = {
    "kv_retrieval": ib_kv_retrieval,
    "passkey": ib_passkey,
    "number_string": ib_number_string,
    "code_run": ib_code_run,
    "code_debug": ib_code_debug,
    "math_find": ib_math_find,
    "math_calc": ib_math_calc,
    "longdialogue_qa_eng": ib_longdialogue_qa_eng,
    "longbook_choice_eng": ib_longbook_choice_eng,
    "longbook_qa_eng": ib_qa_f1,
    "longbook_qa_chn": ib_qa_f1_zh,
    "longbook_sum_eng": ib_rouge_lsum,
}


def infinitebench_score_one(task: str, pred: str, label, model_name: str = "") -> float:
    return float(INFINITEBENCH_SCORERS[task](pred, label, model_name))
