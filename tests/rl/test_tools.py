"""rl/tools.py: the calculator and lookup tools, the plain and Qwen3 call formats, the environments' failure
isolation, and the `[env]` config table."""
import json
import threading
import time

import pytest

from config import ConfigError, load_config
from rl.env import Observation, ToolCall
from rl.tools import (INVALID, LOOKUP_TABLE, Lookup, calculate, calculator_env, call_tool, lookup_env,
                      make_environment, parse_plain, parse_qwen3, timeout_observation)
from runtime.build import environment
from tests.support.real_vocab import QWEN_DIR, needs_qwen


@pytest.fixture(scope="module")
def qwen3_tokenizer():
    from model.tokenizer import load_tokenizer
    return load_tokenizer(QWEN_DIR)


@pytest.mark.parametrize("expr,value", [
    ("1+2", "3"), ("2+3*4", "14"), ("(2+3)*4", "20"), ("-7*6", "-42"), ("10-2-3", "5"), ("7/2", "3.5"),
    ("1/3", "0.333333"), ("2/3", "0.666667"), ("-(4-10)/3", "2"), (" 12 * 34 ", "408"), ("123456789*987654321",
                                                                                          "121932631112635269"),
    ("--3", "3"), ("+5", "5"), ("6/4*2", "3"),
])
def test_calculator_evaluates_integer_arithmetic_exactly(expr, value):
    assert calculate(expr) == value


@pytest.mark.parametrize("expr,needle", [
    ("", "empty"), ("1/0", "division by zero"), ("(1+2", "not an arithmetic expression"), ("2**10", "Pow"),
    ("__import__('os')", "Call"), ("x+1", "Name"), ("1.5*2", "1.5"), ("7%3", "Mod"), ("'a'*3", "'a'"),
    ("True+1", "True"), ("1" * 201, "longer than"), ("*".join(["99999999999"] * 12), "digits"),
    ("(1).real", "Attribute"), ("[1,2]", "List"), ("1 if 1 else 2", "IfExp"),
    ("14", "a bare number"), (" (14) ", "a bare number"), ("((7))", "a bare number"),
])
def test_calculator_rejects_everything_else_with_a_clear_value_error(expr, needle):
    with pytest.raises(ValueError) as e:
        calculate(expr)
    assert needle in str(e.value), str(e.value)


def test_lookup_is_a_fixed_table_with_its_latency():
    fast, slow = Lookup(), Lookup(latency_s=0.05)
    assert fast("oxygen") == "8" and fast("  Neon ") == "10" and len(LOOKUP_TABLE) == 20
    t0 = time.perf_counter()
    assert slow("carbon") == "6"
    assert time.perf_counter() - t0 >= 0.05
    with pytest.raises(ValueError, match="unknown key 'gold'"):
        fast("gold")
    with pytest.raises(ValueError, match="latency_s"):
        Lookup(latency_s=-1)


def test_plain_format_calls_on_a_final_equals_sign_and_renders_results_with_a_bar():
    env = calculator_env("plain")
    assert env.stop == ("=",) and calculator_env("qwen3").stop == ()
    assert env.act("12*34=") == ToolCall("calculator", "12*34")
    assert env.act(" 5+5= ") == ToolCall("calculator", "5+5")
    assert env.act("408") is None and env.act("12=34") is None and env.act("") is None
    # a turn's line: the first turn's begins in the prompt; a later turn's after the last observation's bar
    assert env.call_text("<bos>12*34", "=", first=True) == "12*34="
    assert env.call_text("<bos>7|", "12*34=", first=True) == "12*34="
    assert env.call_text("<bos>12*34", "5*6=", first=False) == "5*6="
    assert env.call_text("<bos>1", "408<eos>", first=True) == "1408"
    assert calculator_env("qwen3").call_text("<bos>x", "y", first=True) == "y"
    obs = env.run(env.act("12*34="))
    assert obs == Observation("408", False, obs.seconds) and env.observation(obs) == "408|"
    bad = env.run(env.act("12*="))
    assert bad.failed and "not an arithmetic expression" in bad.text and env.observation(bad) == "?|"
    assert parse_plain("oxygen=", "lookup") == ToolCall("lookup", "oxygen")


