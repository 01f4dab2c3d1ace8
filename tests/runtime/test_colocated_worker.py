"""A colocated rank's engine refresh at a publication, in one process: the trainer's weights copied in place, the
running sequences recomputed under them, or keeping their KV where the preset's weight sync keeps it
(`WeightSync.keeps_kv`, PipelineRL's in-flight update)."""
from types import SimpleNamespace

import pytest
import torch

from model import Transformer
from runtime.colocated import ColocatedWorker
from runtime.messages import Start
from sched import load_preset
from tests.support.worker import events_of, group_specs, make_worker, run_to_end

pytestmark = pytest.mark.usefixtures("one_thread")


def refreshed_mid_generation(keep_kv: bool):
    """A colocated worker at version 0 decodes 3 steps, then the trainer (version 1: the weights x 1.3) publishes."""
    trainer = SimpleNamespace(model=None, step=0)
    w, ch, task, tok = make_worker(max_new_tokens=10, rank=0, cls=ColocatedWorker, trainer=trainer, ranks=[0],
                                   keep_kv=keep_kv)
    model = Transformer(w.engine.runner.model.config)
    model.load_state_dict(w.engine.runner.model.state_dict())
    trainer.model = model
    w.sync_engine()
    w.handle(Start(group_specs(task, tok)))
    for _ in range(3):
        w.step()
    running = {int(r) for r in w.engine.seqs if w.engine.seqs[r].num_generated > 0}
    assert running
    before = w.engine.stats().num_preemptions
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.3)
    trainer.step = 1
    w.publish(1, overlapped=False)
    preempted = w.engine.stats().num_preemptions - before
    run_to_end(w)
    scored = {e.req_id: e.payload for e in events_of(ch, "reward_scored")}
    return w, running, preempted, scored


def test_the_refresh_recomputes_running_sequences_unless_the_preset_keeps_their_kv():
    w, running, preempted, scored = refreshed_mid_generation(keep_kv=False)
    assert w.engine.version == 1 and preempted == len(running)          # recomputed under the new weights
    kept, running_k, preempted_k, scored_k = refreshed_mid_generation(keep_kv=True)
    assert kept.engine.version == 1 and running_k == running and preempted_k == 0   # KV kept: none re-prefilled
    assert sorted(scored_k) == sorted(scored)
    for rid in running:   # same tokens before the refresh, same versions; the later logprobs differ (old vs new KV)
        a, b = scored[rid], scored_k[rid]
        k = a.versions.count(0)
        assert 0 < k < len(a.versions) and b.versions[:k] == a.versions[:k] and b.response_ids[:k] == a.response_ids[:k]
    assert any(scored[r].logprobs[scored[r].versions.count(0)] != scored_k[r].logprobs[scored[r].versions.count(0)]
               for r in running)


def test_only_pipelinerl_keeps_the_kv_at_a_colocated_refresh():
    keeps = {name for name in ("sync", "areal", "pipelinerl", "partial_rollout", "staleflow", "laminar")
             if load_preset(name).weight_sync.keeps_kv}
    assert keeps == {"pipelinerl"}
