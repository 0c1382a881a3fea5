"""A passkey needle in a Paul Graham haystack, sized in tokens of the model's tokenizer.

The task follows the passkey retrieval of LongLoRA / RULER: an instruction, filler text with the
paragraph ``The pass key is 71432. Remember it. 71432 is the pass key.`` inserted at a relative
depth, and the question ``What is the pass key? The pass key is`` for a base model (no chat template) to
complete. The filler is ``data/haystack_sample.txt``, four whole essays (about 41.8K characters, 10K
Gemma 3 tokens) of the needle-in-a-haystack corpus; longer prompts repeat it.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache
from importlib.resources import files
from pathlib import Path

from .models import encode_prompt

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
NEEDLE = "The pass key is {answer}. Remember it. {answer} is the pass key."
QUESTION = "What is the pass key? The pass key is"


@dataclass(frozen=True)
class NeedlePrompt:
    """A built prompt. Unpacks as ``text, answer = build_needle_prompt(...)``.

    Attributes:
        text: the prompt (plain text; encode it with `locks_hf.models.encode_prompt`).
        answer: the string a correct completion contains (the pass key).
        n_tokens: tokens of ``encode_prompt(tokenizer, text)`` (bos included when the model needs it).
        needle_token: index of the needle's first token in those ids.
        depth: requested relative depth of the needle in the filler (0 = start, 1 = end).
    """

    text: str
    answer: str
    n_tokens: int
    needle_token: int
    depth: float

    def __iter__(self):
        return iter((self.text, self.answer))


@lru_cache(maxsize=4)
def load_haystack(path: str | None = None) -> str:
    """The filler text: the shipped sample, or the file at ``path``."""
    if path is None:
        return files("locks_hf").joinpath("data/haystack_sample.txt").read_text(encoding="utf-8")
    return Path(path).read_text(encoding="utf-8")


def _sentence_end_before(text: str, pos: int) -> int:
    """The position just after the last ``.``/``?``/``!`` at or before ``pos`` (0 if none)."""
    best = max(text.rfind(ch, 0, pos) for ch in ".?!")
    return 0 if best < 0 else best + 1


def _haystack_prefix(tokenizer, haystack: str, n_tokens: int) -> str:
    """The longest prefix of ``haystack`` (repeated as needed) holding about ``n_tokens`` tokens."""
    if n_tokens <= 0:
        return ""
    text = haystack
    while True:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        offsets = enc["offset_mapping"]
        if len(offsets) >= n_tokens:
            return text[: offsets[n_tokens - 1][1]]
        text = text + "\n\n" + haystack


def build_needle_prompt(
    tokenizer,
    context_tokens: int = 8000,
    depth: float = 0.5,
    needle: str = NEEDLE,
    question: str = QUESTION,
    seed: int = 0,
    haystack_path: str | None = None,
    answer: str | None = None,
    instruction: str = INSTRUCTION,
) -> NeedlePrompt:
    """A passkey prompt of about ``context_tokens`` tokens (within a few tokens), needle at ``depth``.

    Args:
        tokenizer: the model's tokenizer (counts are taken with `encode_prompt`, bos included).
        context_tokens: target length of the whole prompt in tokens.
        depth: where the needle goes in the filler, 0.0 (start) to 1.0 (end); it is moved back to
            the nearest sentence end.
        needle: the inserted sentence; ``{answer}`` is replaced by the answer.
        question: the text the model completes (after the filler).
        seed: picks the 5-digit pass key when ``answer`` is None.
        haystack_path: filler text file (default: the shipped Paul Graham sample, repeated if short).
        answer: the pass key (default: random from ``seed``).
        instruction: the text before the filler.

    Returns:
        a `NeedlePrompt`; ``text, answer = build_needle_prompt(tok)`` also works.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth!r}")
    if answer is None:
        answer = str(random.Random(seed).randint(10000, 99999))
    # On a paragraph of its own: Gemma 3 270M (base, full attention, 8K tokens) then finds the key at
    # depths 0.2, 0.5 and 0.8; inline in a paragraph it found it at 0.5 only.
    needle_text = "\n\n" + needle.format(answer=answer) + "\n\n"
    tail = "\n\n" + question
    haystack = load_haystack(None if haystack_path is None else str(haystack_path))

    def assemble(n_filler: int) -> tuple[str, int]:
        filler = _haystack_prefix(tokenizer, haystack, n_filler)
        cut = _sentence_end_before(filler, round(depth * len(filler)))
        head = (instruction + filler[:cut]).rstrip()
        return head + needle_text + filler[cut:].lstrip() + tail, len(head)

    overhead = len(encode_prompt(tokenizer, instruction + needle_text + tail)[0])
    n_filler = max(context_tokens - overhead, 0)
    for _ in range(4):  # token merges at the joins shift the count by a few: correct and retry
        text, needle_char = assemble(n_filler)
        n = encode_prompt(tokenizer, text).shape[1]
        if n == context_tokens or n_filler == 0:
            break
        n_filler = max(n_filler + context_tokens - n, 0)
    ids_before = encode_prompt(tokenizer, text[:needle_char]).shape[1]
    return NeedlePrompt(text=text, answer=answer, n_tokens=n, needle_token=ids_before, depth=depth)
