"""LongBench-v1: official prompts, max new tokens, middle truncation (pred.py), chat-template rule, metrics.

Records: from the HF Hub by name (``datasets.load_dataset("THUDM/LongBench", task, split="test")``)
when online, or a local folder of ``<task>.jsonl`` files in the official layout (``--records-dir``;
default: ``shared/data/longbench/records``, then the packaged 2-record multi_news sample).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from .benchmarks import STOP_EOS, STOP_NEWLINE, Benchmark, encode_text
from .metrics import longbench_sample_score
from .paths import data_file, package_data, shared_data_dir

HF_DATASET = "THUDM/LongBench"


def load_spec(data_dir=None) -> dict:
    return json.loads(data_file("longbench/longbench_tasks.json", "longbench_tasks.json", data_dir).read_text())


def build_prompt(task: str, rec: dict, spec: dict) -> str:
    return spec["tasks"][task]["prompt_template"].format(context=rec["context"], input=rec["input"])


def truncate_middle_text(prompt: str, tokenizer, max_length: int) -> str:
    """pred.py: if the prompt has more than ``max_length`` tokens keep the first and last ``max_length // 2``
    tokens (decoded and re-joined)."""
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    if len(ids) <= max_length:
        return prompt
    half = int(max_length / 2)
    return tokenizer.decode(ids[:half], skip_special_tokens=True) + tokenizer.decode(ids[-half:], skip_special_tokens=True)


def load_records(task: str, records_dir=None, data_dir=None) -> list[dict]:
    candidates = []
    if records_dir:
        candidates.append(Path(records_dir) / f"{task}.jsonl")
    root = shared_data_dir(data_dir)
    if root is not None:
        candidates.append(root / "longbench" / "records" / f"{task}.jsonl")
    for p in candidates:
        if p.exists():
            return [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
    try:  # pragma: no cover - needs network
        from datasets import load_dataset

        return list(load_dataset(HF_DATASET, task, split="test"))
    except Exception as err:
        sample = package_data(f"longbench_{task}_sample2.jsonl")
        if sample.exists():
            return [json.loads(l) for l in sample.read_text().splitlines() if l.strip()]
        raise FileNotFoundError(f"LongBench {task}: no local records ({', '.join(map(str, candidates)) or 'none given'}) "
                                f"and the HF Hub is unreachable ({err})") from err


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
            limit = 31500 if not ctx or ctx > 10 ** 7 else ctx - self.max_new_tokens(rec) - 16
        prompt = truncate_middle_text(prompt, self.tokenizer, limit)
        if self.chat and self.spec["tasks"][task].get("apply_chat_template", True) and getattr(self.tokenizer, "chat_template", None):
            prompt = self.tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                                        add_generation_prompt=True)
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

    def describe(self):
        return {"name": self.name, "tasks": self.tasks, "max_length": self.max_length, "num_samples": self.num_samples,
                "chat": self.chat}
