"""A corpus of bad inputs. Each must fail with an error that names the problem (the file, key, line or field), at
the layer that reads it, and none may leave partial output behind as if it were complete. Then the safe-loading
audit: weights come only from safetensors and DCP, `torch.load` is always `weights_only=True`, and nothing
evaluates text (model output above all) as code.

Cases already pinned elsewhere are not repeated: most config mistakes (test_config.py), rollout.py's parameter and
prompt-file errors (test_engine_rollout.py), malformed data rows (test_data.py), tokenizer paths
(test_tokenizer.py), the train.py config error for a bad value (test_train_e2e.py).
"""
from __future__ import annotations

import ast
import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rollout
from config import ConfigError, load_config
from model import CheckpointError, ModelConfig, ModelConfigError, Transformer, load_model, save_model
from model.hf_io import INDEX
from model.tokenizer import build_char_tokenizer
from rl.data import DataError, PromptDataset
from rl.rewards import REWARD_KINDS, CheckedReward, RewardError, RewardResult, get_reward_fn
from runtime.topology import local_device, shared_devices, split_ranks

ROOT = Path(__file__).resolve().parents[2]
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 ?+="


def tiny_cfg(**overrides) -> ModelConfig:
    base = dict(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4,
                num_kv_heads=2, head_dim=8, qk_norm=True, max_position_embeddings=128, eos_token_id=2)
    return ModelConfig(**{**base, **overrides})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model in the HF layout, sharded (one small file per few tensors) with an index, plus a tokenizer."""
    path = tmp_path_factory.mktemp("m") / "model"
    save_model(Transformer(tiny_cfg()).init_weights(seed=0), tiny_cfg(), path, max_shard_bytes=8000)
    build_char_tokenizer(CHARS, path)
    assert len(list(path.glob("*.safetensors"))) > 2 and (path / INDEX).is_file()
    return path


@pytest.fixture(scope="module")
def single_file_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("m1") / "model"
    save_model(Transformer(tiny_cfg()).init_weights(seed=0), tiny_cfg(), path)
    return path


def copy_of(src: Path, tmp_path: Path, name: str = "copy") -> Path:
    return Path(shutil.copytree(src, tmp_path / name))


def edit_json(path: Path, **changes) -> None:
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------------------------ config

@pytest.mark.parametrize("text, needles", [
    (b"[train\nsteps = 3\n", ["malformed TOML", "line 1"]),
    (b"[train]\nsteps = 3\n\xff\n", ["malformed TOML", "not UTF-8", "0xff"]),
    (b"[train]\nlearning_rate = 1e-5\n", ["unknown key train.learning_rate", "Valid keys in [train]: steps, samples, lr"]),
    (b"[rollout]\ngroup_size = \"8\"\n", ["rollout.group_size", "expected an integer", "got a string"]),
    (b"[data]\nsource = \"p.jsonl\"\n[reward]\nkind = \"math\"\n",
     ['data.source = "p.jsonl"', "needs a tokenizer", "model.path", "model.tokenizer"]),
])
def test_config_file_mistakes_name_the_file_and_the_key(tmp_path, text, needles):
    path = tmp_path / "run.toml"
    path.write_bytes(text)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(path) in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


def test_config_path_that_is_a_directory(tmp_path):
    (tmp_path / "run.toml").mkdir()
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path / "run.toml")


@pytest.mark.parametrize("text, overrides, needles", [
    ("[train\nsteps = 3\n", [], ["malformed TOML", "line 1"]),
    ("[trian]\nsteps = 3\n", [], ["unknown section trian", "did you mean train?"]),
    ("[data]\nsource = \"p.jsonl\"\n[reward]\nkind = \"exact\"\n", [], ["data.source", "needs a tokenizer"]),
])
def test_train_py_config_errors_are_one_line_and_make_no_run_directory(tmp_path, text, overrides, needles):
    """train.py exits 2 with one `config error:` line (no traceback) before any process group or run directory."""
    path = tmp_path / "bad.toml"
    path.write_text(text)
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "--config", str(path), f"--log.dir={run_dir}", *overrides],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(n in errors[0] for n in needles), errors[0]
    assert not run_dir.exists()


def _train_py(tmp_path, *args, env=None):
    run_dir = tmp_path / "run"
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.toml", f"--log.dir={run_dir}", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    return proc, run_dir


def test_train_py_impossible_rank_split_is_a_config_error(tmp_path):
    proc, run_dir = _train_py(tmp_path, "--cluster.rollout_ranks=4", env={"WORLD_SIZE": "4", "RANK": "0"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "config error: cluster.rollout_ranks = 4" in proc.stderr and not run_dir.exists()


def test_train_py_truncated_weights_fail_in_one_line_before_any_work(tmp_path):
    from model import load_model, save_model
    from model.presets import preset_config
    from model.transformer import Transformer
    from rl.tasks import SyntheticTask
    tok = SyntheticTask().tokenizer()
    model_dir = tmp_path / "model"
    cfg = preset_config("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    save_model(Transformer(cfg).init_weights(seed=0), cfg, model_dir)
    load_model(model_dir)  # whole, it loads
    f = model_dir / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    proc, run_dir = _train_py(tmp_path, f"--model.path={model_dir}", "--cluster.colocate=true")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "error:" in proc.stderr and "model.safetensors" in proc.stderr and "truncated" in proc.stderr
    assert not run_dir.exists()


# ------------------------------------------------------------------------------------------------ rank split

@pytest.mark.parametrize("world, rollout_ranks, needles", [
    (4, 5, ["cluster.rollout_ranks = 5", "world of 4", "allowed: 1..3"]),  # more rollout ranks than the world
    (4, 4, ["cluster.rollout_ranks = 4", "world of 4", "allowed: 1..3"]),  # zero train ranks
    (1, 0, ["at least 2 ranks", "world of 1", "cluster.colocate"]),  # nothing to split
])
def test_impossible_rank_splits(world, rollout_ranks, needles):
    with pytest.raises(ValueError) as e:
        split_ranks(world, rollout_ranks, 0.25, colocate=False)
    assert all(n in str(e.value) for n in needles), str(e.value)


def test_ranks_share_a_gpu_across_partitions_but_never_within_an_nccl_group():
    assert local_device(1, 1).index == 0 and local_device(5, 4).index == 1 and local_device(3, 0).type == "cpu"
    assert shared_devices([0], [1], 2, 1, colocate=False) == [(0, 0, [0, 1])]   # a trainer and an engine, one GPU
    assert shared_devices([0], [1], 2, 2, colocate=False) == []                # a GPU each
    shared_devices([0, 1], [2, 3], 4, 2, colocate=False)       # each partition's ranks on distinct GPUs
    shared_devices([0, 2], [1, 3], 2, 1, colocate=False)       # two nodes of 2 ranks, 1 GPU each: one rank of a
    #                                                            group per node
    shared_devices([0, 1, 2], [3], 4, 0, colocate=False)       # no GPU: nothing to share
    for args, needles in [(([0, 1, 2], [3], 4, 2, False), ["train ranks 0 and 2", "cuda:0 of node 0", "at most 2"]),
                          (([0], [1, 2], 3, 1, False), ["rollout ranks 1 and 2"]),   # KV moves between them: NCCL
                          (([0, 1], [0, 1], 2, 1, True), ["train ranks 0 and 1", "cuda:0"])]:   # colocated
        with pytest.raises(ValueError) as e:
            shared_devices(*args[:4], colocate=args[4])
        assert all(n in str(e.value) for n in needles), str(e.value)
    # without KV migration the rollout ranks form no NCCL group: engines may share a GPU (a relay chain on one GPU);
    # two train ranks on one GPU are still refused
    assert shared_devices([0], [1, 2], 3, 1, colocate=False, migrate_kv=False) == [(0, 0, [0, 1, 2])]
    with pytest.raises(ValueError, match="train ranks 0 and 1"):
        shared_devices([0, 1], [2, 3], 4, 1, colocate=False, migrate_kv=False)


def _rank0_of(monkeypatch, world: int, gpus: int) -> object:
    import train
    monkeypatch.setattr(train, "gpu_count", lambda backend: gpus)
    for k, v in dict(RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)).items():
        monkeypatch.setenv(k, v)
    return train


def test_a_split_that_puts_two_train_ranks_on_one_gpu_is_a_config_error(monkeypatch, capsys):
    train = _rank0_of(monkeypatch, world=4, gpus=2)                  # 3 train ranks on 2 GPUs
    assert train.main(["--config", str(ROOT / "configs/tiny.toml")]) == 2
    assert "config error: train ranks 0 and 2 would share cuda:0 of node 0" in capsys.readouterr().err


@pytest.mark.parametrize("fraction, warned", [(0.85, True), (0.4, False)])
def test_a_gpu_shared_by_a_trainer_and_an_engine_warns_about_the_engines_memory_share(monkeypatch, capsys, fraction,
                                                                                    warned):
    train = _rank0_of(monkeypatch, world=2, gpus=1)                  # a trainer and an engine on one GPU
    def stop(*a, **kw):
        raise OSError("stopped after the config")
    monkeypatch.setattr(train, "build_run", stop)
    assert train.main(["--config", str(ROOT / "configs/tiny.toml"), "--cluster.rollout_ranks=1",
                       f"--rollout.gpu_memory_fraction={fraction}"]) == 2
    err = capsys.readouterr().err
    assert ("warning: cuda:0 of node 0 holds train and rollout ranks [0, 1]" in err) == warned, err
    assert "stopped after the config" in err


def test_rank_split_fractions_are_clamped_to_leave_both_partitions():
    assert split_ranks(2, 0, 0.99, colocate=False) == ([0], [1])
    assert split_ranks(8, 0, 0.01, colocate=False) == (list(range(7)), [7])
    assert split_ranks(1, 0, 0.5, colocate=True) == ([0], [0])


# ------------------------------------------------------------------------------------------ model directories

def test_missing_shard_is_named_with_the_index(model_dir, tmp_path):
    bad = copy_of(model_dir, tmp_path)
    gone = sorted(bad.glob("*.safetensors"))[1]
    gone.unlink()
    with pytest.raises(FileNotFoundError, match=f"{gone.name}: listed in {INDEX} but missing"):
        load_model(bad)


@pytest.mark.parametrize("keep", [0, 5, 9, "half", "all but 3"])
def test_truncated_safetensors_is_named(single_file_dir, tmp_path, keep):
    bad = copy_of(single_file_dir, tmp_path)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    n = {"half": len(data) // 2, "all but 3": len(data) - 3}.get(keep, keep)
    f.write_bytes(data[:n])
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert str(f) in str(e.value) and "truncated or corrupt" in str(e.value), str(e.value)


def test_truncated_shard_of_a_sharded_model_is_named(model_dir, tmp_path):
    bad = copy_of(model_dir, tmp_path)
    shard = sorted(bad.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=shard.name):
        load_model(bad)


@pytest.mark.parametrize("index, needle", [
    ('{"weight_map": {"a": "model-00001', "not valid JSON"),  # truncated
    ("[]", 'non-empty "weight_map"'),
    ('{"metadata": {}}', 'non-empty "weight_map"'),
    ('{"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}}', "same directory"),
    ('{"weight_map": {"model.norm.weight": "weights.bin"}}', "*.safetensors"),
])
def test_malformed_index_is_named(model_dir, tmp_path, index, needle):
    bad = copy_of(model_dir, tmp_path)
    (bad / INDEX).write_text(index)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert INDEX in str(e.value) and needle in str(e.value), str(e.value)


def test_tensor_stored_in_two_shards_is_named(model_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    bad = copy_of(model_dir, tmp_path)
    first, second = sorted(bad.glob("*.safetensors"))[:2]
    sd = load_file(str(second))
    sd.update(load_file(str(first)))
    save_file(sd, str(second))
    with pytest.raises(CheckpointError, match="is stored twice"):
        load_model(bad)


@pytest.mark.parametrize("change, needles", [
    (dict(vocab_size=65), ["embed_tokens.weight", "(64, 32)", "(65, 32)"]),
    (dict(intermediate_size=40), ["mlp", "(48, 32)", "(40, 32)"]),
    (dict(num_hidden_layers=3), ["missing", "model.layers.2."]),
    (dict(num_hidden_layers=1), ["unexpected", "model.layers.1."]),
])
def test_tensor_shapes_that_do_not_match_config_json(single_file_dir, tmp_path, change, needles):
    bad = copy_of(single_file_dir, tmp_path)
    edit_json(bad / "config.json", **change)
    with pytest.raises(CheckpointError) as e:
        load_model(bad)
    assert str(bad) in str(e.value) and all(n in str(e.value) for n in needles), str(e.value)


@pytest.mark.parametrize("content, needle", [
    (b"[1, 2]", "expected a JSON object"),
    (b'{"model_type": "qwen3", "vocab_size"', "not valid JSON"),  # truncated
    (b"\xff\xfe{}", "not valid JSON"),
    (None, "num_key_value_heads must be a positive integer, got 0"),
    (None, "head_dim must be a positive integer, got '8'"),
    (None, "rope_parameters must be an object"),
    (None, "dtype 'int8' is not supported"),
])
def test_bad_config_json_is_named(single_file_dir, tmp_path, content, needle):
    bad = copy_of(single_file_dir, tmp_path)
    if content is not None:
        (bad / "config.json").write_bytes(content)
    else:
        change = {"num_key_value_heads must": dict(num_key_value_heads=0), "head_dim must": dict(head_dim="8"),
                  "rope_parameters must": dict(rope_parameters=5), "dtype 'int8'": dict(dtype="int8")}
        edit_json(bad / "config.json", **next(v for k, v in change.items() if needle.startswith(k)))
    with pytest.raises(ModelConfigError) as e:
        load_model(bad)
    assert str(bad / "config.json") in str(e.value) and needle in str(e.value), str(e.value)


def test_pickled_weights_are_refused_by_name(single_file_dir, tmp_path):
    bad = copy_of(single_file_dir, tmp_path)
    (bad / "model.safetensors").unlink()
    (bad / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(FileNotFoundError, match="pytorch_model.bin: pickled weights are not loaded"):
        load_model(bad)


def test_a_failed_save_leaves_no_model_directory(tmp_path, monkeypatch):
    """save_model writes beside the target and renames: a crash mid-write leaves no half model at `path`."""
    import model.hf_io as hf_io
    real, calls = hf_io.save_file, []

    def fail_on_second_shard(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kwargs)
    monkeypatch.setattr(hf_io, "save_file", fail_on_second_shard)
    with pytest.raises(OSError, match="disk full"):
        save_model(Transformer(tiny_cfg()).init_weights(seed=0), tiny_cfg(), tmp_path / "out", max_shard_bytes=8000)
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------- tokenizer and prompt data

def run_cfg(model_path: Path, data: Path, *extra: str):
    return load_config(None, [f"--model.path={model_path}", f"--data.source={data}", "--reward.kind=exact", *extra])


def test_model_dir_without_tokenizer_when_data_is_a_file(single_file_dir, tmp_path):
    from runtime.build import build_run
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "abc", "answer": "cba"}])
    with pytest.raises(FileNotFoundError) as e:
        build_run(run_cfg(single_file_dir, data), with_data=True)
    assert str(single_file_dir) in str(e.value) and "no tokenizer files" in str(e.value)


def test_over_long_prompts_are_skipped_and_counted_by_the_run(model_dir, tmp_path):
    from runtime.build import build_run
    rows = [{"prompt": "a" * n, "answer": "x"} for n in (2, 20, 3, 30, 40)]
    data = write_jsonl(tmp_path / "p.jsonl", rows)
    parts = build_run(run_cfg(model_dir, data, "--data.max_prompt_tokens=8"), with_data=True)
    assert parts.skipped_prompts == 3 and len(parts.source.sampler.dataset) == 2
    assert [p.index for p in parts.source.sampler.dataset] == [0, 2]
    with pytest.raises(DataError, match=r"p.jsonl: all 5 prompts are longer than max_prompt_tokens=1"):
        build_run(run_cfg(model_dir, data, "--data.max_prompt_tokens=1"), with_data=True)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(CHARS)


@pytest.mark.parametrize("content, needle", [
    (b"", "no rows (empty file?)"),
    (b"\n   \n\n", "no rows (empty file?)"),
    (b'{"prompt": "ab", "answer": "1"}\n{"prompt": "cd"}\n', ":2: missing field 'answer'"),
    (b'{"prompt": "ab", "answer": "1"}\n{"prompt": "cd", "answer": null}\n', ":2: field 'answer': answer must be"),
    (b'{"prompt": "ab", "answer": "1"}\n{"prompt": "c\xff", "answer": "1"}\n', ":2: not UTF-8 text (byte 0xff"),
    (b'{"prompt": "ab", "answer": "1"}\n{"prompt": "cd", "answer": "1"\n', ":2: not valid JSON"),
])
def test_bad_prompt_files_name_the_file_and_line(tmp_path, tok, content, needle):
    path = tmp_path / "p.jsonl"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        PromptDataset.from_file(path, tok, max_prompt_tokens=64)
    assert str(path) in str(e.value) and needle in str(e.value), str(e.value)


def test_prompt_file_that_is_a_directory(tmp_path, tok):
    (tmp_path / "p.jsonl").mkdir()
    with pytest.raises(FileNotFoundError, match="p.jsonl: prompt data file not found .it is a directory"):
        PromptDataset.from_file(tmp_path / "p.jsonl", tok, max_prompt_tokens=64)


# ------------------------------------------------------------------------------------------------------ rewards

@pytest.mark.parametrize("returned, needle", [
    (RewardResult("1.0", True), "non-numeric reward '1.0' (str)"),  # type: ignore[arg-type]
    (RewardResult(None, False), "non-numeric reward None (NoneType)"),  # type: ignore[arg-type]
    (RewardResult(torch.tensor(1.0), True), "non-numeric reward"),  # type: ignore[arg-type]
    (RewardResult(True, True), "non-numeric reward True (bool)"),
    (RewardResult(float("nan"), False), "non-finite reward nan"),
    (RewardResult(float("inf"), False), "non-finite reward inf"),
    (0.5, "returned float 0.5, not a RewardResult"),
    (None, "returned NoneType None, not a RewardResult"),
])
def test_non_numeric_reward_is_caught_naming_the_kind(monkeypatch, returned, needle):
    monkeypatch.setitem(REWARD_KINDS, "custom", lambda: (lambda response, answer: returned))
    fn = get_reward_fn("custom")
    with pytest.raises(RewardError) as e:
        fn("the response", "42")
    assert "reward kind 'custom'" in str(e.value) and needle in str(e.value), str(e.value)
    assert "'the response'" in str(e.value)


def test_numeric_rewards_pass_through_as_floats(monkeypatch):
    import numpy as np
    for value in (1, np.float32(0.25), np.int64(0)):
        monkeypatch.setitem(REWARD_KINDS, "custom", lambda v=value: (lambda r, a: RewardResult(v, bool(v))))
        out = get_reward_fn("custom")("x", "y")
        assert type(out.reward) is float and out.reward == float(value)
    exact = get_reward_fn("exact", casefold=True)
    assert isinstance(exact, CheckedReward) and exact.casefold and exact("A", "a") == RewardResult(1.0, True, False,
                                                                                                   "exact match")
    assert get_reward_fn("synthetic")("abc", "abd").reward == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------------- rollout.py

def rollout_main(model: Path, prompts: Path, out: Path, *extra: str) -> int:
    return rollout.main(["--model", str(model), "--prompts", str(prompts), "--out", str(out),
                         "--num-kv-tokens", "256", "--max-new-tokens", "3", "--max-num-seqs", "4", *extra])


@pytest.fixture
def id_prompts(tmp_path) -> Path:
    return write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, 5, 6, 7]}, {"prompt": [1, 8, 9]}])


def one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("rollout.py: error:") and "Traceback" not in err, err
    return lines[0]


def corrupt_truncated(d: Path) -> str:
    f = sorted(d.glob("*.safetensors"))[0]
    f.write_bytes(f.read_bytes()[:50])
    return f.name


def corrupt_missing_shard(d: Path) -> str:
    f = sorted(d.glob("*.safetensors"))[1]
    f.unlink()
    return f.name


def corrupt_config(d: Path) -> str:
    (d / "config.json").write_text('{"model_type": "qwen3", ')
    return "config.json"


def corrupt_shapes(d: Path) -> str:
    edit_json(d / "config.json", hidden_size=40)
    return "embed_tokens.weight"


@pytest.mark.parametrize("corrupt", [corrupt_truncated, corrupt_missing_shard, corrupt_config, corrupt_shapes])
def test_rollout_bad_model_dir_exits_2_in_one_line(model_dir, tmp_path, id_prompts, capsys, corrupt):
    bad = copy_of(model_dir, tmp_path)
    needle = corrupt(bad)
    out = tmp_path / "o.jsonl"
    assert rollout_main(bad, id_prompts, out) == 2
    line = one_line_error(capsys)
    assert "--model:" in line and needle in line, line
    assert not out.exists()


@pytest.mark.parametrize("args, needle", [
    (["--num-kv-tokens", "0"], "--num-kv-tokens must be >= 1"),
    (["--device", "meta"], "--device must be cpu, cuda or cuda:N"),
    (["--device", "tpu9"], "--device must be cpu, cuda or cuda:N"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--dtype", "int8"], "invalid choice: 'int8'"),
])
def test_rollout_bad_parameters_exit_2(model_dir, tmp_path, id_prompts, capsys, args, needle):
    out = tmp_path / "o.jsonl"
    assert rollout_main(model_dir, id_prompts, out, *args) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err, err
    assert not out.exists()


def test_rollout_bad_prompt_file_and_out_path(model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": [1, 2]}\n{"prompt": "caf\xe9"}\n')
    assert rollout_main(model_dir, bad, tmp_path / "o.jsonl") == 2
    assert "bad.jsonl:2: not UTF-8 text (byte 0xe9" in one_line_error(capsys)
    (tmp_path / "dir.jsonl").mkdir()
    assert rollout_main(model_dir, tmp_path / "dir.jsonl", tmp_path / "o.jsonl") == 2
    assert "dir.jsonl is a directory" in one_line_error(capsys)
    good = write_jsonl(tmp_path / "p.jsonl", [{"prompt": [1, 2]}])
    assert rollout_main(model_dir, good, tmp_path / "dir.jsonl") == 2
    assert "--out:" in one_line_error(capsys)
    assert not (tmp_path / "o.jsonl").exists()


def test_rollout_failure_while_writing_leaves_no_partial_out(model_dir, tmp_path, id_prompts, monkeypatch):
    """--out appears only once complete: a failure mid-write leaves neither a partial file nor the temporary one,
    and a complete --out from an earlier run stays as it was."""
    real_load = rollout.load_engine

    class DecodeFailsSecondTime:
        calls = 0

        def decode(self, ids, **kwargs):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("decoder broke")
            return "text"

    def load_engine(*args, **kwargs):
        engine = real_load(*args, **kwargs)
        engine.tokenizer = DecodeFailsSecondTime()  # prompts are token ids: only the output decode uses it
        return engine
    monkeypatch.setattr(rollout, "load_engine", load_engine)
    out = tmp_path / "o.jsonl"
    with pytest.raises(RuntimeError, match="decoder broke"):
        rollout_main(model_dir, id_prompts, out)
    assert not out.exists() and not list(tmp_path.glob(".o.jsonl.tmp*"))
    out.write_text("complete earlier output\n")
    with pytest.raises(RuntimeError, match="decoder broke"):
        rollout_main(model_dir, id_prompts, out)
    assert out.read_text() == "complete earlier output\n" and not list(tmp_path.glob(".o.jsonl.tmp*"))
    monkeypatch.setattr(rollout, "load_engine", real_load)
    assert rollout_main(model_dir, id_prompts, out) == 0  # and a good run replaces it whole
    assert len(out.read_text().splitlines()) == 2 and not list(tmp_path.glob(".o.jsonl.tmp*"))


# --------------------------------------------------------------------------------------------- safe loading audit

# The files that may unpickle, each reading only what its own process tree wrote: the control channel (ranks of one
# job), and a reproduction's pool (its forked workers' results).
PICKLE_READERS = ("runtime/channel.py", "sim/packed.py")


def audit(source: str, rel: str) -> list[str]:
    """Unsafe-loading patterns in one file's source: eval/exec, torch.load without weights_only=True, pickle loads
    outside PICKLE_READERS, trust_remote_code=True, np.load(allow_pickle=True), sympy's string parsers."""
    found = []
    for node in ast.walk(ast.parse(source, rel)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        kw = {k.arg: k.value for k in node.keywords}
        where = f"{rel}:{node.lineno}"
        if isinstance(f, ast.Name) and name in ("eval", "exec"):
            found.append(f"{where}: {name}() evaluates text as code")
        if owner == "torch" and name == "load":
            wo = kw.get("weights_only")
            if not (isinstance(wo, ast.Constant) and wo.value is True):
                found.append(f"{where}: torch.load without weights_only=True")
        if owner in ("pickle", "cPickle", "dill", "cloudpickle") and name in ("load", "loads") \
                and rel not in PICKLE_READERS:
            found.append(f"{where}: {owner}.{name} outside the control channel")
        if isinstance(kw.get("trust_remote_code"), ast.Constant) and kw["trust_remote_code"].value is True:
            found.append(f"{where}: trust_remote_code=True runs code from a model directory")
        if name == "load" and isinstance(kw.get("allow_pickle"), ast.Constant) and kw["allow_pickle"].value is True:
            found.append(f"{where}: allow_pickle=True")
        if name in ("sympify", "parse_expr", "parse_latex"):
            found.append(f"{where}: {name}() on a string may eval it")
    return found


def source_files() -> list[Path]:
    skip = {"tests", "runs", "build", "dist", "node_modules"}
    return sorted(p for p in ROOT.rglob("*.py")
                  if not any(part in skip or part.startswith(".") for part in p.relative_to(ROOT).parts[:-1]))


def test_audit_catches_each_pattern():
    bad = ("import torch, pickle\nx = eval('1')\nexec('y = 2')\ntorch.load('f')\ntorch.load('f', weights_only=False)\n"
           "pickle.loads(b'')\nAutoModel.from_pretrained('m', trust_remote_code=True)\n"
           "np.load('a', allow_pickle=True)\nsympify(text)\nmodel.eval()\ntorch.load('f', weights_only=True)\n")
    found = audit(bad, "x.py")
    assert sorted(int(f.split(":")[1]) for f in found) == list(range(2, 10)), found


def test_source_tree_loads_safely():
    files = source_files()
    assert ROOT / "trainer" / "checkpoint.py" in files and ROOT / "rl" / "rewards.py" in files
    found = [hit for p in files for hit in audit(p.read_text(encoding="utf-8"), p.relative_to(ROOT).as_posix())]
    assert not found, "\n".join(found)


def test_weights_load_only_from_safetensors():
    """The loader opens nothing but safetensors (and its JSON index / config); DCP is trainer/checkpoint.py's."""
    src = (ROOT / "model" / "hf_io.py").read_text()
    assert "safe_open" in src and "torch.load" not in src and "pickle" not in src.replace("pickled", "")


def test_math_reward_never_evaluates_model_output(tmp_path):
    """math_verify parses LaTeX with a grammar and plain expressions with sympy's parse_expr (an eval) only after
    a regex admitting digits and operators. Payloads that would create a file if evaluated anywhere must not."""
    from math_verify import parse

    from rl.rewards import score_math
    sentinel = tmp_path / "pwned"
    touch = f"__import__('pathlib').Path({str(sentinel)!r}).touch()"
    payloads = [f"\\boxed{{{touch}}}", f"The answer is {touch}", f"#### {touch}", f"1+{touch}", f"2*(3+{touch})",
                f"$${touch}$$", f"answer: eval(\"{touch}\")", f"\\boxed{{1}} + {touch}", f"1 + 1 = {touch}."]
    for p in payloads:
        score_math(p, "1")
        score_math("\\boxed{1}", p)  # a poisoned reference too
        parse(p, parsing_timeout=None)  # math_verify's default extraction, on the raw text
    assert not sentinel.exists()
