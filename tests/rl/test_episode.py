"""rl/episode.py: a multi-turn episode's tokens, mask, turns, and the text the environment and the reward read."""
import pytest

from model.tokenizer import build_char_tokenizer
from rl.env import Observation, ToolCall
from rl.episode import (append_observation, build_episode, model_turns, next_call, observation_ids, reward_text,
                        stop_token_ids)
from rl.tools import PLAIN_CHARS, calculator_env
from runtime.samples import response_decoder

TOK = build_char_tokenizer(PLAIN_CHARS)
EOS = TOK.eos_token_id
DECODE = response_decoder(TOK, frozenset({EOS}))


def ids(text):
    return TOK(text, add_special_tokens=False)["input_ids"]


PROMPT = TOK("|")["input_ids"]   # <bos>|: an empty line


def test_a_calculator_episode_in_the_plain_format_end_to_end():
    env = calculator_env("plain", max_turns=3)
    (stop,) = stop_token_ids(env, TOK)
    assert TOK.convert_ids_to_tokens(stop) == "=" and stop_token_ids(calculator_env("qwen3"), TOK) == ()
    t1 = ids("12*34=")                                    # the turn stopped at "=", its stop token
    call = next_call(env, DECODE, PROMPT, t1, [1] * len(t1))
    assert call == ToolCall("calculator", "12*34")
    obs = observation_ids(TOK, env, env.run(call))
    assert TOK.decode(obs) == "408|" and TOK.bos_token_id not in obs
    resp, lp, ver, mask = list(t1), [-1.0] * len(t1), [3] * len(t1), [1] * len(t1)
    append_observation(resp, lp, ver, mask, obs, version=4)
    assert mask == [1] * 6 + [0] * 4 and lp[6:] == [0.0] * 4 and ver[6:] == [4] * 4
    t2 = ids("408") + [EOS]
    resp += t2
    mask += [1] * len(t2)
    assert next_call(env, DECODE, PROMPT, resp, mask) is None              # the answer: no call
    assert reward_text(DECODE, resp, mask) == "408"                        # the reward sees the last turn only
    assert build_episode([t1, t2], [obs]) == (resp, mask)


def test_a_first_turn_calls_on_its_line_which_begins_in_the_prompt():
    env = calculator_env("plain", max_turns=3)
    prompt = TOK("12*34")["input_ids"]
    assert next_call(env, DECODE, prompt, ids("="), [1]) == ToolCall("calculator", "12*34")
    assert next_call(env, DECODE, prompt, ids("+1="), [1] * 3) == ToolCall("calculator", "12*34+1")
    assert next_call(env, DECODE, prompt, ids("408") + [EOS], [1] * 4) is None
    obs = observation_ids(TOK, env, Observation("408"))
    resp, mask = build_episode([ids("="), ids("2*3=")], [obs])
    assert next_call(env, DECODE, prompt, resp, mask) == ToolCall("calculator", "2*3")   # a later line: its own


def test_max_turns_ends_the_episode_even_on_a_call():
    env = calculator_env("plain", max_turns=2)
    turn = ids("1+1=")
    obs = observation_ids(TOK, env, Observation("2"))
    resp, mask = build_episode([turn, turn], [obs])
    assert next_call(env, DECODE, PROMPT, turn, [1] * len(turn)) is not None
    assert next_call(env, DECODE, PROMPT, resp, mask) is None
    assert reward_text(DECODE, resp, mask) == "1+1="


def test_turns_are_the_runs_of_the_mask_and_bad_masks_are_named():
    resp, mask = build_episode([[5, 6, EOS], [EOS], [7, EOS]], [[8, 9], [10]])
    assert model_turns(resp, mask) == [[5, 6, EOS], [EOS], [7, EOS]]
    assert model_turns([5, 6], None) == [[5, 6]] and reward_text(DECODE, [], None) == ""
    with pytest.raises(ValueError, match="loss_mask has 2 entries for 3 response tokens"):
        model_turns([1, 2, 3], [1, 0])
    with pytest.raises(ValueError, match="0 \\(observation\\) or 1"):
        model_turns([1, 2], [1, 2])
    with pytest.raises(ValueError, match="2 model turns need 1 or 2 observations, got 0"):
        build_episode([[1], [2]], [])
    with pytest.raises(ValueError, match="observation 0 is empty"):
        build_episode([[1], [2]], [[]])
