"""rl/data.py: reading JSONL/Parquet prompts, validation errors, over-long prompts, the resumable sampler."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from model.tokenizer import build_char_tokenizer
from rl.data import DataError, PromptDataset, PromptSampler
from rl.tasks import SyntheticTask

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ?+="


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(CHARS, chat_template=True)


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_roundtrip(tmp_path, tok):
    rows = [{"prompt": "what is 1+1?", "answer": "2"}, {"prompt": "2+2?", "answer": 4}]
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", rows + [""]), tok, max_prompt_tokens=64)
    assert len(ds) == 2 and ds.skipped_too_long == []
    p = ds[1]
    assert (p.index, p.prompt, p.answer) == (1, "2+2?", "4")  # numeric answers become strings
    assert p.prompt_ids == tok("2+2?")["input_ids"]


def test_overlong_prompts_skipped_and_counted(tmp_path, tok):
    rows = [{"prompt": "a" * n, "answer": "x"} for n in (3, 30, 5, 40, 7)]
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", rows), tok, max_prompt_tokens=10)
    assert [p.index for p in ds] == [0, 2, 4]
    assert ds.skipped_too_long == [1, 3]
    with pytest.raises(DataError, match="all 5 prompts are longer than max_prompt_tokens=2"):
        PromptDataset.from_file(tmp_path / "d.jsonl", tok, max_prompt_tokens=2)


@pytest.mark.parametrize("bad, match", [
    ('{"prompt": "ab", "answer": ', r"d\.jsonl:3: not valid JSON"),
    ('["ab", "c"]', r"d\.jsonl:3: row must be a JSON object"),
    ('{"answer": "c"}', r"d\.jsonl:3: missing field 'prompt'"),
    ('{"prompt": "ab"}', r"d\.jsonl:3: missing field 'answer'"),
    ('{"prompt": 5, "answer": "c"}', r"d\.jsonl:3: field 'prompt': .* got int"),
    ('{"prompt": "ab", "answer": [1]}', r"d\.jsonl:3: field 'answer': .* got list"),
    ('{"prompt": "ab", "answer": true}', r"d\.jsonl:3: field 'answer': .* got bool"),
    ('{"prompt": "   ", "answer": "c"}', r"d\.jsonl:3: field 'prompt': prompt is empty"),
    ('{"prompt": [], "answer": "c"}', r"d\.jsonl:3: field 'prompt'"),
    ('{"prompt": [{"role": "user"}], "answer": "c"}', r"d\.jsonl:3: field 'prompt'"),
])
def test_malformed_row_names_file_line_field(tmp_path, tok, bad, match):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}, "", bad])
    with pytest.raises(DataError, match=match):
        PromptDataset.from_file(path, tok, max_prompt_tokens=64)


@pytest.mark.parametrize("bad, column", [
    ('{"prompt": "ab", "answer": "c"', 31),      # unclosed: just past the line's end, not column 1
    ('{"prompt": "ab" "answer": "c"}', 17),      # a missing comma: where the next key starts
    ('  {"prompt": "ab",, "answer": "c"}', 19),  # leading spaces count
])
def test_malformed_json_names_the_column_within_the_line(tmp_path, tok, bad, column):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "b"}, bad])
    with pytest.raises(DataError, match=rf"d\.jsonl:2: not valid JSON \(.* at column {column}\)"):
        PromptDataset.from_file(path, tok, max_prompt_tokens=64)


def test_empty_and_missing_files(tmp_path, tok):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    for name in ("empty.jsonl", "blank.jsonl"):
        with pytest.raises(DataError, match="no rows"):
            PromptDataset.from_file(tmp_path / name, tok, max_prompt_tokens=64)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        PromptDataset.from_file(tmp_path / "missing.jsonl", tok, max_prompt_tokens=64)


def test_custom_and_nested_fields(tmp_path, tok):
    rows = [{"question": "2+3?", "reward_model": {"ground_truth": "5"}}]
    ds = PromptDataset.from_file(write_jsonl(tmp_path / "d.jsonl", rows), tok, 64, prompt_field="question",
                                 answer_field="reward_model.ground_truth")
    assert ds[0].answer == "5"
    ds = PromptDataset.from_file(tmp_path / "d.jsonl", tok, 64, prompt_field="question", answer_field=None)
    assert ds[0].answer is None


def test_chat_messages(tmp_path, tok):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1?"}]
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs, "answer": "2"}, {"prompt": "2+2?", "answer": "4"}])
    ds = PromptDataset.from_file(path, tok, 64, chat_template=True)
    assert tok.decode(ds[0].prompt_ids) == "<bos><|system|>be brief<eos><|user|>1+1?<eos><|assistant|>"
    assert tok.decode(ds[1].prompt_ids) == "<bos><|user|>2+2?<eos><|assistant|>"
    with pytest.raises(DataError, match=r"d\.jsonl:1: .*chat_template"):
        PromptDataset.from_file(path, tok, 64, chat_template=False)


def test_parquet(tmp_path, tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    table = pa.table({"problem": ["1+1?", "a" * 50, "3+4?"], "solution": ["2", "x", "7"]})
    pq.write_table(table, tmp_path / "d.parquet")
    ds = PromptDataset.from_file(tmp_path / "d.parquet", tok, 16, prompt_field="problem", answer_field="solution")
    assert [(p.index, p.answer) for p in ds] == [(0, "2"), (2, "7")] and ds.skipped_too_long == [1]
    pq.write_table(pa.table({"problem": ["1+1?", ""], "solution": ["2", "3"]}), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e\.parquet:2: field 'problem': prompt is empty"):
        PromptDataset.from_file(tmp_path / "e.parquet", tok, 16, prompt_field="problem", answer_field="solution")


def test_synthetic_source():
    ds = PromptDataset.from_synthetic(SyntheticTask("copy", num_prompts=10, seed=1), None, 16)
    assert len(ds) == 10 and ds.source == "synthetic:copy"
    assert all(p.prompt == p.answer + "=" for p in ds)


def _dataset(n: int) -> PromptDataset:
    return PromptDataset.from_synthetic(SyntheticTask("copy", num_prompts=n), None, 16)


_DS = {n: _dataset(n) for n in range(1, 10)}  # built once: hypothesis calls the resume test many times


def test_sampler_epochs_are_seeded_permutations():
    ds = _dataset(12)
    s = PromptSampler(ds, seed=5)
    e0, e1 = [p.index for p in s.next_batch(12)], [p.index for p in s.next_batch(12)]
    assert sorted(e0) == sorted(e1) == list(range(12)) and e0 != e1
    assert [p.index for p in PromptSampler(ds, seed=5).next_batch(24)] == e0 + e1
    assert [p.index for p in PromptSampler(ds, seed=6).next_batch(12)] != e0
    assert [p.index for p in PromptSampler(ds, shuffle=False).next_batch(13)] == list(range(12)) + [0]


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 9), seed=st.integers(0, 3), consumed=st.integers(0, 30))
def test_sampler_resume_continues_exactly(n, seed, consumed):
    ds = _DS[n]
    a = PromptSampler(ds, seed=seed)
    a.next_batch(consumed)
    state = a.state_dict()
    b = PromptSampler(ds, seed=seed)
    b.load_state_dict(json.loads(json.dumps(state)))  # survives a checkpoint round trip
    assert [p.index for p in b.next_batch(20)] == [p.index for p in a.next_batch(20)]


def test_sampler_rejects_foreign_state():
    s = PromptSampler(_DS[5], seed=0)
    with pytest.raises(ValueError, match="dataset of 5 prompts"):
        PromptSampler(_DS[6], seed=0).load_state_dict(s.state_dict())
    with pytest.raises(ValueError, match="seed"):
        PromptSampler(_DS[5], seed=1).load_state_dict(s.state_dict())


def test_system_prompt_goes_first_unless_the_prompt_has_its_own(tok):
    rows = [(1, {"prompt": "1+1?", "answer": "2"}),
            (2, {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "2+2?"}], "answer": "4"})]
    ds = PromptDataset.from_records(rows, tok, 64, chat_template=True, system_prompt="be brief")
    first, second = (tok.decode(p.prompt_ids) for p in ds)
    assert first == "<bos><|system|>be brief<eos><|user|>1+1?<eos><|assistant|>"
    assert second == "<bos><|system|>own<eos><|user|>2+2?<eos><|assistant|>"
    assert ds[0].prompt == "1+1?"  # the row's own prompt is kept as it was
    plain = PromptDataset.from_records(rows[:1], tok, 64, chat_template=False, system_prompt="be brief")
    assert tok.decode(plain[0].prompt_ids) == "<bos>1+1?"  # no template: no system message
