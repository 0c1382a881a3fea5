"""The sweep runner: every record prefilled once (dense), decoded by every arm from a fork of that cache.

Protocol (written into ``config.json`` and the reports):

* ``dense-question`` (default, the paper's): the whole prompt (context + question) is prefilled densely
  with one ``model(prompt_ids, past_key_values=cache)``; the first answer token is the greedy argmax
  of the prefill logits and is shared by every arm; then each arm decodes from
  ``cache.fork(arm.config)`` with ``model.generate(cat(prompt_ids, first), ...)`` (generate feeds only
  the token not yet cached).
* ``sparse-question``: only the context is prefilled densely; each arm then feeds the question tokens
  one at a time through its own sparse decode steps before generating.
* Sampled benchmarks (``samples > 1``, e.g. AIME avg@k): the prompt minus its last token is prefilled
  once; each arm and sample generates from a fork (the last prompt token is the first decode step).

Results folder (resumable; a finished (record, arm[, sample]) is never run again)::

    <run>/config.json                      what was run (model, arms, benchmark, protocol)
    <run>/records/<task>.jsonl             the records (generated once; identical for all arms/shards)
    <run>/predictions/shard-<i>-of-<n>.jsonl  one line per (record, arm, sample) as it finishes
    <run>/results.jsonl, scores.csv        merged (`merge`): identical for any sharding
    <run>/timing.csv                       wall time per arm (sum over its records)
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import re
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from .arms import Arm
from .benchmarks import STOP_NEWLINE, STOP_SENTENCE, Benchmark
from .jsonl import end_last_line, read_json, read_jsonl
from .manifest import build_manifest, check_or_write

logger = logging.getLogger(__name__)

#: What to do about a damaged config.json of a run folder (it is written atomically: a tool or a copy broke it).
CONFIG_FIX = "restore the run folder's config.json from a copy, or use another --out folder"

VOLATILE = ("seconds", "prefill_seconds", "host", "shard")
ENGINES = ("eager", "static")  # see SweepRunner


# ----------------------------------------------------------------------------------------------------
# stopping
# a newline after some letter or digit of output (a leading newline, or one right after ":", does not stop)
_NEWLINE_END = re.compile(r"[A-Za-z0-9][^\n]*\n")
# a sentence end: . ! or ? right after 3+ letters/digits (not a list number "1." nor "10."), then
# whitespace or the end of the text so far
_SENTENCE_END = re.compile(r"[A-Za-z0-9]{3}[.!?](?=\s|$)")


def stop_position(text: str, stop: str) -> int | None:
    """Where the answer ends under ``stop`` (index just past it), or None if it has not ended yet."""
    ends = []
    if stop in (STOP_NEWLINE, STOP_SENTENCE):
        m = _NEWLINE_END.search(text)
        if m:
            ends.append(m.end() - 1)
    if stop == STOP_SENTENCE:
        m = _SENTENCE_END.search(text)
        if m:
            ends.append(m.end())
    return min(ends) if ends else None


class _StopAtNewline:
    """Stop once the answer ended under the task's rule (`stop_position`) or the text runs into a loop
    (`looping`); per row."""

    def __init__(self, tokenizer, start: int, loops: bool = True, stop: str = STOP_NEWLINE):
        self.tokenizer, self.start, self.loops, self.stop = tokenizer, start, loops, stop

    def __call__(self, input_ids, scores, **kwargs):
        done = [answer_ended(self.tokenizer.decode(row[self.start:], skip_special_tokens=True), self.stop, self.loops)
                for row in input_ids]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def answer_ended(text: str, stop: str, loops: bool = True) -> bool:
    """The answer ``text`` ended under ``stop`` (`stop_position`) or runs into a loop (`looping`)."""
    return stop_position(text, stop) is not None or (loops and looping(text))


def looping(text: str) -> bool:
    """True when ``text`` ends in a unit repeated back to back: >= 3 times for units of 4+ characters
    (e.g. ``"4380047, "`` x3), >= 6 times for 2-3 characters, >= 10 times for one character; checked
    on the text and on the text with every digit run replaced by ``#`` (a counting run-on such as
    ``"1. 2. 3. 4. 5. 6."`` or a seventh number in a list of numbers). A 7-digit number, a UUID or a
    list of up to 5 numbers never triggers it; a degenerate run-on stops instead of filling the cap."""
    return _repeats(text.rstrip()) or _repeats(re.sub(r"\d+", "#", text).rstrip())


def _repeats(t: str) -> bool:
    for unit in range(1, 41):
        reps = 10 if unit == 1 else 6 if unit <= 3 else 3
        if len(t) < unit * reps:
            continue
        tail = t[-unit:]
        if tail.strip() and t.endswith(tail * reps):
            return True
    return False


def loop_cut(text: str) -> str:
    """The shortest prefix of ``text`` at which `looping` fires (what the stop rule would have kept)."""
    for end in range(1, len(text) + 1):
        if looping(text[:end]):
            return text[:end]
    return text


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids


def _cut_at_stop(text: str, stop: str) -> str:
    end = stop_position(text, stop)
    return text if end is None else text[:end]


# ----------------------------------------------------------------------------------------------------
# shards and layout
def parse_shard(shard: str | None) -> tuple[int, int]:
    """``"i/n"`` -> (i, n); ``None`` -> from accelerate/torchrun env (RANK, WORLD_SIZE) or (0, 1)."""
    if shard:
        i, _, n = str(shard).partition("/")
        if not (i.strip().isdigit() and n.strip().isdigit()) or not 0 <= int(i) < int(n):
            raise ValueError(f"--shard {shard!r}: expected i/n with 0 <= i < n, e.g. 0/2")
        return int(i), int(n)
    n = int(os.environ.get("WORLD_SIZE", "1"))
    i = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))
    return i, n


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", str(name))


def _rows(path: Path, required: tuple[str, ...] = ("id",), appended: bool = False) -> list[dict]:
    """The rows of a JSON-lines file of the run folder (none when it is not there yet), read by the
    harness's one reader (`read_jsonl`: a torn last line of a file appended to is dropped, anything
    else that does not parse is an error naming file:line)."""
    if not path.exists():
        return []
    fix = ("remove that line (a prediction's work is redone on resume), or use another --out folder" if appended else
           "that file was not written whole by locks-hf-eval: delete it (it is made again) or use another --out folder")
    return read_jsonl(path, required=required, appended=appended, fix=fix)


#: Keys every prediction row has (`merge` reads them all).
PREDICTION_KEYS = ("id", "arm", "task", "length", "family", "budget", "selector")


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def load_or_make_records(run_dir: Path, bench: Benchmark, keys=None) -> list[dict]:
    """Records in a fixed order, cached under ``records/`` so every arm, shard and resume sees the same."""
    rdir = run_dir / "records"
    if hasattr(bench, "record_keys"):
        keys = bench.record_keys()
        by_task: dict[str, list] = defaultdict(list)
        for k in keys:
            by_task[f"{k[0]}-{k[1]}" if len(k) > 2 else str(k[0])].append(k)
        out = {}
        for group, gkeys in by_task.items():
            path = rdir / f"{_safe(group)}.jsonl"
            cached = {r["id"]: r for r in _rows(path)}
            recs = []
            for k in gkeys:
                rid = f"{k[0]}-{k[1]}-{k[2]}"
                recs.append(cached[rid] if rid in cached else bench.make_record(k))
            if any(r["id"] not in cached for r in recs):
                merged = {**cached, **{r["id"]: r for r in recs}}
                _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in merged.values()))
            out.update({r["id"]: r for r in recs})
        return [out[f"{k[0]}-{k[1]}-{k[2]}"] for k in keys]
    recs = bench.records()
    path = rdir / f"{_safe(bench.name)}.jsonl"
    if not path.exists():
        _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
    return recs


# ----------------------------------------------------------------------------------------------------
class SweepRunner:
    """Run ``arms`` over ``bench`` with ``model``/``tokenizer`` into ``run_dir`` (resumable, shardable)."""

    def __init__(self, model, tokenizer, bench: Benchmark, arms: list[Arm], run_dir, *, protocol: str = "dense-question",
                 shard: str | None = None, model_name: str = "model", progress: bool = True, limit: int | None = None,
                 max_new_tokens: int | None = None, seed: int = 0, not_run=(), engine: str = "eager",
                 batch_rows: int = 8, step: str = "auto", allow_manifest_change: bool = False):
        if protocol not in ("dense-question", "sparse-question"):
            raise ValueError("protocol must be 'dense-question' or 'sparse-question'")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine, self.batch_rows, self.step = engine, batch_rows, step
        #: arms the static engine decodes; the rest (token-level baselines, shared-basis controls,
        #: ``min_context``) take the eager path, with a dense prefill of their own per record
        self.static_arms: list[Arm] = []
        if engine == "static":
            from .engine import runs_static

            self.static_arms = [a for a in arms if runs_static(a.config)]
            eager = [a.name for a in arms if not runs_static(a.config)]
            if eager:
                logger.info("--engine static: arms %s decode on the eager path (dynamic cache, reference "
                            "selection), one extra dense prefill per record for them", eager)
        #: static engine: one dict per (batch, arm) decoded (rows, steps, tokens, seconds, warm-up, prefill)
        self.arm_runs: list[dict] = []
        self.model, self.tokenizer, self.bench, self.arms = model, tokenizer, bench, arms
        self.run_dir = Path(run_dir)
        self.protocol = protocol
        self.shard = parse_shard(shard)
        self.model_name, self.progress, self.limit = model_name, progress, limit
        self.max_new_cap, self.seed = max_new_tokens, seed
        self.allow_manifest_change = allow_manifest_change  # resume although the manifest differs
        self.not_run = list(not_run)  # (arm, reason): arms whose method does not fit their budget
        self.device = next(model.parameters()).device

    @property
    def _sampled(self) -> bool:
        """Records are sampled (k > 1 samples, or sampling settings even for one): `plan` prefills all
        but the last prompt token, and the config says so."""
        return self.bench.samples > 1 or self.bench.sampling is not None

    # -- config ------------------------------------------------------------------------------------
    def config(self) -> dict:
        import locks_hf

        return {
            "model": self.model_name,
            "benchmark": self.bench.describe(),
            "arms": [{"name": a.name, "family": a.family, "budget": a.budget, "selector": a.selector,
                      "config": {k: getattr(a.config, k) for k in a.config.__dataclass_fields__}} for a in self.arms],
            "arms_not_run": [{"name": name, "reason": reason} for name, reason in self.not_run],
            "protocol": "prefill-all-but-last-token (sampled)" if self._sampled else self.protocol,
            "protocol_text": PROTOCOL_TEXT["sampled" if self._sampled else self.protocol],
            "samples": self.bench.samples, "sampling": self.bench.sampling,
            # greedy tokens are the same on both engines; sampled ones come from different random streams
            "engine": self.engine,
            "max_new_tokens_cap": self.max_new_cap,
            "locks_hf_version": getattr(locks_hf, "__version__", "?"), "torch": torch.__version__,
        }

    def _write_config(self) -> None:
        path = self.run_dir / "config.json"
        cfg = self.config()
        if path.exists():
            old = read_json(path, fix=CONFIG_FIX)
            if old.get("model") != cfg["model"] or old.get("protocol") != cfg["protocol"]:
                raise ValueError(f"{path} holds a run of model={old.get('model')} protocol={old.get('protocol')}; "
                                 "use another --out folder")
            if cfg["sampling"] and old.get("engine", "eager") != cfg["engine"]:
                raise ValueError(f"{path} holds a sampled run of --engine {old.get('engine', 'eager')}: the engines "
                                 "draw different samples; resume with that engine or use another --out folder")
            known = {a["name"] for a in old.get("arms", [])}
            cfg["arms"] = old["arms"] + [a for a in cfg["arms"] if a["name"] not in known]
            if old.get("benchmark") != cfg["benchmark"]:
                cfg["benchmark_history"] = old.get("benchmark_history", [old.get("benchmark")])
        _write_atomic(path, json.dumps(cfg, indent=1) + "\n")

    # -- main loop ---------------------------------------------------------------------------------
    def done_keys(self) -> set[tuple]:
        done = set()
        for path in (self.run_dir / "predictions").glob("shard-*.jsonl"):
            for r in _rows(path, PREDICTION_KEYS, appended=True):
                done.add((r["id"], r["arm"], r.get("sample", 0)))
        return done

    def run(self) -> Path:
        from tqdm.auto import tqdm

        i, n = self.shard
        self.run_dir.mkdir(parents=True, exist_ok=True)
        seeds = {"sweep": self.seed, "benchmark": self.bench.describe().get("seed")}
        check_or_write(self.run_dir, build_manifest(self.bench.data_files(), seeds),
                       allow_change=self.allow_manifest_change, write=_write_atomic)
        if i == 0:
            self._write_config()
        records = load_or_make_records(self.run_dir, self.bench)
        if self.limit:
            records = records[: self.limit]
        if self.engine == "static":  # batches are planned over all records: a shard takes whole batches
            from .batched import plan_batches

            batches = plan_batches(self, records)
            mine = [r for j, batch in enumerate(batches) if j % n == i for r, _ in batch]
            if not self.static_arms:
                batches = []
        else:
            mine = [r for j, r in enumerate(records) if j % n == i]
        done = self.done_keys()
        out_path = self.run_dir / "predictions" / f"shard-{i}-of-{n}.jsonl"
        out_path.parent.mkdir(parents=True, exist_ok=True)
        samples = self.bench.samples
        todo = [(r, [(a, s) for a in self.arms for s in range(samples) if (r["id"], a.name, s) not in done]) for r in mine]
        todo = [(r, w) for r, w in todo if w]
        skipped = len(mine) - len(todo)
        bar = tqdm(total=sum(len(w) for _, w in todo), desc=f"{self.bench.name} shard {i}/{n}", unit="gen",
                   disable=not self.progress, dynamic_ncols=True, file=sys.stderr)
        if skipped:
            bar.write(f"resume: {skipped} of {len(mine)} records already done in {self.run_dir}")
        end_last_line(out_path)  # a line torn by a kill is cut off: only a file's last line can be torn
        if self.engine == "static":
            from itertools import chain

            from .batched import run_batches

            static = {id(a) for a in self.static_arms}
            work = {rec["id"]: [(a, s) for a, s in w if id(a) in static] for rec, w in todo}
            eager = [(rec, [(a, s) for a, s in w if id(a) not in static]) for rec, w in todo]
            results = chain(run_batches(self, [b for j, b in enumerate(batches) if j % n == i], work, bar),
                            (row for rec, w in eager if w for row in self._run_record(rec, w, bar)))
        else:
            results = (row for rec, work in todo for row in self._run_record(rec, work, bar))
        with open(out_path, "a") as f:
            for row in results:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
                f.flush()
        bar.close()
        return out_path

    def _score_context(self, rec: dict, prefilled: torch.Tensor, base, arms) -> None:
        """Once per record, the prefill-time work of the arms' methods that need one (KVzip's
        reconstruction passes), kept on ``base`` for every fork."""
        from locks_hf.baselines import POLICIES

        if not any(getattr(POLICIES.get(arm.selector), "needs_context_scores", False) for arm in arms):
            return
        from locks_hf.baselines.kvzip import score_context

        n = _context_length(self.bench, rec, self.tokenizer, prefilled.shape[1])
        score_context(self.model, self.tokenizer, base, prefilled[:, :n])

    def plan(self, rec: dict) -> RecordPlan:
        """How ``rec`` is run: its prompt ids, the prefilled part, the generation cap, the stop rule."""
        tok = self.tokenizer
        ids = self.bench.prompt_ids(rec, tok)
        T = ids.shape[1]
        max_new = self.bench.max_new_tokens(rec)
        if self.max_new_cap:
            max_new = min(max_new, self.max_new_cap)
        sampled = self._sampled
        split = T
        if sampled:
            split = T - 1
        elif self.protocol == "sparse-question":
            split = min(_context_length(self.bench, rec, tok, T), T - 1)
        return RecordPlan(ids, split, max_new, self.bench.stop(rec), sampled)

    def result_row(self, rec: dict, arm: Arm, sample: int, plan: RecordPlan, new: list[int], frac: float,
                   traffic: dict | None, seconds: float, prefill_seconds: float) -> dict:
        """The prediction line of (``rec``, ``arm``, ``sample``) from its new tokens (as generated), its
        attended fraction and decode traffic (`LocksCache.decode_traffic`)."""
        traffic = traffic or {}
        eos = _eos_ids(self.model, self.tokenizer)
        n_new = len(new)
        while new and new[-1] in eos:
            new = new[:-1]
        raw = self.tokenizer.decode(new, skip_special_tokens=True)
        pred = _cut_at_stop(raw, plan.stop)
        metrics = self.bench.score(rec, pred)
        return {"id": rec["id"], "task": rec.get("task", self.bench.name), "length": rec.get("length"),
                "arm": arm.name, "family": arm.family, "budget": arm.budget, "selector": arm.selector,
                "sample": sample, "prompt_tokens": plan.T, "new_tokens": n_new, "pred": pred,
                **metrics, "attended_fraction": None if math.isnan(frac) else round(frac, 6),
                # per (layer, KV head) and decode step: tokens whose K/V were read, and bytes read
                # (those K/V plus the estimation's reads: summaries, reduced keys, ...)
                "attended_tokens": _rounded(traffic.get("attended_tokens")),
                "read_bytes": _rounded(traffic.get("read_bytes")),
                "seconds": round(seconds, 3), "prefill_seconds": round(prefill_seconds, 3),
                "shard": f"{self.shard[0]}/{self.shard[1]}"}

    @torch.no_grad()
    def _run_record(self, rec: dict, work, bar):
        from locks_hf import LocksCache, LocksConfig

        model, tok = self.model, self.tokenizer
        plan = self.plan(rec)
        ids, T, split, max_new, stop, sampled = (plan.ids.to(self.device), plan.T, plan.split, plan.max_new,
                                                 plan.stop, plan.sampled)

        t0 = time.perf_counter()
        # the eager engine: dynamic caches, as this runner has always decoded (one fork per arm)
        base = LocksCache(model.config, LocksConfig(selector="full"), layout="dynamic")
        # only the last position's logits (the first answer token): the LM head over every prompt
        # position would be most of a prefill's work and memory (Gemma 3: 262K-token vocabulary)
        out = model(ids[:, :split], past_key_values=base, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        self._score_context(rec, ids[:, :split], base, [arm for arm, _ in work])
        prefill_s = time.perf_counter() - t0
        eos = _eos_ids(model, tok)

        for arm, s in work:
            t1 = time.perf_counter()
            cache = base.fork(arm.config)
            cache.expect_new_tokens(max_new)
            crit = []
            gen_kwargs = dict(max_new_tokens=None, do_sample=False, pad_token_id=_pad_id(tok, eos))
            if sampled:
                inputs = ids
                gen_kwargs.update(self.bench.sampling or {}, do_sample=bool(self.bench.sampling))
                gen_kwargs["max_new_tokens"] = max_new
                torch.manual_seed(_stable_seed(self.seed, rec["id"], s))  # same stream for every arm
                start = T
            elif self.protocol == "sparse-question" and split < T:
                for t in range(split, T - 1):  # question tokens, one sparse decode step each
                    model(ids[:, t : t + 1], past_key_values=cache, use_cache=True)
                inputs = ids
                gen_kwargs["max_new_tokens"] = max_new
                start = T
            else:
                inputs = torch.cat([ids, first], dim=1)
                gen_kwargs["max_new_tokens"] = max_new - 1
                start = T
            if stop in (STOP_NEWLINE, STOP_SENTENCE):
                crit.append(_StopAtNewline(tok, start, stop=stop))
            first_done = (not sampled and self.protocol == "dense-question"
                          and (first.item() in eos or max_new <= 1 or (crit and bool(crit[0](inputs, None)[0]))))
            if first_done:
                gen = inputs
            else:
                from transformers import StoppingCriteriaList

                gen = model.generate(inputs, attention_mask=torch.ones_like(inputs), past_key_values=cache,
                                     stopping_criteria=StoppingCriteriaList(crit), **gen_kwargs)
            row = self.result_row(rec, arm, s, plan, gen[0, start:].tolist(), cache.attended_fraction(),
                                  cache.decode_traffic(), time.perf_counter() - t1, prefill_s)
            del cache
            bar.update(1)
            bar.set_postfix_str(f"{rec['id']} {arm.name} score={row.get('score', float('nan')):.2f}")
            yield row


@dataclass
class RecordPlan:
    """How a record is run (`SweepRunner.plan`): ``ids [1, T]``; ``split`` tokens are prefilled (the
    rest fed by decode steps); at most ``max_new`` new tokens; ``stop`` the benchmark's stop rule."""

    ids: torch.Tensor
    split: int
    max_new: int
    stop: str
    sampled: bool

    @property
    def T(self) -> int:
        return self.ids.shape[1]


