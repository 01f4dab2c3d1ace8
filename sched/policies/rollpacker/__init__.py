"""RollPacker (configs/sched/rollpacker.toml): tail batching (§3) and the stream trainer (§4.4), strictly on-policy.

    dispatch.py        tail_batching   dispatch   round composition: speculative short rounds, a long-prompt queue
    rebalance.py       tail_abort      rebalance  "race-to-completion": the aborts of a speculative round
                       rollpacker      rebalance  those aborts plus the stream trainer's elastic scale-down and the
                                                  parallelism planner
    planner.py         TPPlanner                  §4.2: the engines' TP doubled on a preemption rise, halved after
                                                  steps without any (a Reshard between steps)
    stream_trainer.py  stream_trainer  handoff    finished groups stream to the trainer while it has GPUs of its own;
                       ScaleDown                  Algorithm 1: half the rollout engines lent to the trainer mid-round

Tail batching:
- short round (speculative): launch ceil(eta_p * P0) fresh prompts with ceil(eta_r * R0) responses each, "while
  accepting only the first P0 x R0 completions": a prompt is kept once R0 of its responses finish (the rest are
  aborted) and the round is closed once P0 prompts are kept; every other prompt is aborted whole and "deferred into
  a long-prompt queue";
- long round: "once the queue accumulates P0 such prompts", they run together, P0 x R0, "without speculative
  execution" (to full length), regenerated from scratch under the current weights.
P0 = the run's prompts_per_step, R0 = its group_size: every round still trains P0 x R0 samples in one synchronous
step. With eta_p = 1.25 the queue fills every 1 / (eta_p - 1) = 4 short rounds (Fig. 4: 4 short + 1 long).
How the halves compose: `tail_batching` returns a `RoundPlan` (kind "short" with keep_groups = P0 and
keep_per_group = R0, or kind "long"); the controller records it in `Views.plans`; the aborts read the plan; the
prompts they voided are collected by `tail_batching` from the views into its long queue.

The stream trainer's optimizer semantics are StreamRL's `stream` update (one step per round; the preset pairs
them). The adaptive reward timeout of §4.3 is a reward-side mechanism (rl/reward_timeout.py); the judge's GPU sharing
(§4.3) is not implemented. Lending engines and resharding them need a backend that can (the simulator); our runtime's
fixed process groups cannot.
"""
from sched.policies.rollpacker.dispatch import TailBatching
from sched.policies.rollpacker.rebalance import RollPackerRebalance, TailAbort
from sched.policies.rollpacker.stream_trainer import ScaleDown, StreamTrainerHandoff

__all__ = ["RollPackerRebalance", "ScaleDown", "StreamTrainerHandoff", "TailAbort", "TailBatching"]
