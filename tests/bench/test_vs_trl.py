"""bench/vs_trl.py's machinery without TRL: our colocated job for 2 steps read back from its own logs, the table and
ratio line, the TRL side's model directory (our tiny model and tokenizer in the HF layout), and a clear error when
the interpreter given for TRL has no trl."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import vs_trl

ROOT = Path(__file__).resolve().parents[2]


def test_missing_trl_is_a_clear_error(tmp_path):
    fake = tmp_path / "python"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -c 'import no_such_module_trl' \"$@\"\n")
    fake.chmod(0o755)
    with pytest.raises(vs_trl.TrlMissing, match=r"cannot import trl.*\[bench\]"):
        vs_trl.check_trl(str(fake))
    r = subprocess.run([sys.executable, "bench/vs_trl.py", "--quick", "--trl-python", str(fake)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and "cannot import trl" in r.stderr and "Traceback" not in r.stderr


def test_hf_job_directory_loads_in_transformers(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    s = vs_trl.Setting("tiny", 2)
    vs_trl.save_hf_job(s, tmp_path / "hf")
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", local_files_only=True)
    prompt, answer = vs_trl.synthetic_task(s).prompts()[0]
    ids = tok(prompt)["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == prompt
    assert model.config.vocab_size == len(tok) and model.config.eos_token_id == tok.eos_token_id
    long = vs_trl.Setting("long", 2, "repeat", 64, 64)
    assert {len(a) for _, a in vs_trl.synthetic_task(long).prompts()} == {64}


@pytest.mark.dist
@pytest.mark.slow
def test_ours_only_quick_run_reads_its_own_logs(tmp_path):
    r = subprocess.run([sys.executable, "bench/vs_trl.py", "--quick", "--skip-trl", "--work", str(tmp_path)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith("tiny  colocated      2 steps") and lines[-1] == "TRL wall / ours: n/a (no TRL run)"
    run = tmp_path / "colocated-tiny-0"
    res = vs_trl.ours_result(run, "colocated", "tiny", 10.0, 1)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(res.rewards) == 2 and 0 < res.steps_s < rows[-1]["time_s"] + 1e-9
    assert 256 <= res.tokens <= 2 * 256 * 4     # 2 steps of 256 responses of 1-4 tokens


def test_summary_ratio_line():
    rs = [vs_trl.Result("trl", "tiny", 30.0, 40.0, 1000, [0.1, 0.5], 1 << 30),
          vs_trl.Result("colocated", "tiny", 10.0, 20.0, 1000, [0.1, 0.6], 1 << 29),
          vs_trl.Result("disagg", "tiny", 40.0, 50.0, 1000, [0.1, 0.6], 1 << 30)]
    out = vs_trl.summary(rs, ["tiny"], ["trl", "colocated", "disagg"])
    assert out.splitlines()[-1] == ("TRL wall / ours, at equal threads (TRL at --threads): tiny colocated 3.00x, "
                                    "tiny disagg 0.75x")
    rs.append(vs_trl.Result("trl_default", "tiny", 20.0, 30.0, 1000, [0.1, 0.5], 1 << 30))
    out = vs_trl.summary(rs, ["tiny"], ["trl", "trl_default", "colocated", "disagg"]).splitlines()
    assert out[-2].endswith("tiny colocated 3.00x, tiny disagg 0.75x")
    assert out[-1] == ("TRL wall / ours, each side at its defaults (TRL at torch's default threads): "
                       "tiny colocated 2.00x, tiny disagg 0.50x")
    assert vs_trl.summary(rs[1:3], ["tiny"], ["colocated", "disagg"]).splitlines()[-1] == \
        "TRL wall / ours: n/a (no TRL run)"


def test_role_profile_buckets_samples_per_process():
    from bench import roles
    lines = [
        'process 1:"torchrun";process 2:"train.py";<module> (train.py:1);_find_and_load (<frozen>:1) 30',
        'process 1:"torchrun";process 2:"train.py";main (train.py:9);run_leader (train.py:2);'
        'TrainerThread._publish (runtime/train_worker.py:3);WeightPublisher.publish (trainer/publish.py:4) 7',
        'process 1:"torchrun";process 2:"train.py";run_leader (train.py:2);Queue.get (queue.py:1) 50',
        'process 1:"torchrun";process 3:"train.py";run_rollout (train.py:5);RolloutWorker.step (r.py:1) 20',
        'process 1:"torchrun";process 3:"train.py";run_rollout (train.py:5);WeightReceiver.receive (p.py:1);'
        'recv (c10d.py:1) 9',
    ]
    per, role = roles.profile(lines)
    assert role == {"2": "leader", "3": "rollout"}
    assert per["2"]["imports (start-up)"] == 30 and per["2"]["blocked (waiting)"] == 50
    assert per["2"]["weight publication (gather, pack, checksum, broadcast, relay)"] == 7
    assert per["3"]["engine steps (decode, sampling, inline rewards)"] == 20 and per["3"]["blocked (waiting)"] == 9
    out = roles.table(per, role, rate=10.0)
    assert "leader (pid 2): busy 3.7 s" in out and "rollout (pid 3): busy 2.0 s" in out


def test_the_seed_reaches_both_sides(tmp_path, monkeypatch):
    """--seed N: our run gets `--seed=N`, TRL's job spec N (its GRPOConfig seed); model and prompts stay seed 0."""
    seen = []
    monkeypatch.setattr(vs_trl, "launch", lambda cmd, log, env=None: seen.append(cmd) or (1.0, 1))
    monkeypatch.setattr(vs_trl, "ours_result", lambda *a: None)
    s = vs_trl.Setting("tiny", 2)
    vs_trl.run_ours(s, "disagg", tmp_path, "0", 1, seed=3)
    assert "--seed=3" in seen[-1]
    (tmp_path / "trl-tiny.json").write_text(json.dumps({"steps": [2.0], "begin": 1.0, "lengths": [1.0],
                                                         "rewards": [0.5]}))
    vs_trl.run_trl(s, tmp_path, sys.executable, 1, seed=3)
    assert json.loads(seen[-1][seen[-1].index("--trl-job") + 1])["seed"] == 3
