"""Synthetic string tasks for the tiny offline default run: a randomly initialised two-layer model learns them by RL
alone in a couple of CPU minutes, so the run shows reward rising without any download.

A prompt is a short random string over a small alphabet followed by a separator, e.g. `"cafd="`; the response is
the transformed string followed by `<eos>` (the tokenizer is character level, see `model.tokenizer`).

    first    the first symbol                "cafd=" -> "c"
    last     the last symbol                 "cafd=" -> "d"
    copy     the string itself               "cafd=" -> "cafd"
    reverse  the string reversed             "cafd=" -> "dfac"
    repeat   a symbol n times                "c7="   -> "ccccccc"

    calc     a product, with a calculator    "(47*8)" -> "376"  (multi-turn: env.kind = "calculator")

`repeat` is the long-tail length workload (the scheduling presets need rounds whose groups finish at very
different times, as in the papers' reasoning traces). The prompt states how long the answer is, and n is drawn per
prompt from a heavy-tailed `LengthDist` (by default 7 prompts in 8 answer in 1-4 tokens, 1 in 8 in 24-32), so the
length is a property of the prompt, shared by the whole GRPO group (within-group correlation, RollPacker §2.2,
StreamRL §5.1 "difficulty is a property inherent to the prompts themselves"). A random-init model samples EOS
early or never; with `data.cap_at_answer` each response is also stopped at its answer's length + 1 (EOS), so the
response lengths are long-tailed by construction from the first step, and the reward (positions right) still
measures whether the model repeats the right symbol and stops.

`calc` is the tool-use task (configs/tiny-tools.toml): a random-init model cannot multiply, but in the plain tool
format (rl/tools.py) a first turn that is just "=" calls the calculator on the prompt's line, "(47*8)", the result
comes back as "376|", and a second turn that copies it scores 1. The reward sees the last model turn only. Half the
prompts are worked examples, "(47*8)=376|" -> "376", the transcript of such a call: they teach the answer turn's copy
with per-position credit. Products are 3-digit values of a 2-digit and a 1-digit number (not guessable: a first
digit right scores 1/3); without the tool only the examples can be solved. Three choices keep the task down to the
call and the copy: the products are parenthesised, so "=" follows ")" and never a digit in a correct episode (an
answer turn's digit is not a place to call); the calculator fails a bare number ("14=" -> "?|", rl/tools.py), so a
worked example is not turned into a call on guessed digits; and with `data.cap_at_answer` a calc response stops at
exactly the tokens a correct episode needs (`SyntheticTask.response_cap`), so there is no stop to learn and stopping
after one right digit is never worth more than going on. Its characters are the digits and `*()=|?` (`CALC_CHARS`).

The score gives partial credit, the fraction of answer positions the response gets right, divided by the longer
of the two lengths so that rambling past the answer costs as much as stopping short. Dense rewards are what makes
the tasks learnable from a random start with a group of 8 samples.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from model.char_tokenizer import CharTokenizer
from model.tokenizer import CHAR_SPECIALS, EOS, build_char_tokenizer, char_vocab_size
from rl.tools import PLAIN_CALL_END, PLAIN_FAILED, PLAIN_OBS_END
from rl.types import RewardResult

RULES: dict[str, Callable[[str], str]] = {
    "first": lambda s: s[0],
    "last": lambda s: s[-1],
    "copy": lambda s: s,
    "reverse": lambda s: s[::-1],
}
TOOL_TASKS = ("calc",)
TASK_NAMES = tuple(RULES) + ("repeat",) + TOOL_TASKS
DIGITS = "0123456789"


@dataclass
class LengthDist:
    """Answer lengths of the `repeat` task: a two-part mixture, the body uniform in 1..body_max and, with
    probability tail_frac, the tail uniform in tail_min..tail_max. Heavy-tailed by construction: a few prompts
    carry most of the tokens (with the defaults 12.5% of the prompts carry ~60% of the answer tokens)."""
    body_max: int = 4
    tail_min: int = 24
    tail_max: int = 32
    tail_frac: float = 0.125

    def __post_init__(self) -> None:
        if not 1 <= self.body_max <= self.tail_min <= self.tail_max:
            raise ValueError(f"need 1 <= body_max <= tail_min <= tail_max, got body_max={self.body_max}, "
                             f"tail_min={self.tail_min}, tail_max={self.tail_max}")
        if not 0.0 <= self.tail_frac <= 1.0:
            raise ValueError(f"tail_frac must be in [0, 1], got {self.tail_frac}")

    def draw(self, rng: random.Random) -> int:
        if rng.random() < self.tail_frac:
            return rng.randint(self.tail_min, self.tail_max)
        return rng.randint(1, self.body_max)


def score_positions(response: str, answer: str) -> RewardResult:
    """Fraction of positions where `response` matches `answer`, over max(len(response), len(answer)).
    Whitespace at either end of the response is ignored. An exact match is correct with reward 1."""
    resp = response.strip()
    if not answer:
        return RewardResult(1.0 if not resp else 0.0, not resp, False, "empty answer")
    if not resp:
        return RewardResult(0.0, False, False, "empty response")
    hits = sum(a == b for a, b in zip(resp, answer))
    correct = resp == answer
    reason = "exact" if correct else f"{hits}/{len(answer)} positions, length {len(resp)}"
    return RewardResult(hits / max(len(resp), len(answer)), correct, False, reason)


@dataclass
class SyntheticTask:
    """`num_prompts` random strings of length `min_len..max_len` over `alphabet`, deterministic from `seed`."""
    name: str = "reverse"
    num_prompts: int = 1024
    seed: int = 0
    alphabet: str = "abcdef"
    min_len: int = 1
    max_len: int = 3
    sep: str = "="
    lengths: LengthDist = field(default_factory=LengthDist)   # answer lengths of `repeat` (min_len/max_len: others)
    tools: bool = False   # the episodes may call a tool (env.kind != "none"): calc's response caps leave room for it

    def __post_init__(self) -> None:
        if self.name not in TASK_NAMES:
            raise ValueError(f"unknown synthetic task {self.name!r}; valid tasks: {', '.join(TASK_NAMES)}")
        if self.name in TOOL_TASKS:   # its own prompts and characters (calc_prompts)
            if self.num_prompts < 1:
                raise ValueError(f"num_prompts must be positive, got {self.num_prompts}")
            return
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got min_len={self.min_len}, max_len={self.max_len}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be positive, got {self.num_prompts}")
        if len(set(self.alphabet)) != len(self.alphabet) or not self.alphabet:
            raise ValueError(f"alphabet must be non-empty with distinct symbols, got {self.alphabet!r}")
        if len(self.sep) != 1 or self.sep in self.alphabet:
            raise ValueError(f"sep must be one character outside the alphabet, got {self.sep!r}")
        if self.name == "repeat" and set(self.alphabet + self.sep) & set(DIGITS):
            raise ValueError(f"repeat writes lengths in digits: alphabet and sep must not contain any, "
                             f"got {self.alphabet!r} and {self.sep!r}")

    def prompts(self) -> list[tuple[str, str]]:
        """(prompt_text, answer) pairs; the same list for the same (name, num_prompts, seed, alphabet, lengths)."""
        rng = random.Random(f"{self.name}:{self.seed}")
        if self.name == "calc":
            return calc_prompts(self.num_prompts, rng)
        if self.name == "repeat":
            out = []
            for _ in range(self.num_prompts):
                sym, n = rng.choice(self.alphabet), self.lengths.draw(rng)
                out.append((f"{sym}{n}{self.sep}", sym * n))
            return out
        rule = RULES[self.name]
        out = []
        for _ in range(self.num_prompts):
            s = "".join(rng.choice(self.alphabet) for _ in range(rng.randint(self.min_len, self.max_len)))
            out.append((s + self.sep, rule(s)))
        return out

    @property
    def chars(self) -> str:
        """The characters of the prompts and answers: the alphabet (and the digits of `repeat`), the separator; a
        tool task's own (`CALC_CHARS`)."""
        if self.name in TOOL_TASKS:
            return CALC_CHARS
        return self.alphabet + (DIGITS if self.name == "repeat" else "") + self.sep

    def tokenizer(self, path: str | Path | None = None) -> CharTokenizer:
        """The character tokenizer over `chars` (saved to `path` when given)."""
        return build_char_tokenizer(self.chars, path)

    @property
    def vocab_size(self) -> int:
        """`len(self.tokenizer())`, without building it (a train rank needs no more of the tokenizer)."""
        return char_vocab_size(self.chars)

    @property
    def eos_token_id(self) -> int:
        """`self.tokenizer().eos_token_id`, without building it."""
        return CHAR_SPECIALS.index(EOS)

    def score(self, response_text: str, answer: str) -> RewardResult:
        return score_positions(response_text, answer)

    def response_cap(self, prompt: str, answer: str) -> int:
        """A response's token cap under `data.cap_at_answer`: the answer's length + 1 (room for EOS). For `calc`,
        exactly the tokens of a correct episode, without EOS: a worked example's answer; a product's call, its
        observation and the answer ("=376|376") when `tools`, else the answer alone."""
        if self.name != "calc":
            return len(answer) + 1
        if PLAIN_CALL_END in prompt or not self.tools:
            return len(answer)
        return len(PLAIN_CALL_END) + len(answer) + len(PLAIN_OBS_END) + len(answer)


CALC_COPY_FRAC = 0.5
CALC_CHARS = DIGITS + "*()" + PLAIN_CALL_END + PLAIN_OBS_END + PLAIN_FAILED   # the calc task's characters


def calc_prompts(n: int, rng: random.Random) -> list[tuple[str, str]]:
    """The `calc` task's (prompt, answer) pairs: a product of a 2-digit and a 1-digit number with 3 digits,
    "(47*8)" -> "376", or (a `CALC_COPY_FRAC` share) the same worked through the calculator, "(47*8)=376|" -> "376"."""
    out = []
    for _ in range(n):
        while True:
            a, b = rng.randint(10, 99), rng.randint(2, 9)
            if 100 <= a * b <= 999:
                break
        if rng.random() < CALC_COPY_FRAC:
            out.append((f"({a}*{b}){PLAIN_CALL_END}{a * b}{PLAIN_OBS_END}", str(a * b)))
        else:
            out.append((f"({a}*{b})", str(a * b)))
    return out
