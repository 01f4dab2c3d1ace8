"""RollPacker's stream trainer (§4.4, Algorithm 1): the scale-down decision on hand-built views, and the elastic pool
end to end in the simulator (lent engines' GPUs join the trainer; nothing runs on a lent engine; on-policy); the
parallelism planner (§4.2): its TP decisions on hand-built views, and a reshard between steps in the simulator."""
import pytest

from sched.decisions import LendEngines, Migrate, ReturnEngines, RoundPlan
from sched.policies.rollpacker import ScaleDown, StreamTrainerHandoff
from sched.policies.rollpacker.stream_trainer import ScaleDownParams
from sched.resources import EngineView
from sched.views import GroupState, Request, RequestState, Views

S = RequestState


def round_views(running, finished, engines=4, group_size=2, tokens=100, elastic=True):
    """One round: `running` groups on engines 0, 1, 2, ... round-robin (every request running, `tokens` so far), then
    `finished` groups whose requests finished (lengths 100..); the finish order is the lifecycle's."""
    v = Views(group_size=group_size, prompts_per_step=running + finished, elastic=elastic, colocated=True)
    v.engines = [EngineView(e, version=0) for e in range(engines)]
    v.round, v.round_groups[0], v.plans[0] = 0, [], RoundPlan(fresh=running + finished)
    rid = 0
    for gid in range(running + finished):
        g = v.groups[gid] = GroupState(gid, gid, 0, group_size)
        v.round_groups[0].append(gid)
        for s in range(group_size):
            fin = gid >= running
            r = Request(rid, gid, s, gid, 0, 50, state=S.FINISHED if fin else S.RUNNING, engine=gid % engines,
                        tokens=100 + rid if fin else tokens)
            v.requests[rid] = r
            if fin:
                r.finished_seq = rid
                v.finishes.setdefault(0, []).append(rid)
            else:
                v.engines[r.engine].assigned += 1
            g.req_ids.append(rid)
            rid += 1
    return v


def test_scale_down_lends_half_the_least_loaded_engines_at_a_milestone_and_migrates_whole_groups():
    v = round_views(running=6, finished=2)            # 4 of 16 responses done: 25%, in [20%, 50%]
    sd = ScaleDown(ScaleDownParams(kv_tokens=10**6))
    out = sd.plan(v)
    lend = [c for c in out if isinstance(c, LendEngines)]
    moves = [c for c in out if isinstance(c, Migrate)]
    assert len(lend) == 1 and len(lend[0].engines) == 2 and out[-1] is lend[0]
    loads = v.engine_loads()   # groups 0..5 round-robin: engines 0, 1 hold 4, engines 2, 3 hold 2
    assert sorted(lend[0].engines) == [2, 3] and loads[2] == loads[3] == 2 < loads[0]
    for m in moves:                                   # every running request of a lent engine moves, group by group
        assert m.src in lend[0].engines and m.dst not in lend[0].engines
        assert len({v.requests[i].group_id for i in m.req_ids}) == 1
    assert sorted(i for m in moves for i in m.req_ids) == [4, 5, 6, 7]   # groups 2 and 3, on engines 2 and 3
    assert sd.plan(v) == []                           # once per round


def test_scale_down_waits_for_a_milestone_and_for_the_kv_to_fit():
    assert ScaleDown(ScaleDownParams(kv_tokens=10**6)).plan(round_views(running=7, finished=1)) == []   # 12.5%
    assert ScaleDown(ScaleDownParams(kv_tokens=10**6)).plan(round_views(running=3, finished=5)) == []   # 62.5%
    # 8 live requests at 100 tokens, history 100..103: each projected to ~102 + 50 prompt; 2 engines stay
    tight = ScaleDown(ScaleDownParams(kv_tokens=500))
    assert tight.plan(round_views(running=6, finished=2)) == []            # 12 x ~152 > 2 x 500
    roomy = ScaleDown(ScaleDownParams(kv_tokens=1000))
    assert any(isinstance(c, LendEngines) for c in roomy.plan(round_views(running=6, finished=2)))
    assert ScaleDown(ScaleDownParams(kv_tokens=10**6)).plan(round_views(6, 2, elastic=False)) == []


def test_engines_come_back_when_the_round_is_rolled_out_and_streaming_needs_them():
    v = round_views(running=6, finished=2)
    sd = ScaleDown(ScaleDownParams(kv_tokens=10**6))
    lent = next(c for c in sd.plan(v) if isinstance(c, LendEngines)).engines
    handoff = StreamTrainerHandoff()
    v.groups[7].scored = 2                            # a finished group materialised
    v.groups[7].materialized_seq = 1
    v.groups.track(v.groups[7])
    assert handoff.ready(v) is None                   # colocated, nothing lent yet: rollout holds every GPU
    for e in lent:
        v.engines[e].lent = True
    assert handoff.ready(v) == [7]                    # the trainer has GPUs of its own now
    for r in list(v.requests.values()):              # the round's rollout is over
        if r.state == S.RUNNING:
            v.requests.set_state(r, S.FINISHED)
    assert sd.plan(v) == [ReturnEngines(lent)]


