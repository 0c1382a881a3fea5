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

The modules of a sweep, one job each: `runner` (this one: the eager engine and the main loop),
`batched` (``--engine static``), `plan` (how a record is decoded), `stopping` (when an answer has
ended), `rundir` (the results folder), `merge` (shards -> results, scores, timing).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from collections.abc import Iterator
from itertools import chain
from pathlib import Path

import torch

from locks_hf.compat import cache_keyword

from .arms import Arm
from .batched import plan_batches, run_batches
from .benchmarks import STOP_NEWLINE, STOP_SENTENCE, Benchmark
from .engine import runs_static
from .jsonl import end_last_line, read_json
from .manifest import build_manifest, check_or_write
from .merge import merge, read_scores
from .plan import PROTOCOL_TEXT, RecordPlan, context_length, eos_ids, pad_id, stable_seed
from .rundir import CONFIG_FIX, PREDICTION_KEYS, load_or_make_records, parse_shard, read_rows, write_atomic
from .stopping import StopAtAnswerEnd, cut_at_stop

#: Kept importable from here: the merge of a run folder's shards (`merge`) and its scores.
__all__ = ["ENGINES", "SweepRunner", "merge", "read_scores"]

logger = logging.getLogger(__name__)

ENGINES = ("eager", "static")  # see SweepRunner


