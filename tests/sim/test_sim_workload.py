"""Workloads: seeded long-tailed lengths with within-group correlation, and trace replay (sim/workload.py)."""
import json

import numpy as np
import pytest

from sim.workload import WORKLOADS, TraceError, get_workload, load_trace, save_trace


def lengths(name: str, seed: int, prompts: int = 128, g: int = 8) -> np.ndarray:
    w = get_workload(name, seed)
    return np.array([[w.response_len(p, k) for k in range(g)] for p in range(prompts)])


def test_same_seed_same_lengths_other_seed_other_lengths():
    a, b, c = lengths("rollpacker_14b_16k", 0), lengths("rollpacker_14b_16k", 0), lengths("rollpacker_14b_16k", 1)
    assert (a == b).all() and not (a == c).all()


@pytest.mark.parametrize("name", ["rollpacker_7b_8k", "rollpacker_14b_16k", "rollpacker_32b_32k"])
def test_rollpacker_long_tail_is_in_the_documented_range(name):
    # RollPacker §1: "the longest response 25x-32x longer than the medi[an]", max = the cap; one 128 x 8 step each
    ratios = []
    for seed in range(10):
        x = lengths(name, seed).ravel()
        ratios.append(x.max() / np.median(x))
        assert x.max() <= WORKLOADS[name].max_len
    assert 25 <= np.median(ratios) <= 32
    assert sum(25 <= r <= 32 for r in ratios) >= 7


def test_rollpacker_14b_p75_matches_the_paper():
    x = lengths("rollpacker_14b_16k", 0, prompts=512).ravel()
    assert 755 * 0.9 <= np.percentile(x, 75) <= 1100 * 1.1  # RollPacker §2.2: P75 755-1.1k


def test_rolloutpipe_mean_length_matches_the_paper():
    x = lengths("rolloutpipe", 0, prompts=500).ravel()
    assert 3300 * 0.95 <= x.mean() <= 3600 * 1.05  # RolloutPipe §5.3: 3.3k-3.6k


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_lengths_correlate_within_groups(name):
    x = np.log(lengths(name, 0, prompts=300))
    r = np.corrcoef(x[:, 0], x[:, 1])[0, 1]
    assert r > 0.3, r  # ICC 0.6 by construction (capping and runaways lower it a little)
    assert (x >= 0).all()


def test_trace_round_trip(tmp_path):
    w = get_workload("rollpacker_7b_8k", 3)
    path = save_trace(w, tmp_path / "t.jsonl", num_prompts=20, group_size=4)
    t = load_trace(path)
    assert [t.prompt(i).prompt_len for i in range(20)] == [w.prompt(i).prompt_len for i in range(20)]
    assert [[t.response_len(i, k) for k in range(4)] for i in range(20)] == \
           [[w.response_len(i, k) for k in range(4)] for i in range(20)]
    assert t.prompt(20).prompt_len == t.prompt(0).prompt_len  # the trace repeats
    # more responses than recorded (a speculative round): drawn from the prompt's own recorded lengths,
    # deterministic per (seed, prompt, sample), and different draws for different extra samples
    extra = [[t.response_len(i, k) for k in range(4, 10)] for i in range(20)]
    assert all(x in [w.response_len(i, k) for k in range(4)] for i, xs in enumerate(extra) for x in xs)
    assert extra == [[t.response_len(i, k) for k in range(4, 10)] for i in range(20)]
    assert len({x for xs in extra for x in xs}) > 20
    assert [t.with_seed(1).response_len(i, 5) for i in range(20)] != [xs[1] for xs in extra]


@pytest.mark.parametrize("line,match", [
    ("{not json", r"bad.jsonl:2: not valid JSON"),
    ("[1, 2]", r"bad.jsonl:2: expected a JSON object"),
    ('{"response_lens": [3]}', r"bad.jsonl:2: field 'prompt_len' is missing"),
    ('{"prompt_len": 5}', r"bad.jsonl:2: field 'response_lens' is missing"),
    ('{"prompt_len": 0, "response_lens": [3]}', r"bad.jsonl:2: field 'prompt_len' must be a positive integer"),
    ('{"prompt_len": true, "response_lens": [3]}', r"field 'prompt_len' must be a positive integer"),
    ('{"prompt_len": 5, "response_lens": []}', r"bad.jsonl:2: field 'response_lens' must be a non-empty list"),
    ('{"prompt_len": 5, "response_lens": [3, "x"]}', r"bad.jsonl:2: field 'response_lens'\[1\] must be a positive"),
    ('{"prompt_len": 5, "response_lens": [3, 2.5]}', r"field 'response_lens'\[1\] must be a positive integer"),
])
def test_malformed_trace_rows_name_file_line_and_field(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps({"prompt_len": 4, "response_lens": [1, 2]}) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=match):
        load_trace(p)


def test_empty_or_missing_trace(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="holds no rows"):
        load_trace(tmp_path / "empty.jsonl")
    with pytest.raises(TraceError, match="does not exist"):
        load_trace(tmp_path / "nope.jsonl")


def test_unknown_workload_lists_the_known_ones():
    with pytest.raises(ValueError, match="rollpacker_7b_8k"):
        get_workload("nonsense")
