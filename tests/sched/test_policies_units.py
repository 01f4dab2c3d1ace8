"""Each new sched module's decisions on hand-built views, the controller's abort rules event by event, and the
pure helpers (length ranking, resource splits, adaptive reward timeout)."""
import pytest

import sched
from config import ConfigError
from rl.types import Trajectory
from sched.decisions import Abort, RoundPlan, Submit
from sched.resources import EngineView
from sched.views import GroupState, Request, RequestState, Views
from sched.policies.rolloutpipe import CompleteGroupPipelining, EveryU, FrontierDispatch
from sched.controller import Controller, InvariantError, PromptItem
from sched.events import Event, EventLog
from sched.policies.streamrl.length_rank import PREDICTORS, HistoryPredictor
from sched.policies.streamrl.resource_split import (instance_latency, should_scale_out, split_cross_dc, split_gpus,
                                                    split_instances)
from rl.reward_timeout import AdaptiveTimeout
from sched.policies.streamrl.dispatch import SkewnessDispatch
from sched.policies.streamrl.handoff import StreamHandoff
from sched.policies.streamrl.update import StreamUpdate
from sched.policies.rollpacker import TailAbort, TailBatching
from sched.policies.sync import WholeRound


def views(groups, engines=2, group_size=None, prompts_per_step=2, plan=None, rnd=0):
    """groups: per group a list of request states; "finished:<seq>" sets the finish order. Group i has prompt i."""
    v = Views(group_size=group_size or len(groups[0]), prompts_per_step=prompts_per_step)
    v.engines = [EngineView(e, version=0) for e in range(engines)]
    v.round, v.round_groups[rnd], v.plans[rnd] = rnd, [], plan or RoundPlan(fresh=len(groups))
    rid = 0
    for gid, states in enumerate(groups):
        g = v.groups[gid] = GroupState(gid, gid, rnd, len(states), prompt=PromptItem(gid, [1, 2], str(gid)))
        v.round_groups[rnd].append(gid)
        for s, st in enumerate(states):
            st, _, seq = st.partition(":")
            v.requests[rid] = Request(rid, gid, s, gid, rnd, 2 + gid, state=st,
                                      engine=-1 if st == "pending" else 0, finished_seq=int(seq or -1))
            if st in ("running", "aborting", "requeueing"):
                v.engines[0].assigned += 1
            g.req_ids.append(rid)
            rid += 1
    return v


S = RequestState


def materialize(v, gid, seq, scored=None):
    g = v.groups[gid]
    g.scored, g.materialized_seq = g.size if scored is None else scored, seq
    g.dropped = g.size - g.scored
    v.groups.track(g)
    for i in g.req_ids:
        v.requests.set_state(v.requests[i], S.FINISHED)


def consume(v, *gids):
    for gid in gids:
        v.groups[gid].consumed = True
        v.groups.track(v.groups[gid])


def drop(v, gid, n):
    v.dropped += n - v.groups[gid].dropped           # as the lifecycle counts every drop
    v.groups[gid].dropped = n
    v.groups.track(v.groups[gid])


