"""An overlapped publication sharing the train calls' processor (CostModel.publish_train_share = a): while both run,
the call progresses at 1 - a and the publication at a, so each is slowed by exactly the other's share of their
overlap; a = 0 leaves the simulation as it was."""
from __future__ import annotations

from dataclasses import replace

import pytest

from sim import simulate
from sim.profiles import PROFILES, get_profile

KW = dict(steps=12, group_size=4, prompts_per_step=8, seed=0)


def _run(share: float, preset: str = "stream_generation", **cost_kw):
    cost = replace(get_profile("cpu_tiny"), publish_train_share=share, **cost_kw)
    return cost, simulate(preset, "cpu_tiny", cost, 2, 2, **KW)


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_each_call_and_publication_loses_exactly_the_others_share_of_their_overlap(share):
    cost, r = _run(share, publish_s=0.05)   # publications long against the calls: most overlap one
    done = [e for e in r.events if e.kind == "train_step_done"]
    calls = [(e.t - e.data["step_time_s"], e.t) for e in done]
    pubs = [(e.t - e.data["seconds"], e.t) for e in r.events if e.kind == "version_published" and e.version > 0]
    assert 3 < len(pubs) < sum(e.data["stepped"] for e in done)   # the run ends at its last step, before its sending
    for e, call in zip(done, calls):
        if call[1] > pubs[-1][1]:
            continue            # beside a publication still sending when the run ended (not in the log)
        nominal = cost.train_s(int(e.data["tokens"]), r.train_gpus, 1 if e.data["stepped"] else 0)
        shared = sum(_overlap(call, p) for p in pubs)
        assert e.data["step_time_s"] - nominal == pytest.approx(share * shared, abs=1e-9), e
    for p in pubs:
        shared = sum(_overlap(c, p) for c in calls)
        assert p[1] - p[0] - cost.publish_s == pytest.approx((1 - share) * shared, abs=1e-9), p
    assert sum(_overlap(c, p) for c in calls for p in pubs) > 0.1     # they did share
    # one call at a time, one publication at a time, each publication after its own step
    for spans in (calls, pubs):
        assert all(x[1] <= y[0] + 1e-12 for x, y in zip(spans, spans[1:]))
    steps = [c[1] for c, e in zip(calls, done) if e.data["stepped"]]
    assert all(p[0] >= s - 1e-12 for p, s in zip(pubs, steps))


def test_sharing_slows_the_run_and_no_share_changes_nothing():
    _, shared = _run(0.5, publish_s=0.05)
    _, alone = _run(0.0, publish_s=0.05)
    base = simulate("stream_generation", "cpu_tiny", replace(get_profile("cpu_tiny"), publish_s=0.05), 2, 2, **KW)
    assert [(e.kind, e.t) for e in alone.events] == [(e.kind, e.t) for e in base.events]
    assert shared.metrics["makespan_s"] > alone.metrics["makespan_s"]


def test_a_publication_the_trainer_waits_for_shares_nothing():
    """sync publishes without overlap (the trainer waits for it): the share has nothing to act on."""
    _, a = _run(0.5, "sync")
    _, b = _run(0.0, "sync")
    assert [(e.kind, e.t) for e in a.events] == [(e.kind, e.t) for e in b.events]


def test_every_paper_profile_gives_publications_hardware_of_their_own():
    assert all(p.publish_train_share == 0.0 for p in PROFILES.values())


def test_a_share_of_the_whole_processor_is_refused():
    with pytest.raises(ValueError, match="publish_train_share must be in"):
        replace(get_profile("cpu_tiny"), publish_train_share=1.0)
