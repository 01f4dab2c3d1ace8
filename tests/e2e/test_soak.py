"""Memory soak: a few hundred tiny engine steps (groups with shared prompt blocks, aborts, weight loads, KV
exhaustion) and tiny train steps in one process leave no KV block held and no resident-memory growth beyond a small
bound after warm-up."""
from __future__ import annotations

import gc
import os
import random
import resource

import pytest

from config import TrainConfig
from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from trainer import Trainer
from tests.support.trainer import make_groups, tiny_model

RSS_BOUND_MB = 24.0


def rss_mb() -> float:
    """Resident set size now (psutil when installed, else /proc/self/statm; ru_maxrss as a last resort)."""
    try:
        import psutil
        return psutil.Process().memory_info().rss / 2**20
    except ImportError:
        pass
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


pytestmark = pytest.mark.usefixtures("one_thread")


def engine_round(eng: LLMEngine, rng: random.Random, r: int) -> int:
    """One round: 4 groups of 4 with shared prompts, one request aborted mid-way; run to completion."""
    ids = []
    for g in range(4):
        prompt = [rng.randrange(3, 60) for _ in range(rng.randrange(3, 14))]
        for s in range(4):
            sp = SamplingParams(temperature=1.0, max_new_tokens=rng.randrange(2, 12), seed=r * 100 + g * 4 + s)
            ids.append(eng.add_request(GenRequest(prompt, sp, group_id=r * 10 + g, sample_index=s)))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        if steps == 2:
            eng.abort(ids[rng.randrange(len(ids))])
    return steps


@pytest.mark.slow
def test_engine_and_trainer_soak_leaks_no_kv_blocks_and_no_memory():
    rng = random.Random(0)
    model = tiny_model()
    # a small pool (32 blocks of 4 tokens) so that rounds exhaust it and preempt
    eng = LLMEngine(tiny_model(seed=1), EngineConfig(block_size=4, num_kv_tokens=128, max_num_seqs=16,
                                                     max_batch_tokens=64, seed=0), version=0)
    bm = eng.block_manager
    trainer = Trainer(model, TrainConfig(lr=1e-3, micro_batch_tokens=64), temperature=1.0)
    steps, rounds, base = 0, 0, None
    while steps < 400:
        steps += engine_round(eng, rng, rounds)
        assert bm.num_free == bm.num_blocks and not any(bm.ref_counts), f"KV blocks leaked after round {rounds}"
        assert not eng.seqs and not eng.scheduler.running and not eng.scheduler.waiting
        if rounds % 3 == 0:
            trainer.train_step(make_groups(rounds, n_groups=2, group_size=4))
        if rounds % 5 == 0:
            eng.load_weights({k: v.detach() for k, v in model.state_dict().items()}, version=rounds)
        rounds += 1
        if rounds == 8:  # warm-up done: allocator pools, optimizer state, lazily built buffers
            gc.collect()
            base = rss_mb()
    gc.collect()
    grown = rss_mb() - base
    assert eng.scheduler.num_preemptions > 0, "the soak should exhaust the KV pool at least once"
    assert trainer.step > 5 and steps >= 400
    assert grown < RSS_BOUND_MB, f"resident memory grew {grown:.1f} MB over {rounds} rounds / {steps} engine steps"