# ---- frontier (FGD) --------------------------------------------------------------------------------------------
def test_frontier_admits_only_the_earliest_unfinished_groups():
    # F_w groups per engine: 2 engines x 1 = a frontier of 2 groups
    v = views([["pending"] * 3] * 5)
    subs = FrontierDispatch(FrontierDispatch.Params(width=1)).admit(v)
    assert [(s.engine, s.req_ids) for s in subs] == [(0, [0, 1, 2]), (1, [3, 4, 5])]  # whole groups, spread
    v = views([["pending"] * 3] * 5)
    assert sorted(r for s in FrontierDispatch(FrontierDispatch.Params(width=2)).admit(v) for r in s.req_ids) == \
        list(range(12))  # 2 engines x 2: the first four groups
    v = views([["finished:1"] * 3, ["running"] * 3, ["pending"] * 3, ["pending"] * 3])
    assert [s.req_ids for s in FrontierDispatch(FrontierDispatch.Params(width=1)).admit(v)] == [[6, 7, 8]]
    # group 1 finished before group 0: F = {0, 2}, not contiguous
    v = views([["running"] * 2, ["finished:1"] * 2, ["pending"] * 2, ["pending"] * 2])
    assert [s.req_ids for s in FrontierDispatch(FrontierDispatch.Params(width=1)).admit(v)] == [[4, 5]]
    # a requeued request returns to its group's engine, and the group still holds its slot (3 engines x 1)
    v = views([["running", "pending"], ["pending", "pending"], ["pending", "pending"], ["pending", "pending"]],
              engines=3)
    v.requests[0].engine = 2
    subs = {s.engine: s.req_ids for s in FrontierDispatch(FrontierDispatch.Params(width=1)).admit(v)}
    assert subs[2][:1] == [1] and sorted(r for ids in subs.values() for r in ids) == [1, 2, 3, 4, 5]
    # aborting requests do not hold a slot (their group is serving-complete for FGD)
    v = views([["aborting", "finished:1"], ["pending", "pending"], ["pending", "pending"]])
    assert sorted(s.req_ids for s in FrontierDispatch(FrontierDispatch.Params(width=1)).admit(v)) == [[2, 3], [4, 5]]
    with pytest.raises(ConfigError, match="width = 0 .*must be >= 1"):
        sched.load_preset("rolloutpipe", {"dispatch": {"width": 0}})
    with pytest.raises(ConfigError, match=r"sched.dispatch.admit_params.width = 0 .*must be >= 1"):
        sched.load_preset("fgd_tailbatch", {"dispatch": {"admit_params": {"width": 0}}})


def test_frontier_first_admits_every_group_fifo_admits_the_frontier_first():
    """mode = "first" (the abstract's reading): nothing is held back, unlike the cap; each engine's queue starts
    with the frontier's requests; a group's requeued request still returns to the engine that serves the rest."""
    from sched.policies.sync import FifoDispatch

    def fresh():   # group 0 part-served on engine 1 with one request requeued, group 1 done, groups 2-5 pending
        v = views([["running", "pending"], ["finished:1"] * 2] + [["pending"] * 2] * 4)
        v.requests[0].engine = 1
        v.engines[0].assigned, v.engines[1].assigned = 0, 1
        return v

    first = FrontierDispatch(FrontierDispatch.Params(width=1, mode="first"))
    subs = first.admit(fresh())
    admitted = sorted(r for s in subs for r in s.req_ids)
    assert admitted == sorted(r for s in FifoDispatch().admit(fresh()) for r in s.req_ids) == [1, *range(4, 12)]
    cap = FrontierDispatch(FrontierDispatch.Params(width=1)).admit(fresh())
    assert sorted(r for s in cap for r in s.req_ids) == [1, 4, 5]        # the cap: the frontier {0, 2} only
    v = fresh()
    front = {0, 2}                                                          # F_w x N = 2 lowest unfinished groups
    by_engine = {s.engine: s.req_ids for s in subs}
    assert by_engine[1][0] == 1                                             # group 0's request: its serving engine
    for ids in by_engine.values():
        in_front = [v.requests[r].group_id in front for r in ids]
        assert in_front == sorted(in_front, reverse=True)                   # frontier requests before the rest
    for ids in by_engine.values():                                          # whole groups, never split
        for g in {v.requests[r].group_id for r in ids} - {0}:
            assert set(v.groups[g].req_ids) <= set(ids)
    assert first.admit(views([["running"] * 2, ["finished:1"] * 2])) == []  # nothing pending: nothing to do
    with pytest.raises(ConfigError, match="mode"):
        sched.load_preset("rolloutpipe", {"dispatch": {"mode": "priority"}})


