"""InfiniteBench: templates, scorers (`locks_hf.eval.metrics`), local regeneration of passkey /
number_string / kv_retrieval at any length, and scoring of published prediction files.

Records: local ``<task>.jsonl`` files in the official layout (``id, context, input, answer, options``),
e.g. downloaded from the HF dataset ``xinrongzhang2022/InfiniteBench``, or loaded from the Hub by name
when ``datasets`` and a network are available; passkey / number_string / kv_retrieval are regenerated
locally (`regenerate`) to a target token length with the model's tokenizer.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from .benchmarks import STOP_EOS, Benchmark, encode_text
from .jsonl import InputFileError, InputPathMissing, read_json, read_jsonl, resolve
from .metrics import infinitebench_score_one
from .paths import data_file

REGENERATED = ("passkey", "number_string", "kv_retrieval")
HF_DATASET = "xinrongzhang2022/InfiniteBench"


def load_spec(data_dir=None) -> dict:
    return read_json(data_file("infinitebench/infinitebench_tasks.json", "infinitebench_tasks.json", data_dir))


# -------------------------------------------------------------------------------------------------
# prompts (src/prompt.py, "open model" templates as used for yi-34b-200k / yarn-mistral)
def build_prompt(task: str, rec: dict, spec: dict, template: str = "template_open_models") -> str:
    t = spec["tasks"][task][template]
    ctx, inp = rec.get("context", ""), rec.get("input", "")
    if task == "math_find":
        m = re.search(r"The .+ of", inp)
        target = m.group(0)[4:-3].lower() if m else ""
        prefix = f"What is {target} in the following list?"
        return t.format(prefix=prefix, context=ctx, input=inp)
    if task == "code_run":
        calls = re.findall(r"func_[0-9]+\(\-?[0-9]+\)", inp)
        func_call = calls[0] if calls else ""
        return t.format(func=func_call.split("(")[0], func_call=func_call, context=ctx)
    if task in ("longbook_choice_eng", "code_debug"):
        opts = rec.get("options") or ["", "", "", ""]
        fields = dict(
            context=ctx, question=inp, input=inp, OPTION_A=opts[0], OPTION_B=opts[1], OPTION_C=opts[2], OPTION_D=opts[3]
        )
        return t.format(**fields)
    if task in ("longbook_qa_eng", "longbook_qa_chn"):
        return t.format(context=ctx, question=inp, input=inp)
    return t.format(context=ctx, input=inp, question=inp)


def truncate_middle(ids: list[int], max_length: int) -> list[int]:
    """Keep the first and last ``max_length // 2`` tokens (InfiniteBench / LongBench middle truncation)."""
    if len(ids) <= max_length:
        return ids
    half = max_length // 2
    return ids[:half] + ids[-half:]


# -------------------------------------------------------------------------------------------------
# regeneration (data/construct_synthetic_dataset.py, lost-in-the-middle kv data)
def _passkey_key(rng: random.Random) -> str:
    return "".join(str(rng.randint(0, 9)) for _ in range(5))


def _number_string_key(rng: random.Random) -> str:
    keys = [str(rng.randint(0, 9)) for _ in range(5)]
    for k in range(5):
        pos = rng.randint(0, 5 + k - 1)
        keys.insert(pos, keys[pos])
    return "".join(keys)


def regenerate(
    task: str,
    tokenizer,
    length: int,
    num_samples: int,
    seed: int = 42,
    spec: dict | None = None,
    template: str = "template_open_models",
) -> list[dict]:
    """Records of ``task`` whose full prompt is at most ``length`` tokens (plus the answer budget).

    passkey / number_string: noise lines around the needle at evenly spread depths (record i at depth
    i / (num_samples - 1)); kv_retrieval: a JSON object of UUID pairs, the queried key at depth i.
    """
    spec = spec or load_spec()
    if task not in REGENERATED:
        raise ValueError(f"{task} cannot be regenerated; only {REGENERATED}")
    count = lambda s: len(tokenizer.encode(s, add_special_tokens=False))
    recipe = spec["regeneration_recipes"][task]
    max_new = spec["tasks"][task]["max_new_tokens"]
    out = []
    for i in range(num_samples):
        rng = random.Random(f"{seed}-{task}-{length}-{i}")
        depth = i / max(num_samples - 1, 1)
        if task in ("passkey", "number_string"):
            key = _passkey_key(rng) if task == "passkey" else _number_string_key(rng)
            noise = recipe["noise_line"]
            if not noise.endswith("\n"):  # number_string's recipe says "same as passkey"
                noise = spec["regeneration_recipes"]["passkey"]["noise_line"]
            needle = recipe["needle_line"].format(key=key)

            def make(n):
                j = round(n * depth)
                return {"context": noise * j + needle + noise * (n - j), "input": recipe["question"], "answer": [key]}
        else:
            pairs = [
                (
                    str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                    str(uuid.UUID(int=rng.getrandbits(128), version=4)),
                )
                for _ in range(4000)
            ]

            def make(n):
                n = max(n, 1)
                q = min(int(depth * n), n - 1)
                ctx = "JSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs[:n]) + "}"
                return {
                    "context": ctx,
                    "input": f'\nKey: "{pairs[q][0]}"\nThe value associated with the specified key is: ',
                    "answer": pairs[q][1],
                }

        lo, hi = 1, 8
        while count(build_prompt(task, make(hi), spec, template)) + max_new <= length and hi < 4000:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (
                (mid, hi) if count(build_prompt(task, make(mid), spec, template)) + max_new <= length else (lo, mid)
            )
        rec = make(lo)
        rec.update(
            {
                "id": f"{task}-{length}-{i}",
                "task": task,
                "length": length,
                "index": i,
                "options": [],
                "depth": round(depth, 4),
                "units": lo,
            }
        )
        out.append(rec)
    return out