def test_elastic_stream_trainer_in_the_simulator_keeps_every_rule_and_speeds_up_the_round():
    """Lent engines decode nothing while lent, their GPUs train the finished groups, every engine is back before the
    next round, the run stays on-policy and loses nothing, and the stream trainer beats round-end training."""
    import sched
    from sched.metrics import engine_spans, trainer_spans
    from sim import simulate
    from sim.check import on_policy_report
    from sim.profiles import get_profile
    cost = get_profile("h800_7b")
    kw = dict(workload="rollpacker_7b_8k", cost=cost, num_engines=8, train_gpus=8, steps=10**9, group_size=8,
              prompts_per_step=32, seed=3, colocated=True, samples=3 * 32 * 8)
    elastic = simulate(sched.load_preset("rollpacker", {"rebalance": {"kv_tokens": cost.kv_capacity_tokens}}), **kw)
    fixed = simulate(sched.load_preset("rollpacker", {"rebalance": {"scale_down": False}}), **kw)
    rep = on_policy_report(elastic.events)
    assert rep["off_policy"] == [] and rep["trained_twice"] == [] and rep["finished_not_trained"] == []
    assert elastic.backend.lent_gpu_s > 0 and fixed.backend.lent_gpu_s == 0 and not elastic.backend.lent
    assert elastic.metrics["makespan_s"] < fixed.metrics["makespan_s"]
    end = max(e.t for e in elastic.events)
    lent: dict[int, list[tuple[float, float]]] = {}  # engine -> the intervals it was lent
    since: dict[int, float] = {}
    for e in elastic.events:
        if e.kind == "engines_lent":
            for i in e.data["engines"]:
                if e.data["lent"]:
                    since[i] = e.t
                else:
                    lent.setdefault(i, []).append((since.pop(i), e.t))
        elif e.kind == "round_started":
            assert not since, "a round started with engines still lent"
    assert lent and not since
    spans = engine_spans(elastic.events, end)
    for i, ivs in lent.items():                       # a lent engine decodes nothing
        assert not any(a < y - 0.05 and x < b - 0.05 for a, b in spans.get(i, []) for x, y in ivs)  # (a step)
    mid = [(a, b) for a, b, d in trainer_spans(elastic.events) if not d["step"]]
    assert mid                                        # gradients computed mid-round, on the lent GPUs ...
    def lent_during(i, x, y):
        return any(p < y and x < q for p, q in lent.get(i, []))
    assert any(a < y and x < b for x, y in mid for i in spans if not lent_during(i, x, y)
               for a, b in spans[i])                  # ... while the engines still in rollout decode


# ------------------------------------------------------------------------------- the parallelism planner (§4.2)
def planner_step(planner, v, pool, kind: str, preemptions: int):
    """One more round of `kind` whose one response went through `preemptions` preemptions, trained and published;
    the planner decides, and its Reshard (if any) is applied by the lifecycle's engine pool."""
    from sched.decisions import Reshard
    r = v.round = v.round + 1
    v.round_groups[r], v.plans[r] = [r], RoundPlan(fresh=1, kind=kind)
    g = v.groups[r] = GroupState(r, r, r, 1)
    v.requests[r] = Request(r, r, 0, r, r, 5, state=S.FINISHED, engine=0, preemptions=preemptions)
    g.req_ids.append(r)
    v.finishes[r] = [r]
    g.scored, g.materialized_seq = 1, r
    v.groups.track(g)
    v.trainer.busy = True
    assert planner.plan(v) == []                      # mid-step: nothing
    v.trainer.busy = False
    v.trainer.steps_done += 1
    v.trainer.version = v.trainer.published = v.trainer.steps_done
    out = planner.plan(v)
    for cmd in out:
        assert isinstance(cmd, Reshard)
        pool.reshard(cmd)
    return out