# ---- CGP and stream handoffs -------------------------------------------------------------------------------------
def test_cgp_hands_u_groups_in_materialisation_order_and_the_round_rest():
    v = views([["running"] * 2] * 5)
    cgp = CompleteGroupPipelining(CompleteGroupPipelining.Params(groups=2))
    materialize(v, 3, seq=5)
    assert cgp.ready(v) is None                      # one group: wait for U
    materialize(v, 1, seq=7)
    assert cgp.ready(v) == [3, 1]                    # FIFO by materialisation, not by id
    materialize(v, 0, seq=9)
    materialize(v, 4, seq=8)
    materialize(v, 2, seq=10)
    assert cgp.ready(v) == [3, 1]
    consume(v, 3, 1, 4, 0)
    assert cgp.ready(v) == [2]                       # R not a multiple of U: the rest goes once nothing else can
    v = views([["running"] * 2] * 3)
    materialize(v, 0, seq=1)
    drop(v, 1, 2)                                    # void (deferred): nothing else of the round can come but 2
    assert cgp.ready(v) is None
    materialize(v, 2, seq=2)
    assert cgp.ready(v) == [0, 2]


def test_stream_handoff_hands_everything_ready_once_enough():
    v = views([["running"] * 2] * 4)
    h = StreamHandoff(StreamHandoff.Params(min_groups=2))
    materialize(v, 2, seq=3)
    assert h.ready(v) is None
    materialize(v, 0, seq=4)
    materialize(v, 1, seq=2)
    assert h.ready(v) == [1, 2, 0]
    consume(v, 0, 1, 2)
    materialize(v, 3, seq=9)
    assert h.ready(v) == [3]                         # the round's rest, below min_groups


def test_batches_never_mix_rounds():
    v = views([["running"] * 2] * 2)
    v.round_groups[1] = [7]
    v.groups[7] = GroupState(7, 7, 1, 2, scored=2, materialized_seq=1)   # indexed as it is inserted
    materialize(v, 0, seq=2)
    assert StreamHandoff().ready(v) == [0] and CompleteGroupPipelining().ready(v) is None


# ---- updates -----------------------------------------------------------------------------------------------------
def test_every_u_steps_every_u_groups_and_publishes_after_the_round():
    v = views([["finished:1"]] * 5)
    u = EveryU(EveryU.Params(groups=2))
    assert (u.decide([0, 1], v).step, u.decide([0, 1], v).publish) == (True, False)
    assert (u.decide([0], v).step, u.decide([0], v).publish) == (False, False)    # a streamed group accumulates
    v.trainer.groups_since_step = 1
    assert u.decide([1], v).step
    consume(v, 0, 1, 2)
    drop(v, 4, 1)                                    # void
    v.trainer.groups_since_step = 0
    call = u.decide([3], v)
    assert call.step and call.publish                # the round's last group steps and publishes, whatever U


def test_stream_update_steps_once_at_round_end():
    v = views([["finished:1"]] * 3)
    assert StreamUpdate().decide([0, 2], v) == StreamUpdate().decide([0, 2], v)
    c = StreamUpdate().decide([0, 2], v)
    assert (c.step, c.publish) == (False, False)
    consume(v, 1)
    c = StreamUpdate().decide([0, 2], v)
    assert (c.step, c.publish) == (True, True)