def test_a_call_on_a_bare_number_fails_and_one_with_an_operator_does_not():
    """Nothing to calculate in "14" (a worked example's answer turned into a call on its digits): a failed
    observation; a signed number or any operation is a calculation."""
    env = calculator_env("plain")
    for line in ("14=", "(376)="):
        obs = env.run(env.act(line))
        assert obs.failed and "a bare number" in obs.text and env.observation(obs) == "?|", obs
    assert env.run(env.act("-14=")).text == "-14" and env.run(env.act("(14)*1=")).text == "14"
    assert calculate("0+14") == "14"


def test_environment_turns_a_models_mistakes_into_failed_observations():
    env = calculator_env("qwen3")
    for call, needle in [(ToolCall("search", '{"query": "x"}'), "unknown tool 'search'; available: calculator"),
                         (ToolCall("calculator", '{"expr": "1+1"}'), 'calculator takes {"expression": "..."}'),
                         (ToolCall("calculator", "1+1"), "arguments are not JSON"),
                         (ToolCall("calculator", '{"expression": "1/0"}'), "division by zero"),
                         (ToolCall(INVALID, "{not json"), "invalid tool call")]:
        obs = env.run(call)
        assert obs.failed and needle in obs.text, (call, obs)
    ok = env.run(ToolCall("calculator", '{"expression": "6*7"}'))
    assert not ok.failed and ok.text == "42"
    lk = lookup_env("plain")
    assert lk.run(lk.act("helium=")).text == "2"
    miss = lk.run(lk.act("gold="))
    assert miss.failed and "unknown key" in miss.text


def test_call_tool_turns_any_exception_into_an_observation_and_timeouts_have_one():
    class Broken:
        max_turns, timeout_s = 2, 0.5

        def run(self, call):
            raise RuntimeError("tool crashed")

    obs = call_tool(Broken(), ToolCall("x", ""))
    assert obs.failed and "RuntimeError: tool crashed" in obs.text
    t = timeout_observation(Broken())
    assert t.failed and "timed out after 0.5 s" in t.text and t.seconds == 0.5
    env = calculator_env()
    assert call_tool(env, ToolCall("calculator", "2*3")).text == "6"


