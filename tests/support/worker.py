"""A rollout worker in one process: a fake control channel, an engine, published weights."""
from __future__ import annotations

from sched.decisions import LoadWeights

import torch

from engine import EngineConfig, LLMEngine
from model import Transformer
from model.presets import preset_config
from rl.tasks import SyntheticTask
from runtime.messages import StartRequest
from runtime.reward_scorer import InlineScorer
from runtime.rollout_worker import RolloutWorker, SamplingConfig
from runtime.samples import response_decoder


class FakeChannel:
    def __init__(self):
        self.sent = []

    def send(self, obj, dst, port=0):
        self.sent.append((dst, obj))


def make_worker(verify=True, max_new_tokens=4, temperature=1.0, scorer=None, rank=1, cls=RolloutWorker, **kw):
    task = SyntheticTask("reverse", 16, 0)
    tok = task.tokenizer()
    cfg = preset_config("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    engine = LLMEngine(Transformer(cfg).init_weights(seed=0), EngineConfig(
        num_kv_tokens=512, max_num_seqs=16, max_batch_tokens=256,
        cpu_decode_steps=1), version=-1)   # a worker step is one engine step here (the tests count them)
    ch = FakeChannel()
    w = cls(engine, ch, engine_index=0, rank=rank,
            scorer=scorer if scorer is not None else InlineScorer(task.score),
            decode=response_decoder(tok, engine.eos_ids), receiver=None,
            sampling=SamplingConfig(temperature, 1.0, -1, max_new_tokens, seed=0), t0=0.0,
            verify_weights=verify, **kw)
    return w, ch, task, tok


def published(engine, scale=1.0):
    return [(k, v.detach().clone() * scale) for k, v in engine.runner.model.state_dict().items()
            if k != "lm_head.weight" or not engine.runner.model.config.tie_word_embeddings]


# ---- partial trajectories: interrupt, resume, load on a busy engine ------------------------------------------------
def loaded_worker(version=0, scale=1.5, **kw):
    w, ch, task, tok = make_worker(**kw)
    w.relay.fill(published(w.engine, scale), version)
    w.handle(LoadWeights(0, version))
    return w, ch, task, tok


def group_specs(task, tok, n_groups=2, group_size=3):
    return [StartRequest(10 * g + s, g, s, g, tok.encode(p, add_special_tokens=False), a)
            for g, (p, a) in enumerate(task.prompts()[:n_groups]) for s in range(group_size)]


def events_of(ch, kind):
    return [e for _, batch in ch.sent for e in batch if e.kind == kind]


def run_to_end(w):
    while w.engine.has_unfinished():
        w.step()
    w.flush()