# ---- tail batching ------------------------------------------------------------------------------------------------
def test_tail_batching_plans_short_rounds_then_a_long_round_from_the_queue():
    tb = TailBatching()
    v = Views(group_size=8, prompts_per_step=128, engines=[EngineView(0, version=0)])
    p = tb.intake(v)
    assert (p.fresh, p.group_size, p.kind, p.keep_groups, p.keep_per_group) == (160, 10, "short", 128, 8)
    # a short round in which 3 prompts ended void (deferred): queued once, the round is closed, next is short
    v = views([["finished:1"]] * 4 + [["aborted"]] * 3, engines=1, group_size=2, prompts_per_step=3,
              plan=RoundPlan(fresh=7, group_size=3, kind="short", keep_groups=4, keep_per_group=1))
    for g in range(4):
        materialize(v, g, seq=g)
        consume(v, g)
    for g in range(4, 7):
        drop(v, g, 1)
    assert tb.intake(v).kind == "long"               # 3 queued >= P0 = 3
    assert tb.long_queue == [] and tb.intake(v).kind == "short"  # harvested once only
    # nothing while the round is open or the engines are behind
    v.groups[0].consumed = False
    v.groups.track(v.groups[0])
    assert tb.intake(v) == 0
    with pytest.raises(ValueError, match="admit"):
        TailBatching(TailBatching.Params(admit="tail_batching"))
    with pytest.raises(ValueError, match="admit_params"):
        TailBatching(TailBatching.Params(admit="frontier", admit_params={"widht": 2}))


def test_tail_batching_queue_survives_a_checkpoint():
    tb = TailBatching()
    tb.long_queue = [PromptItem(4, [1, 2], "a")]
    fresh = TailBatching()
    fresh.load_state_dict(tb.state_dict())
    v = Views(group_size=2, prompts_per_step=1, engines=[EngineView(0, version=0)])
    plan = fresh.intake(v)
    assert plan.kind == "long" and plan.prompts == [PromptItem(4, [1, 2], "a")]


def test_tail_abort_keeps_the_first_finishers_and_defers_the_rest():
    plan = RoundPlan(fresh=3, group_size=3, kind="short", keep_groups=2, keep_per_group=2)
    # group 0: 2 finished -> kept, its running third aborted; group 1: 1 finished, racing; group 2: none yet
    v = views([["finished:4", "running", "finished:2"], ["finished:3", "running", "running"],
               ["running", "pending", "running"]], group_size=2, plan=plan)
    ta = TailAbort()
    assert [(a.req_ids, a.requeue) for a in ta.plan(v)] == [([1], False)]
    v.requests.set_state(v.requests[1], S.ABORTING)
    assert ta.plan(v) == []
    for rid, seq in ((8, 6), (6, 7)):                 # group 2's first finish, then its second: kept, P0 = 2
        v.requests.set_state(v.requests[rid], S.FINISHED)
        v.requests[rid].finished_seq = seq
        v.finishes.setdefault(0, []).append(rid)      # as the lifecycle records a trajectory_finished
    out = ta.plan(v)
    victims = sorted(i for a in out for i in a.req_ids)
    assert victims == [3, 4, 5, 7]                   # all of group 1 (finished one too), group 2's pending third
    assert all(not a.requeue for a in out) and ta.races[0].settled
    assert ta.plan(v) == []                          # settled
    long = views([["running"] * 2] * 3, plan=RoundPlan(prompts=[1, 2, 3], kind="long"))
    assert TailAbort().plan(long) == []              # non-speculative rounds are never touched


def test_tail_abort_drops_a_kept_groups_extra_response_while_it_migrates():
    """An extra response on its way to another engine (the stream trainer's scale-down migrates it) is dropped like
    a running one when its group is kept: it must never come back and join a group the trainer already has."""
    plan = RoundPlan(fresh=2, group_size=3, kind="short", keep_groups=2, keep_per_group=2)
    v = views([["finished:1", "finished:2", "interrupting"], ["running"] * 3], plan=plan, group_size=2)
    assert [a.req_ids for a in TailAbort().plan(v)] == [[2]]


def test_tail_abort_orders_by_finish_not_by_sample_index():
    plan = RoundPlan(fresh=2, group_size=3, kind="short", keep_groups=1, keep_per_group=1)
    v = views([["running", "finished:9", "running"], ["finished:5", "running", "running"]], plan=plan, group_size=1)
    assert sorted(i for a in TailAbort().plan(v) for i in a.req_ids) == [0, 1, 2, 4, 5]


