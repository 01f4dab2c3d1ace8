"""rollout.py: standalone generation from the command line (run in-process through main(argv))."""
import json

import pytest

import rollout
from tests.support.helpers import make_hf_model

CHARS = "abcdefghijklmnopqrstuvwxyz ?!.,0123456789"


def char_tokenizer(path):
    """A character-level WordLevel tokenizer (<pad> <bos> <eos> <unk>, then one id per character)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {t: i for i, t in enumerate(["<pad>", "<bos>", "<eos>", "<unk>", *CHARS])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                  unk_token="<unk>")
    tok.save_pretrained(str(path))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    make_hf_model("qwen2", path)
    char_tokenizer(path)
    return path


def write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return path


def run(model_dir, tmp_path, *extra, prompts=None):
    prompts = prompts or write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hello world"}), "",
                                                       json.dumps({"prompt": "what is 2+2?", "x": 1}),
                                                       json.dumps({"prompt": [1, 5, 6, 7]})])
    return rollout.main(["--model", str(model_dir), "--prompts", str(prompts), "--out", str(tmp_path / "o.jsonl"),
                         "--num-kv-tokens", "2048", "--max-num-seqs", "8", *extra])


def test_happy_path_writes_one_line_per_sample(model_dir, tmp_path):
    assert run(model_dir, tmp_path, "--n", "3", "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "20",
               "--seed", "4") == 0
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [(r["prompt_index"], r["sample_index"]) for r in rows] == [(i, j) for i in range(3) for j in range(3)]
    for r in rows:
        assert 1 <= len(r["token_ids"]) <= 6 and len(r["logprobs"]) == len(r["token_ids"])
        assert r["finish_reason"] in ("stop", "length") and isinstance(r["text"], str)
        assert all(lp <= 0 for lp in r["logprobs"])
    first = (tmp_path / "o.jsonl").read_text()
    assert run(model_dir, tmp_path, "--n", "3", "--max-new-tokens", "6", "--temperature", "0.8", "--top-k", "20",
               "--seed", "4") == 0
    assert (tmp_path / "o.jsonl").read_text() == first  # seeded: reproducible


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1]"),
    (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
    (["--n", "0"], "--n must be >= 1"),
    (["--top-k", "-2"], "--top-k must be >= 0"),
])
def test_bad_parameters(model_dir, tmp_path, capsys, args, message):
    assert run(model_dir, tmp_path, *args) == 2
    assert message in capsys.readouterr().err


def test_bad_model_directory(tmp_path, capsys):
    p = write(tmp_path / "p.jsonl", [json.dumps({"prompt": [1, 2]})])
    assert rollout.main(["--model", str(tmp_path / "nope"), "--prompts", str(p), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "nope" in err and "does not exist" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert rollout.main(["--model", str(tmp_path / "empty"), "--prompts", str(p), "--out", str(tmp_path / "o")]) == 2
    assert "config.json" in capsys.readouterr().err


@pytest.mark.parametrize("lines,message", [
    (None, "does not exist"),
    ([json.dumps({"prompt": "ok"}), "{not json"], "p.jsonl:2: not valid JSON"),
    ([json.dumps({"text": "hi"})], "p.jsonl:1: no field 'prompt'"),
    ([json.dumps(["hi"])], "p.jsonl:1: expected a JSON object"),
    ([json.dumps({"prompt": 3})], "p.jsonl:1: field 'prompt' must be"),
    ([json.dumps({"prompt": [1, 999]})], "token ids must be in [0, 128)"),
    ([""], "no prompts"),
])
def test_bad_prompt_files(model_dir, tmp_path, capsys, lines, message):
    path = tmp_path / "p.jsonl"
    if lines is not None:
        write(path, lines)
    assert run(model_dir, tmp_path, prompts=path) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_text_prompts_need_a_tokenizer(tmp_path, capsys):
    make_hf_model("llama", tmp_path / "m")
    p = write(tmp_path / "p.jsonl", [json.dumps({"q": "hello"})])
    assert rollout.main(["--model", str(tmp_path / "m"), "--prompts", str(p), "--out", str(tmp_path / "o.jsonl"),
                         "--prompt-field", "q", "--num-kv-tokens", "512"]) == 2
    assert "no tokenizer" in capsys.readouterr().err
    write(p, [json.dumps({"q": [5, 6, 7]})])
    assert rollout.main(["--model", str(tmp_path / "m"), "--prompts", str(p), "--out", str(tmp_path / "o.jsonl"),
                         "--prompt-field", "q", "--num-kv-tokens", "512", "--max-new-tokens", "3"]) == 0
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert row["text"] is None and len(row["token_ids"]) <= 3


def test_tokenizer_flag_gives_text_prompts_a_tokenizer(model_dir, tmp_path, capsys):
    """A model directory without tokenizer files (an export from an older run) takes text prompts with --tokenizer;
    a tokenizer that is missing or larger than the model's vocabulary is a one-line error."""
    make_hf_model("qwen2", tmp_path / "m")
    p = write(tmp_path / "p.jsonl", [json.dumps({"prompt": "hello"})])
    base = ["--model", str(tmp_path / "m"), "--prompts", str(p), "--out", str(tmp_path / "o.jsonl"),
            "--num-kv-tokens", "512", "--max-new-tokens", "3", "--temperature", "0"]
    assert rollout.main(base) == 2 and "--tokenizer DIR" in capsys.readouterr().err
    assert rollout.main([*base, "--tokenizer", str(model_dir)]) == 0
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert isinstance(row["text"], str) and 1 <= len(row["token_ids"]) <= 3
    capsys.readouterr()
    assert rollout.main([*base, "--tokenizer", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--tokenizer:" in err and "nope" in err and "does not exist" in err
    from model.tokenizer import build_char_tokenizer
    build_char_tokenizer("".join(chr(0x4e00 + i) for i in range(200)), tmp_path / "big")
    assert rollout.main([*base, "--tokenizer", str(tmp_path / "big")]) == 2
    assert "--tokenizer: the tokenizer has 204 tokens but the model's vocab_size is 128" in capsys.readouterr().err
