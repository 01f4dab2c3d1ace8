"""The rollout worker without a cluster: messages in, events out, and weight verification after a load."""
import pytest
import torch

from engine.config import EngineConfig
from engine.engine import LLMEngine
from model import Transformer
from model.presets import preset_config
from rl.tasks import SyntheticTask
from runtime.rollout_worker import RolloutWorker, SamplingConfig, WeightMismatchError


class FakeChannel:
    def __init__(self):
        self.sent = []

    def send(self, obj, dst, port=0):
        self.sent.append((dst, obj))


def make_worker(verify=True):
    task = SyntheticTask("reverse", 16, 0)
    tok = task.tokenizer()
    cfg = preset_config("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    engine = LLMEngine(Transformer(cfg).init_weights(seed=0), EngineConfig(num_kv_tokens=512, max_num_seqs=16,
                                                                          max_batch_tokens=256), version=-1)
    ch = FakeChannel()
    from runtime.launch import response_decoder
    w = RolloutWorker(engine, ch, 0, 1, task.score, response_decoder(tok, engine.eos_ids), None,
                      SamplingConfig(1.0, 1.0, -1, 4, seed=0), t0=0.0, timeout_s=5, verify_weights=verify)
    return w, ch, task, tok


def published(engine, scale=1.0):
    return [(k, v.detach().clone() * scale) for k, v in engine.runner.model.state_dict().items()
            if k != "lm_head.weight" or not engine.runner.model.config.tie_word_embeddings]


def test_submit_steps_and_reports_scored_trajectories():
    w, ch, task, tok = make_worker()
    w._into_relay(published(w.engine, 1.5), 0)
    w.relay_version = 0
    assert w.handle(("load", 0))
    prompts = task.prompts()[:2]
    specs = [dict(req_id=10 * g + s, group_id=g, sample_index=s, prompt_index=g,
                  prompt_ids=tok.encode(p, add_special_tokens=False), answer=a)
             for g, (p, a) in enumerate(prompts) for s in range(3)]
    w.handle(("submit", specs))
    while w.engine.has_unfinished():
        w.step()
    events = [e for _, batch in ch.sent for e in batch]
    scored = [e for e in events if e.kind == "reward_scored"]
    assert sorted(e.req_id for e in scored) == sorted(s["req_id"] for s in specs)
    answer = {s["req_id"]: s["answer"] for s in specs}
    eos = tok.eos_token_id
    for e in scored:
        t = e.payload
        assert t.versions and set(t.versions) == {0} and len(t.logprobs) == len(t.response_ids)
        ids = t.response_ids[:-1] if t.response_ids and t.response_ids[-1] == eos else t.response_ids
        want = task.score(tok.decode(ids, skip_special_tokens=False), answer[e.req_id])
        assert (t.reward, t.correct) == (want.reward, want.correct) == (e.data["reward"], e.data["correct"])
    kinds = [e.kind for e in events]
    assert kinds[0] == "weights_loaded" and "engine_busy" in kinds and kinds[-1] == "engine_idle"
    assert w.engine.block_manager.num_free == w.engine.block_manager.num_blocks


def test_a_load_that_corrupts_a_tensor_is_named():
    w, ch, _, _ = make_worker()
    w._into_relay(published(w.engine, 2.0), 3)
    w.relay_version = 3
    original = w.engine.runner.load_weights

    def corrupting(weights):
        n = original(weights)
        with torch.no_grad():
            w.engine.runner.model.model.layers[1].mlp.up_proj.weight[0, 0] += 1e-3
        return n
    w.engine.runner.load_weights = corrupting
    with pytest.raises(WeightMismatchError, match="model.layers.1.mlp.up_proj.weight"):
        w.handle(("load", 3))


def test_loading_a_version_the_relay_does_not_hold_fails():
    w, _, _, _ = make_worker()
    with pytest.raises(RuntimeError, match="relay holds"):
        w.handle(("load", 5))
