"""A tiny model and made-up GRPO groups for the trainer's tests."""
from __future__ import annotations

import math

import torch

from model import ModelConfig, Transformer, cu_seqlens_from_lengths
from rl.types import Group, Trajectory

VOCAB = 64


def tiny_cfg(tied: bool = True) -> ModelConfig:
    return ModelConfig(family="qwen3" if tied else "qwen2", vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=tied,
                       qk_norm=tied, attention_bias=not tied)


def tiny_model(tied: bool = True, seed: int = 0) -> Transformer:
    return Transformer(tiny_cfg(tied)).init_weights(std=0.1, seed=seed)


def make_groups(seed: int, n_groups: int = 3, group_size: int = 4, max_resp: int = 10) -> list[Group]:
    """Random prompts and responses with made-up behaviour logprobs near the truth's scale and varied rewards."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, VOCAB, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        trajs = []
        for j in range(group_size):
            n = int(torch.randint(1, max_resp + 1, (1,), generator=g))
            resp = torch.randint(3, VOCAB, (n,), generator=g).tolist()
            lps = (-math.log(VOCAB) + 0.3 * torch.randn(n, generator=g)).tolist()
            trajs.append(Trajectory(gi, j, prompt, resp, lps, [0] * n, reward=float(torch.rand(1, generator=g))))
        groups.append(Group(seed * 100 + gi, gi, None, trajs))
    return groups


# Adam's first steps are nearly sign(grad): a gradient element at rounding-noise level would flip a whole lr-sized
# update between two summation orders. Equivalence tests use a larger eps so the update is smooth in the gradient.
SMOOTH_ADAM = dict(adam_eps=1e-4)


def weights(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def on_policy_groups(model: Transformer, seed: int, n_groups: int = 4, group_size: int = 8, resp_len: int = 4,
                     temperature: float = 1.0, reward=None) -> list[Group]:
    """Responses sampled from `model` itself, with the sampling log-probs as behaviour log-probs."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(n_groups):
        prompt = torch.randint(3, VOCAB, (5,), generator=g).tolist()
        seqs = [list(prompt) for _ in range(group_size)]
        lps: list[list[float]] = [[] for _ in range(group_size)]
        with torch.no_grad():
            for _ in range(resp_len):
                ids = torch.tensor(sum(seqs, []))
                cu = cu_seqlens_from_lengths([len(s) for s in seqs])
                logp = (model.forward_packed(ids, cu)[cu[1:] - 1] / temperature).log_softmax(-1)
                nxt = torch.multinomial(logp.exp(), 1, generator=g)[:, 0]
                for s, lp, tok, row in zip(seqs, lps, nxt.tolist(), logp):
                    s.append(tok)
                    lp.append(float(row[tok]))
        trajs = []
        for j, (s, lp) in enumerate(zip(seqs, lps)):
            resp = s[len(prompt):]
            r = reward(resp) if reward else float(torch.rand(1, generator=g))
            trajs.append(Trajectory(gi, j, prompt, resp, lp, [0] * resp_len, reward=r))
        groups.append(Group(seed * 100 + gi, gi, None, trajs))
    return groups