# ---- skewness dispatch and the ranker ----------------------------------------------------------------------------
def test_history_predictor():
    h = HistoryPredictor()
    assert h.predict(3, prompt_len=7) == 7.0         # nothing seen: prompt length
    h.observe(1, prompt_len=4, response_len=10)
    h.observe(1, prompt_len=4, response_len=30)
    assert h.predict(1, 4) == 20.0
    assert h.predict(2, 8) == pytest.approx(40.0)    # unseen: mean response x relative prompt length
    g = HistoryPredictor()
    g.load_state_dict(h.state_dict())
    assert g.predict(1, 4) == 20.0 and set(PREDICTORS) >= {"history", "prompt_length"}


def test_skewness_sends_the_predicted_long_tail_to_dedicated_engines_longest_first():
    v = views([["pending"] * 2] * 5, engines=3)      # prompt i has prompt_len 2 + i: group 4 predicted longest
    d = SkewnessDispatch(SkewnessDispatch.Params(long_fraction=0.2, long_engines=1))
    subs = d.admit(v)
    assert d.long == {4}
    placed = {s.engine: s.req_ids for s in subs}
    assert placed[2] == [8, 9]                       # the long tail alone on the dedicated engine
    assert placed[0] == [6, 7, 0, 1] and placed[1] == [4, 5, 2, 3]  # LPT: longest first onto the least work
    # small batches on the long engines: the second long group waits while the first runs
    v = views([["pending"] * 2] * 4, engines=2)
    d = SkewnessDispatch(SkewnessDispatch.Params(long_fraction=0.5, long_engines=1, long_batch=2))
    assert [s.engine for s in d.admit(v) for _ in s.req_ids].count(1) == 2
    # finished responses teach the ranker; one engine: LPT order only
    v = views([["pending"], ["pending"]], engines=1)
    d = SkewnessDispatch()
    d.ranker.observe(0, 2, 100)
    d.ranker.observe(1, 3, 5)                        # the longer prompt had the shorter answers
    assert d.admit(v)[0].req_ids == [0, 1] and d.long == {0}


def test_skewness_learns_from_finished_requests():
    v = views([["pending"], ["pending"]], engines=1)
    d = SkewnessDispatch(SkewnessDispatch.Params(predictor="history"))
    d.admit(v)
    v.requests.set_state(v.requests[0], S.FINISHED)
    v.requests[0].tokens = 50
    v.finishes.setdefault(0, []).append(0)           # as the lifecycle records a trajectory_finished
    d.admit(v)
    assert d.ranker.predict(0, 2) == 50.0 and not d.work.get(0) and list(d.recent) == [50]


def test_skewness_runs_algorithm_2_each_round_from_the_decode_profile():
    """With a profile, the long tail gets Algorithm 2's N_l engines and its batch size as their cap; without one,
    no engine is dedicated."""
    from sched.resources import DecodeProfile
    prof = DecodeProfile(weights_s=0.01, per_seq_s=0.001, per_token_s=0.0, fixed_s=0.0, kv_tokens=10**6, max_seqs=4)
    v = views([["pending"]] * 20, engines=4, group_size=1)          # prompt i has prompt_len 2 + i
    v.decode_profile = prof
    d = SkewnessDispatch(SkewnessDispatch.Params(predictor="prompt_length"))
    subs = d.admit(v)
    est = [float(2 + i) for i in range(20)]
    want = split_instances(est, 4, lambda bs, L: prof.ptl(bs, 2 + 11.5 + L / 2),
                           lambda L: prof.max_batch(2 + 11.5 + L), 0.2)
    split = d.splits[0]
    assert (len(split.long), split.long_batch) == (want.long, want.long_batch) and want.long >= 1
    long_reqs = [i for s in subs if s.engine in split.long for i in s.req_ids]
    assert sorted(long_reqs) == sorted(v.groups[g].req_ids[0] for g in d.long)[:want.long * want.long_batch]
    assert all(len([i for s in subs if s.engine == e for i in s.req_ids]) <= want.long_batch for e in split.long)
    bare = views([["pending"]] * 20, engines=4, group_size=1)
    d = SkewnessDispatch(SkewnessDispatch.Params(predictor="prompt_length"))
    d.admit(bare)
    assert d.splits[0].long == () and d.splits[0].regular == (0, 1, 2, 3)


