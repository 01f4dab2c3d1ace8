"""Engines over small models, prompts, and the checks the engine's tests share."""
from __future__ import annotations

import torch

from engine import EngineConfig, LLMEngine
from model import cu_seqlens_from_lengths
from tests.support.helpers import make_hf_model


def sharp_model(family: str, path, seed: int = 0):
    """A tiny HF model with weights scaled up so that greedy outputs vary instead of repeating one token."""
    hf = make_hf_model(family, seed=seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    hf.save_pretrained(str(path))
    return hf


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def engine(model, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_kv_tokens=1024, max_num_seqs=8, max_batch_tokens=64)
    cfg.update(kw)
    return LLMEngine(model, EngineConfig(**cfg))


def assert_pool_whole(eng: LLMEngine):
    bm, sch = eng.block_manager, eng.scheduler
    assert bm.num_free == bm.num_blocks and not any(bm.ref_counts)
    assert not sch.running and not sch.waiting and not eng.seqs
    assert sorted(sch.free_seats) == list(range(sch.max_num_seqs))


def drain(eng: LLMEngine) -> list:
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return outs


def packed_logprobs(model, outs, temperature=1.0):
    """Per-token logprobs of each output's response under the training forward (forward_packed + log_softmax)."""
    seqs = [o.prompt_ids + o.token_ids for o in outs]
    with torch.no_grad():
        logits = model.forward_packed(torch.tensor(sum(seqs, [])), cu_seqlens_from_lengths([len(s) for s in seqs]))
    lp = torch.log_softmax(logits.float() / temperature, -1)
    res, start = [], 0
    for o, s in zip(outs, seqs):
        P, R = len(o.prompt_ids), len(o.token_ids)
        rows = torch.arange(start + P - 1, start + P + R - 1)
        res.append(lp[rows, torch.tensor(o.token_ids)])
        start += len(s)
    return res
