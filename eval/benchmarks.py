"""Benchmarks as the sweep runner sees them: records, a prompt, a generation budget, a stop rule, a scorer.

A `Benchmark` yields plain-dict records (each with a unique ``id``, a ``task`` and a ``length`` or
``None``). The runner turns ``prompt_text(rec)`` into token ids (bos handled by the model's
`encode_prompt`), generates at most ``max_new_tokens(rec)`` tokens, stops early per ``stop(rec)`` and
calls ``score(rec, prediction)`` -> ``{"score": float in [0, 1], ...}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

STOP_NEWLINE = "newline"  # stop at the first newline that follows some non-blank output (and at EOS)
STOP_EOS = "eos"
STOP_SENTENCE = "sentence"  # as STOP_NEWLINE, and also at the first sentence end after the answer


class Benchmark(ABC):
    """Base class: a benchmark implements `records`, `prompt_text`, `max_new_tokens` and `score`."""

    name = "benchmark"
    #: samples per record and sampling settings (None = greedy, one sample)
    samples: int = 1
    sampling: dict | None = None

    @abstractmethod
    def records(self) -> list[dict]:
        """Every record of the benchmark (plain dicts with ``id``, ``task``, ``length``)."""

    @abstractmethod
    def prompt_text(self, rec: dict) -> str:
        """The prompt of ``rec`` as text."""

    def prompt_ids(self, rec: dict, tokenizer):
        """``[1, T]`` ids; default: `encode_prompt` of `prompt_text` (bos as the model needs)."""
        return encode_text(tokenizer, self.prompt_text(rec))

    def question_start_text(self, rec: dict) -> int | None:
        """Character offset in ``prompt_text`` where the question starts (sparse-question protocol)."""
        return None

    @abstractmethod
    def max_new_tokens(self, rec: dict) -> int:
        """Generation cap for ``rec``."""

    def stop(self, rec: dict) -> str:
        return STOP_EOS

    @abstractmethod
    def score(self, rec: dict, pred: str) -> dict:
        """``{"score": float in [0, 1], ...}`` of the prediction ``pred`` for ``rec``."""

    def describe(self) -> dict:
        return {"name": self.name}

    def data_files(self) -> dict:
        """``{role: path}`` of the local files the records are made from (hashed into the run manifest)."""
        return {}


def encode_text(tokenizer, text: str):
    try:
        from locks_hf.models import encode_prompt
    except ImportError:  # pragma: no cover - models.py is part of the package
        return tokenizer(text, return_tensors="pt").input_ids
    return encode_prompt(tokenizer, text)


@dataclass
class RulerBenchmark(Benchmark):
    """RULER tasks x lengths, generated with the model's tokenizer (see `locks_hf.eval.ruler`)."""

    tokenizer: object
    tasks: list[str]
    lengths: list[int]
    num_samples: int = 10
    seed: int | None = None
    data_dir: str | None = None
    haystack_path: str | None = None
    wordlist_dir: str | None = None
    squad_path: str | None = None
    hotpotqa_path: str | None = None
    stop_at_newline: bool = True
    name: str = "ruler"
    _gen: Any = field(default=None, repr=False)  # the RulerGenerator

    def __post_init__(self):
        from .ruler import RulerGenerator, RulerSources

        src = RulerSources(
            haystack_path=self.haystack_path,
            wordlist_dir=self.wordlist_dir,
            squad_path=self.squad_path,
            hotpotqa_path=self.hotpotqa_path,
            data_dir=self.data_dir,
        )
        self._gen = RulerGenerator(self.tokenizer, src, seed=self.seed, data_dir=self.data_dir)
        unknown = [t for t in self.tasks if t not in self._gen.spec["tasks"]]
        if unknown:
            raise ValueError(f"unknown RULER tasks {unknown}; known: {list(self._gen.spec['tasks'])}")

    def record_keys(self) -> list[tuple]:
        # index-major within a length, so a partial run covers every task about equally
        return [(t, L, i) for L in self.lengths for i in range(self.num_samples) for t in self.tasks]

    def make_record(self, key) -> dict:
        return self._gen.record(*key)

    def records(self) -> list[dict]:
        return [self.make_record(k) for k in self.record_keys()]

    def prompt_text(self, rec):
        return rec["input"] + rec["answer_prefix"]

    def question_start_text(self, rec):
        from .ruler import question_start

        return question_start(rec)

    def max_new_tokens(self, rec):
        return rec["tokens_to_generate"]

    def stop(self, rec):
        """niah*/vt: the answer is one sentence (values/UUIDs/words/names hold no '.'), so stop at its end
        or at a newline; cwe/fwe/qa: at a newline. ``stop_at_newline=False``: EOS / max tokens only."""
        if not self.stop_at_newline:
            return STOP_EOS
        return STOP_SENTENCE if rec["task"].startswith("niah") or rec["task"] == "vt" else STOP_NEWLINE

    def score(self, rec, pred):
        from .ruler import METRICS, postprocess_pred

        return {"score": METRICS[rec["metric"]](postprocess_pred(pred), rec["outputs"])}

    def data_files(self):
        return self._gen.data_files(self.tasks)

    def describe(self):
        return {
            "name": self.name,
            "tasks": self.tasks,
            "lengths": self.lengths,
            "num_samples": self.num_samples,
            "seed": self._gen.seed,
            "haystack": self._gen.src._cache.get("essay_path"),
            "stop": (
                "niah*/vt: first sentence end (.!? after 3+ alphanumerics) or newline after non-blank output; "
                "other tasks: newline after non-blank output; always EOS, a degenerate loop, or max tokens"
            )
            if self.stop_at_newline
            else "EOS or max tokens",
        }
