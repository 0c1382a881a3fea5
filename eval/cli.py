"""``locks-hf-eval``: sweep / merge / report / fidelity / ruler-generate / infinitebench-score.

Examples::

    locks-hf-eval sweep --benchmark ruler --model gemma3-270m --tasks niah_single_1,vt --lengths 4096 \\
        --num-samples 10 --arms full,oracle,locks-r8i4,locks-r4i4,quest --budgets 64,128,256,512 --out runs/ruler4k
    locks-hf-eval sweep ... --shard 0/2          # this process does shard 0 of 2; then `merge`
    accelerate launch -m locks_hf.eval.cli sweep ...   # one shard per process, rank 0 merges
    locks-hf-eval report --run runs/ruler4k --out runs/ruler4k-report
    locks-hf-eval fidelity --model gemma3-270m --records-from runs/ruler4k --num-prompts 4 --out runs/fid
    locks-hf-eval infinitebench-score --predictions ../shared/data/infinitebench/reference_predictions/yi-34b-200k
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

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
        extra = {"head_dim": int(width)} if width else {}
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


def _positive_int(text: str) -> int:
    """argparse type: an int >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_int_list(text: str) -> str:
    """argparse type: comma-separated ints >= 1 (kept as text; the commands split it)."""
    for item in _split(text):
        _positive_int(item)
    return text


def _shard(text: str) -> str:
    """argparse type: ``i/n`` with ``0 <= i < n``, checked before any model loads."""
    from .runner import parse_shard

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
        return RulerBenchmark(tokenizer, tasks, [int(x) for x in _split(args.lengths) or ["4096"]],
                              num_samples=args.num_samples, seed=args.seed, data_dir=args.data_dir,
                              haystack_path=args.haystack, wordlist_dir=args.wordlists,
                              stop_at_newline=not args.no_stop_newline)
    if args.benchmark == "longbench":
        from .longbench import LongBenchBenchmark

        return LongBenchBenchmark(tokenizer, _split(args.tasks) or ["multi_news"], max_length=args.max_length,
                                  num_samples=args.num_samples, records_dir=args.records_dir, data_dir=args.data_dir,
                                  chat=args.chat)
    if args.benchmark == "infinitebench":
        from .infinitebench import InfiniteBenchBenchmark

        return InfiniteBenchBenchmark(tokenizer, _split(args.tasks) or ["passkey"],
                                      lengths=[int(x) for x in _split(args.lengths) or ["4096"]],
                                      num_samples=args.num_samples, seed=args.seed, records_dir=args.records_dir,
                                      data_dir=args.data_dir, max_length=args.max_length)
    if args.benchmark == "math":
        from .mathbench import MathBenchmark

        return MathBenchmark(tokenizer, _split(args.tasks) or ["math500"], num_samples=args.num_samples,
                             k=args.k, temperature=args.temperature, top_p=args.top_p,
                             max_new_tokens=args.max_new_tokens or 4096, thinking=not args.no_thinking,
                             data_dir=args.data_dir)
    raise SystemExit(f"unknown benchmark {args.benchmark}")


def cmd_sweep(args):
    _threads(args.threads)
    from .arms import parse_arms
    from .runner import SweepRunner, merge

    not_run: list[tuple[str, str]] = []
    arms = parse_arms(_split(args.arms), [int(b) for b in _split(args.budgets)], page_size=args.page_size,
                      not_run=not_run)
    for name, reason in not_run:
        logger.warning("not run: %s: %s", name, reason)
    t0 = time.time()
    model, tok = load_any_model(args.model, _device(args.device), args.dtype)
    logger.info("loaded %s in %.0f s", args.model, time.time() - t0)
    bench = build_benchmark(args, tok)
    runner = SweepRunner(model, tok, bench, arms, args.out, protocol=args.protocol, shard=args.shard,
                         model_name=args.model, limit=args.limit, max_new_tokens=args.max_new_tokens
                         if args.benchmark != "math" else None, seed=args.seed or 0, not_run=not_run,
                         engine=args.engine, batch_rows=args.batch_rows, step=args.step,
                         allow_manifest_change=args.allow_manifest_change)
    from .manifest import ManifestMismatch

    try:
        runner.run()
    except ManifestMismatch as err:
        raise SystemExit(f"locks-hf-eval sweep: {err}") from None
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
    from .runner import merge

    try:
        info = merge(args.out)
    except FileNotFoundError as err:
        raise SystemExit(f"locks-hf-eval merge: {err}") from None
    print(json.dumps(info))


