"""Partial trajectories: an engine interrupts a running request and hands back its tokens, logprobs and
per-token versions; another engine resumes it by re-prefill. A seeded continuation under the same weights is the
uninterrupted run; under newer weights its tokens carry the new version and the new weights' logprobs. The
trainer's side: decoupled PPO's proximal policy is the weights at the start of the call, and per-token staleness."""
import copy

import pytest
import torch

from config import TrainConfig
from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from model import ModelConfig, Transformer, cu_seqlens_from_lengths
from rl.types import Group, Trajectory
from trainer import Trainer

VOCAB = 64


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(seed: int = 0, std: float = 0.3) -> Transformer:
    """A tiny random Qwen3-shaped model; a large init std so that sampled tokens vary and logprobs are peaked."""
    cfg = ModelConfig(family="qwen3", vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True, qk_norm=True,
                      eos_token_id=2)
    return Transformer(cfg).init_weights(std=std, seed=seed).eval()


def engine(model: Transformer, version: int = 0, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_tokens=512, max_num_seqs=8, max_batch_tokens=64)
    cfg.update(kw)
    return LLMEngine(copy.deepcopy(model), EngineConfig(**cfg), version=version)  # engines never share weights


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def drain(eng: LLMEngine) -> dict:
    outs = {}
    while eng.has_unfinished():
        outs.update((o.request_id, o) for o in eng.step())
    return outs


