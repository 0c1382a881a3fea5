"""AIME 2024/2025 and MATH-500 with avg@k, checked with ``math-verify`` (not string matching).

Prompt: the tokenizer's chat template when it has one (thinking enabled where the template supports
``enable_thinking``), else a plain completion prompt; the instruction asks for a final ``\\boxed{}``.
Sampling (temperature, top_p, k samples per problem) is the same for every arm and the sample seeds
are shared across arms (sample s of a problem starts from the same random stream in every arm).
"""

from __future__ import annotations

from dataclasses import dataclass

from .benchmarks import STOP_EOS, Benchmark
from .jsonl import read_jsonl
from .paths import data_file

INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
DATASETS = {
    "math500": ("math/math500.jsonl", "math500_sample8.jsonl"),
    "aime2024": ("math/aime_2024.jsonl", "aime_2024_sample3.jsonl"),
    "aime2025": ("math/aime_2025.jsonl", None),
}


def load_problems(name: str, data_dir=None) -> list[dict]:
    if name not in DATASETS:
        raise ValueError(f"unknown math dataset {name!r}; known: {', '.join(DATASETS)}")
    rel, sample = DATASETS[name]
    path = data_file(rel, sample, data_dir)
    rows = read_jsonl(path, required=("problem", "answer"), fix="fix or remove that line, or download the file again")
    out = []
    for i, r in enumerate(rows):
        rid = r.get("unique_id") or r.get("id") or str(i)
        out.append(
            {
                "id": f"{name}-{rid}",
                "task": name,
                "length": None,
                "index": i,
                "problem": r["problem"],
                "answer": str(r["answer"]),
            }
        )
    return out


def parse_gold(answer: str):
    from math_verify import parse

    gold = parse(f"${answer}$")
    if not gold:
        gold = parse(f"\\boxed{{{answer}}}")
    return gold


def check_answer(prediction: str, answer: str) -> dict:
    """``{"score": 1.0|0.0, "extracted": str}``: math-verify's ``verify(parse(gold), parse(prediction))``."""
    from math_verify import parse, verify

    gold = parse_gold(answer)
    pred = parse(prediction)
    try:
        ok = bool(verify(gold, pred))
    except Exception:  # pragma: no cover - math-verify guards itself; be safe anyway
        ok = False
    return {"score": float(ok), "extracted": str(pred[1]) if len(pred) > 1 else (str(pred[0]) if pred else "")}


def build_prompt(tokenizer, problem: str, thinking: bool = True) -> tuple[str, bool]:
    """(text, uses_chat_template)."""
    content = f"{problem}\n\n{INSTRUCTION}"
    if getattr(tokenizer, "chat_template", None):
        msgs = [{"role": "user", "content": content}]
        try:
            return tokenizer.apply_chat_template(
                msgs, tokenize=False, add_generation_prompt=True, enable_thinking=thinking
            ), True
        except TypeError:
            return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True), True
    return f"Problem: {problem}\n{INSTRUCTION}\n\nSolution:", False


@dataclass
class MathBenchmark(Benchmark):
    tokenizer: object
    tasks: list[str]
    num_samples: int | None = None  # problems per dataset
    k: int = 1  # samples per problem (avg@k)
    temperature: float = 0.6
    top_p: float = 0.95
    max_new_tokens_cap: int = 4096
    thinking: bool = True
    data_dir: str | None = None
    name: str = "math"

    def __init__(
        self,
        tokenizer,
        tasks,
        num_samples=None,
        k=1,
        temperature=0.6,
        top_p=0.95,
        max_new_tokens=4096,
        thinking=True,
        data_dir=None,
    ):
        self.tokenizer, self.tasks, self.num_samples, self.k = tokenizer, list(tasks), num_samples, int(k)
        self.temperature, self.top_p, self.max_new_tokens_cap = temperature, top_p, int(max_new_tokens)
        self.thinking, self.data_dir = thinking, data_dir
        self.samples = self.k
        self.sampling = (
            None
            if self.temperature == 0
            else {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p, "top_k": 0}
        )

    def records(self):
        out = []
        for t in self.tasks:
            rows = load_problems(t, self.data_dir)
            out += rows[: self.num_samples] if self.num_samples else rows
        return out

    def prompt_text(self, rec):
        return build_prompt(self.tokenizer, rec["problem"], self.thinking)[0]

    def prompt_ids(self, rec, tokenizer):
        text, chat = build_prompt(tokenizer, rec["problem"], self.thinking)
        if chat:
            return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        from .benchmarks import encode_text

        return encode_text(tokenizer, text)

    def max_new_tokens(self, rec):
        return self.max_new_tokens_cap

    def stop(self, rec):
        return STOP_EOS

    def score(self, rec, pred):
        return check_answer(pred, rec["answer"])

    def describe(self):
        return {
            "name": self.name,
            "tasks": self.tasks,
            "num_samples": self.num_samples,
            "k": self.k,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "max_new_tokens": self.max_new_tokens_cap,
            "thinking": self.thinking,
            "checker": "math-verify parse/verify",
        }
