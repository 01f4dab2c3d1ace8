"""The tools and environments shipped with tidal (rl/env.py's `Environment`), and their call formats.

Tools (plain functions of one argument string, raising ValueError on a bad argument):
    calculator   integers, + - * /, unary minus and parentheses, evaluated on the parsed `ast` (never `eval`);
                 exact rational arithmetic, the result an integer or a decimal ("7/2" -> "3.5"); a bare number
                 ("14") is nothing to calculate and fails
    lookup       a fixed table key -> value (`LOOKUP_TABLE`: the first 20 chemical elements -> atomic number),
                 sleeping `latency_s` per call: a tool whose latency a run chooses

Formats (how a call is written in a model turn, and how its observation is appended after it):
    plain   for the character-level tiny tasks, a completion format: prompt, turns and observations are one running
            text, and "|" ends a line (prompts may end with one; every observation does). A turn ending in "="
            (a stop token: generation stops there, `ToolEnv.stop`) calls the environment's tool on its *line*, the
            text after the transcript's last "|" without the "=": prompt "12*34" then turn "=" calls the calculator
            on "12*34", and so do prompt "|" then turn "12*34=". A turn ending at EOS is the answer. Observation: the
            result then "|" ("408|"); a failed call's text is "?" ("?|"), as the character vocabulary has no
            letters for an error message. The text needs `PLAIN_CHARS` in the tokenizer.
    qwen3   Qwen3's function calling: the turn's first `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
            block (Qwen3's chat template writes the assistant's calls so). The calculator takes
            {"expression": "..."}, lookup {"key": "..."}. The observation is exactly what the Qwen3 chat template
            renders after an assistant turn (which ends at its <|im_end|>, the token the model stopped at) for one
            `tool` message, then the next assistant header:
                "\\n<|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n"
            A failed call's text is its error message ("error: division by zero").

Failures: `Environment.run` never raises for a model's mistake: an unknown tool, arguments that do not parse, an
expression that does not evaluate or an unknown key all come back as `Observation(failed=True)` from the
environment itself. Whatever else escapes `run` (a bug, an interrupted sleep) and a call that overruns `timeout_s`
are the caller's to turn into an observation: `call_tool` (any exception) and `timeout_observation` do that, so a
rollout rank's tool thread is `call_tool(env, call)` under a deadline of `env.timeout_s`.
"""
from __future__ import annotations

import ast
import json
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Literal

from rl.env import Environment, Observation, ToolCall

FORMATS = ("plain", "qwen3")
ENV_KINDS = ("none", "calculator", "lookup")
Format = Literal["plain", "qwen3"]

# ------------------------------------------------------------------------------------------------- the tools

MAX_EXPRESSION_CHARS = 200
MAX_RESULT_DIGITS = 100
DECIMALS = 6


def calculate(expression: str) -> str:
    """The value of an arithmetic expression over integers with + - * /, unary +/- and parentheses, as text: an
    integer, or a decimal rounded to 6 places without trailing zeros. Parsed with `ast` and walked node by node;
    any other syntax (names, calls, floats, **, %) raises ValueError, as do a bare number ("14", "(14)": nothing to
    calculate), division by zero, more than MAX_EXPRESSION_CHARS characters and a value of more than
    MAX_RESULT_DIGITS digits."""
    if not isinstance(expression, str):
        raise ValueError(f"expression must be text, got {type(expression).__name__}")
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError) as e:
        raise ValueError(f"not an arithmetic expression: {text!r}") from e
    if isinstance(tree.body, ast.Constant) and type(tree.body.value) is int:
        raise ValueError(f"a bare number, nothing to calculate: {text!r}")
    value = _eval(tree.body)
    return _format_number(value)


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        v = _eval(node.operand)
        return v if isinstance(node.op, ast.UAdd) else -v
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        a, b = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Div):
            if b == 0:
                raise ValueError("division by zero")
            out = a / b
        else:
            out = a + b if isinstance(node.op, ast.Add) else a - b if isinstance(node.op, ast.Sub) else a * b
        if max(abs(out.numerator), out.denominator).bit_length() > MAX_RESULT_DIGITS * 3.33:
            raise ValueError(f"a value of more than {MAX_RESULT_DIGITS} digits")
        return out
    what = type(node).__name__
    if isinstance(node, ast.Constant):
        what = f"the constant {node.value!r}"
    elif isinstance(node, (ast.BinOp, ast.UnaryOp)):
        what = f"the operator {type(node.op).__name__}"
    raise ValueError(f"unsupported {what}: only integers, + - * / and parentheses")