# ---- the controller's abort rules ------------------------------------------------------------------------------
class Stub:
    num_engines = 1

    def __init__(self):
        self.cmds, self.trained = [], []

    def now(self):
        return 0.0

    def submit(self, engine, reqs, prompts):
        pass

    def command(self, cmd):
        self.cmds.append(cmd)

    def train(self, call, groups):
        self.trained.append((call, groups))


def controller(aborts, group_size=3, handoff="whole_round"):
    preset = sched.load_preset("sync", {"handoff": {"name": handoff}})
    preset.rebalance.plan = lambda v: aborts.pop(0) if aborts else []
    src = iter(range(100))
    ctl = Controller(preset, lambda n: [PromptItem(next(src), [1, 2], "x") for _ in range(n)], group_size, 1, 5,
                     log=EventLog())
    ctl.v.engines = [EngineView(0, version=0)]
    return ctl


def traj(gid, s):
    return Trajectory(gid, s, [1, 2], [3], [-1.0], [0], "stop", reward=float(s))


def test_abort_rules_running_pending_finished_and_races():
    aborts = [[], [Abort(0, [0, 1])]]
    ctl, b = controller(aborts), Stub()
    ctl.decide(b)                                     # round 0 starts, all 3 submitted
    ctl.apply(Event("trajectory_finished", 1, engine=0, req_id=2, group_id=0, data={"tokens": 1}))
    ctl.decide(b)                                     # abort 0 and 1 (running): sent, counted dropped at once
    assert b.cmds == [Abort(0, [0, 1], False)] and ctl.v.dropped == 2
    assert [ctl.v.requests[i].state for i in (0, 1)] == ["aborting", "aborting"]
    ctl.apply(Event("trajectory_aborted", 2, engine=0, req_id=0, data={"requeue": False}))  # the ack
    ctl.apply(Event("trajectory_finished", 2, engine=0, req_id=1, group_id=0))              # lost the race
    ctl.apply(Event("reward_scored", 3, req_id=1, group_id=0, payload=traj(0, 1)))          # ignored
    ctl.apply(Event("reward_scored", 3, req_id=2, group_id=0, payload=traj(0, 2)))
    g = ctl.v.groups[0]
    assert (g.scored, g.dropped, ctl.v.dropped, ctl.v.engines[0].assigned) == (1, 2, 2, 0) and g.materialized
    assert ctl.v.requests[1].state == "aborted"
    ctl.decide(b)
    (call, groups), = b.trained
    assert [t.sample_index for t in groups[0].trajectories] == [2]
    closed = [e for e in ctl.log.events if e.kind == "trajectory_aborted"]
    assert [(e.req_id, e.data) for e in closed] == [(0, {"requeue": False}),
                                                    (1, {"requeue": False, "discarded": True})]
    with pytest.raises(InvariantError, match="after its group"):
        ctl.command(b, Abort(0, [2]))                   # trained: can never be dropped


def test_abort_of_pending_and_scored_requests_is_settled_locally():
    ctl, b = controller([]), Stub()
    ctl.start_round(1)
    ctl.submit(b, Submit(0, [0, 1]))
    ctl.apply(Event("trajectory_finished", 1, engine=0, req_id=0, group_id=0))
    ctl.apply(Event("reward_scored", 1, req_id=0, group_id=0, payload=traj(0, 0)))
    ctl.command(b, Abort(0, [0, 2]))                   # 0 finished and scored: discarded; 2 never sent: local
    g = ctl.v.groups[0]
    assert b.cmds == [] and (g.scored, g.dropped, g.trajectories) == (0, 2, [])
    assert [e.data for e in ctl.log.events if e.kind == "trajectory_aborted"] == [
        {"requeue": False, "discarded": True}, {"requeue": False, "local": True}]
    ctl.command(b, Abort(0, [1]))
    assert g.void and g.closed and not g.materialized and ctl.v.round_done(0) and ctl.v.open_groups() == []
    assert WholeRound().ready(ctl.v) is None          # a void group is never handed to the trainer
    ctl.apply(Event("trajectory_aborted", 2, engine=0, req_id=1, data={"requeue": False}))
    assert ctl.quiescent()


