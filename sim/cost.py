"""The simulator's cost model: every duration the virtual clock advances by comes from here.

Decode step latency (one engine step: every running sequence gets one token)

    L(n, kv) = k1 * kv + max(k2, k3 * n) + k4                                   [seconds]

n = running sequences, kv = context tokens they attend over (prompt + generated, summed). This is the latency
(denominator) of StaleFlow's throughput model, Eq. (2)/(13), T = n / L (StaleFlow §5.3, App. B): attention reads the
KV cache (memory-bound, k1 per token), the GEMMs read the weights once per step (k2) until the batch is large enough
to be compute-bound (k3 per sequence), plus a fixed per-step cost k4 (scheduling, sampling, launches, TP
all-reduces). We use this form because (a) it is also exactly what a memory roofline gives — bytes(weights +
KV)/bandwidth + overhead, with the compute roof as the max — so profiles can be derived from hardware datasheets
(sim/profiles.py, `roofline`) or taken from a paper's regression (StaleFlow Table 4) with the same code; and (b) it
is linear in kv, so many decode steps sum in closed form while kv grows by n per step, which lets the engine model
jump from one event to the next instead of stepping (sim/engine.py).

Other costs: prefill is linear in tokens (compute-bound); a train call is seconds per trained token (prompt +
response) for one GPU, divided by the train partition's GPUs, plus a fixed cost per optimizer step it takes and a
fixed cost per call (both 0 on every paper profile; measured on our CPU trainer, whose cost is mostly per optimizer
step: sim/calibrate.py `train_fit`); publishing weights is one
broadcast from the trainer to every engine's relay; loading is relay -> engine; reward latency is a per-sample
distribution per task (a prompt's task fixed by the prompt). The named calibrations, each constant with its
source, are in sim/profiles.py.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Mapping


@dataclass(frozen=True)
class RewardTask:
    """One task of a reward mix: seconds from a trajectory's last token to its reward are lognormal,
    median_s * exp(sigma_prompt * z_p + sigma * e) with z_p the prompt's own (a test case's inputs set how long its
    tests run) and e the sample's, capped at the verifier's own limit `timeout_s`; a share `hang_frac` of runs hangs
    until that limit (a code sandbox killing a slow test). A run killed at a limit scores 0 (incorrect). `sandbox`:
    the adaptive timeout of RollPacker §4.3 applies to this task (a code sandbox), not to a rule check or an LLM
    judge."""
    name: str
    weight: float
    median_s: float
    sigma: float                 # between samples of one prompt
    timeout_s: float
    hang_frac: float = 0.0
    sandbox: bool = False
    sigma_prompt: float = 0.0    # between prompts

    def sample(self, rng: random.Random, z: float = 0.0) -> tuple[float, bool]:
        """(seconds, whether the run was killed at the task's limit) for a sample of a prompt with difficulty z."""
        if self.hang_frac > 0 and rng.random() < self.hang_frac:
            return self.timeout_s, True
        x = self.median_s * math.exp(self.sigma_prompt * z + self.sigma * rng.gauss(0.0, 1.0))
        return (self.timeout_s, True) if x >= self.timeout_s else (x, False)

    def mean(self) -> float:
        """Approximate mean (ignores the cap on the lognormal body)."""
        body = min(self.timeout_s, self.median_s * math.exp((self.sigma ** 2 + self.sigma_prompt ** 2) / 2))
        return self.hang_frac * self.timeout_s + (1 - self.hang_frac) * body


@dataclass(frozen=True)
class RewardLatency:
    """The reward mix of a setting: one task per prompt, chosen by the prompt's own uniform `mix` (a dataset's
    prompts all go to that dataset's verifier: RollPacker §6's uniform math / code / judge mix is per dataset)."""
    tasks: tuple[RewardTask, ...] = (RewardTask("math", 1.0, 0.02, 1.0, 2.0),)

    def task_of(self, mix: float) -> RewardTask:
        if len(self.tasks) == 1:    # one task (most settings): every prompt's
            return self.tasks[0]
        u = mix * sum(t.weight for t in self.tasks)
        for t in self.tasks:
            if u < t.weight:
                return t
            u -= t.weight
        return self.tasks[-1]

    def mean(self) -> float:
        tot = sum(t.weight for t in self.tasks)
        return sum(t.weight / tot * t.mean() for t in self.tasks)


@dataclass(frozen=True)
class CostModel:
    name: str
    k1: float                       # s per resident context token per decode step (KV read)
    k2: float                       # s per decode step for reading the weights once
    k3: float                       # s per running sequence per decode step when compute-bound
    k4: float                       # s fixed per decode step
    prefill_s_per_token: float      # s per prompt (or recomputed) token
    kv_capacity_tokens: int         # KV cache size of one engine, in tokens
    train_s_per_token: float        # s per trained token (prompt + response) on ONE train GPU
    publish_s: float                # trainer -> every engine's relay, per published version
    load_s: float                   # relay -> engine weights, per LoadWeights
    reward: RewardLatency = field(default_factory=RewardLatency)
    block_size: int = 16            # tokens per KV block (our engine's default, engine/config.py)
    max_num_seqs: int = 256         # most sequences in one engine batch
    gpus_per_engine: int = 1        # tensor-parallel size of one engine
    train_overhead_s: float = 0.0   # fixed per train call (launch, advantages, however many steps it takes)
    train_step_s: float = 0.0       # fixed per optimizer step (one minibatch's pass and optimizer update)
    kv_move_s_per_token: float = 0.0  # a migrated trajectory's KV sent to its new engine, per token (0: it is
    #                                 re-prefilled there at prefill_s_per_token, as an interrupted one always is)
    train_accumulate_s: float = 0.0  # fixed per train call that only accumulates gradients (steps = 0): its
    #                                 minibatch's forward and backward without an optimizer step (0: nothing)
    proximal_share: float = 0.0     # decoupled PPO's no-grad proximal pass (one forward of every minibatch before
    #                                 a call's first step, trainer/trainer.py), as a share of the call's train_s
    #                                 (0: not charged)
    switch_s: float = 0.0           # an engine lent to the trainer or given back changes role in this long each
    #                                 way (verl's Hybrid replicas: the inference engine sleeps, offloading its
    #                                 weights and KV, or wakes and rebuilds them); 0: at once. Disaggregated pools only
    train_cold_s: float = 0.0       # more for a train call that starts after the trainer idled (its first pass
    #                                 cold: the CPU's caches taken by other work meanwhile; 0: nothing)
    controller_s_per_trajectory: float = 0.0  # the train leader's controller CPU per trajectory it handles (its
    #                                 finish, reward, hand-off): where the controller shares the leader's CPU with
    #                                 train rank 0 (our CPU runs), each one finishing during a call extends the call
    #                                 by that much (0: the controller has its own CPU, as beside GPUs)
    publish_train_share: float = 0.0  # an overlapped publication's share of the processor it shares with the train
    #                                 calls running meanwhile (each runs at its share while both do): where the
    #                                 leader's weight sender runs on the train ranks' processor (our CPU runs); 0:
    #                                 the transfer has hardware of its own (a NIC beside GPUs) and costs a call nothing
    sources: Mapping[str, str] = field(default_factory=dict)  # constant -> where its value comes from

    def __post_init__(self) -> None:
        for k in ("k1", "k2", "k3", "k4", "prefill_s_per_token", "train_s_per_token", "publish_s", "load_s",
                  "train_overhead_s", "train_step_s", "kv_move_s_per_token", "proximal_share",
                  "train_accumulate_s", "controller_s_per_trajectory", "train_cold_s"):
            if getattr(self, k) < 0:
                raise ValueError(f"cost profile {self.name!r}: {k} must be >= 0, got {getattr(self, k)}")
        if not 0.0 <= self.publish_train_share < 1.0:
            raise ValueError(f"cost profile {self.name!r}: publish_train_share must be in [0, 1), got "
                             f"{self.publish_train_share}")
        if self.k2 + self.k4 <= 0:
            raise ValueError(f"cost profile {self.name!r}: a decode step must take time (k2 + k4 > 0)")
        if self.kv_capacity_tokens < self.block_size or self.max_num_seqs < 1:
            raise ValueError(f"cost profile {self.name!r}: needs kv_capacity_tokens >= block_size and "
                             f"max_num_seqs >= 1")

    # ------------------------------------------------------------------------------------------------ decode
    @property
    def kv_capacity_blocks(self) -> int:
        return self.kv_capacity_tokens // self.block_size

    def step_s(self, n: int, kv: float) -> float:
        """Latency of one decode step with n running sequences attending over kv context tokens."""
        return self.k1 * kv + max(self.k2, self.k3 * n) + self.k4

    def steps_s(self, n: int, kv0: float, m: int) -> float:
        """Total latency of m consecutive decode steps starting at kv0 context tokens (kv grows by n per step)."""
        if m <= 0:
            return 0.0
        base = max(self.k2, self.k3 * n) + self.k4 + self.k1 * kv0
        return m * base + self.k1 * n * m * (m - 1) / 2.0

    def steps_reaching(self, n: int, kv0: float, dt: float) -> int:
        """Smallest m >= 0 with steps_s(n, kv0, m) >= dt: the step boundary at or after dt into a run of steps."""
        if dt <= 0:
            return 0
        base = max(self.k2, self.k3 * n) + self.k4 + self.k1 * kv0
        a = self.k1 * n / 2.0
        b = base - a
        m = dt / b if a == 0 else (-b + math.sqrt(b * b + 4 * a * dt)) / (2 * a)
        m = max(0, math.floor(m))
        while self.steps_s(n, kv0, m) < dt - 1e-12:
            m += 1
        while m > 0 and self.steps_s(n, kv0, m - 1) >= dt - 1e-12:
            m -= 1
        return m

    def prefill_s(self, tokens: int) -> float:
        return self.prefill_s_per_token * tokens

    def kv_move_s(self, tokens: int) -> float:
        """A migrated trajectory's tokens arriving on its new engine: KV moved over the interconnect, or (no rate
        given) recomputed."""
        return (self.kv_move_s_per_token or self.prefill_s_per_token) * tokens

    # ------------------------------------------------------------------------------------------------- train
    def train_s(self, tokens: int, train_gpus: int, steps: int = 1) -> float:
        """One train call over `tokens` trained tokens on the train partition (perfect data-parallel scaling of the
        per-token part) that takes `steps` optimizer steps (0: it only accumulates gradients); the fixed costs per
        call and per step are paid by every rank at once, so the train GPUs do not divide them."""
        return (self.train_overhead_s + steps * self.train_step_s + (self.train_accumulate_s if steps == 0 else 0.0)
                + tokens * self.train_s_per_token / max(1, train_gpus))

    def proximal_s(self, tokens: int, train_gpus: int, steps: int) -> float:
        """Decoupled PPO's proximal pass before a train call of `steps` > 1 optimizer steps over `tokens`: the
        trainer's no-grad forward of every minibatch under the weights at the call's start (one step needs none: its
        proximal log-probs are the current ones)."""
        return self.proximal_share * self.train_s(tokens, train_gpus, steps) if steps > 1 else 0.0

    def decode_tokens_per_s(self, n: int, kv: float) -> float:
        return n / self.step_s(n, kv)


def relay_broadcast_s(nbytes: float, relays: int, bw: float, chunk_bytes: float = 32 * 2**20,
                      t_start: float = 5e-6) -> float:
    """Laminar App. C: the master relay sends `nbytes` down a chain of `relays` other relays, pipelined in chunks of
    `chunk_bytes` (32 MB in the paper, §7) over links of `bw` bytes/s with a per-message start-up `t_start`.
    With p = relays + 1 nodes and k chunks, each chunk hop takes t = chunk / bw + t_start and

        T(p, k) = (p - 1 + k - 1) * t  ~  nbytes / bw + (hops - 1) * chunk / bw      (+ (p + k - 2) * t_start)

    i.e. the bandwidth term of one copy plus one chunk per extra hop: nearly constant in the chain length."""
    if relays <= 0:
        return 0.0
    k = max(1, math.ceil(nbytes / chunk_bytes))
    t = (nbytes / k) / bw + t_start
    return (relays + k - 1) * t