def test_planner_doubles_tp_on_a_rise_over_the_same_kind_and_halves_after_four_quiet_steps():
    from sched.events import Event
    from sched.engine_pool import EnginePool
    from sched.policies.rollpacker.planner import PlannerParams, TPPlanner
    v = Views(elastic=True, tp=2, tp_sizes=(1, 2, 4, 8))
    v.engines = [EngineView(e, version=0) for e in range(4)]         # 8 rollout GPUs at TP 2
    events: list[Event] = []
    pool, p = EnginePool(v, events.append), TPPlanner(PlannerParams(max_tp=4))
    assert planner_step(p, v, pool, "short", 100) == []               # no reference yet
    assert planner_step(p, v, pool, "long", 50) == []                 # long's own reference
    assert planner_step(p, v, pool, "short", 105) == []               # 105 <= 1.05 x 100
    assert [c.tp for c in planner_step(p, v, pool, "short", 111)] == [4]   # a rise: doubled
    assert v.tp == 4 and len(v.engines) == 2 and all(e.version == -1 for e in v.engines)
    assert events[-1].kind == "engines_resharded" and events[-1].data == {"tp": 4, "engines": 2}
    assert planner_step(p, v, pool, "short", 200) == []               # a rise, but TP 4 is the most
    assert planner_step(p, v, pool, "long", 40) == []                 # fewer: no change
    for _ in range(3):
        assert planner_step(p, v, pool, "short", 0) == []
    assert [c.tp for c in planner_step(p, v, pool, "long", 0)] == [2]   # the fourth quiet step: halved
    assert v.tp == 2 and len(v.engines) == 4
    for _ in range(4):
        planner_step(p, v, pool, "short", 0)
    assert v.tp == 1 and len(v.engines) == 8
    for _ in range(4):
        assert planner_step(p, v, pool, "short", 0) == []             # TP 1 is the least
    big = Views(elastic=True, tp=2, tp_sizes=(2, 4))                 # the model does not fit at TP 1
    big.engines = [EngineView(e, version=0) for e in range(4)]
    q, pool2 = TPPlanner(), EnginePool(big, events.append)
    for _ in range(4):
        assert planner_step(q, big, pool2, "short", 0) == []
    assert big.tp == 2
    fixed = Views(elastic=False, tp=2)
    fixed.engines = [EngineView(e, version=0) for e in range(4)]
    q = TPPlanner()
    planner_step(q, fixed, EnginePool(fixed, events.append), "short", 10)
    assert planner_step(q, fixed, EnginePool(fixed, events.append), "short", 20) == []   # a backend that cannot


def test_reshard_is_refused_with_work_in_flight_or_to_a_size_the_backend_cannot_take():
    from sched.base import InvariantError
    from sched.decisions import Reshard
    from sched.engine_pool import EnginePool
    v = round_views(running=2, finished=0)
    v.tp, v.tp_sizes = 2, (1, 2, 4)
    with pytest.raises(InvariantError, match="in flight"):
        EnginePool(v, lambda e: None).reshard(Reshard(4))
    idle = Views(elastic=True, tp=1, tp_sizes=(1, 2))
    idle.engines = [EngineView(e, version=0) for e in range(3)]
    with pytest.raises(InvariantError, match="reshards only to"):
        EnginePool(idle, lambda e: None).reshard(Reshard(2))             # 3 GPUs: TP 2 does not divide them
    with pytest.raises(InvariantError, match="reshards only to"):
        EnginePool(idle, lambda e: None).reshard(Reshard(4))


def test_planner_in_the_simulator_reshards_on_preemptions_between_steps_and_stays_on_policy():
    """14B at TP 1 on 2 GPUs with a small KV pool (40k tokens: preemptions from the start): the planner doubles TP
    between two steps, the backend rebuilds its engines at TP 2 (the profile's roofline there), and the run stays
    on-policy and loses nothing."""
    from dataclasses import replace
    import sched
    from sim import simulate
    from sim.check import on_policy_report
    from sim.profiles import at_tp, get_profile
    cost = replace(at_tp(get_profile("h800_14b"), 1), kv_capacity_tokens=40_000)
    r = simulate(sched.load_preset("rollpacker"), "rollpacker_14b_16k", cost, 2, 2, steps=4, group_size=8,
                 prompts_per_step=16, seed=0, colocated=True)
    assert r.backend.tp_sizes == (1, 2)                               # 2 GPUs; 14B fits at TP 1
    assert r.backend.reshards and r.backend.reshards[0][1] == 2 and r.backend.tp == 2 and r.num_engines == 1
    assert r.backend.cost.kv_capacity_tokens == at_tp(get_profile("h800_14b"), 2).kv_capacity_tokens
    t, _ = r.backend.reshards[0]
    rounds = [e.t for e in r.events if e.kind == "round_started"]
    assert any(a < t for a in rounds) and any(a > t for a in rounds)  # between two steps
    hist = r.policy.rebalance.planner.history
    assert hist[-1][3] == 2 and any(n > 0 for _, _, n, _ in hist)
    assert r.metrics["preemptions"] >= sum(n for _, _, n, _ in hist)
    rep = on_policy_report(r.events)
    assert rep["off_policy"] == [] and rep["trained_twice"] == [] and rep["finished_not_trained"] == []


def test_sim_tp_sizes_are_those_the_model_fits_at_and_that_divide_the_gpus():
    from sim.profiles import get_profile, tp_sizes
    assert tp_sizes(get_profile("h800_14b"), 16) == (1, 2, 4, 8)
    assert tp_sizes(get_profile("h800_32b"), 64) == (2, 4, 8)        # 32B's weights do not fit one GPU's share
    assert tp_sizes(get_profile("h800_14b"), 6) == (1, 2)
    assert tp_sizes(get_profile("h800_streamrl_7b"), 16) == ()       # a profile without TP variants