def test_requeue_returns_to_pending_unless_it_finished_first():
    ctl, b = controller([]), Stub()
    ctl.start_round(1)
    ctl.submit(b, Submit(0, [0, 1, 2]))
    ctl.command(b, Abort(0, [0, 1], requeue=True))
    assert b.cmds == [Abort(0, [0, 1], True)] and ctl.v.dropped == 0
    ctl.apply(Event("trajectory_aborted", 1, engine=0, req_id=0, data={"requeue": True}))
    ctl.apply(Event("trajectory_finished", 1, engine=0, req_id=1, group_id=0))
    assert [ctl.v.requests[i].state for i in (0, 1)] == ["pending", "finished"]
    with pytest.raises(InvariantError, match="state pending"):
        ctl.apply(Event("trajectory_aborted", 2, engine=0, req_id=0, data={"requeue": True}))


def test_round_plan_reruns_prompts_with_its_own_group_size():
    ctl = controller([])
    ctl.start_round(RoundPlan(prompts=[PromptItem(9, [5], "y")], fresh=1, group_size=2, kind="long"))
    assert [(g.prompt_index, g.size) for g in ctl.v.groups.values()] == [(9, 2), (0, 2)]
    assert ctl.log.events[-1].data == {"round": 0, "prompts": 2, "group_size": 2, "kind": "long"}


# ---- pure helpers ------------------------------------------------------------------------------------------------
def test_split_gpus_balances_the_stages():
    s = split_gpus(12, gen_time=lambda x: 100 / x, train_time=lambda y: 200 / y)
    assert (s.gen, s.train, s.time) == (4, 8, 25.0)
    plateau = split_gpus(16, gen_time=lambda x: max(10.0, 40 / x), train_time=lambda y: max(10.0, 80 / y))
    assert (plateau.gen, plateau.train, plateau.time) == (4, 8, 10.0)   # ties: the fewest GPUs
    assert split_gpus(16, lambda x: 64 / x, lambda y: 64 / y, gen_unit=4, train_unit=4).gen % 4 == 0
    with pytest.raises(ValueError):
        split_gpus(3, lambda x: 1.0, lambda y: 1.0, gen_unit=2, train_unit=2)


def test_split_cross_dc_shrinks_the_faster_stage():
    gen, train = (lambda x: 90 / x), (lambda y: 100 / y)
    s = split_cross_dc(32, 8, gen, train)             # gen is faster: shrink it toward train's 12.5 s
    assert (s.gen, s.train) == (7, 8) and s.time == pytest.approx(90 / 7)   # argmin |.| lands slower
    safe = split_cross_dc(32, 8, gen, train, safe=True)
    assert (safe.gen, safe.train, safe.time) == (8, 8, 12.5)
    assert split_cross_dc(4, 64, gen, train).gen == 4 and split_cross_dc(4, 64, gen, train).train < 64


def test_scale_out_rule():
    gen = lambda x: 100 / x  # noqa: E731
    assert should_scale_out(30, 10, gen, gen_gpus=4, unit=4)      # gap 20 >= 25 - 12.5 that one more unit saves
    assert not should_scale_out(20, 10, gen, gen_gpus=4, unit=4)
    assert not should_scale_out(10, 20, gen, gen_gpus=4, unit=4)
    assert not should_scale_out(30, 10, lambda x: 50.0, gen_gpus=4, unit=4)   # a flat profile: a unit saves nothing


