"""Passkey demo: one ~8K-token needle prompt answered with full attention, Locks, the oracle and Quest.

    python scripts/demo.py                       # Gemma 3 270M, 8000 tokens, budget 128
    python scripts/demo.py --arms full,r8i4,r4i2 --budget 256 --context-tokens 4000

The prompt is prefilled once (dense, in chunks) into a `LocksCache`; each arm decodes from a
`LocksCache.fork` of it with its own `LocksConfig`. The first answer token comes from the prefill
logits (dense for every method), so arms differ from the second token on. Per arm it prints the
answer, whether it holds the pass key, the share of cached tokens the full-attention layers attended
over the decode steps (`LocksCache.attended_fraction`; sliding-window layers are not counted) and
the decode wall time.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time

import torch

from .cache import LocksCache
from .compat import cache_keyword
from .config import LocksConfig
from .models import DEFAULT_MODEL, MODELS
from .selectors import config_for_family, family_help

DEFAULT_ARMS = "full,r8i4,oracle,quest"


def arm_config(arm: str, budget: int, page_size: int = 16) -> LocksConfig:
    """``full``, ``oracle``, ``quest``, a Locks summary label (``r8i4``, ``r4i2``, ``r8bf16``) or any
    registered selector's arm label (`locks_hf.selectors.parse_family`)."""
    return config_for_family(arm, budget=budget, page_size=page_size)


def prefill(
    model, input_ids: torch.LongTensor, cache: LocksCache, chunk_size: int = 1024, progress: bool = True
) -> torch.LongTensor:
    """Run the prompt through ``cache`` in chunks (dense); return the greedy next token ``[b, 1]``."""
    from tqdm.auto import tqdm

    total = input_ids.shape[1]
    logits = None
    with tqdm(total=total, unit="tok", desc="prefill", disable=not progress, file=sys.stderr) as bar:
        for start in range(0, total, chunk_size):
            chunk = input_ids[:, start : start + chunk_size]
            logits = model(chunk, **{cache_keyword(model): cache}, use_cache=True, logits_to_keep=1).logits
            bar.update(chunk.shape[1])
    assert logits is not None, "prefill: the prompt has no tokens"
    return logits[:, -1].argmax(-1, keepdim=True)


class StopOnNewline:
    """Stopping criterion: stop once the text generated after ``start`` contains a newline."""

    def __init__(self, tokenizer, start: int) -> None:
        self.tokenizer, self.start = tokenizer, start

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.Tensor:
        done = ["\n" in self.tokenizer.decode(row[self.start :]) for row in input_ids]
        return torch.tensor(done, device=input_ids.device)