# -------------------------------------------------------------------------------------------------
# scoring published prediction files
def score_prediction_file(task: str, path, model_name: str = "") -> tuple[float, int]:
    """Mean score x100 of a ``preds_<task>.jsonl`` or ``.jsonl.gz`` (fields prediction/pred and ground_truth/label)."""
    fix = "each line must be a JSON object with prediction (or pred) and ground_truth (or label); fix the file"
    rows = read_jsonl(path, fix=fix)
    if not rows:
        raise InputFileError(
            f"{resolve(path)}: no predictions in it (an empty file): remove it, or write its predictions again"
        )
    scores = []
    for number, r in enumerate(rows, 1):
        pred = r.get("prediction", r.get("pred"))
        label = r.get("ground_truth", r.get("label"))
        if pred is None or label is None:
            raise InputFileError(
                f"{resolve(path)}: row {number} has no {'prediction' if pred is None else 'ground_truth'}: {fix}"
            )
        scores.append(infinitebench_score_one(task, pred, label, model_name))
    return 100 * sum(scores) / len(scores), len(scores)


def score_prediction_dir(folder, data_dir=None, model_name: str | None = None) -> list[dict]:
    """One row per task whose ``preds_<task>.jsonl[.gz]`` is in ``folder``: score, n and the README's figure.
    A folder without any is an error (a misspelled folder would otherwise print an empty table)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputPathMissing(f"--predictions {folder}: no such folder; check the path")
    model_name = model_name if model_name is not None else folder.name
    spec = load_spec(data_dir)
    readme_names = {"yi-34b-200k": "Yi-34B-200K", "gpt4": "GPT-4", "yarn-mistral": "YaRN-Mistral-7B"}
    reported = spec["reported_results_readme_percent"].get(readme_names.get(model_name, model_name), {})
    table = []
    for task in spec["tasks"]:
        path = resolve(folder / f"preds_{task}.jsonl")  # or preds_<task>.jsonl.gz
        if not path.exists():
            continue
        score, n = score_prediction_file(task, path, model_name)
        table.append({"task": task, "n": n, "score": score, "reported": reported.get(task)})
    if not table:
        raise InputPathMissing(
            f"--predictions {folder}: no preds_<task>.jsonl[.gz] of any InfiniteBench task in it "
            f"(tasks: {', '.join(spec['tasks'])}); name the folder that holds them"
        )
    return table


def matches_reported(score: float, reported) -> bool:
    """README figures are 2-decimal percentages or '<5'."""
    if isinstance(reported, str) and reported.startswith("<"):
        return score < float(reported[1:])
    return abs(score - float(reported)) < 0.005 + 1e-9


# -------------------------------------------------------------------------------------------------
@dataclass
class InfiniteBenchBenchmark(Benchmark):
    tokenizer: object
    tasks: list[str]
    lengths: list[int] = field(default_factory=lambda: [4096])
    num_samples: int = 10
    seed: int | None = None
    records_dir: str | None = None
    data_dir: str | None = None
    max_length: int | None = None  # middle truncation of other tasks' prompts (default 128K)
    template: str = "template_open_models"
    name: str = "infinitebench"

    def __post_init__(self):
        if self.records_dir and not Path(self.records_dir).is_dir():
            raise InputPathMissing(
                f"--records-dir {self.records_dir}: no such folder; check the path, or leave "
                "--records-dir out for the HF Hub"
            )
        self.spec = load_spec(self.data_dir)

    def records(self):
        out = []
        for task in self.tasks:
            if task in REGENERATED and not self.records_dir:
                for L in self.lengths:
                    out += regenerate(
                        task, self.tokenizer, L, self.num_samples, self.seed or 42, self.spec, self.template
                    )
                continue
            rows = self._load(task)[: self.num_samples]
            for r in rows:
                out.append({**r, "id": f"{task}-{r['id']}", "task": task, "length": None})
        return out

    def _load(self, task):
        if self.records_dir:  # a folder the user named: its file or an error, never the Hub instead
            path = Path(self.records_dir) / self.spec["tasks"][task]["file"]
            if not resolve(path).exists():
                raise InputPathMissing(
                    f"--records-dir {self.records_dir}: no {path.name} (InfiniteBench {task}) in "
                    "it; name the folder that holds it, or leave --records-dir out for the HF Hub"
                )
            return read_jsonl(path, fix="fix or remove that line, or download the file again")
        try:  # pragma: no cover - needs network
            from datasets import load_dataset

            return list(load_dataset(HF_DATASET, data_files={"test": self.spec["tasks"][task]["file"]}, split="test"))
        except Exception as err:
            raise FileNotFoundError(
                f"InfiniteBench {task}: no --records-dir and the HF Hub is unreachable ({err})"
            ) from err

    def prompt_text(self, rec):
        return build_prompt(rec["task"], rec, self.spec, self.template)

    def prompt_ids(self, rec, tokenizer):
        import torch

        ids = encode_text(tokenizer, self.prompt_text(rec))
        limit = self.max_length or 128 * 1024
        if ids.shape[1] > limit:
            ids = torch.tensor([truncate_middle(ids[0].tolist(), limit)])
        return ids

    def max_new_tokens(self, rec):
        return self.spec["tasks"][rec["task"]]["max_new_tokens"]

    def stop(self, rec):
        return STOP_EOS

    def score(self, rec, pred):
        return {"score": infinitebench_score_one(rec["task"], pred, rec["answer"])}

    def describe(self):
        return {
            "name": self.name,
            "tasks": self.tasks,
            "lengths": self.lengths,
            "num_samples": self.num_samples,
            "template": self.template,
        }