def _format_number(v: Fraction) -> str:
    if v.denominator == 1:
        return str(v.numerator)
    scaled = round(v * 10 ** DECIMALS)   # exact rational rounding (half to even)
    sign = "-" if scaled < 0 else ""
    whole, frac = divmod(abs(scaled), 10 ** DECIMALS)
    frac_text = f"{frac:0{DECIMALS}d}".rstrip("0")
    return f"{sign}{whole}.{frac_text}" if frac_text else f"{sign}{whole}"


LOOKUP_TABLE: dict[str, str] = {
    name: str(i + 1) for i, name in enumerate((
        "hydrogen", "helium", "lithium", "beryllium", "boron", "carbon", "nitrogen", "oxygen", "fluorine", "neon",
        "sodium", "magnesium", "aluminium", "silicon", "phosphorus", "sulfur", "chlorine", "argon", "potassium",
        "calcium"))
}


@dataclass
class Lookup:
    """A deterministic table lookup that takes `latency_s` seconds (sleeps) per call; keys are matched after
    stripping whitespace and lower-casing. An unknown key raises ValueError naming a few known ones."""
    table: Mapping[str, str] = field(default_factory=lambda: dict(LOOKUP_TABLE))
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {self.latency_s}")
        self._keys = {k.strip().lower(): v for k, v in self.table.items()}

    def __call__(self, key: str) -> str:
        if self.latency_s:
            time.sleep(self.latency_s)
        k = key.strip().lower() if isinstance(key, str) else key
        if k not in self._keys:
            some = ", ".join(list(self._keys)[:5])
            raise ValueError(f"unknown key {key!r} (known keys include {some})")
        return self._keys[k]


# ----------------------------------------------------------------------------------------------- the formats

INVALID = "<invalid>"   # the ToolCall name of a call that was attempted but could not be parsed (run: failed)

PLAIN_CALL_END = "="
PLAIN_OBS_END = "|"
PLAIN_FAILED = "?"
PLAIN_CHARS = "0123456789+-*/()" + PLAIN_CALL_END + PLAIN_OBS_END + PLAIN_FAILED

QWEN3_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
QWEN3_OPEN = "<tool_call>"
QWEN3_OBS_HEAD = "\n<|im_start|>user\n<tool_response>\n"
QWEN3_OBS_TAIL = "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"


SPECIAL = re.compile(r"<[^<>]*>")   # a special token's text (<bos>, <|im_end|>): no plain character is "<"


def plain_line(prompt_text: str, turn_text: str, first: bool) -> str:
    """The line a plain-format turn writes on: the text after the last "|" of (the prompt, for the first turn) and
    the turn, special tokens' text dropped."""
    text = SPECIAL.sub("", (prompt_text if first else "") + turn_text)
    return text.rsplit(PLAIN_OBS_END, 1)[-1]


def parse_plain(line: str, tool: str) -> ToolCall | None:
    """A plain-format call of `tool`: the line (stripped) ends with "=", the argument is what precedes it."""
    text = line.strip()
    if not text.endswith(PLAIN_CALL_END):
        return None
    return ToolCall(tool, text[:-len(PLAIN_CALL_END)].strip())


def render_plain(obs: Observation) -> str:
    return (PLAIN_FAILED if obs.failed else obs.text) + PLAIN_OBS_END


def parse_qwen3(turn_text: str) -> ToolCall | None:
    """The first `<tool_call>` block of a Qwen3 turn: ToolCall(name, arguments as compact JSON text); a block that
    is not JSON with a string "name" and an object "arguments" gives ToolCall(INVALID, the block's text). No block
    (or an opening tag without its closing one, as when the response hit its token cap): None."""
    m = QWEN3_CALL.search(turn_text)
    if m is None:
        return None
    body = m.group(1).strip()
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return ToolCall(INVALID, body)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(INVALID, body)
    args = obj.get("arguments", {})
    if isinstance(args, str):   # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return ToolCall(INVALID, body)
    if not isinstance(args, dict):
        return ToolCall(INVALID, body)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False, separators=(", ", ": ")))


def render_qwen3(obs: Observation) -> str:
    return QWEN3_OBS_HEAD + obs.text + QWEN3_OBS_TAIL


# ---------------------------------------------------------------------------------------------- environments