def test_split_instances_gives_the_long_tail_its_own_instances():
    # StreamRL Fig. 6a: DP 2, two long-tail samples twice as long as 64 regular ones, PTL rising with batch size
    ptl = lambda bs: 1.0 + 0.05 * bs  # noqa: E731
    lengths = [2.0, 2.0] + [1.0] * 64
    sp = split_instances(lengths, 2, lambda bs, L: ptl(bs), max_bs=lambda L: 1000, alpha=2 / 66)
    assert (sp.long, sp.regular, sp.long_batch) == (1, 1, 2)
    assert split_instances(lengths, 1, lambda bs, L: ptl(bs), max_bs=lambda L: 1000).long == 0
    # Eq. 2 per class, L_a = P90 = 10, L_r = P50 = 1, BS capped at 16: the printed sum and the makespan differ
    many = [10.0] * 20 + [1.0] * 80
    for objective, combine in (("sum", lambda a, b: a + b), ("max", max)):
        sp = split_instances(many, 8, lambda bs, L: ptl(bs), max_bs=lambda L: 16, alpha=0.2, objective=objective)
        brute = min(range(1, 8), key=lambda nl: (combine(
            instance_latency(20, 10.0, nl, lambda bs, L: ptl(bs), lambda L: 16),
            instance_latency(80, 1.0, 8 - nl, lambda bs, L: ptl(bs), lambda L: 16)), nl))
        assert sp.long == brute and sp.regular == 8 - brute and sp.long_batch == -(-20 // brute)
    assert split_instances(many, 8, lambda bs, L: ptl(bs), lambda L: 16, 0.2, objective="sum").long == 3
    assert split_instances(many, 8, lambda bs, L: ptl(bs), lambda L: 16, 0.2, objective="max").long == 7


def test_adaptive_timeout():
    t = AdaptiveTimeout()
    assert t.timeout_s("tc1") == 30.0                 # never solved: the cap
    t.observe("tc1", 1.0, correct=True)
    assert t.timeout_s("tc1") == 2.0                  # 1.5 x 1 s, floored at 2 s
    t.observe("tc1", 4.0, correct=True)
    t.observe("tc1", 3.0, correct=True)               # the anchor is the slowest correct run
    t.observe("tc1", 29.0, correct=False)             # wrong answers never move it
    assert t.timeout_s("tc1") == 6.0
    t.observe("tc2", 25.0, correct=True)
    assert t.timeout_s("tc2") == 30.0
    u = AdaptiveTimeout(AdaptiveTimeout.Params(scale=2.0, min_s=0.5, max_s=10.0))
    u.load_state_dict(t.state_dict())
    assert u.timeout_s("tc1") == 8.0 and u.timeout_s("tc2") == 10.0
    with pytest.raises(ValueError):
        AdaptiveTimeout.Params(min_s=5, max_s=1)


def test_barrier_waits_for_held_back_requests_and_one_step_admits_them_under_the_round_s_version():
    """A dispatch may hold requests back (StreamRL's small long-tail batches): the barrier loads no engine while one
    waits, and one_step without overlap still admits it though a newer version is published."""
    from sched.policies.one_step import OneStepOff
    from sched.policies.sync import Barrier
    v = views([["running", "pending"]])
    v.trainer.published = 1                                        # version 1 published mid-round; engines at 0
    assert Barrier().engines_to_load(v) == []                      # engine 1 is idle, but request 1 waits
    assert [s.req_ids for s in OneStepOff().admit(v)] == [[1]]
    assert OneStepOff(OneStepOff.Params(overlap=True)).admit(v) == []   # partial rollout resumes on new weights only
    v.requests.set_state(v.requests[1], S.RUNNING)
    assert [(c.engine, c.version) for c in Barrier().engines_to_load(v)] == [(1, 1)]
