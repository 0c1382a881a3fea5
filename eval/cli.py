"""``locks-hf-eval``: sweep / merge / report / fidelity / ruler-generate / infinitebench-score.

Examples::

    locks-hf-eval sweep --benchmark ruler --model gemma3-270m --tasks niah_single_1,vt --lengths 4096 \\
        --num-samples 10 --arms full,oracle,locks-r8i4,locks-r4i4,quest --budgets 64,128,256,512 --out runs/ruler4k
    locks-hf-eval sweep ... --shard 0/2          # this process does shard 0 of 2; then `merge`
    accelerate launch -m locks_hf.eval.cli sweep ...   # one shard per process, rank 0 merges
    locks-hf-eval report --run runs/ruler4k --out runs/ruler4k-report
    locks-hf-eval fidelity --model gemma3-270m --records-from runs/ruler4k --num-prompts 4 --out runs/fid
    locks-hf-eval infinitebench-score --predictions <folder of preds_<task>.jsonl files>

Data: RULER is generated from text sources; LongBench / InfiniteBench records come from the Hugging Face
Hub (``datasets``) or from a folder you name (``--records-dir``); ``--data-dir`` (else ``$LOCKS_HF_DATA``)
names a data folder (ruler/, longbench/, infinitebench/, math/, haystack/). Without one the packaged
samples stand in (a smoke test, with a warning). A path you name must exist: it is never replaced.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

# Only the standard library and the harness's light modules at the top: `--help` and argument errors
# answer without importing torch / transformers (seconds); each command imports what it needs.
from .jsonl import InputFileError, InputPathMissing

logger = logging.getLogger(__name__)


def _threads(n):
    import torch

    if n:
        torch.set_num_threads(int(n))


def load_any_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """A real model by name (`locks_hf.models.load_model`) or ``tiny-<arch>[-d<head_dim>]`` (random
    weights, byte tokenizer; e.g. ``tiny-llama-d64`` has heads wide enough for the GPU kernels)."""
    import torch

    dt = getattr(torch, dtype)
    if name.startswith("tiny-"):
        from locks_hf.models import tiny_model

        from .testing import ByteTokenizer

        arch, _, width = name[5:].partition("-d")
        extra: dict[str, Any] = {"head_dim": int(width)} if width else {}
        model = tiny_model(arch, vocab_size=256, max_position_embeddings=65536, **extra).to(device=device, dtype=dt)
        return model, ByteTokenizer()
    from locks_hf.models import load_model

    return load_model(name, attn_implementation="locks", dtype=dt, device=device)


def load_tokenizer_only(name: str):
    """The tokenizer of a supported model without loading its weights (``tiny-*``: the byte tokenizer)."""
    if name.startswith("tiny-"):
        from .testing import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    from locks_hf.models import MODELS, convert

    tok = AutoTokenizer.from_pretrained(convert(name))
    tok.locks_hf_prepend_bos = MODELS[name].prepend_bos
    return tok


class Number:
    """argparse type: an int or float in a range, checked when the arguments are parsed (before any
    model loads), so that a value that means nothing is refused instead of ignored or clamped.

    ``lo`` / ``hi``: bounds (``None``: unbounded); ``lo_open`` / ``hi_open``: the bound itself is out.
    """

    def __init__(self, kind=int, lo=None, hi=None, lo_open=False, hi_open=False):
        self.kind, self.lo, self.hi, self.lo_open, self.hi_open = kind, lo, hi, lo_open, hi_open

    def describe(self) -> str:
        name = "an integer" if self.kind is int else "a number"
        if self.kind is int and self.lo == 1 and self.hi is None:
            return "a positive integer"
        if self.hi is None:
            return f"{name} {'>' if self.lo_open else '>='} {self.lo}" if self.lo is not None else name
        return f"{name} in {'(' if self.lo_open else '['}{self.lo}, {self.hi}{')' if self.hi_open else ']'}"

    def __call__(self, text: str):
        try:
            value = self.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}") from None
        if (
            value != value
            or value in (float("inf"), float("-inf"))
            or (self.lo is not None and (value < self.lo or (self.lo_open and value == self.lo)))
            or (self.hi is not None and (value > self.hi or (self.hi_open and value == self.hi)))
        ):  # NaN, inf: out
            raise argparse.ArgumentTypeError(f"expected {self.describe()}, got {text!r}")
        return value

    def out_of_range(self) -> list[str]:
        """Values this type refuses (the tests feed each numeric option every one of them)."""
        bad = ["abc", "nan", "inf"]
        if self.lo is not None:
            bad.append(str(self.lo) if self.lo_open else str(self.lo - 1))
        if self.hi is not None:
            bad.append(str(self.hi) if self.hi_open else str(self.hi + (1 if self.kind is int else 0.5)))
        return bad


class NumberList(Number):
    """argparse type: a non-empty comma-separated list of `Number` values (kept as text; the commands
    split it)."""

    def __call__(self, text: str) -> str:
        items = _split(text)
        if not items:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {self.describe()}s, got {text!r}")
        for item in items:
            super().__call__(item)
        return text

    def out_of_range(self) -> list[str]:
        return ["", ","] + [f"1,{v}" if self.lo is not None and self.lo <= 1 else v for v in super().out_of_range()]


def _names(text: str) -> str:
    """argparse type: a non-empty comma-separated list of names (an empty one would silently mean
    "the default list": refused)."""
    if not _split(text):
        raise argparse.ArgumentTypeError(
            f"expected a comma-separated list of names, got {text!r}; leave the option out for the default"
        )
    return text


class ExistingPath:
    """argparse type: a path the user names that must already exist (a folder, or a file), so a typo is
    refused instead of another folder being read or an empty result printed."""

    def __init__(self, what: str = "folder"):
        self.what = what

    def __call__(self, text: str) -> str:
        path = Path(text)
        ok = path.is_dir() if self.what == "folder" else path.is_file()
        if not ok:
            raise argparse.ArgumentTypeError(
                f"{text}: no such {self.what}; check the path (a path you name is never replaced by another)"
            )
        return text


POSITIVE = Number(int, lo=1)
POSITIVE_LIST = NumberList(int, lo=1)
SEED = Number(int, lo=0)
TEMPERATURE = Number(float, lo=0)
TOP_P = Number(float, lo=0, hi=1, lo_open=True)


def _shard(text: str) -> str:
    """argparse type: ``i/n`` with ``0 <= i < n``, checked before any model loads."""
    from .rundir import parse_shard

    try:
        parse_shard(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


DTYPES = ("float32", "bfloat16", "float16", "float64")


def _device(arg):
    import torch

    if arg:
        return arg
    if torch.cuda.is_available():
        return f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    return "cpu"


def _split(v):
    from .arms import split_list

    return split_list(v)


def build_benchmark(args, tokenizer):
    from .benchmarks import RulerBenchmark

    if args.benchmark == "ruler":
        from .ruler import TASKS

        tasks = _split(args.tasks) or list(TASKS)
        return RulerBenchmark(
            tokenizer,
            tasks,
            [int(x) for x in _split(args.lengths) or ["4096"]],
            num_samples=args.num_samples,
            seed=args.seed,
            data_dir=args.data_dir,
            haystack_path=args.haystack,
            wordlist_dir=args.wordlists,
            stop_at_newline=not args.no_stop_newline,
        )
    if args.benchmark == "longbench":
        from .longbench import LongBenchBenchmark

        return LongBenchBenchmark(
            tokenizer,
            _split(args.tasks) or ["multi_news"],
            max_length=args.max_length,
            num_samples=args.num_samples,
            records_dir=args.records_dir,
            data_dir=args.data_dir,
            chat=args.chat,
        )
    if args.benchmark == "infinitebench":
        from .infinitebench import InfiniteBenchBenchmark

        return InfiniteBenchBenchmark(
            tokenizer,
            _split(args.tasks) or ["passkey"],
            lengths=[int(x) for x in _split(args.lengths) or ["4096"]],
            num_samples=args.num_samples,
            seed=args.seed,
            records_dir=args.records_dir,
            data_dir=args.data_dir,
            max_length=args.max_length,
        )
    if args.benchmark == "math":
        from .mathbench import MathBenchmark

        return MathBenchmark(
            tokenizer,
            _split(args.tasks) or ["math500"],
            num_samples=args.num_samples,
            k=args.k,
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=args.max_new_tokens or 4096,
            thinking=not args.no_thinking,
            data_dir=args.data_dir,
        )
    raise SystemExit(f"unknown benchmark {args.benchmark}")


def sweep_plan(args, arms, not_run) -> str:
    """What a sweep is about to run, printed before the model loads: records x arms (x samples)."""
    tasks = _split(args.tasks)
    default_tasks = {"ruler": "all 13 tasks", "longbench": "multi_news", "infinitebench": "passkey", "math": "math500"}
    task_text = (
        f"{len(tasks)} task(s) ({', '.join(tasks)})" if tasks else f"default tasks ({default_tasks[args.benchmark]})"
    )
    if args.benchmark == "ruler" or (args.benchmark == "infinitebench" and not args.records_dir):
        lengths = [int(x) for x in _split(args.lengths) or ["4096"]]
        n_tasks = len(tasks) if tasks else (13 if args.benchmark == "ruler" else 1)
        records = n_tasks * len(lengths) * args.num_samples
        rec_text = (
            f"{records} records = {task_text} x {len(lengths)} length(s) ({', '.join(map(str, lengths))}) "
            f"x {args.num_samples} records"
        )
    else:
        records = None
        rec_text = f"up to {args.num_samples} records per task of {task_text}"
    if args.limit:
        rec_text += f", the first {args.limit} only"
        records = min(records, args.limit) if records is not None else None
    samples = args.k if args.benchmark == "math" else 1
    budgets = _split(args.budgets)
    families = _split(args.arms)
    total = f"{records * len(arms) * samples} generations" if records is not None else "generations: records x arms"
    data = (
        args.data_dir
        or os.environ.get("LOCKS_HF_DATA")
        or "packaged samples / HF Hub (no --data-dir, no $LOCKS_HF_DATA)"
    )
    lines = [
        f"sweep {args.benchmark} on {args.model} into {args.out}:",
        f"  records: {rec_text}",
        f"  arms: {len(arms)} = {len(families)} famil{'y' if len(families) == 1 else 'ies'} ({', '.join(families)}) "
        f"x {len(budgets)} budget(s) ({', '.join(budgets)}), full once"
        + (f"; not run (budget too small): {', '.join(name for name, _ in not_run)}" if not_run else ""),
        f"  samples per record and arm: {samples}" if samples > 1 else None,
        f"  total: {total}; data: {data}; engine {args.engine}, protocol {args.protocol}",
    ]
    return "\n".join(line for line in lines if line)


def cmd_sweep(args):
    from .arms import parse_arms

    not_run: list[tuple[str, str]] = []
    arms = parse_arms(
        _split(args.arms), [int(b) for b in _split(args.budgets)], page_size=args.page_size, not_run=not_run
    )
    for name, reason in not_run:
        logger.warning("not run: %s: %s", name, reason)
    # what is about to run, before minutes of model loading and record generation
    print(sweep_plan(args, arms, not_run), file=sys.stderr, flush=True)
    _threads(args.threads)
    from .merge import merge
    from .runner import SweepRunner

    t0 = time.time()
    model, tok = load_any_model(args.model, _device(args.device), args.dtype)
    logger.info("loaded %s in %.0f s", args.model, time.time() - t0)
    bench = build_benchmark(args, tok)
    runner = SweepRunner(
        model,
        tok,
        bench,
        arms,
        args.out,
        protocol=args.protocol,
        shard=args.shard,
        model_name=args.model,
        limit=args.limit,
        max_new_tokens=args.max_new_tokens if args.benchmark != "math" else None,
        seed=args.seed or 0,
        not_run=not_run,
        engine=args.engine,
        batch_rows=args.batch_rows,
        step=args.step,
        allow_manifest_change=args.allow_manifest_change,
    )
    runner.run()
    i, n = runner.shard
    if n > 1 and not args.shard:  # accelerate / torchrun: rank 0 merges after everyone finished
        try:
            from accelerate import PartialState

            PartialState().wait_for_everyone()
        except Exception as err:  # pragma: no cover
            logger.warning("could not synchronise processes (%s); run `merge` afterwards", err)
            return
    if n == 1 or (i == 0 and not args.shard):
        info = merge(args.out)
        logger.info("merged %s predictions into %s/results.jsonl, scores.csv", info["rows"], args.out)
    else:
        logger.info("shard %s/%s done; run `locks-hf-eval merge --out %s` once all shards finished", i, n, args.out)


def cmd_merge(args):
    from .merge import merge

    try:
        info = merge(args.out)
    except FileNotFoundError as err:
        raise SystemExit(f"locks-hf-eval merge: {err}") from None
    print(json.dumps(info))


def cmd_report(args):
    from .jsonl import read_text
    from .report import write_report

    path = write_report(
        [Path(r) for r in args.run],
        Path(args.out),
        title=args.title,
        name=args.name,
        fidelity_dirs=[Path(f) for f in (args.fidelity or [])],
        notes=read_text(args.notes) if args.notes else None,
        pool=args.pool,
    )
    print(path)


def _records_from(run: str, tasks: list[str], lengths: list[int]) -> list[dict]:
    """The records of sweep run folder ``run`` (its ``records/*.jsonl``) of ``tasks`` / ``lengths``
    (all when empty); none is an error naming the folder."""
    from .jsonl import read_jsonl

    files = sorted((Path(run) / "records").glob("*.jsonl"))
    if not files:
        raise InputPathMissing(
            f"--records-from {run}: no records/<task>.jsonl in it; name a sweep run folder "
            "(one that `locks-hf-eval sweep --out` wrote)"
        )
    fix = (
        "that records file was not written by locks-hf-eval sweep: delete it, or name another --records-from run folder"
    )
    recs = [
        r
        for p in files
        for r in read_jsonl(p, required=("id", "task", "length", "index", "input", "answer_prefix"), fix=fix)
    ]
    recs = [r for r in recs if (not tasks or r["task"] in tasks) and (not lengths or r["length"] in lengths)]
    if not recs:
        raise InputPathMissing(
            f"--records-from {run}: no records of tasks {tasks or 'any'} and lengths "
            f"{lengths or 'any'} in {len(files)} records file(s); choose tasks / lengths the run "
            "has, or leave them out"
        )
    return recs


def cmd_fidelity(args):
    from .arms import parse_arms

    arms = parse_arms(_split(args.arms), [int(b) for b in _split(args.budgets)], page_size=args.page_size)
    arms = [a for a in arms if a.family != "full"] if args.drop_full else arms
    # the records of --records-from are read before the model loads: a bad folder fails at once
    recs = (
        _records_from(args.records_from, _split(args.tasks), [int(x) for x in _split(args.lengths)])
        if args.records_from
        else None
    )
    _threads(args.threads)
    import torch

    from .benchmarks import RulerBenchmark, encode_text
    from .fidelity import run_fidelity

    model, tok = load_any_model(args.model, _device(args.device), args.dtype)
    prompts = []
    if recs is not None:
        by_task = {}
        for r in recs:
            by_task.setdefault((r["task"], r["length"]), []).append(r)
        for key in sorted(by_task):
            for r in sorted(by_task[key], key=lambda r: r["index"])[: args.num_prompts]:
                ids = encode_text(tok, r["input"] + r["answer_prefix"])
                needle = None
                if r.get("token_position_answer", -1) >= 0:  # niah: token index of the (first) answer
                    bos = getattr(tok, "bos_token_id", None)
                    needle = r["token_position_answer"] + int(bos is not None and int(ids[0, 0]) == bos)
                prompts.append((r["id"], ids, needle))
    else:
        from .ruler import TASKS

        bench = RulerBenchmark(
            tok,
            _split(args.tasks) or list(TASKS[:1]),
            [int(x) for x in _split(args.lengths) or ["4096"]],
            num_samples=args.num_prompts,
            data_dir=args.data_dir,
        )
        for r in bench.records():
            prompts.append((r["id"], bench.prompt_ids(r, tok)))
    with torch.no_grad():
        run_fidelity(model, prompts, arms, args.out, steps=args.steps, page_size=args.page_size)
    logger.info("wrote %s/fidelity.csv", args.out)


def cmd_ruler_generate(args):
    from .ruler import RulerGenerator, RulerSources

    tok = load_tokenizer_only(args.model)
    gen = RulerGenerator(
        tok,
        RulerSources(haystack_path=args.haystack, wordlist_dir=args.wordlists, data_dir=args.data_dir),
        seed=args.seed,
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from .ruler import TASKS

    for L in [int(x) for x in _split(args.lengths) or ["4096"]]:
        for t in _split(args.tasks) or TASKS:
            recs = gen.generate(t, L, args.num_samples)
            (out / f"{t}-{L}.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in recs))
            logger.info("%s %s: %d records, max %d tokens", t, L, len(recs), max(r["length_tokens"] for r in recs))


def cmd_ib_score(args):
    from .infinitebench import score_prediction_dir

    table = score_prediction_dir(args.predictions, data_dir=args.data_dir)
    print("| task | n | score (%) | README |")
    print("|---|---|---|---|")
    for row in table:
        print(f"| {row['task']} | {row['n']} | {row['score']:.2f} | {row.get('reported', '')} |")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help: ``(default: X)`` unless the text already says what the
    default is (a default computed at run time, e.g. the device); the description keeps its layout."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is argparse.SUPPRESS or not action.option_strings:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return text + " (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The ``locks-hf-eval`` argument parser (every sub-command)."""
    p = argparse.ArgumentParser(prog="locks-hf-eval", description=__doc__, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def add(name, **kwargs):
        return sub.add_parser(name, formatter_class=HelpFormatter, **kwargs)

    def common(sp):
        sp.add_argument(
            "--model",
            default="gemma3-270m",
            help="gemma3-270m | smollm2-135m | tiny-<llama|gemma3|qwen3>[-d<head_dim>]",
        )
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available, else cpu)")
        sp.add_argument("--dtype", default="float32", choices=DTYPES, help="model weights and K/V dtype")
        sp.add_argument(
            "--threads", type=POSITIVE, default=None, help="torch.set_num_threads on the CPU (default: torch's choice)"
        )
        sp.add_argument(
            "--arms",
            default="full,oracle,locks-r8i4,locks-r4i4,locks-r2i4,quest",
            type=_names,
            help="comma-separated arm families: full, oracle, quest, locks-r<rank>i<bits> (or r8i4), "
            "locks-r<rank>bf16, locks-r<rank>i<bits>-rr<m> (exact re-ranking of m*k candidate pages), "
            "shared_basis-r<rank>, shared_all-r<rank>, the baselines rocketkv, shadowkv, rkv, "
            "triattention, lazy_eviction; any of them on quantized KV with +kv<bits>[-post|-pre]; "
            "transformers' QuantizedCache as hf-quanto<bits> / hf-hqq<bits>; each but full and hf-* runs at "
            "every budget (an arm whose method does not fit its budget is listed as not run)",
        )
        sp.add_argument(
            "--budgets",
            default="64,128,256,512,1024,2048",
            type=POSITIVE_LIST,
            help="comma-separated token budgets b per layer and KV head",
        )
        sp.add_argument("--page-size", type=POSITIVE, default=16, help="tokens per page B")
        sp.add_argument(
            "--tasks",
            default=None,
            type=_names,
            help="comma-separated task names of the benchmark "
            "(default: RULER all 13, LongBench multi_news, InfiniteBench passkey, math math500)",
        )
        sp.add_argument(
            "--lengths",
            default=None,
            type=POSITIVE_LIST,
            help="comma-separated prompt lengths in tokens for generated tasks (RULER, InfiniteBench; default 4096)",
        )
        sp.add_argument("--num-samples", type=POSITIVE, default=10, help="records per task (and length)")
        sp.add_argument("--seed", type=SEED, default=None, help="seed of record generation (default: the benchmark's)")
        sp.add_argument(
            "--data-dir",
            default=None,
            type=ExistingPath(),
            help="evaluation data folder (ruler/, "
            "longbench/, infinitebench/, math/, haystack/; default: $LOCKS_HF_DATA, else the packaged "
            "samples and, for LongBench / InfiniteBench, the HF Hub)",
        )
        sp.add_argument("--out", required=True, help="run folder (created; an existing one is resumed)")

    s = add("sweep", help="run arms over a benchmark (resumable)")
    common(s)
    s.add_argument(
        "--benchmark",
        default="ruler",
        choices=["ruler", "longbench", "infinitebench", "math"],
        help="which benchmark the records come from",
    )
    s.add_argument(
        "--protocol",
        default="dense-question",
        choices=["dense-question", "sparse-question"],
        help="dense-question: the whole prompt is prefilled densely; sparse-question: the question "
        "tokens are fed one by one through sparse decode steps",
    )
    s.add_argument(
        "--shard",
        default=None,
        type=_shard,
        help="i/n: this process runs records j with j %% n == i "
        "(default: one process, or one shard per accelerate / torchrun rank)",
    )
    s.add_argument(
        "--allow-manifest-change",
        action="store_true",
        help="resume a run folder although its manifest.json (library version, git commit, "
        "transformers / torch versions, data file hashes, seeds) differs; the change is recorded",
    )
    s.add_argument("--limit", type=POSITIVE, default=None, help="first N records only (default: all)")
    s.add_argument(
        "--max-new-tokens",
        type=POSITIVE,
        default=None,
        help="cap on generated tokens (default: the task's; math: the generation cap, default 4096)",
    )
    s.add_argument(
        "--engine",
        default="eager",
        choices=["eager", "static"],
        help="eager: each (record, arm, sample) through generate() on a fork of a LocksCache; static: "
        "batched rows, one prefill per batch shared by every arm, CUDA-graph decode on a GPU (arms "
        "it cannot decode, e.g. token-level baselines, take the eager path)",
    )
    s.add_argument("--batch-rows", type=POSITIVE, default=8, help="static engine: rows (records x samples) per batch")
    s.add_argument(
        "--step",
        default="auto",
        choices=["auto", "graph", "compile", "eager"],
        help="static engine: how a decode step runs (auto: CUDA graph on a GPU, eager on the CPU)",
    )
    s.add_argument(
        "--haystack",
        default=None,
        type=ExistingPath("file"),
        help="RULER essay haystack text file (default: the data folder's, else the packaged sample)",
    )
    s.add_argument(
        "--wordlists",
        default=None,
        type=ExistingPath(),
        help="folder with "
        "wonderwords-2.2.0_{noun,adjective,verb}list.txt (default: the data folder's, else the packaged)",
    )
    s.add_argument("--no-stop-newline", action="store_true", help="RULER: do not stop at the first newline")
    s.add_argument(
        "--records-dir",
        default=None,
        type=ExistingPath(),
        help="LongBench / InfiniteBench: folder of <task>.jsonl records (default: the data folder's, else the HF Hub)",
    )
    s.add_argument(
        "--max-length",
        type=POSITIVE,
        default=None,
        help="LongBench/InfiniteBench prompt truncation in "
        "tokens (default: LongBench the model's context, InfiniteBench 128K)",
    )
    s.add_argument("--chat", action="store_true", help="LongBench: apply the tokenizer's chat template")
    s.add_argument("--k", type=POSITIVE, default=1, help="math: samples per problem (avg@k)")
    s.add_argument("--temperature", type=TEMPERATURE, default=0.6, help="math: sampling temperature (>= 0)")
    s.add_argument("--top-p", type=TOP_P, default=0.95, help="math: nucleus sampling threshold, in (0, 1]")
    s.add_argument("--no-thinking", action="store_true", help="math: disable the chat template's thinking mode")
    s.set_defaults(func=cmd_sweep)

    m = add("merge", help="combine shard predictions into results.jsonl / scores.csv")
    m.add_argument("--out", required=True, help="the sweep run folder whose predictions/ to merge")
    m.set_defaults(func=cmd_merge)

    r = add("report", help="markdown tables + PNG plots from run folders")
    r.add_argument(
        "--run",
        action="append",
        required=True,
        type=ExistingPath(),
        help="a run folder (a sweep's, or a published one: config.json + results.jsonl); repeatable",
    )
    r.add_argument(
        "--fidelity",
        action="append",
        default=None,
        type=ExistingPath(),
        help="a fidelity run folder (fidelity_raw.jsonl); repeatable (default: none)",
    )
    r.add_argument("--out", required=True, help="folder the report is written to")
    r.add_argument("--title", default="Locks sweep", help="the report's title")
    r.add_argument("--name", default="report", help="file name stem of the report (<name>.md, <name>-*.png)")
    r.add_argument(
        "--notes",
        default=None,
        type=ExistingPath("file"),
        help="markdown file inserted under the title (default: none)",
    )
    r.add_argument(
        "--pool",
        action="store_true",
        help="also report the records of all --run folders together (independent draws of one benchmark, "
        "e.g. two --seed values), for the arms they share",
    )
    r.set_defaults(func=cmd_report)

    f = add("fidelity", help="selection fidelity on captured decode queries/keys")
    common(f)
    f.add_argument(
        "--records-from",
        default=None,
        type=ExistingPath(),
        help="a sweep run folder: use its records' prompts (default: generate RULER records)",
    )
    f.add_argument("--num-prompts", type=POSITIVE, default=2, help="prompts per task (and length)")
    f.add_argument("--steps", type=POSITIVE, default=8, help="decode steps captured per prompt")
    f.add_argument("--drop-full", action="store_true", help="leave the full-attention arm out")
    f.set_defaults(func=cmd_fidelity)

    g = add("ruler-generate", help="write RULER records (jsonl) for a model's tokenizer")
    common(g)
    g.add_argument(
        "--haystack",
        default=None,
        type=ExistingPath("file"),
        help="essay haystack text file (default: the data folder's, else the packaged sample)",
    )
    g.add_argument(
        "--wordlists",
        default=None,
        type=ExistingPath(),
        help="folder of the wonderwords lists (default: the data folder's, else the packaged)",
    )
    g.set_defaults(func=cmd_ruler_generate)

    i = add("infinitebench-score", help="score InfiniteBench prediction files (preds_<task>.jsonl)")
    i.add_argument(
        "--predictions",
        required=True,
        type=ExistingPath(),
        help="folder of preds_<task>.jsonl[.gz] files, named after the model (e.g. yi-34b-200k)",
    )
    i.add_argument(
        "--data-dir",
        default=None,
        type=ExistingPath(),
        help="data folder of the task spec (default: $LOCKS_HF_DATA, else the packaged spec)",
    )
    i.set_defaults(func=cmd_ib_score)

    return p


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    from .manifest import ManifestMismatch

    try:
        args.func(args)
    except (InputFileError, InputPathMissing, ManifestMismatch) as err:
        # a file or path the user gave (or a run folder's own file) cannot be used: the message names
        # it and what to do; a traceback would only bury that
        raise SystemExit(f"locks-hf-eval {args.cmd}: {err}") from None


if __name__ == "__main__":
    main()