def cmd_report(args):
    from .report import write_report

    path = write_report([Path(r) for r in args.run], Path(args.out), title=args.title, name=args.name,
                        fidelity_dirs=[Path(f) for f in (args.fidelity or [])],
                        notes=Path(args.notes).read_text() if args.notes else None)
    print(path)


def cmd_fidelity(args):
    _threads(args.threads)
    import torch

    from .arms import parse_arms
    from .benchmarks import RulerBenchmark, encode_text
    from .fidelity import run_fidelity

    arms = parse_arms(_split(args.arms), [int(b) for b in _split(args.budgets)], page_size=args.page_size)
    arms = [a for a in arms if a.family != "full"] if args.drop_full else arms
    model, tok = load_any_model(args.model, _device(args.device), args.dtype)
    prompts = []
    if args.records_from:
        from .runner import _jsonl

        recs = []
        for p in sorted((Path(args.records_from) / "records").glob("*.jsonl")):
            recs += _jsonl(p)
        tasks = _split(args.tasks)
        lengths = [int(x) for x in _split(args.lengths)]
        recs = [r for r in recs if (not tasks or r["task"] in tasks) and (not lengths or r["length"] in lengths)]
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

        bench = RulerBenchmark(tok, _split(args.tasks) or list(TASKS[:1]),
                               [int(x) for x in _split(args.lengths) or ["4096"]], num_samples=args.num_prompts,
                               data_dir=args.data_dir)
        for r in bench.records():
            prompts.append((r["id"], bench.prompt_ids(r, tok)))
    with torch.no_grad():
        run_fidelity(model, prompts, arms, args.out, steps=args.steps, page_size=args.page_size)
    logger.info("wrote %s/fidelity.csv", args.out)


def cmd_ruler_generate(args):
    from .ruler import RulerGenerator, RulerSources

    tok = load_tokenizer_only(args.model)
    gen = RulerGenerator(tok, RulerSources(haystack_path=args.haystack, wordlist_dir=args.wordlists,
                                           data_dir=args.data_dir), seed=args.seed)
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