def _context_length(bench, rec: dict, tok, prefilled: int) -> int:
    """Tokens of the prompt's context (before the question), at most the ``prefilled`` tokens."""
    q = bench.question_start_text(rec)
    if q is None:
        return prefilled
    from .benchmarks import encode_text

    return min(encode_text(tok, bench.prompt_text(rec)[:q]).shape[1], prefilled)


def _rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)


def _stable_seed(*parts) -> int:
    import hashlib

    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


def _pad_id(tok, eos) -> int:
    p = getattr(tok, "pad_token_id", None)
    if p is not None:
        return p
    return min(eos) if eos else 0


PROTOCOL_TEXT = {
    "dense-question": "Each record's full prompt (context + question) is prefilled once with dense attention; the "
                      "first answer token is the greedy argmax of the prefill logits, shared by all arms; every arm "
                      "then decodes the remaining tokens from its own fork of the prefilled cache (sparse decode for "
                      "sparse arms). Generation stops at max_new_tokens, EOS, a degenerate loop, or the benchmark's "
                      "stop rule (benchmark.stop).",
    "sparse-question": "Each record's context is prefilled once with dense attention; every arm then feeds the "
                       "question tokens one by one through its own decode steps (sparse for sparse arms) before "
                       "generating greedily.",
    "sampled": "The prompt minus its last token is prefilled once densely; each arm and sample generates from a fork, "
               "the last prompt token being the first (sparse) decode step; sampling settings per arm as configured.",
}


