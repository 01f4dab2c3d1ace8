"""The compute the controller schedules onto, as it sees it: each rollout engine (`EngineView`: its weights, the
counters it last reported, the controller's own `assigned`, `loading`, `lent` and `failed`), the engines' profiled
decode step (`DecodeProfile`, from a backend that has one) and the trainer (`TrainerView`: its version, what is
published, its progress). Part of `Views` (sched/views.py); written only by the request lifecycle (sched/lifecycle.py),
its event fold and its elastic pool (sched/engine_pool.py).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineView:
    engine: int
    version: int = -1            # weights the engine generates with (-1: none loaded yet)
    running: int = 0             # requests in its batch (as last reported)
    waiting: int = 0             # requests queued at the engine
    kv_used: int = 0
    kv_free: int = 0
    tokens_decoded: int = 0
    loading: bool = False        # a LoadWeights command is in flight
    assigned: int = 0            # requests sent and not yet given back (the controller's own count)
    lent: bool = False           # lent to the trainer (LendEngines): no request may be placed on it
    preemptions: int = 0         # KV preemptions so far (as last reported)
    failed: bool = False         # its engine failed (`engine_failed`) and has not rejoined: nothing goes to it
    retired: bool = False        # failed for good (it gave up recovering): it never rejoins
    failures: int = 0            # times it failed


@dataclass(frozen=True)
class DecodeProfile:
    """An engine's decode step, profiled in advance (StreamRL §5.1: "PTL(BS) can be profiled in advance"): a step of
    n sequences attending over kv context tokens takes fixed_s + max(weights_s, per_seq_s x n) + per_token_s x kv
    (the memory roofline with a compute roof, sim/cost.py); its KV pool holds kv_tokens, and at most max_seqs run at
    once. The simulator's engines report theirs (its cost model); a runtime backend reports none."""
    weights_s: float
    per_seq_s: float
    per_token_s: float
    fixed_s: float
    kv_tokens: int
    max_seqs: int

    def ptl(self, bs: int, context: float = 0.0) -> float:
        """Per-token latency of a batch of bs sequences, each attending over `context` tokens."""
        return self.fixed_s + max(self.weights_s, self.per_seq_s * bs) + self.per_token_s * bs * context

    def max_batch(self, tokens: float) -> int:
        """Sequences of `tokens` tokens each that run at once (the KV pool, then max_seqs)."""
        return max(1, min(self.max_seqs, int(self.kv_tokens // max(tokens, 1.0))))


@dataclass
class TrainerView:
    version: int = 0             # optimizer steps taken = version of the trainer's weights
    published: int = -1          # latest version available to engines (the backend publishes 0 at start)
    busy: bool = False           # a train call is in flight
    steps_done: int = 0
    groups_consumed: int = 0
    samples_consumed: int = 0    # samples (responses) of the groups handed to the trainer
    groups_since_step: int = 0   # groups whose gradients are accumulated but not yet stepped
