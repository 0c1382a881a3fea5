#!/usr/bin/env python
"""Whether torch's saved compiled frames ("caching precompile") skip dynamo's trace of a decode step.

With warm inductor and Triton caches, a static cache's first ``generate()`` is nearly all dynamo
tracing the forward again (docs/performance.md). torch >= 2.8 can save what dynamo produced (guards and
bytecode) and load it in the next process when ``torch._dynamo.config.caching_precompile`` is on and
``torch.compiler.save_cache_artifacts()`` was called after the compile. This probe compiles one decode
step of a random-weight Llama (``torch.compile(model.__call__, fullgraph=True)``, inductor, as
``generate()`` compiles it) in four fresh processes sharing one cache folder:

  cold   empty caches;
  warm   the caches the cold run left (dynamo traces again);
  save   caching precompile on, the compile's frames saved;
  load   caching precompile on, the saved frames loaded instead of traced.

    python scripts/dev/saved_frames.py --layers 32 --out runs/saved_frames.json
    TRITON_INTERPRET=1 python scripts/dev/saved_frames.py --cache locks-kernels   # the library's graph

Each row gives the first call's seconds, the second call's, whether the logits equal the cold run's, torch's
``dynamo_cache`` counters, and the error a run ended with. Caching precompile is an experimental torch
feature that drops identity guards (it logs each one); the library does not turn it on.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

MODES = ("cold", "warm", "save", "load")


def _child(mode: str, cache_kind: str, layers: int) -> dict:
    import torch

    if mode in ("save", "load"):
        torch._dynamo.config.caching_precompile = True
    from torch._dynamo.utils import counters

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trace_time import _model, make_cache, on_kernels  # the trace probe's model and caches

    torch.manual_seed(0)
    model = _model(layers).eval()
    cache = make_cache(cache_kind, model, 128)
    ids = torch.randint(0, 1000, (1, 64), generator=torch.Generator().manual_seed(1))
    row: dict = {"mode": mode, "cache": cache_kind, "layers": layers}
    try:
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
            if cache_kind == "locks-kernels":
                on_kernels(cache)
            step = torch.compile(model.__call__, fullgraph=True)
            token = ids[:, -1:]
            start = time.perf_counter()
            out = step(token, past_key_values=cache, cache_position=torch.tensor([64]), use_cache=True)
            row["first_call_s"] = round(time.perf_counter() - start, 3)
            start = time.perf_counter()
            step(token, past_key_values=cache, cache_position=torch.tensor([65]), use_cache=True)
            row["second_call_s"] = round(time.perf_counter() - start, 4)
            row["logits"] = out.logits[0, -1, :8].tolist()
        if mode == "save":
            torch.compiler.save_cache_artifacts()
    except Exception as e:  # the probe reports how a mode fails; it does not stop at it
        row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        row["where"] = traceback.extract_tb(e.__traceback__)[-1].filename.split("site-packages/")[-1]
    row["dynamo_cache"] = dict(counters["dynamo_cache"])
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--cache", default="hf-static", choices=["hf-static", "locks-kernels"])
    ap.add_argument("--out", type=Path)
    ap.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print("ROW " + json.dumps(_child(args.child, args.cache, args.layers)))
        return []
    rows = []
    with tempfile.TemporaryDirectory(prefix="saved-frames-") as folder:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=f"{folder}/inductor", TRITON_CACHE_DIR=f"{folder}/triton")
        for mode in MODES:
            cmd = [sys.executable, __file__, "--child", mode, "--cache", args.cache, "--layers", str(args.layers)]
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            rows.append(json.loads(found[0]) if found else {"mode": mode, "error": done.stderr.strip()[-300:]})
    cold = rows[0].get("logits")
    print(f"{'mode':<6} {'first call s':>12} {'second s':>9} {'same logits':>11} {'dynamo_cache':<28} error")
    for r in rows:
        r["same_logits"] = cold is not None and r.get("logits") == cold
        print(
            f"{r['mode']:<6} {r.get('first_call_s', float('nan')):>12.2f} {r.get('second_call_s', float('nan')):>9.4f} "
            f"{r['same_logits']!s:>11} {json.dumps(r.get('dynamo_cache', {})):<28} {r.get('error', '')}"
        )
    if args.out:
        import torch
        import transformers

        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "transformers": transformers.__version__, "python": sys.version.split()[0]}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return rows


if __name__ == "__main__":
    main()
