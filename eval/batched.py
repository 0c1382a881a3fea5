"""The sweep runner's ``--engine static``: records grouped into batches, each run by `engine.StaticEngine`.

A batch holds records that are run alike (same number of tokens fed after the prefill, same
generation cap and stop rule) and of similar prompt length (left padding costs slots), with all
``k`` samples of each record; at most ``batch_rows`` rows. Batches are planned over all records
before sharding, so a record's batch (and with it every number it produces) does not depend on
``--shard`` or on what a resumed run has already done: a shard takes whole batches, and a batch
with any (record, arm, sample) left decodes that arm for all its rows, writing only the missing ones.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import cast

from .arms import Arm
from .benchmarks import STOP_NEWLINE, STOP_SENTENCE
from .engine import Row, StaticEngine
from .plan import RecordPlan, eos_ids, pad_id, stable_seed
from .stopping import answer_ended

#: Records share a batch when the shortest prompt is within this share of the longest (padding).
LENGTH_SLACK = 0.125


def plan_batches(runner, records: list[dict]) -> list[list[tuple[dict, RecordPlan]]]:
    """``records`` grouped into batches of ``(record, plan)``, in the order of their first record."""
    samples = max(1, runner.bench.samples)
    per_batch = max(1, runner.batch_rows // samples)
    groups: dict[tuple, list] = defaultdict(list)
    for index, rec in enumerate(records):
        plan = runner.plan(rec)
        forced = plan.T - plan.split
        groups[(forced, plan.max_new, plan.stop)].append((plan.split, index, rec, plan))
    batches = []
    for members in groups.values():
        members.sort(key=lambda m: (m[0], m[1]))
        current: list = []
        for m in members:  # ascending length: the newest member is the longest
            if current and (len(current) == per_batch or current[0][0] < (1 - LENGTH_SLACK) * m[0]):
                batches.append(current)
                current = []
            current.append(m)
        if current:
            batches.append(current)
    batches.sort(key=lambda b: min(m[1] for m in b))
    return [[(m[2], m[3]) for m in sorted(b, key=lambda m: m[1])] for b in batches]


def run_batches(runner, batches, work: dict[str, list], bar):
    """Yield the prediction lines of the ``work`` left (``{record id: [(arm, sample), ...]}``)."""
    model, tok, bench = runner.model, runner.tokenizer, runner.bench
    eos = eos_ids(model, tok)
    engine = StaticEngine(model, step=runner.step, sampling=bench.sampling, pad_id=pad_id(tok, eos))
    samples = max(1, bench.samples)
    for index, batch in enumerate(batches):
        wanted = {(rec["id"], arm.name, s) for rec, _ in batch for arm, s in work.get(rec["id"], [])}
        arms = [
            a for a in runner.arms if any((rec["id"], a.name, s) in wanted for rec, _ in batch for s in range(samples))
        ]
        if not arms:
            continue
        rows, owners = [], []
        for rec, plan in batch:
            for s in range(samples):
                rows.append(_row(runner, rec, plan, s, eos))
                owners.append((rec, plan, s))
        for given, run in engine.run(rows, arms):
            arm = cast(Arm, given)  # one of ``arms`` (typed `object` by the engine)
            runner.arm_runs.append(
                {
                    "batch": index,
                    "arm": arm.name,
                    "rows": len(rows),
                    "steps": run.steps,
                    "tokens": sum(len(r.tokens) for r in run.results),
                    "seconds": run.seconds,
                    "warmup_seconds": run.warmup_seconds,
                    "prefill_seconds": run.prefill_seconds,
                    "new_step": run.new_step,
                }
            )
            for (rec, plan, s), res in zip(owners, run.results):
                if (rec["id"], arm.name, s) not in wanted:
                    continue
                frac = res.attended / res.context if res.context and res.attended is not None else math.nan
                line = runner.result_row(
                    rec,
                    arm,
                    s,
                    plan,
                    res.tokens,
                    frac,
                    res.traffic,
                    run.seconds / len(rows),
                    run.prefill_seconds / len(rows),
                )
                bar.update(1)
                bar.set_postfix_str(f"{rec['id']} {arm.name} score={line.get('score', float('nan')):.2f}")
                yield line


def _row(runner, rec: dict, plan: RecordPlan, sample: int, eos: set[int]) -> Row:
    """The engine's row of (``rec``, ``sample``) with the old runner's stop rules (`SweepRunner._run_record`)."""
    ids = plan.ids[0]
    dense_first = not plan.sampled and plan.split == plan.T  # the prefill's token is the first answer token
    hf_eos = runner.model.generation_config.eos_token_id
    hf_eos = set() if hf_eos is None else set(hf_eos if isinstance(hf_eos, (list, tuple)) else [hf_eos])
    tok, stop = runner.tokenizer, plan.stop
    text_rule = stop in (STOP_NEWLINE, STOP_SENTENCE)

    def finished(new: list[int]) -> bool:
        # generate() stops at the generation config's EOS; the prefill's token is checked against
        # every EOS id the runner knows (as `_run_record` does)
        if new[-1] in (eos if dense_first and len(new) == 1 else hf_eos):
            return True
        return text_rule and answer_ended(tok.decode(new, skip_special_tokens=True), stop)

    return Row(
        prefix=ids[: plan.split],
        forced=ids[plan.split :].tolist(),
        max_new=plan.max_new,
        finished=finished,
        seed=stable_seed(runner.seed, rec["id"], sample) if plan.sampled else None,
    )
