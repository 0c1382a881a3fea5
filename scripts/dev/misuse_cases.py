#!/usr/bin/env python
"""Misuse cases a careful user tries, on tiny random models: each ends as a clear error, a correct
result, a silent wrong result, or a crash (an error from deep inside torch / transformers).

    python scripts/dev/misuse_cases.py --out runs/misuse.json      # a table on stdout, every case in the JSON

A case's function returns ``"correct"`` or ``"silent: <why>"``; a library error (`LocksConfigError`,
`UnsupportedModelError`, a ValueError / FileNotFoundError with a message from locks_hf, or an argparse
exit) counts as a clear error; any other exception as a crash.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, BloomConfig, DeepseekV3Config, FalconConfig, Gemma2Config, MptConfig

import locks_hf
import locks_hf.eval as locks_hf_eval
from locks_hf import LocksCache, LocksConfig, LocksConfigError, LocksStaticCache, UnsupportedModelError
from locks_hf.models import TINY_ARCHS, tiny_config, tiny_model

#: The package folders (the eval harness may live outside locks_hf/ in a source checkout).
LIBRARY = [Path(m.__file__).resolve().parent for m in (locks_hf, locks_hf_eval)]
CASES: dict[str, object] = {}


def case(name):
    def register(fn):
        CASES[name] = fn
        return fn

    return register


def tiny(arch, attn="locks", seed=0):
    model = tiny_model(arch, attn_implementation=attn, seed=seed).to(torch.float64)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    return model


def ids(n=100, b=1, seed=1):
    return torch.randint(8, 256, (b, n), generator=torch.Generator().manual_seed(seed))


def same(a, b, what):
    return "correct" if torch.equal(a, b) else f"silent: {what}"


# -- generate() options and model loading ----------------------------------------------------------
for arch in TINY_ARCHS:

    @case(f"{arch}: covering budget equals dense")
    def _(arch=arch):
        out = tiny(arch).generate(
            ids(), max_new_tokens=6, do_sample=False, past_key_values=LocksCache(tiny(arch).config, budget=1024)
        )
        return same(out, tiny(arch, "sdpa").generate(ids(), max_new_tokens=6, do_sample=False), "differs from dense")

    @case(f"{arch}: prompt-lookup decoding")
    def _(arch=arch):
        model = tiny(arch)
        cache = LocksCache(model.config, budget=32)
        model.generate(ids(), max_new_tokens=8, do_sample=False, prompt_lookup_num_tokens=3, past_key_values=cache)
        return "silent: ran as something other than Locks decode"

    @case(f"{arch}: assisted decoding")
    def _(arch=arch):
        model = tiny(arch)
        cache = LocksCache(model.config, budget=32)
        model.generate(
            ids(), max_new_tokens=8, do_sample=False, assistant_model=tiny(arch, "sdpa", seed=1), past_key_values=cache
        )
        return "silent: ran as something other than Locks decode"

    for attn in ("sdpa", "eager"):

        @case(f"{arch}: LocksCache(model.config) on an {attn} model")
        def _(arch=arch, attn=attn):
            model = tiny(arch, attn)
            cache = LocksCache(model.config, budget=32)
            model.generate(ids(), max_new_tokens=4, do_sample=False, past_key_values=cache)
            return "silent: decoded densely"

    @case(f"{arch}: LocksCache() without config on an sdpa model")
    def _(arch=arch):
        model = tiny(arch, "sdpa")
        cache = LocksCache(budget=32)
        model.generate(ids(), max_new_tokens=4, do_sample=False, past_key_values=cache)
        return "silent: decoded densely"

    @case(f"{arch}: a NaN row in a batch of two")
    def _(arch=arch):
        dense, model = tiny(arch, "sdpa"), tiny(arch)
        for m in (dense, model):
            with torch.no_grad():
                m.get_input_embeddings().weight[7] = float("nan")
        batch = ids(120, 2)
        batch[1, 50] = 7
        got = model.generate(
            batch, max_new_tokens=4, do_sample=False, past_key_values=LocksCache(model.config, budget=32)
        )
        alone = model.generate(
            batch[:1], max_new_tokens=4, do_sample=False, past_key_values=LocksCache(model.config, budget=32)
        )
        want = dense.generate(batch, max_new_tokens=4, do_sample=False)
        return "correct" if torch.equal(got[1], want[1]) and torch.equal(got[:1], alone) else "silent: rows differ"


def _deepseek():
    return DeepseekV3Config(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        num_hidden_layers=2,
        vocab_size=256,
        intermediate_size=64,
        moe_intermediate_size=32,
        kv_lora_rank=16,
        q_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        first_k_dense_replace=2,
    )


FAMILIES = {
    "bloom (ALiBi)": lambda: BloomConfig(hidden_size=64, n_head=4, n_layer=2, vocab_size=256),
    "mpt (ALiBi)": lambda: MptConfig(d_model=64, n_heads=4, n_layers=2, vocab_size=256),
    "falcon (ALiBi)": lambda: FalconConfig(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256, alibi=True
    ),
    "falcon (RoPE)": lambda: FalconConfig(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=256),
    "deepseek-v3 (MLA)": _deepseek,
    "gemma2 (soft-capping)": lambda: Gemma2Config(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2
    ),
}
for family, make in FAMILIES.items():

    @case(f"{family}: LocksCache(config)")
    def _(make=make):
        LocksCache(make())
        return "silent: accepted"

    @case(f"{family}: loaded with attn_implementation='locks', forward with LocksCache()")
    def _(make=make):
        model = AutoModelForCausalLM.from_config(make(), attn_implementation="locks")
        model(ids(20), past_key_values=LocksCache())
        return "silent: ran"


@case("llama model, LocksCache built from gemma3's config")
def _():
    tiny("llama")(ids(), past_key_values=LocksCache(tiny("gemma3").config, budget=32))
    return "silent: ran"


@case("gemma3 model, LocksCache built from llama's config")
def _():
    tiny("gemma3")(ids(), past_key_values=LocksCache(tiny("llama").config, budget=32))
    return "silent: ran"


@case("llama model, LocksCache built from a 1-layer config")
def _():
    config = tiny_config("llama", num_hidden_layers=1)
    config._attn_implementation = "locks"
    tiny("llama")(ids(), past_key_values=LocksCache(config, budget=32))
    return "silent: ran"


# -- LocksStaticCache ------------------------------------------------------------------------------
@case("LocksStaticCache overflow during decode")
def _():
    model = tiny("llama")
    model.generate(
        ids(100),
        past_key_values=LocksStaticCache(model.config, max_cache_len=112, budget=32),
        max_new_tokens=20,
        do_sample=False,
    )
    return "silent: wrote past max_cache_len"


@case("LocksStaticCache max_cache_len not a whole number of pages")
def _():
    model = tiny("llama")
    model.generate(
        ids(100),
        past_key_values=LocksStaticCache(model.config, max_cache_len=105, budget=32),
        max_new_tokens=10,
        do_sample=False,
    )
    return "silent: wrote past max_cache_len (rounded up to a page)"


@case("LocksStaticCache holds exactly max_cache_len")
def _():
    model = tiny("llama")
    out = model.generate(
        ids(100),
        past_key_values=LocksStaticCache(model.config, max_cache_len=110, budget=32),
        max_new_tokens=11,
        do_sample=False,
    )
    return "correct" if out.shape[1] == 111 else "silent: wrong length"


# -- LocksConfig ----------------------------------------------------------------------------------
for label, kwargs in {
    "basis_bits=4.0": {"basis_bits": 4.0},
    "rank=True": {"rank": True},
    "page_size=2**40": {"page_size": 2**40},
    "budget=128.0": {"budget": 128.0},
}.items():

    @case(f"LocksConfig({label})")
    def _(kwargs=kwargs):
        model = tiny("llama")
        model.generate(ids(), past_key_values=LocksCache(model.config, LocksConfig(**kwargs)), max_new_tokens=2)
        return "silent: accepted"


@case("LocksConfig.from_label(None)")
def _():
    LocksConfig.from_label(None)
    return "silent: accepted"


@case("fork(rank=32) on head_dim 16")
def _():
    model = tiny("llama")
    cache = LocksCache(model.config, budget=32)
    model(ids(), past_key_values=cache)
    fork = cache.fork(LocksConfig(rank=32, page_size=32, budget=64))
    model(ids(1), past_key_values=fork)
    return "silent: ran"


@case("decode_compile_config with a misspelt inductor option")
def _():
    locks_hf.decode_compile_config({"combo_kernel": True})
    return "silent: accepted"


@case("decode_compile_config asking inductor for its own CUDA graphs")
def _():
    locks_hf.decode_compile_config({"triton.cudagraphs": True})
    return "silent: accepted"


# -- the eval harness -----------------------------------------------------------------------------
@case("RULER vt records under two PYTHONHASHSEEDs")
def _():
    code = (
        "import json; from locks_hf.eval.ruler import RulerGenerator; from locks_hf.eval.testing import "
        "ByteTokenizer; print(json.dumps([RulerGenerator(ByteTokenizer()).record('vt', 4096, i) for i in range(3)]))"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": s},
        ).stdout
        for s in ("1", "2")
    }
    return "correct" if len(outs) == 1 else "silent: records differ"


def _prediction(**changes):
    row = {
        "id": "vt-4096-0",
        "task": "vt",
        "length": 4096,
        "arm": "full",
        "family": "full",
        "budget": None,
        "selector": "full",
        "sample": 0,
        "pred": "",
        "score": 1.0,
    }
    return json.dumps({**row, **changes}, ensure_ascii=False) + "\n"


@case("merge after a kill tore a line inside a UTF-8 character")
def _():
    from locks_hf.eval.merge import merge

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "predictions" / "shard-0-of-1.jsonl"
        path.parent.mkdir()
        torn = _prediction(id="vt-4096-1", pred="Ωμέγα").encode()
        path.write_bytes(_prediction().encode() + torn[: torn.index("Ω".encode()) + 1])
        return "correct" if merge(tmp)["rows"] == 1 else "silent: wrong rows"


@case("merge of a JSON row without id")
def _():
    from locks_hf.eval.merge import merge

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "predictions" / "shard-0-of-1.jsonl"
        path.parent.mkdir()
        path.write_text(_prediction() + '{"task": "vt"}\n')
        merge(tmp)
        return "silent: merged"


@case("LongBench with no data and no Hub")
def _():
    import locks_hf.eval.longbench as lb
    from locks_hf.eval.testing import ByteTokenizer

    def offline(task):
        raise ConnectionError("offline")

    with tempfile.TemporaryDirectory() as tmp:
        old, os.environ["LOCKS_HF_DATA"] = os.environ.get("LOCKS_HF_DATA"), tmp
        saved = getattr(lb, "_hub_records", None)
        lb._hub_records = offline
        try:
            n = len(lb.LongBenchBenchmark(ByteTokenizer(), ["multi_news"], num_samples=50).records())
        finally:
            lb._hub_records = saved
            os.environ.pop("LOCKS_HF_DATA") if old is None else os.environ.__setitem__("LOCKS_HF_DATA", old)
        return f"silent: ran {n} packaged sample records"


SWEEP = [
    "sweep",
    "--model",
    "tiny-llama",
    "--tasks",
    "niah_single_1",
    "--lengths",
    "1024",
    "--num-samples",
    "1",
    "--arms",
    "full",
    "--budgets",
    "64",
    "--max-new-tokens",
    "2",
]
for flag, value in [
    ("--max-new-tokens", "0"),
    ("--lengths", "0"),
    ("--num-samples", "-3"),
    ("--shard", "abc"),
    ("--dtype", "float99"),
    ("--shard", "3/2"),
]:

    @case(f"locks-hf-eval sweep {flag} {value}")
    def _(flag=flag, value=value):
        from locks_hf.eval.cli import main

        args = list(SWEEP)
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
        with tempfile.TemporaryDirectory() as tmp:
            main(args + ["--out", str(Path(tmp) / "run")])
        return "silent: ran"


@case("locks-hf-eval merge --out <typo>")
def _():
    from locks_hf.eval.cli import main

    with tempfile.TemporaryDirectory() as tmp:
        main(["merge", "--out", str(Path(tmp) / "typo")])
        return "silent: created an empty run" if (Path(tmp) / "typo").exists() else "silent: exit 0"


@case("a conversion killed mid-way leaves work folders")
def _():
    import socket

    from locks_hf import models

    with tempfile.TemporaryDirectory() as tmp:
        target = Path(tmp) / "smollm2-135m"
        target.mkdir()
        (target / models._MARKER).write_text(json.dumps({"format": models.CACHE_FORMAT}))
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait()
        stale = Path(tmp) / f".smollm2-135m.tmp-{socket.gethostname()}@{child.pid}-x"
        stale.mkdir()
        models.convert("smollm2-135m", cache_dir=tmp)
        return "silent: left behind" if stale.exists() else "correct"


def classify(fn) -> tuple[str, str]:
    try:
        result = fn()
    except SystemExit as err:  # argparse or the CLI's own message
        return ("clear error", f"exit {err.code}") if err.code not in (0, None) else ("silent", "exit 0")
    except Exception as err:  # noqa: BLE001 - classifying is the point
        last = Path(traceback.extract_tb(err.__traceback__)[-1].filename).resolve()
        ours = any(folder in last.parents for folder in LIBRARY)
        if isinstance(err, (LocksConfigError, UnsupportedModelError)) or (
            isinstance(err, (ValueError, FileNotFoundError)) and ours
        ):
            return "clear error", f"{type(err).__name__}: {str(err)[:120]}"
        return "crash", f"{type(err).__name__}: {str(err)[:120]}"
    if result == "correct":
        return "correct", ""
    return "silent", result.removeprefix("silent: ")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="write every case and its outcome to this JSON file")
    ap.add_argument("--only", default=None, help="run the cases whose name contains this text")
    args = ap.parse_args(argv)
    rows = []
    for name, fn in CASES.items():
        if args.only and args.only not in name:
            continue
        outcome, detail = classify(fn)
        rows.append({"case": name, "outcome": outcome, "detail": detail})
        print(f"{outcome:12s} {name}" + (f"  [{detail}]" if detail else ""), flush=True)
    counts = collections.Counter(r["outcome"] for r in rows)
    print(
        f"\ntried {len(rows)}: " + ", ".join(f"{k} {counts[k]}" for k in ("clear error", "correct", "silent", "crash"))
    )
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"counts": counts, "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