@dataclass
class ToolEnv:
    """An `Environment` with one tool (`name`: `fn` of one argument string; qwen3 reads it from the JSON key
    `arg_key`). `description` and `schema()` describe it to a chat model (Qwen3's `tools=` of apply_chat_template).
    Stateless: every method is a function of its arguments."""
    name: str
    fn: Callable[[str], str]
    arg_key: str
    description: str
    format: Format = "plain"
    max_turns: int = 4
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"format {self.format!r} is not one of {', '.join(FORMATS)}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")

    @property
    def stop(self) -> tuple[str, ...]:
        """Texts besides EOS that end a model turn (each one token): plain's "=", none for qwen3 (its turns end at
        <|im_end|>, its EOS)."""
        return (PLAIN_CALL_END,) if self.format == "plain" else ()

    def call_text(self, prompt_text: str, turn_text: str, first: bool) -> str:
        """What `act` reads for a turn: plain, the turn's line (`plain_line`); qwen3, the turn's text."""
        return plain_line(prompt_text, turn_text, first) if self.format == "plain" else turn_text

    def act(self, turn_text: str) -> ToolCall | None:
        """The call in `turn_text` (for plain: the turn's line, `call_text`), or None: the turn is the answer."""
        if self.format == "plain":
            return parse_plain(turn_text, self.name)
        return parse_qwen3(turn_text)

    def run(self, call: ToolCall) -> Observation:
        """The tool's result; a model's mistake (unknown tool, bad arguments, a ValueError of the tool) is an
        `Observation(failed=True)` whose text says what went wrong. Other exceptions propagate (see `call_tool`)."""
        t0 = time.perf_counter()
        try:
            text, failed = self.fn(self._argument(call)), False
        except ValueError as e:
            text, failed = f"error: {e}", True
        return Observation(text, failed, time.perf_counter() - t0)

    def _argument(self, call: ToolCall) -> str:
        if call.name == INVALID:
            raise ValueError(f"invalid tool call (expected {{\"name\": ..., \"arguments\": {{...}}}}): "
                             f"{call.arguments[:100]!r}")
        if call.name != self.name:
            raise ValueError(f"unknown tool {call.name!r}; available: {self.name}")
        if self.format == "plain":
            return call.arguments
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError as e:
            raise ValueError(f"arguments are not JSON: {call.arguments[:100]!r}") from e
        if not isinstance(args, dict) or not isinstance(args.get(self.arg_key), str):
            raise ValueError(f"{self.name} takes {{\"{self.arg_key}\": \"...\"}}, got {call.arguments[:100]}")
        return args[self.arg_key]

    def observation(self, obs: Observation) -> str:
        return render_plain(obs) if self.format == "plain" else render_qwen3(obs)

    def schema(self) -> dict:
        """The tool as an OpenAI-style function spec (what Qwen3's chat template lists in its system message)."""
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": {self.arg_key: {"type": "string"}},
                           "required": [self.arg_key]}}}


def calculator_env(format: Format = "plain", max_turns: int = 4, timeout_s: float = 10.0) -> ToolEnv:
    """The calculator environment (`calculate`)."""
    return ToolEnv("calculator", calculate, "expression",
                   "Evaluate an arithmetic expression of integers with + - * / and parentheses.",
                   format, max_turns, timeout_s)


def lookup_env(format: Format = "plain", max_turns: int = 4, timeout_s: float = 10.0, latency_s: float = 0.0,
               table: Mapping[str, str] | None = None) -> ToolEnv:
    """The lookup environment (`Lookup`, `LOOKUP_TABLE` unless `table`), each call taking `latency_s`."""
    tool = Lookup(dict(table) if table is not None else dict(LOOKUP_TABLE), latency_s)
    return ToolEnv("lookup", tool, "key", "Look up a key in a fixed table (the atomic number of an element).",
                   format, max_turns, timeout_s)


def make_environment(kind: str, format: Format = "plain", max_turns: int = 4, timeout_s: float = 10.0,
                     latency_s: float = 0.0) -> Environment | None:
    """The environment of `kind` (ENV_KINDS; "none": None, single-turn episodes)."""
    if kind == "none":
        return None
    if kind == "calculator":
        return calculator_env(format, max_turns, timeout_s)
    if kind == "lookup":
        return lookup_env(format, max_turns, timeout_s, latency_s)
    raise ValueError(f"environment kind {kind!r} is not one of {', '.join(ENV_KINDS)}")


# ------------------------------------------------------------------------------------------ the caller's side

def call_tool(env: Environment, call: ToolCall) -> Observation:
    """`env.run(call)` with every exception turned into a failed observation naming it: the body of a rollout
    rank's tool thread (the caller still enforces `env.timeout_s`, see `timeout_observation`)."""
    t0 = time.perf_counter()
    try:
        obs = env.run(call)
    except Exception as e:   # noqa: BLE001: a tool's bug must not take the rank down
        return Observation(f"error: {type(e).__name__}: {e}", True, time.perf_counter() - t0)
    if not isinstance(obs, Observation):
        return Observation(f"error: the tool returned a {type(obs).__name__}, not an Observation", True,
                           time.perf_counter() - t0)
    return obs


def timeout_observation(env: Environment) -> Observation:
    """The observation of a call that did not return within `env.timeout_s`."""
    return Observation(f"error: the tool call timed out after {env.timeout_s:g} s", True, float(env.timeout_s))
