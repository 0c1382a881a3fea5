"""How a record is decoded, whatever the engine: its `RecordPlan`, the protocol texts of the run's
config, and the model/tokenizer facts both engines read (EOS and padding ids, per-sample seeds).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from .benchmarks import encode_text


def eos_ids(model, tokenizer) -> set[int]:
    """Every EOS id the model's generation config, its config and the tokenizer name."""
    ids: set[int] = set()
    for src in (getattr(model, "generation_config", None), model.config, tokenizer):
        e = getattr(src, "eos_token_id", None)
        if e is None:
            continue
        ids.update(e if isinstance(e, (list, tuple)) else [e])
    return ids


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


def context_length(bench, rec: dict, tok, prefilled: int) -> int:
    """Tokens of the prompt's context (before the question), at most the ``prefilled`` tokens."""
    q = bench.question_start_text(rec)
    if q is None:
        return prefilled
    return min(encode_text(tok, bench.prompt_text(rec)[:q]).shape[1], prefilled)


def stable_seed(*parts) -> int:
    """A seed from ``parts`` that is the same in every process (Python's ``hash`` of a string is not)."""
    return int(hashlib.sha256(repr(parts).encode()).hexdigest()[:8], 16)


def pad_id(tok, eos) -> int:
    """The tokenizer's pad id, else the smallest EOS id (else 0)."""
    p = getattr(tok, "pad_token_id", None)
    if p is not None:
        return p
    return min(eos) if eos else 0


#: The protocols in words (``config.json``'s ``protocol_text``; `runner` says more).
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
