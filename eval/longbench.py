"""LongBench-v1: official prompts, max new tokens, middle truncation (pred.py), chat-template rule, metrics.

Records: a local folder of ``<task>.jsonl`` files in the official layout (``--records-dir``; else the
data folder's ``longbench/records``), or the HF Hub by name (``datasets.load_dataset("THUDM/LongBench",
task, split="test")``); the packaged 2-record multi_news sample only with ``LOCKS_HF_DATA=none``. A
``--records-dir`` that does not exist, or lacks the task's file, is an error, never another source.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from .benchmarks import STOP_EOS, STOP_NEWLINE, Benchmark, encode_text
from .jsonl import InputPathMissing, read_json, read_jsonl
from .metrics import longbench_sample_score
from .paths import data_file, package_data, shared_data_dir

HF_DATASET = "THUDM/LongBench"

logger = logging.getLogger(__name__)


def load_spec(data_dir=None) -> dict:
    return read_json(data_file("longbench/longbench_tasks.json", "longbench_tasks.json", data_dir))


def build_prompt(task: str, rec: dict, spec: dict) -> str:
    return spec["tasks"][task]["prompt_template"].format(context=rec["context"], input=rec["input"])


def truncate_middle_text(prompt: str, tokenizer, max_length: int) -> str:
    """pred.py: if the prompt has more than ``max_length`` tokens keep the first and last ``max_length // 2``
    tokens (decoded and re-joined)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(
        ids[-half:], skip_special_tokens=True
    )


def _hub_records(task: str) -> list[dict]:  # pragma: no cover - needs network
    from datasets import load_dataset

    return list(load_dataset(HF_DATASET, task, split="test"))


def samples_only() -> bool:
    """``LOCKS_HF_DATA=none``: the user asked for the packaged samples (tests, smoke runs)."""
    return os.environ.get("LOCKS_HF_DATA", "").lower() == "none"


def _record_candidates(task: str, records_dir=None, data_dir=None) -> list[Path]:
    """Where ``<task>.jsonl`` may be: only ``records_dir`` when the user named one (which must exist),
    else the data folder's ``longbench/records``."""
    if records_dir:
        if not Path(records_dir).is_dir():
            raise InputPathMissing(
                f"--records-dir {records_dir}: no such folder; check the path, or leave "
                "--records-dir out for the data folder's records or the HF Hub"
            )
        return [Path(records_dir) / f"{task}.jsonl"]
    root = shared_data_dir(data_dir)
    return [] if root is None else [root / "longbench" / "records" / f"{task}.jsonl"]


def local_records_file(task: str, records_dir=None, data_dir=None) -> Path | None:
    """The local ``<task>.jsonl`` the records are read from, or ``None`` (the HF Hub's); a named
    ``records_dir`` without the task's file is an error (it would otherwise fall through to the Hub)."""
    found = next((p for p in _record_candidates(task, records_dir, data_dir) if p.exists()), None)
    if found is None and records_dir:
        raise InputPathMissing(
            f"--records-dir {records_dir}: no {task}.jsonl (LongBench {task}) in it; name the "
            "folder that holds it, or leave --records-dir out for the HF Hub"
        )
    return found


FIX = "fix or remove that line, or download the file again"


def load_records(task: str, records_dir=None, data_dir=None) -> list[dict]:
    """The test records of ``task``: ``records_dir/<task>.jsonl``, the data folder's, else the HF Hub.

    The packaged 2-record sample is used only when asked for (``LOCKS_HF_DATA=none``), never as a
    silent stand-in for a missing dataset.
    """
    local = local_records_file(task, records_dir, data_dir)
    if local is not None:
        return read_jsonl(local, fix=FIX)
    candidates = _record_candidates(task, records_dir, data_dir)
    sample = package_data(f"longbench_{task}_sample2.jsonl")
    if samples_only():
        if not sample.exists():
            raise FileNotFoundError(f"LongBench {task}: no packaged sample ({sample.name}); unset LOCKS_HF_DATA=none")
        logger.warning("LongBench %s: the packaged %s (LOCKS_HF_DATA=none), not the dataset", task, sample.name)
        return read_jsonl(sample, fix=FIX)
    try:
        return _hub_records(task)
    except Exception as err:
        raise FileNotFoundError(
            f"LongBench {task}: no local records ({', '.join(map(str, candidates)) or 'none given'}) and the HF Hub "
            f"is unreachable ({type(err).__name__}: {err}). Pass --records-dir <folder of <task>.jsonl> or --data-dir, "
            "or set LOCKS_HF_DATA=none to run the packaged 2-record sample (a smoke test, not the benchmark)"
        ) from err


@dataclass
class LongBenchBenchmark(Benchmark):
    tokenizer: object
    tasks: list[str]
    max_length: int | None = None  # the model's prompt budget (pred.py model2maxlen); default: model context - max_new
    num_samples: int | None = None
    records_dir: str | None = None
    data_dir: str | None = None
    chat: bool = False  # apply the tokenizer's chat template where LongBench does (instruction models)
    name: str = "longbench"

    def __post_init__(self):
        self.spec = load_spec(self.data_dir)
        bad = [t for t in self.tasks if t not in self.spec["tasks"]]
        if bad:
            raise ValueError(f"unknown LongBench tasks {bad}")
        for task in self.tasks if self.records_dir else ():  # a named folder: checked before any model work
            local_records_file(task, self.records_dir, self.data_dir)

    def records(self):
        out = []
        for task in self.tasks:
            rows = load_records(task, self.records_dir, self.data_dir)
            if self.num_samples:
                rows = rows[: self.num_samples]
            for i, r in enumerate(rows):
                out.append({**r, "id": f"{task}-{r.get('_id', i)}", "task": task, "length": None, "index": i})
        return out

    def prompt_text(self, rec):
        task = rec["task"]
        prompt = build_prompt(task, rec, self.spec)
        limit = self.max_length
        if limit is None:
            ctx = getattr(self.tokenizer, "model_max_length", None)
            limit = 31500 if not ctx or ctx > 10**7 else ctx - self.max_new_tokens(rec) - 16
        prompt = truncate_middle_text(prompt, self.tokenizer, limit)
        if (
            self.chat
            and self.spec["tasks"][task].get("apply_chat_template", True)
            and getattr(self.tokenizer, "chat_template", None)
        ):
            prompt = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
            )
        return prompt

    def prompt_ids(self, rec, tokenizer):
        text = self.prompt_text(rec)
        if self.chat and getattr(tokenizer, "chat_template", None):
            return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        return encode_text(tokenizer, text)

    def max_new_tokens(self, rec):
        return self.spec["tasks"][rec["task"]]["max_new_tokens"]

    def stop(self, rec):
        return STOP_NEWLINE if rec["task"] == "samsum" else STOP_EOS

    def score(self, rec, pred):
        t = self.spec["tasks"][rec["task"]]
        return {"score": longbench_sample_score(rec["task"], t["metric"], pred, rec["answers"], rec.get("all_classes"))}

    def data_files(self):
        files = {"spec": data_file("longbench/longbench_tasks.json", "longbench_tasks.json", self.data_dir)}
        for task in self.tasks:
            path = local_records_file(task, self.records_dir, self.data_dir)
            if path is None and samples_only():
                path = package_data(f"longbench_{task}_sample2.jsonl")
            if path is not None:  # else the HF Hub's (its revision is not recorded)
                files[f"records_{task}"] = path
        return files

    def describe(self):
        return {
            "name": self.name,
            "tasks": self.tasks,
            "max_length": self.max_length,
            "num_samples": self.num_samples,
            "chat": self.chat,
        }
