"""cpu/process.py `keep_freed_memory`: a CPU rank's train steps reuse their freed memory instead of faulting it
back in every step."""
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# Six train steps of the tiny model on 32 samples of 12 + 128 tokens, in a fresh process: the minor page faults of
# each step (one per 4 KiB page the step took fresh from the OS).
STEPS = textwrap.dedent("""
    import random, resource, sys
    import torch
    from config import TrainConfig
    from model.presets import preset_config
    from model.transformer import Transformer
    import cpu
    from cpu.process import keep_freed_memory
    cpu.enable()   # the C train ops, as a CPU rank runs them
    from trainer.batch import Sample
    from trainer.trainer import Trainer
    if sys.argv[1] == "keep" and not keep_freed_memory():
        print("unsupported"); sys.exit(0)
    torch.set_num_threads(1)
    L, rng = 128, random.Random(0)
    model = Transformer(preset_config("tiny", vocab_size=20, eos_token_id=1)).init_weights(seed=0)
    trainer = Trainer(model, TrainConfig(lr=1e-3, micro_batch_tokens=32 * (L + 16), warmup_steps=1), max_response_len=L)
    samples = []
    for g in range(4):
        prompt = [rng.randrange(2, 20) for _ in range(12)]
        for _ in range(8):
            resp = [rng.randrange(2, 20) for _ in range(L)]
            samples.append(Sample(prompt + resp[:-1], resp, [-3.0] * L, rng.gauss(0, 1), g))
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        trainer._backward(samples, 0, {}, None)
        trainer._apply()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(*faults)
""")


def _faults(mode: str, env: dict[str, str] | None = None) -> list[int] | None:
    out = subprocess.run([sys.executable, "-c", STEPS, mode], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 0, out.stderr
    last = out.stdout.strip().splitlines()[-1]
    return None if last == "unsupported" else [int(x) for x in last.split()]


@pytest.mark.slow
def test_train_steps_reuse_their_memory_once_freed_memory_is_kept():
    keep = _faults("keep")
    if keep is None:
        pytest.skip("this C library has no mallopt (not glibc)")
    assert keep[0] > 4000, keep   # the first step takes its activations' pages (~5 MiB each) from the OS
    # kept, a later step runs on reused memory alone (3-5 fresh pages: Python's own small-object arenas); with
    # glibc's default thresholds the third to sixth steps took 262-11,000 fresh pages each (16 runs of this loop)
    assert min(keep[2:]) < 100, keep


@pytest.mark.slow
def test_the_peer_benchmarks_kept_allocator_reaches_glibc_through_its_environment():
    """bench/vs_trl.py --trl-allocator kept: a process that never calls mallopt, given the environment it builds for
    TRL, reuses its memory the same way (glibc reads MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ at start)."""
    from bench.vs_trl import trl_env
    if _faults("keep") is None:
        pytest.skip("this C library has no mallopt (not glibc)")
    assert "MALLOC_TRIM_THRESHOLD_" not in trl_env("default")
    kept = _faults("default", trl_env("kept"))
    assert kept[0] > 4000 and min(kept[2:]) < 100, kept
    with pytest.raises(ValueError, match="allocator"):
        trl_env("jemalloc")