def test_lookup_calls_run_concurrently_in_threads():
    env = lookup_env("plain", latency_s=0.5)
    out = []
    threads = [threading.Thread(target=lambda: out.append(call_tool(env, env.act("argon=")))) for _ in range(4)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert [o.text for o in out] == ["18"] * 4
    assert time.perf_counter() - t0 < 1.5   # four 0.5 s calls side by side, not one after another (2 s)


def test_qwen3_parser_reads_the_first_tool_call_block():
    text = ('<think>\nI need to multiply.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": '
            '{"expression": "12*34"}}\n</tool_call>\n<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    call = parse_qwen3(text)
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "12*34"}
    assert parse_qwen3("The answer is 408.") is None
    assert parse_qwen3("<tool_call>\n{\"name\": \"calculator\", \"argu") is None    # cut at the token cap
    assert parse_qwen3("<tool_call>\n{oops}\n</tool_call>") == ToolCall(INVALID, "{oops}")
    assert parse_qwen3('<tool_call>{"name": 3}</tool_call>').name == INVALID
    as_string = parse_qwen3('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}'
                            '</tool_call>')
    assert json.loads(as_string.arguments) == {"expression": "1+1"}
    env = calculator_env("qwen3")
    assert env.run(env.act(text)).text == "408"


@needs_qwen
def test_qwen3_observation_is_what_the_chat_template_renders_for_a_tool_message(qwen3_tokenizer):
    """The text appended after an assistant turn that called a tool (and ended at <|im_end|>) is exactly the chat
    template's rendering of the tool message and the next generation prompt, for one and for several turns; and it
    tokenizes alone into the same ids as inside the whole conversation."""
    tok = qwen3_tokenizer
    env = calculator_env("qwen3")
    env_schema = [env.schema()]
    messages = [{"role": "system", "content": "Use the calculator."},
                {"role": "user", "content": "What is 12*34 + 5?"}]
    text = tok.apply_chat_template(messages, tools=env_schema, add_generation_prompt=True, tokenize=False)
    turns = ['<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*34"}}\n</tool_call>',
             '<think>\nNow add 5.\n</think>\n\n<tool_call>\n{"name": "calculator", "arguments": {"expression": '
             '"408+5"}}\n</tool_call>',
             '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call>']
    pieces = [text]
    for turn in turns:
        obs = env.run(env.act(turn))
        messages += [{"role": "assistant", "content": turn}, {"role": "tool", "content": obs.text}]
        pieces += [turn + tok.eos_token, env.observation(obs)]
        want = tok.apply_chat_template(messages, tools=env_schema, add_generation_prompt=True, tokenize=False)
        assert "".join(pieces) == want
    assert "error: division by zero" in pieces[-1] and "413" in pieces[-3]
    whole = tok("".join(pieces), add_special_tokens=False)["input_ids"]
    assert whole == [i for p in pieces for i in tok(p, add_special_tokens=False)["input_ids"]]


def test_env_config_builds_the_environment_and_rejects_bad_values():
    assert environment(load_config(None)) is None
    env = environment(load_config(None, ["--env.kind=lookup", "--env.latency_s=0.5", "--env.max_turns=3",
                                         "--env.tool_timeout_s=2", "--env.format=qwen3"]))
    assert env.name == "lookup" and env.max_turns == 3 and env.timeout_s == 2.0 and env.format == "qwen3"
    assert env.fn.latency_s == 0.5
    for args, needle in [(["--env.kind=search"], 'env.kind = "search" (from command line): must be one of "none", '
                                                 '"calculator", "lookup"'),
                         (["--env.format=json"], 'must be one of "plain", "qwen3"'),
                         (["--env.max_turns=0"], "env.max_turns = 0 (from command line): must be >= 1"),
                         (["--env.tool_timeout_s=0"], "env.tool_timeout_s = 0.0 (from command line): must be > 0"),
                         (["--env.tool_workers=0"], "env.tool_workers = 0 (from command line): must be >= 1"),
                         (["--env.kind=calculator", "--env.latency_s=1"], 'applies only to env.kind = "lookup"'),
                         (["--env.kind=lookup", "--env.latency_s=20"], "must be < env.tool_timeout_s = 10")]:
        with pytest.raises(ConfigError) as e:
            load_config(None, args)
        assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(ValueError, match="environment kind 'x'"):
        make_environment("x")


@needs_qwen
def test_a_qwen3_tools_run_lists_the_calculator_in_its_prompts(qwen3_tokenizer):
    from model.tokenizer import encode_prompt
    from runtime.build import prompt_tools
    cfg = load_config("configs/qwen3-0.6b-tools.toml")
    tools = prompt_tools(cfg)
    assert tools == [calculator_env("qwen3").schema()]
    assert prompt_tools(load_config("configs/tiny-tools.toml")) is None   # plain format: no chat template
    assert prompt_tools(load_config("configs/qwen3-0.6b-gsm8k.toml")) is None
    text = qwen3_tokenizer.decode(encode_prompt(qwen3_tokenizer, [{"role": "system", "content": "Be brief."},
                                                                  {"role": "user", "content": "2+2?"}], True, tools))
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools") and '"name": "calculator"' in text
    assert text.endswith("<|im_start|>assistant\n")
