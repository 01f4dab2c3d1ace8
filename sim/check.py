"""Invariant checks read back from an event log (in memory: reward_scored events carry their Trajectory payload).

docs/architecture.md, "Invariants": on-policy presets train every sample under the weights the step starts from;
no finished trajectory is lost or trained twice. The controller enforces what it can decide on the spot
(sched/lifecycle.py); this reads the log afterwards, per token, so a simulator or policy bug shows up as a list of
offending samples.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from sched.events import Event


def on_policy_report(events: list[Event]) -> dict[str, Any]:
    """{trained, off_policy, off_policy_round, trained_twice, finished_not_trained, max_staleness}.

    off_policy: (group, sample, generating versions, trainer version at consumption) where any token's version
    differs from the trainer's version when its group was handed over (step-level: sync, stream trainer).
    off_policy_round: the same against the trainer's version when the group's round started (round-level, as
    RolloutPipe/Slime define on-policy: several optimizer steps per round, all on the round's weights).
    finished_not_trained: finished samples of
    groups never trained and not dropped (a sample still in flight when a run stops early also lands here)."""
    dropped = {e.req_id for e in events if e.kind == "trajectory_aborted" and not e.data.get("requeue")}
    trajs: dict[int, list] = {}
    for e in events:
        if e.kind == "reward_scored" and e.payload is not None and e.req_id not in dropped:
            trajs.setdefault(e.group_id, []).append(e.payload)
    group_round = {e.group_id: e.data.get("round") for e in events if e.kind == "group_materialized"}
    times: Counter[int] = Counter()
    off, off_round, staleness, version, round_version = [], [], 0, 0, {}
    for e in events:
        if e.kind == "train_step_done" and e.data.get("stepped", True):
            version = e.version
        elif e.kind == "round_started":
            round_version[e.data["round"]] = version
        elif e.kind == "train_started":
            for gid in e.data.get("groups", []):
                times[gid] += 1
                rv = round_version.get(group_round.get(gid), -1)
                for t in trajs.get(gid, []):
                    vs = set(t.versions)
                    staleness = max(staleness, e.version - min(vs, default=e.version))
                    if vs != {e.version}:
                        off.append((gid, t.sample_index, sorted(vs), e.version))
                    if vs != {rv}:
                        off_round.append((gid, t.sample_index, sorted(vs), rv))
    fin_groups = {e.req_id: e.group_id for e in events if e.kind == "trajectory_finished"}
    lost = sorted(r for r, g in fin_groups.items() if g not in times and r not in dropped)
    return {"trained": sum(len(trajs.get(g, [])) for g in times), "off_policy": off, "off_policy_round": off_round,
            "trained_twice": sorted(g for g, n in times.items() if n > 1), "finished_not_trained": lost,
            "max_staleness": staleness}
