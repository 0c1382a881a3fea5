#!/usr/bin/env python
"""On a GPU: the static layout (pages summarized in place by `update_completed_pages`) against the
dynamic layout (batched `build_summary`) on the kernels, tiny Llama (d = 64, float32): the first
token where their greedy generations part, and how the page summaries of the two differ (bytes
equal, or the largest difference per tensor). Prints a table; ``--out`` writes JSON."""

from __future__ import annotations

import argparse
import json

import torch

from locks_hf import LocksCache, LocksConfig
from locks_hf.models import tiny_model


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt", type=int, default=600)
    ap.add_argument("--new", type=int, default=150)
    ap.add_argument("--budgets", default="64,128")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of the script (reference path)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model = tiny_model("llama", head_dim=64).to(args.device)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    ids = torch.randint(3, 256, (1, args.prompt), generator=torch.Generator().manual_seed(1)).to(args.device)
    report = []
    for budget in (int(b) for b in args.budgets.split(",")):
        caches = {
            layout: LocksCache(
                model.config, LocksConfig(budget=budget), layout=layout, max_cache_len=args.prompt + args.new + 16
            )
            for layout in ("static", "dynamic")
        }
        outs = {
            layout: model.generate(
                ids, max_new_tokens=args.new, do_sample=False, disable_compile=True, past_key_values=cache
            )[0, args.prompt :]
            for layout, cache in caches.items()
        }
        differ = (outs["static"] != outs["dynamic"]).nonzero()
        first = int(differ[0]) if len(differ) else None
        pages = (args.prompt + args.new - 1) // 16  # complete pages (the last token is never fed)
        diffs = {}
        for li, (s, d) in enumerate(zip(caches["static"].locks_layers, caches["dynamic"].locks_layers)):
            for name in s.summary:
                a, b = s.summary[name][:, :, :pages].float(), d.summary[name][:, :, :pages].float()
                bad = (a != b).flatten(3).any(-1)  # [b, h, P]: pages whose bytes differ
                diffs[f"L{li}.{name}"] = {
                    "pages_differ": int(bad.sum()),
                    "max_abs": float((a - b).abs().max()),
                    "first_page": int(bad.nonzero()[0, -1]) if bad.any() else None,
                }
        row = {"budget": budget, "first_differing_token": first, "summaries": diffs}
        report.append(row)
        print(f"b={budget}: first differing token {first} of {args.new}")
        for k, v in diffs.items():
            if v["pages_differ"]:
                print(
                    f"  {k:<22} {v['pages_differ']:4d} pages differ (first {v['first_page']}), max |diff| {v['max_abs']:.3g}"
                )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return {"rows": report}


if __name__ == "__main__":
    main()
