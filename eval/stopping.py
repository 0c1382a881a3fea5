"""When an answer has ended: the benchmarks' stop rules (`stop_position`), the loop guard
(`looping`), and the `generate` stopping criterion that applies both per row (`StopAtAnswerEnd`).

Both sweep engines (`runner.SweepRunner`'s eager path, `batched`'s static one) stop by these rules.
"""

from __future__ import annotations

import re

import torch

from .benchmarks import STOP_NEWLINE, STOP_SENTENCE

# a newline after some letter or digit of output (a leading newline, or one right after ":", does not stop)
_NEWLINE_END = re.compile(r"[A-Za-z0-9][^\n]*\n")
# a sentence end: . ! or ? right after 3+ letters/digits (not a list number "1." nor "10."), then
# whitespace or the end of the text so far
_SENTENCE_END = re.compile(r"[A-Za-z0-9]{3}[.!?](?=\s|$)")


def stop_position(text: str, stop: str) -> int | None:
    """Where the answer ends under ``stop`` (index just past it), or None if it has not ended yet."""
    ends = []
    if stop in (STOP_NEWLINE, STOP_SENTENCE):
        m = _NEWLINE_END.search(text)
        if m:
            ends.append(m.end() - 1)
    if stop == STOP_SENTENCE:
        m = _SENTENCE_END.search(text)
        if m:
            ends.append(m.end())
    return min(ends) if ends else None


class StopAtAnswerEnd:
    """Stop once the answer ended under the task's rule (`stop_position`) or the text runs into a loop
    (`looping`); per row."""

    def __init__(self, tokenizer, start: int, loops: bool = True, stop: str = STOP_NEWLINE):
        self.tokenizer, self.start, self.loops, self.stop = tokenizer, start, loops, stop

    def __call__(self, input_ids, scores, **kwargs):
        done = [
            answer_ended(self.tokenizer.decode(row[self.start :], skip_special_tokens=True), self.stop, self.loops)
            for row in input_ids
        ]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


def answer_ended(text: str, stop: str, loops: bool = True) -> bool:
    """The answer ``text`` ended under ``stop`` (`stop_position`) or runs into a loop (`looping`)."""
    return stop_position(text, stop) is not None or (loops and looping(text))


def looping(text: str) -> bool:
    """True when ``text`` ends in a unit repeated back to back: >= 3 times for units of 4+ characters
    (e.g. ``"4380047, "`` x3), >= 6 times for 2-3 characters, >= 10 times for one character; checked
    on the text and on the text with every digit run replaced by ``#`` (a counting run-on such as
    ``"1. 2. 3. 4. 5. 6."`` or a seventh number in a list of numbers). A 7-digit number, a UUID or a
    list of up to 5 numbers never triggers it; a degenerate run-on stops instead of filling the cap."""
    return _repeats(text.rstrip()) or _repeats(re.sub(r"\d+", "#", text).rstrip())


def _repeats(t: str) -> bool:
    for unit in range(1, 41):
        reps = 10 if unit == 1 else 6 if unit <= 3 else 3
        if len(t) < unit * reps:
            continue
        tail = t[-unit:]
        if tail.strip() and t.endswith(tail * reps):
            return True
    return False


def loop_cut(text: str) -> str:
    """The shortest prefix of ``text`` at which `looping` fires (what the stop rule would have kept)."""
    for end in range(1, len(text) + 1):
        if looping(text[:end]):
            return text[:end]
    return text


def cut_at_stop(text: str, stop: str) -> str:
    """``text`` up to where the answer ended under ``stop`` (all of it when it has not)."""
    end = stop_position(text, stop)
    return text if end is None else text[:end]
