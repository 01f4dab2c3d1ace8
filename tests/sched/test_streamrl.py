"""StreamRL's elastic generation pool and planning (§4.2): AddEngines in the engine pool and the simulator, the
scale-out decision on hand-built views, Algorithm 1's split from simulated generation profiles (sim/split.py), and the
reproduction's headline ordering (StreamRL ahead of ColocationRL) at a small scale."""
import pytest

import sched
from sched.base import InvariantError
from sched.decisions import AddEngines, RoundPlan
from sched.engine_pool import EnginePool
from sched.events import Event
from sched.policies.streamrl.scale_out import ScaleOut
from sched.resources import EngineView
from sched.views import GroupState, Request, RequestState, Views
from sim import simulate
from sim.backend import SimBackend, SimStalled
from sim.check import on_policy_report
from sim.profiles import get_profile
from sim.workload import get_workload

S = RequestState


def test_engine_pool_adds_engines_without_weights_only_on_an_elastic_backend():
    v = Views(elastic=True)
    v.engines = [EngineView(0, version=3), EngineView(1, version=3)]
    events: list[Event] = []
    EnginePool(v, events.append).add_engines(AddEngines(2))
    assert [e.engine for e in v.engines] == [0, 1, 2, 3] and [e.version for e in v.engines[2:]] == [-1, -1]
    assert [(e.kind, e.data["engines"]) for e in events] == [("engines_added", [2, 3])]
    fixed = Views(elastic=False)
    fixed.engines = [EngineView(0)]
    with pytest.raises(InvariantError, match="cannot scale out"):
        EnginePool(fixed, events.append).add_engines(AddEngines(1))
    with pytest.raises(InvariantError):
        EnginePool(v, events.append).add_engines(AddEngines(0))


def test_sim_backend_scales_out_onto_its_spare_gpus_and_no_further():
    cost = get_profile("h800_streamrl_32b")                       # TP 4: an engine takes 4 GPUs
    b = SimBackend(cost, get_workload("streamrl_20k"), num_engines=2, train_gpus=8, spare_gpus=8)
    b.command(AddEngines(1))
    assert b.num_engines == 3 and b.spare_gpus == 4
    assert b.engines[2].rank == 8 + 2 * 4                      # after the trainer's GPUs and the first two
    with pytest.raises(SimStalled, match="needs 8 GPUs; 4 spare"):
        b.command(AddEngines(2))
    assert b.num_engines == 3


def scale_views(t_gen: float, t_train: float, elastic: bool = True, engines: int = 4) -> tuple[ScaleOut, Views]:
    """A round of one 2-request group generated in t_gen, then a train call of t_train that completes a step;
    the policy has seen it all (the decisions before the step completes are checked to be empty)."""
    p = ScaleOut(ScaleOut.Params(unit=4, gen_engines=[4, 8], gen_seconds=[100.0, 60.0]))
    v = Views(group_size=2, prompts_per_step=1, elastic=elastic)
    v.engines = [EngineView(e, version=0) for e in range(engines)]
    v.round, v.round_groups[0], v.plans[0] = 0, [0], RoundPlan(fresh=1)
    v.groups[0] = GroupState(0, 0, 0, 2)
    for i in range(2):
        v.requests[i] = Request(i, 0, i, 0, 0, 5, state=S.RUNNING, engine=0)
    assert p.plan(v) == []                                          # t = 0: the round starts
    v.now, v.finishes[0] = t_gen, [0, 1]
    v.trainer.busy = True
    assert p.plan(v) == []                                          # generated; training starts
    v.now, v.trainer.busy, v.trainer.steps_done = t_gen + t_train, False, 1
    return p, v


def test_scale_out_adds_a_unit_when_the_gap_exceeds_what_it_saves():
    p, v = scale_views(t_gen=100.0, t_train=10.0)                  # delta 90 >= delta' = 100 x (1 - 60/100) = 40
    assert p.plan(v) == [AddEngines(4)]
    assert p.events == [(1, 90.0, pytest.approx(40.0))]
    assert p.plan(v) == []                                          # once per step
    p, v = scale_views(t_gen=100.0, t_train=70.0)                  # delta 30 < 40: a unit would overshoot
    assert p.plan(v) == []
    p, v = scale_views(t_gen=100.0, t_train=120.0)                 # training is the slower stage
    assert p.plan(v) == []
    p, v = scale_views(t_gen=100.0, t_train=10.0, elastic=False)   # a backend that cannot scale out
    assert p.plan(v) == []
    p, v = scale_views(t_gen=100.0, t_train=10.0, engines=8)       # beyond the profile: flat, a unit saves nothing
    assert p.plan(v) == []
    p, v = scale_views(t_gen=100.0, t_train=10.0)
    p.p.max_engines = 6                                             # 4 + 4 > 6
    assert p.plan(v) == []