# ----------------------------------------------------------------------------------------------------
# merge
#: Decode-traffic columns of scores.csv (means over the cell's generations) and their rounding.
TRAFFIC = {"attended_fraction": 4, "attended_tokens": 1, "read_bytes": 0}

def merge(run_dir) -> dict:
    """Combine every shard's predictions into ``results.jsonl`` / ``scores.csv`` / ``timing.csv``.

    The merged files depend only on the predictions, not on how the work was sharded.
    """
    run_dir = Path(run_dir)
    if not (run_dir / "predictions").is_dir():
        raise FileNotFoundError(f"{run_dir} is not a sweep run folder (no predictions/ in it): check --out")
    cfg = read_json(run_dir / "config.json", fix=CONFIG_FIX) if (run_dir / "config.json").exists() else {}
    arm_order = {a["name"]: i for i, a in enumerate(cfg.get("arms", []))}
    rows: dict[tuple, dict] = {}
    timing: dict[str, list] = defaultdict(lambda: [0.0, 0])
    for path in sorted((run_dir / "predictions").glob("shard-*.jsonl")):
        for r in _rows(path, PREDICTION_KEYS, appended=True):
            key = (r["id"], r["arm"], r.get("sample", 0))
            if key not in rows:
                rows[key] = r
                timing[r["arm"]][0] += r.get("seconds", 0.0)
                timing[r["arm"]][1] += 1
    order = {rid: i for i, rid in enumerate(_record_order(run_dir))}
    keyf = lambda k: (order.get(k[0], len(order)), k[0], arm_order.get(k[1], len(arm_order)), k[1], k[2])
    merged = [{k: v for k, v in rows[key].items() if k not in VOLATILE} for key in sorted(rows, key=keyf)]
    _write_atomic(run_dir / "results.jsonl", "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in merged))

    # per (task, length, arm): mean score x 100 (avg over samples first, then records: avg@k)
    agg: dict[tuple, list] = defaultdict(list)
    per_rec: dict[tuple, list] = defaultdict(list)
    traffic = {name: defaultdict(list) for name in TRAFFIC}
    meta = {}
    for r in merged:
        per_rec[(r["task"], r["length"], r["arm"], r["id"])].append(r.get("score", 0.0))
        for name, values in traffic.items():
            if r.get(name) is not None:
                values[(r["task"], r["length"], r["arm"])].append(r[name])
        meta[r["arm"]] = (r["family"], r["budget"], r["selector"])
    for (task, length, arm, _), scores in per_rec.items():
        agg[(task, length, arm)].append(sum(scores) / len(scores))
    lines = ["task,length,arm,family,budget,selector,n,score," + ",".join(TRAFFIC)]
    for (task, length, arm) in sorted(agg, key=lambda k: (str(k[1]), k[0], arm_order.get(k[2], 999), k[2])):
        vals = agg[(task, length, arm)]
        fam, bud, sel = meta[arm]
        means = []
        for name, digits in TRAFFIC.items():
            got = traffic[name].get((task, length, arm))
            means.append("" if not got else str(round(sum(got) / len(got), digits)))
        lines.append(f"{task},{'' if length is None else length},{arm},{fam},{'' if bud is None else bud},{sel},"
                     f"{len(vals)},{round(100 * sum(vals) / len(vals), 2)}," + ",".join(means))
    _write_atomic(run_dir / "scores.csv", "\n".join(lines) + "\n")
    tl = ["arm,generations,seconds_total,seconds_per_generation"]
    for arm in sorted(timing, key=lambda a: arm_order.get(a, 999)):
        s, c = timing[arm]
        tl.append(f"{arm},{c},{round(s, 1)},{round(s / max(c, 1), 2)}")
    _write_atomic(run_dir / "timing.csv", "\n".join(tl) + "\n")
    return {"rows": len(merged), "cells": len(agg)}


def _record_order(run_dir: Path) -> list[str]:
    ids = []
    for path in sorted((run_dir / "records").glob("*.jsonl")):
        ids += [r["id"] for r in _rows(path)]
    return ids


def read_scores(run_dir) -> list[dict]:
    with open(Path(run_dir) / "scores.csv") as f:
        return list(csv.DictReader(f))
