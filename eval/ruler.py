"""RULER's 13 synthetic tasks, generated locally at any target length with the model's tokenizer.

Follows ``ruler_tasks.json`` (NVIDIA/RULER @ c3f5e3b): templates, answer prefixes, tokens to generate,
needle/haystack recipes, ``string_match_all`` / ``string_match_part``. Each record is built from its own
``random.Random(f"{seed}-{task}-{length}-{index}")`` so a record does not depend on which others are
generated (shards and resumed runs see identical records). The haystack size is binary-searched per
task (once, on a probe record) so that ``tokens(input + answer_prefix) + tokens_to_generate <= length``;
records that overshoot shrink until they fit.

Known differences from upstream RULER (stated, not hidden): sentence splitting of the essay haystack
uses a regular expression, not NLTK punkt (not available offline); qa_1/qa_2 draw from whatever SQuAD /
HotpotQA file is given (the shared data holds partial dev sets); cwe never needs english_words.json
below ~64K tokens (the wonderwords vocabulary is large enough).
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .jsonl import read_json, read_jsonl, read_text
from .paths import data_file

TASKS = (
    "niah_single_1",
    "niah_single_2",
    "niah_single_3",
    "niah_multikey_1",
    "niah_multikey_2",
    "niah_multikey_3",
    "niah_multivalue",
    "niah_multiquery",
    "vt",
    "cwe",
    "fwe",
    "qa_1",
    "qa_2",
)
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DEPTHS = [round(x) for x in [i * 100 / 39 for i in range(40)]]  # round(linspace(0, 100, 40))


def load_spec(data_dir=None) -> dict:
    return read_json(data_file("ruler/ruler_tasks.json", "ruler_tasks.json", data_dir))


# ----------------------------------------------------------------------------------------------------
# metrics (RULER scripts/eval/synthetic/constants.py)
def postprocess_pred(pred: str) -> str:
    pred = pred.strip()
    pred = re.sub(r"[\x00-\x1f]", "\n", pred)
    return pred.strip()


def string_match_all(pred: str, refs: list[str]) -> float:
    """Fraction of references contained in the prediction (case-insensitive), 0..1."""
    p = pred.lower()
    return sum(r.lower() in p for r in refs) / len(refs)


def string_match_part(pred: str, refs: list[str]) -> float:
    """1 if any reference is contained in the prediction (case-insensitive)."""
    p = pred.lower()
    return float(max(r.lower() in p for r in refs))


METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}


def score_record(task: str, pred: str, outputs: list[str], spec: dict | None = None) -> float:
    """Per-record score in [0, 1] (the task score is the mean x 100)."""
    spec = spec or load_spec()
    return METRICS[task_metric(task, spec)](postprocess_pred(pred), outputs)


def task_metric(task: str, spec: dict) -> str:
    return spec["base_tasks"][_base_key(spec, task)]["metric"]


def _base_key(spec: dict, task: str) -> str:
    return spec["tasks"][task]["base"]


# ----------------------------------------------------------------------------------------------------
# data sources
@dataclass
class RulerSources:
    """Text sources RULER draws from: the files named here, else the data folder's (``--data-dir`` /
    ``$LOCKS_HF_DATA``), else the packaged samples."""

    haystack_path: str | None = None
    wordlist_dir: str | None = None
    squad_path: str | None = None
    hotpotqa_path: str | None = None
    data_dir: str | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    def _file(self, explicit, rel, sample):
        return Path(explicit) if explicit else data_file(rel, sample, self.data_dir)

    def haystack_file(self) -> Path:
        return self._file(self.haystack_path, "haystack/paul_graham_essays.txt", "haystack_sample.txt")

    def wordlist_file(self, kind: str) -> Path:
        name = f"wonderwords-2.2.0_{kind}list.txt"
        return (
            Path(self.wordlist_dir) / name
            if self.wordlist_dir
            else data_file(f"ruler/wordlists/{name}", name, self.data_dir)
        )

    def squad_file(self) -> Path:
        return self._file(
            self.squad_path, "ruler/qa_sources/squad_v2_dev_sample500.jsonl", "ruler_squad_v2_dev_sample12.jsonl"
        )

    def hotpotqa_file(self) -> Path:
        return self._file(
            self.hotpotqa_path,
            "ruler/qa_sources/hotpotqa_dev_distractor_subset1100.json",
            "ruler_hotpotqa_dev_distractor_sample5.json",
        )

    def files(self) -> dict[str, Path]:
        """``{role: path}`` of every source file (resolved, not read)."""
        out = {"haystack": self.haystack_file(), "squad": self.squad_file(), "hotpotqa": self.hotpotqa_file()}
        out.update({f"wordlist_{kind}": self.wordlist_file(kind) for kind in ("noun", "adjective", "verb")})
        return out

    def essay_words(self) -> list[str]:
        if "essay" not in self._cache:
            path = self.haystack_file()
            self._cache["essay"] = re.sub(r"\s+", " ", read_text(path)).strip().split(" ")
            self._cache["essay_path"] = str(path)
        return self._cache["essay"]

    def words(self, kind: str) -> list[str]:
        key = f"w_{kind}"
        if key not in self._cache:
            path = self.wordlist_file(kind)
            self._cache[key] = [w for w in read_text(path).split("\n") if w.strip()]
        return self._cache[key]

    def needle_pair(self, rng: random.Random) -> str:
        """A random '<adjective>-<noun>' (uniform over the sorted unique adjective x noun pairs)."""
        if "pairs" not in self._cache:
            self._cache["pairs"] = (sorted(set(self.words("adjective"))), sorted(set(self.words("noun"))))
        adjs, nouns = self._cache["pairs"]
        a, n = divmod(rng.randrange(len(adjs) * len(nouns)), len(nouns))
        return f"{adjs[a]}-{nouns[n]}"

    def cwe_vocab(self) -> list[str]:
        if "cwe" not in self._cache:
            self._cache["cwe"] = sorted(set(self.words("noun") + self.words("adjective") + self.words("verb")))
        return self._cache["cwe"]

    def squad(self):
        if "squad" not in self._cache:
            path = self.squad_file()
            rows = read_jsonl(
                path, required=("context", "question"), fix="fix or remove that line, or use another --data-dir"
            )
            docs = sorted({r["context"] for r in rows})
            index = {d: i for i, d in enumerate(docs)}
            qas = [
                {
                    "query": r["question"],
                    "outputs": list(dict.fromkeys(r["answers"])),
                    "context": [index[r["context"]]],
                    "more_context": [],
                }
                for r in rows
                if not r.get("is_impossible") and r.get("answers")
            ]
            self._cache["squad"] = (docs, qas)
        return self._cache["squad"]

    def hotpotqa(self):
        if "hotpot" not in self._cache:
            path = self.hotpotqa_file()
            data = read_json(path, fix="restore the file, or use another --data-dir")
            doc_of = lambda c: f"{c[0]}\n{''.join(c[1])}"
            docs = sorted({doc_of(c) for r in data for c in r["context"]})
            index = {d: i for i, d in enumerate(docs)}
            qas = [
                {
                    "query": r["question"],
                    "outputs": [r["answer"]],
                    "context": [index[doc_of(c)] for c in r["context"]],
                    "more_context": [],
                }
                for r in data
            ]
            self._cache["hotpot"] = (docs, qas)
        return self._cache["hotpot"]


_SENT = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[\"'(\[]?[A-Z0-9])")


def split_sentences(text: str) -> list[str]:
    """Sentence split (regex stand-in for NLTK punkt: a break after . ! ? before a capital/digit)."""
    return [s for s in _SENT.split(text.strip()) if s]


def make_token_counter(tokenizer) -> Callable[[str], int]:
    """Token count without special tokens, from an HF tokenizer or a callable ``text -> int``."""
    if callable(tokenizer) and not hasattr(tokenizer, "encode"):
        return tokenizer
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


# ----------------------------------------------------------------------------------------------------
# task generators: each returns (input_text, answer_prefix, outputs, extra) for a haystack size n
def _rand_value(rng: random.Random, kind: str, src: RulerSources) -> str:
    if kind == "numbers":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "words":
        return src.needle_pair(rng)
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(kind)


def _gen_niah(rng, n, cfg, base, src, seed):
    type_v = cfg["type_needle_v"]
    nk = max(cfg["num_needle_k"], cfg["num_needle_q"])
    keys, values, needles = [], [], []
    for _ in range(nk):
        keys.append(_rand_value(rng, cfg["type_needle_k"], src))
        vals = []
        for _ in range(cfg["num_needle_v"]):
            vals.append(_rand_value(rng, type_v, src))
            needles.append(base["needle_sentence"].format(type_needle_v=type_v, key=keys[-1], value=vals[-1]))
        values.append(vals)
    random.Random(seed).shuffle(needles)

    hay = cfg["type_haystack"]
    if hay == "essay":
        words = src.essay_words()
        reps = math.ceil(n / len(words))
        text = " ".join((words * reps)[:n])
        sents = split_sentences(text)
        depths = sorted(int(len(sents) * d / 100) for d in rng.sample(DEPTHS, len(needles)))
        pos = [0] + depths + [len(sents)]
        parts = []
        for i in range(1, len(pos)):
            parts.append(" ".join(sents[pos[i - 1] : pos[i]]))
            if i - 1 < len(needles):
                parts.append(needles[i - 1])
        context = " ".join(p for p in parts if p)
    else:
        if hay == "noise":
            sentences = [NOISE] * n
        else:  # "needle": distractor needles with fresh keys/values
            sentences = [
                base["needle_sentence"].format(
                    type_needle_v=type_v,
                    key=_rand_value(rng, cfg["type_needle_k"], src),
                    value=_rand_value(rng, type_v, src),
                )
                for _ in range(n)
            ]
        for index, needle in zip(sorted(rng.sample(range(max(n, len(needles))), len(needles)), reverse=True), needles):
            sentences.insert(index, needle)
        context = "\n".join(sentences)

    idx = rng.sample(range(nk), cfg["num_needle_q"])
    queries = [keys[i] for i in idx]
    answers = [a for i in idx for a in values[i]]
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    template, prefix, tv = base["template"], base["answer_prefix"], type_v
    if cfg["num_needle_q"] * cfg["num_needle_v"] == 1:
        for a, b in (("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")):
            template, prefix = template.replace(a, b), prefix.replace(a, b)
        tv = type_v[:-1]
    text = template.format(type_needle_v=tv, context=context, query=query)
    return text, prefix.format(type_needle_v=tv, query=query), answers, {"query": query, "context": context}


def _vt_chain(rng, num_hops, k):
    names: list[str] = []  # a list, not a set: a set's order depends on PYTHONHASHSEED
    while len(names) < num_hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=k))
        if name not in names:
            names.append(name)
    rng.shuffle(names)
    chain = [f"VAR {names[0]} = {rng.randint(10000, 99999)}"]
    chain += [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(num_hops)]
    return names, chain


def _vt_text(rng, n_noise, num_hops, base, k):
    names, chain = _vt_chain(rng, num_hops, k)
    sentences = [NOISE + "\n"] * n_noise
    positions = sorted(rng.sample(range(max(len(sentences), len(chain))), len(chain)))
    for j, p in enumerate(positions):
        sentences.insert(p + j, chain[j])
    context = " ".join(sentences).replace(". \n", ".\n")
    value = chain[0].split("=")[-1].strip()
    text = base["template"].format(context=context, query=value)
    prefix = base["answer_prefix"].format(num_v=num_hops + 1, query=value)
    return text, prefix, names, value


VT_ICL_NOISE = 18  # noise lines of the one-shot example (RULER builds it for max_seq_length=500)


def _gen_vt(rng, n, cfg, base, src, seed):
    hops = cfg["num_hops"]
    icl_text, icl_prefix, icl_names, _ = _vt_text(rng, VT_ICL_NOISE, hops, base, 3)
    icl = icl_text + icl_prefix + " ".join(icl_names)
    text, prefix, names, value = _vt_text(rng, n, hops, base, 5)
    return icl + "\n" + text, prefix, names, {"query": value}


def _cwe_example(rng, vocab, num_words, freq_cw, freq_ucw, num_cw, seed):
    words = rng.sample(vocab, num_words)
    common, uncommon = words[:num_cw], words[num_cw:]
    lst = common * int(freq_cw) + uncommon * int(freq_ucw)
    random.Random(seed).shuffle(lst)
    return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst)), common


def _gen_cwe(rng, n, cfg, base, src, seed, length=4096):
    vocab = list(src.cwe_vocab())
    random.Random(seed).shuffle(vocab)
    n = min(n, len(vocab))
    if length < 4096:
        ex = _cwe_example(rng, vocab, 20, 3, 1, cfg["num_cw"], seed)
        ctx, ans = _cwe_example(rng, vocab, n, 6, 1, cfg["num_cw"], seed)
    else:
        ex = _cwe_example(rng, vocab, 40, 10, 3, cfg["num_cw"], seed)
        ctx, ans = _cwe_example(rng, vocab, n, cfg["freq_cw"], cfg["freq_ucw"], cfg["num_cw"], seed)
    shot = (
        base["template"].format(context=ex[0])
        + base["answer_prefix"]
        + " "
        + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[1]))
    )
    return shot + "\n" + base["template"].format(context=ctx), base["answer_prefix"], ans, {}


def _zeta(alpha: float, terms: int = 100000) -> float:
    if alpha == 2.0:
        return math.pi**2 / 6
    return sum(k**-alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


def _gen_fwe(rng, n, cfg, base, src, seed, length=4096):
    L = cfg["coded_wordlen"]
    vocab_size = max(4, (length - base["tokens_to_generate"]) // 50)
    vr = random.Random(f"{seed}-fwe-vocab-{length}")  # vocabulary is fixed per length, like RULER's
    vocab = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(vr.choices(string.ascii_lowercase, k=L)))
    vocab = sorted(vocab)
    random.Random(seed).shuffle(vocab)
    vocab[0] = "..."
    z = _zeta(cfg["alpha"])
    words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n * k ** -cfg["alpha"] / z))]
    rng.shuffle(words)
    return base["template"].format(context=" ".join(words)), base["answer_prefix"], vocab[1:4], {}


def _gen_qa(rng, n, cfg, base, src, seed, index=0):
    docs, qas = src.squad() if cfg["dataset"] == "squad" else src.hotpotqa()
    qa = qas[index % len(qas)]
    gold, more = qa["context"], qa["more_context"]
    if n < len(docs):
        if n - len(gold) > len(more):
            extra = [i for i in range(len(docs)) if i not in set(gold + more)]
            chosen = gold + more + rng.sample(extra, max(0, min(len(extra), n - len(gold) - len(more))))
        else:
            chosen = gold + rng.sample(more, max(0, n - len(gold)))
        chosen = [docs[i] for i in chosen]
    else:
        chosen = list(docs)
    random.Random(seed).shuffle(chosen)
    context = "\n\n".join(f"Document {i + 1}:\n{d}" for i, d in enumerate(chosen))
    text = base["template"].format(context=context, query=qa["query"])
    return text, base["answer_prefix"], qa["outputs"], {"query": qa["query"], "num_docs": len(chosen)}


_BASE_KEYS = {
    "niah": "niah",
    "variable_tracking": "vt",
    "common_words_extraction": "cwe",
    "freq_words_extraction": "fwe",
    "qa": "qa",
}


def _step(spec, task, length):
    cfg = spec["tasks"][task]
    base = spec["base_tasks"][cfg["base"]]
    if cfg["base"] == "qa":
        return base.get("haystack_search_step", 10)
    steps = base.get("haystack_search_step", {})
    if cfg["base"] == "common_words_extraction":
        return 10
    if cfg["base"] == "freq_words_extraction":
        return max(1, length // 32)
    hay = cfg.get("type_haystack", "noise")
    if hay != "essay" and length < 4096:
        return steps.get("non_essay_below_4096", 5)
    return steps.get(hay, 25)


class RulerGenerator:
    """Generates RULER records for one tokenizer.

    >>> gen = RulerGenerator(tokenizer)            # doctest: +SKIP
    >>> recs = gen.generate("niah_single_1", 4096, num_samples=10)
    """

    def __init__(
        self,
        tokenizer,
        sources: RulerSources | None = None,
        seed: int | None = None,
        spec: dict | None = None,
        data_dir=None,
    ):
        self.spec_path: Path | None = None
        if spec:
            self.spec = spec
        else:
            self.spec_path = data_file("ruler/ruler_tasks.json", "ruler_tasks.json", data_dir)
            self.spec = read_json(self.spec_path)
        self.count = make_token_counter(tokenizer)
        self.src = sources or RulerSources(data_dir=data_dir)
        self.seed = self.spec["global"]["random_seed"] if seed is None else seed
        self._sizes: dict = {}

    def data_files(self, tasks) -> dict[str, Path]:
        """``{role: path}`` of the spec and of the sources ``tasks`` draw from (the run manifest hashes them)."""
        files = self.src.files()
        bases = {self.spec["tasks"][t]["base"] for t in tasks}
        used = {"haystack"} if bases & {"niah", "variable_tracking"} else set()
        if bases & {"niah", "common_words_extraction"}:
            used |= {"wordlist_noun", "wordlist_adjective", "wordlist_verb"}
        used |= {self.spec["tasks"][t]["dataset"] for t in tasks if self.spec["tasks"][t]["base"] == "qa"}
        out = {role: files[role] for role in sorted(used)}
        if self.spec_path is not None:
            out["spec"] = self.spec_path
        return out

    def tokens_to_generate(self, task: str) -> int:
        return self.spec["base_tasks"][self.spec["tasks"][task]["base"]]["tokens_to_generate"]

    def _build(self, task, length, index, n):
        cfg = self.spec["tasks"][task]
        base = self.spec["base_tasks"][cfg["base"]]
        rng = random.Random(f"{self.seed}-{task}-{length}-{index}")
        kind = cfg["base"]
        if kind == "niah":
            return _gen_niah(rng, n, cfg, base, self.src, self.seed)
        if kind == "variable_tracking":
            return _gen_vt(rng, n, cfg, base, self.src, self.seed)
        if kind == "common_words_extraction":
            return _gen_cwe(rng, n, cfg, base, self.src, self.seed, length)
        if kind == "freq_words_extraction":
            return _gen_fwe(rng, n, cfg, base, self.src, self.seed, length)
        if kind == "qa":
            return _gen_qa(rng, n, cfg, base, self.src, self.seed, index)
        raise ValueError(kind)

    def _fits(self, task, length, index, n):
        text, prefix, outs, extra = self._build(task, length, index, n)
        total = self.count(text + prefix)
        return total + self.tokens_to_generate(task) <= length, (text, prefix, outs, extra, total)

    def haystack_size(self, task: str, length: int) -> int:
        """Largest haystack size (multiple of the task's search step) whose probe record fits ``length``."""
        key = (task, length)
        if key in self._sizes:
            return self._sizes[key]
        step = _step(self.spec, task, length)
        lo, hi = 0, step
        while self._fits(task, length, 0, hi)[0]:  # exponential search for an upper bound
            lo, hi = hi, hi * 2
            if self.spec["tasks"][task]["base"] == "common_words_extraction" and lo >= len(self.src.cwe_vocab()):
                break
            if self.spec["tasks"][task]["base"] == "qa" and lo >= len(self._qa_docs(task)):
                break
        while hi - lo > step:
            mid = (lo + hi) // 2 // step * step
            if mid <= lo:
                break
            lo, hi = (mid, hi) if self._fits(task, length, 0, mid)[0] else (lo, mid)
        self._sizes[key] = max(lo, step if self.spec["tasks"][task]["base"] != "qa" else 1)
        return self._sizes[key]

    def _qa_docs(self, task):
        return (self.src.squad() if self.spec["tasks"][task]["dataset"] == "squad" else self.src.hotpotqa())[0]

    def record(self, task: str, length: int, index: int) -> dict:
        """One record; deterministic in (seed, task, length, index)."""
        n = self.haystack_size(task, length)
        step = _step(self.spec, task, length)
        while True:
            ok, (text, prefix, outs, extra, total) = self._fits(task, length, index, n)
            if ok or n <= step:
                break
            n -= step
        if not ok:
            raise ValueError(
                f"RULER {task} at length {length}: the smallest record has {total} prompt tokens + "
                f"{self.tokens_to_generate(task)} to generate, more than {length}; choose a longer --lengths"
            )
        rec = {
            "task": task,
            "length": length,
            "index": index,
            "id": f"{task}-{length}-{index}",
            "input": text,
            "answer_prefix": prefix,
            "outputs": outs,
            "length_tokens": total,
            "tokens_to_generate": self.tokens_to_generate(task),
            "haystack_size": n,
            "metric": task_metric(task, self.spec),
            "seed": self.seed,
        }
        ctx = extra.get("context")
        # where the question part begins (after the context): used by the sparse-question protocol
        rec["question_start"] = (text.rfind(ctx) + len(ctx)) if ctx and ctx in text else text.rfind("\nQuestion")
        if self.spec["tasks"][task]["base"] == "niah" and outs:
            at = text.find(outs[0])
            rec["token_position_answer"] = self.count(text[:at]) if at >= 0 else -1
        return rec

    def generate(self, task: str, length: int, num_samples: int, start: int = 0) -> list[dict]:
        if task not in self.spec["tasks"]:
            raise ValueError(f"unknown RULER task {task!r}; tasks: {', '.join(TASKS)}")
        return [self.record(task, length, i) for i in range(start, start + num_samples)]


def question_start(rec: dict) -> int:
    """Character offset where the question begins (context ends) in ``rec['input']``."""
    q = rec.get("question_start", -1)
    if q is None or q < 0:
        q = rec["input"].rfind("\n")
    return max(q, 0)