def test_scale_out_rejects_a_profile_that_does_not_pair_up():
    with pytest.raises(ValueError, match="pair up"):
        ScaleOut(ScaleOut.Params(gen_engines=[4, 8], gen_seconds=[1.0]))
    with pytest.raises(ValueError, match="ascending"):
        ScaleOut(ScaleOut.Params(gen_engines=[8, 4], gen_seconds=[1.0, 2.0]))


def test_scale_out_in_the_simulator_new_engines_take_work_and_the_run_stays_one_step_off():
    """A generation-bound split with spare GPUs: the pool grows, the new engines load weights before they decode,
    nothing is lost or trained twice."""
    over = {"rebalance": {"unit": 2, "max_engines": 6, "gen_engines": [2, 4, 6], "gen_seconds": [90.0, 50.0, 40.0]}}
    r = simulate(sched.load_preset("streamrl_async", over), "streamrl_10k", "h800_streamrl_7b", num_engines=2,
                 train_gpus=8, steps=4, group_size=1, prompts_per_step=48, seed=0, spare_gpus=4)
    added = [e for e in r.events if e.kind == "engines_added"]
    assert added and r.num_engines > 2 and r.num_engines <= 6
    assert r.backend.spare_gpus == 4 - (r.num_engines - 2)
    new = set().union(*(e.data["engines"] for e in added))
    loaded: dict[int, float] = {}                                   # a new engine's first load
    for e in r.events:
        if e.kind == "weights_loaded" and e.engine in new:
            loaded.setdefault(e.engine, e.t)
    admitted = [e for e in r.events if e.kind == "request_admitted" and e.engine in new]
    assert admitted, "the new engines never took a request"
    assert all(e.t >= loaded[e.engine] and e.version >= 0 for e in admitted)
    rep = on_policy_report(r.events)
    assert rep["trained_twice"] == [] and rep["finished_not_trained"] == []


def test_split_profiles_generation_and_algorithm_1_balances_the_stages():
    from sim.split import plan, profile
    cost = get_profile("h800_streamrl_7b")
    prof = profile("streamrl", "streamrl_10k", cost, gpus=6, prompts=32, group_size=1, step=2)
    assert sorted(prof.seconds) == [2, 4] and prof.round_tokens > 0
    assert prof.seconds[4] < prof.seconds[2]                        # more engines generate a round faster
    best = plan(prof, cost, 6)
    assert best.gen in prof.seconds and best.gen + best.train <= 6
    brute = min((max(prof.seconds[x], cost.train_s(prof.round_tokens, 6 - x)), x) for x in prof.seconds)
    assert best.time == pytest.approx(brute[0]) and best.gen == brute[1]


def test_split_cli_prints_the_chosen_split(capsys):
    from sim.split import main
    assert main(["--workload", "streamrl_10k", "--cost", "h800_streamrl_7b", "--gpus", "4", "--prompts", "16",
                 "--step", "1"]) == 0
    out = capsys.readouterr().out
    assert "<- Algorithm 1" in out and out.strip().splitlines()[-1].startswith("split: ")
    with pytest.raises(SystemExit):
        main(["--workload", "nope", "--cost", "h800_streamrl_7b", "--gpus", "4"])


def test_streamrl_headline_disaggregated_streaming_beats_colocation():
    """StreamRL §7.1 at a small scale: StreamRL-Sync on a disaggregated split ahead of ColocationRL (sync,
    colocated on every GPU, the same engines and trainer), and StreamRL-Async ahead of StreamRL-Sync."""
    from sim.repro import Runs, Setting
    from sim.repro.figures import after_warmup_throughput
    runs = Runs(0)
    colo = runs.get("sync", Setting("streamrl_20k", "h800_streamrl_7b", 8, 8, 64, 1, 3, colocated=True))
    dis = Setting("streamrl_20k", "h800_streamrl_7b", 4, 4, 64, 1, 3)
    sync, async_ = runs.get("streamrl", dis), runs.get("streamrl_async", dis)
    tput = [after_warmup_throughput(x) for x in (colo, sync, async_)]
    assert tput[1] > 1.05 * tput[0] and tput[2] > tput[1]


def test_ramped_workload_scales_lengths_linearly_up_to_the_cap():
    from sim.workload import RampedWorkload
    base = get_workload("streamrl_20k", 1)
    w = RampedWorkload(base, 0.5, 1.0, 1000).with_seed(1)
    assert w.prompt(7) == base.prompt(7) and w.max_len == base.max_len
    for i in (0, 500, 999, 5000):
        scale = 0.5 + 0.5 * min(1.0, i / 1000)
        for s in range(3):
            assert w.response_len(i, s) == max(1, min(base.max_len, round(base.response_len(i, s) * scale)))
    assert max(w.response_len(0, s) for s in range(200)) <= base.max_len // 2       # the first prompt: half the cap