# ----------------------------------------------------------------------------------------------------
class SweepRunner:
    """Run ``arms`` over ``bench`` with ``model``/``tokenizer`` into ``run_dir`` (resumable, shardable)."""

    def __init__(
        self,
        model,
        tokenizer,
        bench: Benchmark,
        arms: list[Arm],
        run_dir,
        *,
        protocol: str = "dense-question",
        shard: str | None = None,
        model_name: str = "model",
        progress: bool = True,
        limit: int | None = None,
        max_new_tokens: int | None = None,
        seed: int = 0,
        not_run=(),
        engine: str = "eager",
        batch_rows: int = 8,
        step: str = "auto",
        allow_manifest_change: bool = False,
    ):
        if protocol not in ("dense-question", "sparse-question"):
            raise ValueError("protocol must be 'dense-question' or 'sparse-question'")
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
        self.engine, self.batch_rows, self.step = engine, batch_rows, step
        for arm in arms:
            if arm.hf_cache is not None:
                arm.hf_cache.check_model(model.config)
        #: arms the static engine decodes; the rest (token-level baselines, shared-basis controls,
        #: ``min_context``) take the eager path, with a dense prefill of their own per record
        self.static_arms: list[Arm] = []
        if engine == "static":
            self.static_arms = [a for a in arms if runs_static(a.config) and a.hf_cache is None]
            eager = [a.name for a in arms if a not in self.static_arms]
            if eager:
                logger.info(
                    "--engine static: arms %s decode on the eager path (dynamic cache, reference "
                    "selection), one extra dense prefill per record for them",
                    eager,
                )
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
            "arms": [
                {
                    "name": a.name,
                    "family": a.family,
                    "budget": a.budget,
                    "selector": a.selector,
                    "config": {k: getattr(a.config, k) for k in a.config.__dataclass_fields__},
                    **({"hf_cache": vars(a.hf_cache)} if a.hf_cache is not None else {}),
                }
                for a in self.arms
            ],
            "arms_not_run": [{"name": name, "reason": reason} for name, reason in self.not_run],
            "protocol": "prefill-all-but-last-token (sampled)" if self._sampled else self.protocol,
            "protocol_text": PROTOCOL_TEXT["sampled" if self._sampled else self.protocol],
            "samples": self.bench.samples,
            "sampling": self.bench.sampling,
            # greedy tokens are the same on both engines; sampled ones come from different random streams
            "engine": self.engine,
            "max_new_tokens_cap": self.max_new_cap,
            "locks_hf_version": getattr(locks_hf, "__version__", "?"),
            "torch": torch.__version__,
        }

    def _write_config(self) -> None:
        path = self.run_dir / "config.json"
        cfg = self.config()
        if path.exists():
            old = read_json(path, fix=CONFIG_FIX)
            if old.get("model") != cfg["model"] or old.get("protocol") != cfg["protocol"]:
                raise ValueError(
                    f"{path} holds a run of model={old.get('model')} protocol={old.get('protocol')}; "
                    "use another --out folder"
                )
            if cfg["sampling"] and old.get("engine", "eager") != cfg["engine"]:
                raise ValueError(
                    f"{path} holds a sampled run of --engine {old.get('engine', 'eager')}: the engines "
                    "draw different samples; resume with that engine or use another --out folder"
                )
            known = {a["name"] for a in old.get("arms", [])}
            cfg["arms"] = old["arms"] + [a for a in cfg["arms"] if a["name"] not in known]
            if old.get("benchmark") != cfg["benchmark"]:
                cfg["benchmark_history"] = old.get("benchmark_history", [old.get("benchmark")])
        write_atomic(path, json.dumps(cfg, indent=1) + "\n")

    # -- main loop ---------------------------------------------------------------------------------
    def done_keys(self) -> set[tuple]:
        done = set()
        for path in (self.run_dir / "predictions").glob("shard-*.jsonl"):
            for r in read_rows(path, PREDICTION_KEYS, appended=True):
                done.add((r["id"], r["arm"], r.get("sample", 0)))
        return done

    def run(self) -> Path:
        from tqdm.auto import tqdm

        i, n = self.shard
        self.run_dir.mkdir(parents=True, exist_ok=True)
        seeds = {"sweep": self.seed, "benchmark": self.bench.describe().get("seed")}
        check_or_write(
            self.run_dir,
            build_manifest(self.bench.data_files(), seeds),
            allow_change=self.allow_manifest_change,
            write=write_atomic,
        )
        if i == 0:
            self._write_config()
        records = load_or_make_records(self.run_dir, self.bench)
        if self.limit:
            records = records[: self.limit]
        if self.engine == "static":  # batches are planned over all records: a shard takes whole batches
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
        todo = [
            (r, [(a, s) for a in self.arms for s in range(samples) if (r["id"], a.name, s) not in done]) for r in mine
        ]
        todo = [(r, w) for r, w in todo if w]
        skipped = len(mine) - len(todo)
        bar = tqdm(
            total=sum(len(w) for _, w in todo),
            desc=f"{self.bench.name} shard {i}/{n}",
            unit="gen",
            disable=not self.progress,
            dynamic_ncols=True,
            file=sys.stderr,
        )
        if skipped:
            bar.write(f"resume: {skipped} of {len(mine)} records already done in {self.run_dir}")
        end_last_line(out_path)  # a line torn by a kill is cut off: only a file's last line can be torn
        if self.engine == "static":
            static = {id(a) for a in self.static_arms}
            work = {rec["id"]: [(a, s) for a, s in w if id(a) in static] for rec, w in todo}
            eager = [(rec, [(a, s) for a, s in w if id(a) not in static]) for rec, w in todo]
            results: Iterator[dict] = chain(
                run_batches(self, [b for j, b in enumerate(batches) if j % n == i], work, bar),
                (row for rec, w in eager if w for row in self._run_record(rec, w, bar)),
            )
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

        n = context_length(self.bench, rec, self.tokenizer, prefilled.shape[1])
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
            split = min(context_length(self.bench, rec, tok, T), T - 1)
        return RecordPlan(ids, split, max_new, self.bench.stop(rec), sampled)

    def result_row(
        self,
        rec: dict,
        arm: Arm,
        sample: int,
        plan: RecordPlan,
        new: list[int],
        frac: float,
        traffic: dict | None,
        seconds: float,
        prefill_seconds: float,
    ) -> dict:
        """The prediction line of (``rec``, ``arm``, ``sample``) from its new tokens (as generated), its
        attended fraction and decode traffic (`LocksCache.decode_traffic`)."""
        traffic = traffic or {}
        eos = eos_ids(self.model, self.tokenizer)
        n_new = len(new)
        while new and new[-1] in eos:
            new = new[:-1]
        raw = self.tokenizer.decode(new, skip_special_tokens=True)
        pred = cut_at_stop(raw, plan.stop)
        metrics = self.bench.score(rec, pred)
        return {
            "id": rec["id"],
            "task": rec.get("task", self.bench.name),
            "length": rec.get("length"),
            "arm": arm.name,
            "family": arm.family,
            "budget": arm.budget,
            "selector": arm.selector,
            "sample": sample,
            "prompt_tokens": plan.T,
            "new_tokens": n_new,
            "pred": pred,
            **metrics,
            "attended_fraction": None if math.isnan(frac) else round(frac, 6),
            # per (layer, KV head) and decode step: tokens whose K/V were read, and bytes read
            # (those K/V plus the estimation's reads: summaries, reduced keys, ...)
            "attended_tokens": _rounded(traffic.get("attended_tokens")),
            "read_bytes": _rounded(traffic.get("read_bytes")),
            "seconds": round(seconds, 3),
            "prefill_seconds": round(prefill_seconds, 3),
            "shard": f"{self.shard[0]}/{self.shard[1]}",
        }

    @torch.no_grad()
    def _run_record(self, rec: dict, work, bar):
        from locks_hf import LocksCache, LocksConfig

        model, tok = self.model, self.tokenizer
        plan = self.plan(rec)
        ids, T, split, max_new, stop, sampled = (
            plan.ids.to(self.device),
            plan.T,
            plan.split,
            plan.max_new,
            plan.stop,
            plan.sampled,
        )

        t0 = time.perf_counter()
        # the eager engine: dynamic caches, as this runner has always decoded (one fork per arm)
        base = LocksCache(model.config, LocksConfig(selector="full"), layout="dynamic")
        # only the last position's logits (the first answer token): the LM head over every prompt
        # position would be most of a prefill's work and memory (Gemma 3: 262K-token vocabulary)
        out = model(ids[:, :split], **{cache_keyword(model): base}, use_cache=True, logits_to_keep=1)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        del out
        self._score_context(rec, ids[:, :split], base, [arm for arm, _ in work])
        prefill_s = time.perf_counter() - t0
        eos = eos_ids(model, tok)

        for arm, s in work:
            t1 = time.perf_counter()
            if arm.hf_cache is not None:  # transformers' QuantizedCache: a prefill of its own (hf_quantized)
                cache = arm.hf_cache.prefilled(model, ids[:, :split])
            else:
                cache = base.fork(arm.config)
                cache.expect_new_tokens(max_new)
            crit = []
            gen_kwargs = dict(max_new_tokens=None, do_sample=False, pad_token_id=pad_id(tok, eos))
            if sampled:
                inputs = ids
                gen_kwargs.update(self.bench.sampling or {}, do_sample=bool(self.bench.sampling))
                gen_kwargs["max_new_tokens"] = max_new
                torch.manual_seed(stable_seed(self.seed, rec["id"], s))  # same stream for every arm
                start = T
            elif self.protocol == "sparse-question" and split < T:
                for t in range(split, T - 1):  # question tokens, one sparse decode step each
                    model(ids[:, t : t + 1], **{cache_keyword(model): cache}, use_cache=True)
                inputs = ids
                gen_kwargs["max_new_tokens"] = max_new
                start = T
            else:
                inputs = torch.cat([ids, first], dim=1)
                gen_kwargs["max_new_tokens"] = max_new - 1
                start = T
            if stop in (STOP_NEWLINE, STOP_SENTENCE):
                crit.append(StopAtAnswerEnd(tok, start, stop=stop))
            first_done = (
                not sampled
                and self.protocol == "dense-question"
                and (first.item() in eos or max_new <= 1 or (crit and bool(crit[0](inputs, None)[0])))
            )
            if first_done:
                gen = inputs
            else:
                from transformers import StoppingCriteriaList

                gen = model.generate(
                    inputs,
                    attention_mask=torch.ones_like(inputs),
                    **{cache_keyword(model): cache},
                    stopping_criteria=StoppingCriteriaList(crit),
                    **gen_kwargs,
                )
            row = self.result_row(
                rec,
                arm,
                s,
                plan,
                gen[0, start:].tolist(),
                float("nan") if arm.hf_cache is not None else cache.attended_fraction(),
                {} if arm.hf_cache is not None else cache.decode_traffic(),
                time.perf_counter() - t1,
                prefill_s,
            )
            del cache
            bar.update(1)
            bar.set_postfix_str(f"{rec['id']} {arm.name} score={row.get('score', float('nan')):.2f}")
            yield row


def _rounded(value: float | None, digits: int = 2) -> float | None:
    return None if value is None else round(value, digits)