def build_parser() -> argparse.ArgumentParser:
    """The ``locks-hf-eval`` argument parser (every sub-command)."""
    p = argparse.ArgumentParser(prog="locks-hf-eval", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--model", default="gemma3-270m", help="gemma3-270m | smollm2-135m | tiny-<llama|gemma3|qwen3>[-d<head_dim>]")
        sp.add_argument("--device", default=None, help="cpu | cuda | cuda:N (default: cuda when available, else cpu)")
        sp.add_argument("--dtype", default="float32", choices=DTYPES, help="model weights and K/V dtype")
        sp.add_argument("--threads", type=_positive_int, default=None, help="torch.set_num_threads (CPU)")
        sp.add_argument("--arms", default="full,oracle,locks-r8i4,locks-r4i4,locks-r2i4,quest",
                        help="comma-separated arm families: full, oracle, quest, locks-r<rank>i<bits> (or r8i4), "
                        "locks-r<rank>bf16, locks-r<rank>i<bits>-rr<m> (exact re-ranking of m*k candidate pages), "
                        "shared_basis-r<rank>, shared_all-r<rank>, the baselines rocketkv, shadowkv, rkv, "
                        "triattention, lazy_eviction; each but full runs at every budget (an arm whose method does not "
                        "fit its budget is listed as not run)")
        sp.add_argument("--budgets", default="64,128,256,512,1024,2048", type=_positive_int_list,
                        help="comma-separated token budgets b per layer and KV head")
        sp.add_argument("--page-size", type=_positive_int, default=16, help="tokens per page B")
        sp.add_argument("--tasks", default=None, help="comma-separated task names of the benchmark (default: RULER all 13, "
                        "LongBench multi_news, InfiniteBench passkey, math math500)")
        sp.add_argument("--lengths", default=None, type=_positive_int_list, help="comma-separated prompt lengths in tokens for generated tasks "
                        "(RULER, InfiniteBench; default 4096)")
        sp.add_argument("--num-samples", type=_positive_int, default=10, help="records per task (and length)")
        sp.add_argument("--seed", type=int, default=None, help="seed of record generation (default: the benchmark's)")
        sp.add_argument("--data-dir", default=None, help="evaluation data (layout of shared/data); default: "
                        "$LOCKS_HF_DATA, ../shared/data, else packaged samples")
        sp.add_argument("--out", required=True, help="run folder (created; an existing one is resumed)")

    s = sub.add_parser("sweep", help="run arms over a benchmark (resumable)")
    common(s)
    s.add_argument("--benchmark", default="ruler", choices=["ruler", "longbench", "infinitebench", "math"],
                   help="which benchmark the records come from")
    s.add_argument("--protocol", default="dense-question", choices=["dense-question", "sparse-question"],
                   help="dense-question: the whole prompt is prefilled densely; sparse-question: the question "
                   "tokens are fed one by one through sparse decode steps")
    s.add_argument("--shard", default=None, type=_shard, help="i/n: this process runs records j with j %% n == i")
    s.add_argument("--allow-manifest-change", action="store_true",
                   help="resume a run folder although its manifest.json (library version, git commit, "
                   "transformers / torch versions, data file hashes, seeds) differs; the change is recorded")
    s.add_argument("--limit", type=_positive_int, default=None, help="first N records only")
    s.add_argument("--max-new-tokens", type=_positive_int, default=None, help="cap on generated tokens (math: the generation cap)")
    s.add_argument("--engine", default="eager", choices=["eager", "static"],
                   help="eager: each (record, arm, sample) through generate() on a fork of a LocksCache; static: "
                        "batched rows, one prefill per batch shared by every arm, CUDA-graph decode on a GPU (arms "
                        "it cannot decode, e.g. token-level baselines, take the eager path)")
    s.add_argument("--batch-rows", type=_positive_int, default=8, help="static engine: rows (records x samples) per batch")
    s.add_argument("--step", default="auto", choices=["auto", "graph", "compile", "eager"],
                   help="static engine: how a decode step runs (auto: CUDA graph on a GPU, eager on the CPU)")
    s.add_argument("--haystack", default=None, help="RULER essay haystack text file")
    s.add_argument("--wordlists", default=None, help="folder with wonderwords-2.2.0_{noun,adjective,verb}list.txt")
    s.add_argument("--no-stop-newline", action="store_true", help="RULER: do not stop at the first newline")
    s.add_argument("--records-dir", default=None, help="LongBench / InfiniteBench local <task>.jsonl folder")
    s.add_argument("--max-length", type=_positive_int, default=None, help="LongBench/InfiniteBench prompt truncation (tokens)")
    s.add_argument("--chat", action="store_true", help="LongBench: apply the tokenizer's chat template")
    s.add_argument("--k", type=_positive_int, default=1, help="math: samples per problem (avg@k)")
    s.add_argument("--temperature", type=float, default=0.6, help="math: sampling temperature")
    s.add_argument("--top-p", type=float, default=0.95, help="math: nucleus sampling threshold")
    s.add_argument("--no-thinking", action="store_true", help="math: disable the chat template's thinking mode")
    s.set_defaults(func=cmd_sweep)

    m = sub.add_parser("merge", help="combine shard predictions into results.jsonl / scores.csv")
    m.add_argument("--out", required=True, help="the sweep run folder whose predictions/ to merge")
    m.set_defaults(func=cmd_merge)

    r = sub.add_parser("report", help="markdown tables + PNG plots from run folders")
    r.add_argument("--run", action="append", required=True)
    r.add_argument("--fidelity", action="append", default=None)
    r.add_argument("--out", required=True)
    r.add_argument("--title", default="Locks sweep")
    r.add_argument("--name", default="report")
    r.add_argument("--notes", default=None, help="markdown file inserted under the title")
    r.set_defaults(func=cmd_report)

    f = sub.add_parser("fidelity", help="selection fidelity on captured decode queries/keys")
    common(f)
    f.add_argument("--records-from", default=None, help="a sweep run folder: use its records' prompts")
    f.add_argument("--num-prompts", type=_positive_int, default=2, help="prompts per task (and length)")
    f.add_argument("--steps", type=_positive_int, default=8, help="decode steps captured per prompt")
    f.add_argument("--drop-full", action="store_true")
    f.set_defaults(func=cmd_fidelity)

    g = sub.add_parser("ruler-generate", help="write RULER records (jsonl) for a model's tokenizer")
    common(g)
    g.add_argument("--haystack", default=None)
    g.add_argument("--wordlists", default=None)
    g.set_defaults(func=cmd_ruler_generate)

    i = sub.add_parser("infinitebench-score", help="score InfiniteBench prediction files (preds_<task>.jsonl)")
    i.add_argument("--predictions", required=True)
    i.add_argument("--data-dir", default=None)
    i.set_defaults(func=cmd_ib_score)

    return p


def main(argv=None):
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