def decode_from(
    model,
    input_ids: torch.LongTensor,
    first_token: torch.LongTensor,
    cache: LocksCache,
    max_new_tokens: int,
    tokenizer=None,
    stop_at_newline: bool = False,
) -> torch.Tensor:
    """Greedy continuation of a prefilled ``cache``: the new tokens ``[b, n]``, ``first_token`` included.

    ``generate`` is given prompt + first token and feeds only the token not in the cache yet.
    """
    if max_new_tokens <= 1:
        return first_token[:, :max_new_tokens]
    from transformers import StoppingCriteriaList

    start = input_ids.shape[1]
    criteria = StoppingCriteriaList([StopOnNewline(tokenizer, start)]) if stop_at_newline else None
    out = model.generate(
        torch.cat([input_ids, first_token], dim=-1),
        **{cache_keyword(model): cache},
        max_new_tokens=max_new_tokens - 1,
        do_sample=False,
        stopping_criteria=criteria,
        pad_token_id=getattr(model.generation_config, "pad_token_id", None),
    )
    return out[:, start:]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="locks-hf-demo",
        description="Answer one passkey needle-in-a-haystack prompt with full attention and sparse decode arms.",
    )
    parser.add_argument("--model", default=DEFAULT_MODEL, choices=sorted(MODELS), help="default: %(default)s")
    parser.add_argument(
        "--context-tokens", type=int, default=8000, help="prompt length in tokens (default: %(default)s)"
    )
    parser.add_argument(
        "--depth", type=float, default=0.5, help="needle depth in the filler, 0..1 (default: %(default)s)"
    )
    parser.add_argument(
        "--budget", type=int, default=128, help="token budget b per layer and KV head (default: %(default)s)"
    )
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page B (default: %(default)s)")
    parser.add_argument("--max-new-tokens", type=int, default=12, help="answer length limit (default: %(default)s)")
    parser.add_argument(
        "--no-stop-at-newline",
        dest="stop_at_newline",
        action="store_false",
        help="do not stop an answer at its first newline",
    )
    parser.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"comma-separated arms: {family_help()}; Locks labels also without the "
        "locks- prefix (r8i4, r4i2, r8bf16) (default: %(default)s)",
    )
    parser.add_argument("--seed", type=int, default=0, help="picks the pass key (default: %(default)s)")
    parser.add_argument(
        "--prefill-chunk", type=int, default=1024, help="prefill chunk in tokens (default: %(default)s)"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the one-time model conversion
    parser = build_parser()
    args = parser.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    try:
        configs = {arm: arm_config(arm, args.budget, args.page_size) for arm in arms}
    except ValueError as err:  # LocksConfigError included
        parser.error(str(err))
    if not arms:
        parser.error("--arms is empty")
    if args.threads:
        torch.set_num_threads(args.threads)

    from .models import encode_prompt, load_model
    from .needle import build_needle_prompt

    print(f"Loading {args.model} ({MODELS[args.model].description})", flush=True)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model)
    print(f"  loaded in {time.perf_counter() - start:.1f} s", flush=True)

    prompt = build_needle_prompt(tokenizer, args.context_tokens, args.depth, seed=args.seed)
    input_ids = encode_prompt(tokenizer, prompt.text)
    print(
        f"Prompt: {input_ids.shape[1]} tokens, pass key {prompt.answer} at token {prompt.needle_token} "
        f"(depth {args.depth}); budget b={args.budget} tokens per layer and KV head "
        f"({args.budget / input_ids.shape[1]:.1%} of the prompt)",
        flush=True,
    )

    with torch.inference_mode():
        # dynamic layout: each arm decodes a few tokens once, where a compiled step would cost more to
        # compile than it saves
        cache = LocksCache(model.config, LocksConfig(selector="full", page_size=args.page_size), layout="dynamic")
        start = time.perf_counter()
        first = prefill(model, input_ids, cache, args.prefill_chunk)
        print(f"  prefill (dense, once): {time.perf_counter() - start:.1f} s", flush=True)

        rows = []
        for config in configs.values():
            start = time.perf_counter()
            fork = cache.fork(config)
            new = decode_from(
                model, input_ids, first, fork, args.max_new_tokens, tokenizer, stop_at_newline=args.stop_at_newline
            )
            seconds = time.perf_counter() - start
            text = tokenizer.decode(new[0], skip_special_tokens=True)
            rows.append((config.label, text, prompt.answer in text, fork.attended_fraction(), seconds, new.shape[1]))
            del fork

    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'arm':<{width}}  {'found':<5}  {'attended':>8}  {'decode':>7}  answer")
    for label, text, found, attended, seconds, _tokens in rows:
        share = "n/a" if attended != attended else f"{attended:.1%}"
        print(f"{label:<{width}}  {'yes' if found else 'NO':<5}  {share:>8}  {seconds:6.2f}s  {text!r}")
    print(
        f"\n(attended: share of cached tokens read by the {len(cache.locks_layers)} full-attention layers "
        f"over the decode steps; {len(cache.layers) - len(cache.locks_layers)} sliding-window layers are "
        "not counted. The first token comes from the dense prefill for every arm.)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
