"""The off-policy invariants checked on a run's event log (simulated or real ranks)."""
from __future__ import annotations

from collections import Counter, defaultdict


def check_offpolicy_log(events: list[dict], max_staleness: int | None = None) -> dict:
    """From an events.jsonl alone: no group trained twice or before it materialised; none lost (every finished
    request of a trained group reached it: its reward was scored); every interrupted request comes back
    (admitted again) or its group is untrained at the end; per-sample staleness (trainer version at hand-off minus
    the sample's oldest token version, from reward_scored.version) within `max_staleness` if given."""
    version, trained, stale = 0, Counter(), []
    sample_version: dict[int, list[int]] = defaultdict(list)
    finished = {e["req_id"]: e["group_id"] for e in events if e["kind"] == "trajectory_finished"}
    admitted = Counter(e["req_id"] for e in events if e["kind"] == "request_admitted")
    interrupted = Counter(e["req_id"] for e in events if e["kind"] == "trajectory_interrupted")
    group_of = {e["req_id"]: e["group_id"] for e in events if e["kind"] == "request_admitted"}
    for e in events:
        if e["kind"] == "reward_scored":
            sample_version[e["group_id"]].append(e["version"])
        elif e["kind"] == "train_step_done" and e["data"].get("stepped", True):
            version = e["version"]
        elif e["kind"] == "train_started":
            for g in e["data"]["groups"]:
                trained[g] += 1
                stale += [(g, version - v) for v in sample_version[g]
                          if max_staleness is not None and version - v > max_staleness]
    scored = {e["req_id"] for e in events if e["kind"] == "reward_scored"}
    lost = [r for r, g in finished.items() if g in trained and r not in scored]
    materialised = {e["group_id"] for e in events if e["kind"] == "group_materialized"}
    unreturned = [r for r, n in interrupted.items() if admitted[r] < n + 1 and group_of[r] in trained]
    return {"twice": [g for g, n in trained.items() if n > 1], "lost": lost, "unreturned": unreturned,
            "stale": stale, "trained_groups": len(trained), "interrupted": sum(interrupted.values()),
            "unmaterialised_trained": sorted(set(trained) - materialised),
            "waiting_at_end": len(materialised - set(trained))}