def training_logprobs(model: Transformer, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log p(response[i]) under the training forward (forward_packed + log_softmax at the temperature)."""
    seq = prompt + response
    with torch.no_grad():
        logits = model.forward_packed(torch.tensor(seq), cu_seqlens_from_lengths([len(seq)]))
    lp = torch.log_softmax(logits.float() / temperature, -1)
    rows = torch.arange(len(prompt) - 1, len(seq) - 1)
    return lp[rows, torch.tensor(response)]


PARAMS = [SamplingParams(temperature=1.0, max_new_tokens=20, ignore_eos=True, seed=11),
          SamplingParams(temperature=0.8, top_k=8, top_p=0.9, max_new_tokens=20, ignore_eos=True, seed=12)]


@pytest.mark.parametrize("sp", PARAMS, ids=["t1", "topk_topp"])
def test_interrupted_twice_and_resumed_elsewhere_equals_the_uninterrupted_run(sp):
    model = tiny_model()
    ps = prompts((6, 11, 3))
    want = engine(model).generate([GenRequest(p, sp, request_id=f"r{i}", group_id=i) for i, p in enumerate(ps)])
    want = {o.request_id: o for o in want}

    a, b, c = engine(model), engine(model, block_size=8), engine(model, max_batch_tokens=16)
    for i, p in enumerate(ps):
        a.add_request(GenRequest(p, sp, request_id=f"r{i}", group_id=i))
    for _ in range(4):
        a.step()
    part1 = a.export("r1")                    # k1 tokens on engine A, its neighbours keep running there
    b.import_request(part1)
    for _ in range(5):
        b.step()
    part2 = b.export("r1")                    # k1 + k2 tokens, all parts so far
    c.import_request(part2)
    got = {**drain(a), **drain(c)}
    assert not b.has_unfinished()

    k1, k2 = len(part1.token_ids), len(part2.token_ids)
    assert 0 < k1 < k2 < sp.max_new_tokens
    r1 = got["r1"]
    assert part2.token_ids[:k1] == part1.token_ids and part2.logprobs[:k1] == part1.logprobs
    assert r1.token_ids[:k2] == part2.token_ids and r1.logprobs[:k2] == part2.logprobs
    assert r1.versions[:k2] == part2.versions
    for rid, o in want.items():  # the parts concatenated are the uninterrupted run, and so are the neighbours
        assert got[rid].token_ids == o.token_ids and got[rid].versions == o.versions == [0] * sp.max_new_tokens
        assert torch.allclose(torch.tensor(got[rid].logprobs), torch.tensor(o.logprobs), atol=1e-5)
    for eng in (a, b, c):
        assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_resume_under_newer_weights_tags_versions_and_scores_with_the_new_weights():
    old, new = tiny_model(seed=0), tiny_model(seed=1)
    sp = SamplingParams(temperature=0.9, max_new_tokens=16, ignore_eos=True, seed=3)
    prompt = prompts((9,))[0]
    a = engine(old, version=0)
    a.add_request(GenRequest(prompt, sp, request_id="x"))
    for _ in range(6):
        a.step()
    part = a.export("x")
    k = len(part.token_ids)
    b = engine(new, version=1)
    b.import_request(part)
    out = drain(b)["x"]

    assert out.versions == [0] * k + [1] * (sp.max_new_tokens - k) and 0 < k < sp.max_new_tokens
    assert out.token_ids[:k] == part.token_ids and out.logprobs[:k] == part.logprobs
    lp = torch.tensor(out.logprobs)
    ref_old = training_logprobs(old, prompt, out.token_ids, sp.temperature)
    ref_new = training_logprobs(new, prompt, out.token_ids, sp.temperature)
    assert (lp[:k] - ref_old[:k]).abs().max() < 1e-4   # part 1: the behaviour policy was the old weights
    assert (lp[k:] - ref_new[k:]).abs().max() < 1e-4   # part 2: the new weights' training forward
    assert (ref_old[k:] - ref_new[k:]).abs().max() > 1e-2  # ... which the old weights' would not have matched

    # The same request kept in place while its engine loads the new weights (a LoadWeights on a busy engine)
    # continues identically: migration + re-prefill and in-place recompute are one semantics.
    c = engine(old, version=0)
    c.add_request(GenRequest(prompt, sp, request_id="x"))
    for _ in range(6):
        c.step()
    c.load_weights(new.state_dict(), version=1)
    in_place = drain(c)["x"]
    assert in_place.token_ids == out.token_ids and in_place.versions == out.versions
    assert torch.allclose(torch.tensor(in_place.logprobs), lp, atol=1e-5)


# ---- the trainer's side --------------------------------------------------------------------------------------------
def groups_from(model: Transformer, seed: int, versions_of, n_groups: int = 3, group_size: int = 4,
                resp_len: int = 6) -> list[Group]:
    """Responses sampled from `model`, its logprobs as behaviour logprobs, versions from versions_of(group, j)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for gi in range(n_groups):
        prompt = torch.randint(3, VOCAB, (5,), generator=g).tolist()
        trajs = []
        for j in range(group_size):
            resp = torch.randint(3, VOCAB, (resp_len,), generator=g).tolist()
            lps = training_logprobs(model, prompt, resp, 1.0).tolist()
            trajs.append(Trajectory(gi, j, prompt, resp, lps, versions_of(gi, j, resp_len),
                                    reward=float(torch.rand(1, generator=g))))
        out.append(Group(gi, gi, None, trajs))
    return out


def train_cfg(**kw) -> TrainConfig:
    base = dict(lr=3e-2, micro_batch_tokens=40, grad_clip=1e9, adam_eps=1e-4, clip_low=0.05, clip_high=0.05)
    base.update(kw)
    return TrainConfig(**base)


def record_step_gradients(tr: Trainer) -> list[torch.Tensor]:
    """The gradient of every optimizer step of `tr` (all parameters, flattened), as the step sees it."""
    grads: list[torch.Tensor] = []
    tr.optimizer.register_step_pre_hook(lambda opt, args, kwargs: grads.append(
        torch.cat([p.grad.flatten() for group in opt.param_groups for p in group["params"]])))
    return grads


@pytest.mark.parametrize("minibatches,epochs", [(1, 1), (3, 1), (2, 2)])
def test_decoupled_with_on_policy_data_is_plain_ppo(minibatches, epochs):
    """Behaviour logprobs = the weights at the start of the call: the importance weight is 1 and the proximal
    policy IS the behaviour policy, so decoupled PPO must step exactly like plain PPO -- also over several
    optimizer steps per call, where the proximal log-probs must come from before the first step (were they the
    current weights', every later minibatch would see a ratio of 1 and never clip).

    Compared: the loss and every optimizer step's gradient, to a relative 1e-3. The two runs agree only up to
    float32 rounding: the behaviour log-probs (a full log_softmax) and the trainer's recomputation (chunked) differ
    by ~1e-7, hence so do the first step's gradients; Adam (eps 1e-4) turns such differences in tiny gradients
    into weight differences up to ~2e-5 (which is why the final weights are not compared); those reach the later
    steps' gradients at <= ~1e-5 relative. Proximal log-probs of the current weights instead of the call's start
    make later steps' gradients differ by >= 0.9 relative."""
    start = tiny_model(seed=2, std=0.1)
    groups = groups_from(start, 0, lambda g, j, n: [0] * n)
    runs = {}
    for mode in ("behaviour", "decoupled"):
        tr = Trainer(copy.deepcopy(start), train_cfg(off_policy=mode, minibatches=minibatches, ppo_epochs=epochs))
        grads = record_step_gradients(tr)
        runs[mode] = (tr.train_step(groups), grads)
    (m_b, g_b), (m_d, g_d) = runs["behaviour"], runs["decoupled"]
    assert len(g_b) == len(g_d) == minibatches * epochs
    for k, (b, d) in enumerate(zip(g_b, g_d)):
        assert (d - b).norm() <= 1e-3 * b.norm(), f"optimizer step {k}"
    assert m_d["loss"] == pytest.approx(m_b["loss"], rel=1e-3)
    assert m_d["is_weight_mean"] == pytest.approx(1.0, abs=1e-5) and m_d["is_truncated_frac"] == 0.0
    assert "is_weight_mean" not in m_b
    if minibatches * epochs > 1:  # the later minibatches moved off the start weights far enough to clip
        assert m_b["clip_frac_low"] + m_b["clip_frac_high"] > 0
        assert m_d["clip_frac_low"] + m_d["clip_frac_high"] == pytest.approx(m_b["clip_frac_low"] +
                                                                             m_b["clip_frac_high"])


@pytest.mark.parametrize("mode,minibatches,proximal", [("behaviour", 3, False), ("decoupled", 1, False),
                                                       ("decoupled", 3, True)])
def test_a_call_reports_its_forward_and_optimizer_seconds_and_the_proximal_pass_only_when_it_runs(
        mode, minibatches, proximal):
    """forward_s: the call's forward passes (with grad), optimizer_s: its optimizer steps, both parts of its
    step_time_s (sim.calibrate charges the simulated proximal pass at the forward's share, a call that only
    accumulates at a step's time less the optimizer's); proximal_s: decoupled PPO's no-grad pass, run only for a
    call of several optimizer steps; passes_s: its minibatch passes whole (the forward inside them), apart from the
    optimizer steps and the proximal pass (sim.calibrate's call_split takes the call apart with them)."""
    start = tiny_model(seed=2, std=0.1)
    groups = groups_from(start, 0, lambda g, j, n: [0] * n)
    m = Trainer(copy.deepcopy(start), train_cfg(off_policy=mode, minibatches=minibatches)).train_step(groups)
    assert 0 < m["forward_s"] < m["passes_s"] < m["step_time_s"] - m["optimizer_s"] - m.get("proximal_s", 0.0)
    assert 0 < m["first_pass_s"] <= m["passes_s"] and (m["first_pass_s"] < m["passes_s"]) == (minibatches > 1)
    assert 0 < m["optimizer_s"] < m["step_time_s"] - m["forward_s"]
    assert ("proximal_s" in m) == proximal
    if proximal:
        assert 0 < m["proximal_s"] < m["step_time_s"] - m["forward_s"] - m["optimizer_s"]
    tr = Trainer(copy.deepcopy(start), train_cfg(off_policy=mode))
    assert tr.train_step(groups, step=False)["optimizer_s"] == 0.0   # accumulates: no optimizer step


def test_decoupled_weights_stale_tokens_and_reports_staleness():
    """Behaviour logprobs from other (stale) weights: the weight exp(prox - behaviour) differs from 1, is truncated
    at is_cap, and the step differs from plain PPO; staleness is per token from Trajectory.versions."""
    start, stale = tiny_model(seed=2, std=0.1), tiny_model(seed=3, std=0.1)
    groups = groups_from(stale, 1, lambda g, j, n: [g] * (n // 2) + [3] * (n - n // 2))
    tr = Trainer(copy.deepcopy(start), train_cfg(off_policy="decoupled", is_cap=1.2))
    tr.step = 4  # the trainer's version: tokens of versions 0..3 are 4..1 versions old
    m = tr.train_step(groups)
    lags = [4 - v for grp in groups for t in grp.trajectories for v in t.versions]
    assert m["staleness_mean"] == pytest.approx(sum(lags) / len(lags)) and m["staleness_max"] == 4.0
    assert 0 < m["is_truncated_frac"] < 1 and m["is_weight_mean"] <= 1.2
    plain = Trainer(copy.deepcopy(start), train_cfg(off_policy="behaviour"))
    plain.train_step(groups)
    assert any(not torch.allclose(p, q) for p, q in zip(tr.model.parameters(), plain.model.parameters()))
    uncapped = Trainer(copy.deepcopy(start), train_cfg(off_policy="decoupled", is_cap=0.0))
    m0 = uncapped.train_step(groups)
    assert m0["is_truncated_frac"] == 0.0 and m0["is_weight_mean"] > m["is_weight_mean"]


def test_trainer_rejects_an_unknown_off_policy_mode():
    with pytest.raises(ValueError, match="off_policy"):
        Trainer(tiny_model(), train_cfg(off_policy="vtrace"))
    with pytest.raises(ValueError, match="is_cap"):
        Trainer(tiny_model(), train_cfg(is_cap=-1.0))


# ---- decoupled PPO under FSDP2: the proximal pass runs every rank's collectives in step ----------------------------
DIST_CFG = dict(lr=1e-2, micro_batch_tokens=24, minibatches=2, ppo_epochs=1, off_policy="decoupled", is_cap=1.1,
                clip_high=0.28, grad_clip=1e9, adam_eps=1e-4)


def _dist_batches():
    from tests.support.trainer import make_groups  # made-up behaviour logprobs: weights far from 1, some truncated
    return [make_groups(1, n_groups=2), make_groups(3, n_groups=1, group_size=2)]  # the last: a rank gets none


def _dist_world(rank: int, world: int):
    from tests.support.trainer import tiny_model as trainer_model
    from trainer.fsdp import full_state_dict
    tr = Trainer(trainer_model(), TrainConfig(**DIST_CFG))
    metrics = [tr.train_step(b) for b in _dist_batches()]
    return {"metrics": metrics, "w": full_state_dict(tr.model)}


@pytest.mark.dist
@pytest.mark.slow
def test_decoupled_multi_step_call_under_fsdp_matches_one_process():
    from tests.support.dist_utils import run_world
    from tests.support.trainer import tiny_model as trainer_model
    ranks = run_world(_dist_world, 2)
    ref = Trainer(trainer_model(), TrainConfig(**DIST_CFG))
    ref_metrics = [ref.train_step(b) for b in _dist_batches()]
    assert 0 < ref_metrics[0]["is_truncated_frac"] < 1
    for r in ranks:
        for name, p in r["w"].items():
            assert torch.allclose(p, dict(ref.model.named_parameters())[name].detach(), atol=1e-5), name
        for got, want in zip(r["metrics"], ref_metrics):
            for k in ("loss", "is_weight_mean", "is_truncated_frac", "clip_frac_low", "clip_frac_high"):
                assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), k
