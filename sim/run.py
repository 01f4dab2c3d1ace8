"""simulate(): one run of a scheduling preset on the simulator, through the same Controller as the runtime.

    from sim import simulate
    r = simulate("sync", "rollpacker_7b_8k", "h800_7b", num_engines=8, train_gpus=8, steps=3, group_size=8,
                 prompts_per_step=128, seed=0)
    r.metrics["trainer_wait_ratio"], r.wall_s, len(r.events)

Deterministic: the same arguments give the same event log (the workload is a hash of (seed, prompt, sample), the
reward draws come from one seeded generator consumed in event order, and queue ties break in push order).
"""
from __future__ import annotations

import gc
import itertools
import json
import math
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import sched
from sched.base import Preset
from sched.controller import Controller, PromptItem
from sched.events import Event, EventLog
from sched.metrics import summarize
from sim.backend import EngineFault, SimBackend, StopSimulation
from sim.cost import CostModel
from sim.packed import PackedEvents
from sim.profiles import get_profile
from sim.ranker import NoisyRanker, install
from sim.tokens import RunList
from sim.workload import PromptSpec, Workload, get_workload

PROMPT_TOKEN = 1


@dataclass
class SimResult:
    preset: str
    events: list[Event]
    metrics: dict[str, Any]
    wall_s: float                 # real seconds the simulation took
    num_engines: int
    train_gpus: int
    gpus: int                     # GPUs simulated (engines x TP + train GPUs, or train GPUs when colocated)
    backend: SimBackend = field(repr=False)
    views: Any = field(default=None, repr=False)  # the controller's views at the end (what is still in flight)
    policy: Any = field(default=None, repr=False)  # the Preset as it ended (its mechanisms' own state)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a reproduction's pool ships results, sim/repro/core.py) with the events packed
        (sim/packed.py), without the memo of `of`."""
        state = dict(self.__dict__)
        state.pop("_of", None)
        packed = state.pop("_packed", None)
        state["events"] = packed if packed is not None else PackedEvents(state["events"], state.get("_ships"))
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Unpickled with the events still packed: `of` makes only the kinds it is asked for (a row reads a few
        kinds of ~10^5-10^6 events), `events` the whole list when first read."""
        packed = state.pop("events")
        self.__dict__.update(state, _packed=packed)

    def __getattr__(self, name: str) -> Any:
        packed = self.__dict__.get("_packed") if name == "events" else None
        if packed is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        ships = self.__dict__.get("_ships")
        if ships is not None:
            raise AttributeError(f"this result carries only the event kinds {sorted(ships)} (ship_only): read them "
                                 f"with of()")
        events = self.__dict__["events"] = packed.select()
        del self.__dict__["_packed"]
        return events

    def _packed_events(self) -> PackedEvents | None:
        """The unpickled events while the list is not built (None once it is, or if never pickled)."""
        return None if "events" in self.__dict__ else self.__dict__.get("_packed")

    def _memo(self) -> dict[Any, Any]:
        """What `of` and `end_t` computed from this run's events (made again if the list is replaced)."""
        src = self._packed_events()
        if src is None:
            src = self.events
        memo = self.__dict__.get("_of")
        if memo is None or memo[0] is not src:
            memo = self.__dict__["_of"] = (src, {})
        return memo[1]

    def ship_only(self, kinds: frozenset[str]) -> None:
        """Carry only these event kinds when pickled (a reproduction whose rows read no other:
        `Paper.reads_kinds`); from then on, `of` another kind raises, here and wherever the result is unpickled."""
        self.__dict__["_ships"] = frozenset(kinds)

    def of(self, *kinds: str) -> list[Event]:
        """The run's events of these kinds, in log order: a reproduction's figures read a few kinds of a log of
        ~10^5-10^6 events, each several times, so each selection is made once and kept."""
        memo = self._memo()
        out = memo.get(kinds)
        if out is None:
            want = frozenset(kinds)
            ships = self.__dict__.get("_ships")
            if ships is not None and not want <= ships:
                raise KeyError(f"event kinds {sorted(want - ships)} not in the paper's reads_kinds, the only kinds "
                               f"this result carries ({sorted(ships)})")
            packed = self._packed_events()
            out = [e for e in self.events if e.kind in want] if packed is None else packed.select(want)
            memo[kinds] = out
        return out

    @property
    def end_t(self) -> float:
        """The latest event time of the log (kept, as `of`'s selections)."""
        memo = self._memo()
        if "end_t" not in memo:
            packed = self._packed_events()
            if packed is None:
                memo["end_t"] = max(e.t for e in self.events)
            elif packed.end_t is None:
                raise ValueError("end_t of a run without events")
            else:
                memo["end_t"] = packed.end_t
        return memo["end_t"]

    def write(self, out_dir: str | Path, timeline: bool = True) -> Path:
        """events.jsonl + summary.json (+ timeline.png) like a real run directory."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "events.jsonl", "w") as f:
            for ev in self.events:
                f.write(ev.to_json() + "\n")
        (out / "summary.json").write_text(json.dumps(self.metrics, indent=2, default=str) + "\n")
        if timeline:
            draw_timeline(self.events, out / "timeline.png", self.preset, self.num_engines)
        return out


def draw_timeline(events: list[Event], out: str | Path, title: str, num_engines: int, max_lanes: int = 24) -> Path:
    """sched.timeline.draw over at most `max_lanes` engines (a 512-lane picture is unreadable and huge)."""
    from sched.timeline import draw
    shown = [e for e in events if e.engine < max_lanes]
    if num_engines > max_lanes:
        title = f"{title} (engines 0-{max_lanes - 1} of {num_engines})"
    return draw(shown, out, title)


def prompt_ids(spec: PromptSpec) -> RunList:
    """Fake prompt token ids of the prompt's length (one filler token). They carry nothing about the response: the
    workload generator's difficulty stays hidden from every policy, so a length ranker that reads prompt content
    learns nothing here; a simulated ranker of a stated quality is `simulate(ranker_recall=...)` (sim/ranker.py)."""
    return RunList([(PROMPT_TOKEN, spec.prompt_len)])


def prompt_source(workload: Workload):
    """The controller's prompt source: prompts 0, 1, 2, ... of the workload, with fake ids of the right length
    (`prompt_ids`)."""
    counter = itertools.count()

    def source(n: int) -> list[PromptItem]:
        items = []
        for _ in range(n):
            i = next(counter)
            items.append(PromptItem(i, prompt_ids(workload.prompt(i)), None))
        return items
    return source


# The collector's thresholds while a simulation (or a reproduction's intake of results) runs: a simulation makes
# millions of short-lived objects and keeps a growing heap of long-lived ones (requests, events), and CPython's default
# (700, 10, 10) re-scans that heap so often that collection took 15-22% of a StaleFlow or AReaL run and half of a
# reproduction's main process; almost nothing it makes is cyclic garbage (a run leaves ~20-70k objects of it, a
# fraction of a MB), so collections 70x rarer change no result and no peak memory measurably.
SIM_GC_THRESHOLD = (50_000, 20, 100)


@contextmanager
def rare_collections(threshold: tuple[int, int, int] = SIM_GC_THRESHOLD) -> Iterator[None]:
    """Collect cyclic garbage at `threshold` (gc.set_threshold's; 0 first: no automatic collection) instead of the
    interpreter's defaults inside the block; restored after."""
    saved = gc.get_threshold()
    gc.set_threshold(*threshold)
    try:
        yield
    finally:
        gc.set_threshold(*saved)


def simulate(preset: str | Preset, workload: str | Workload, cost: str | CostModel, num_engines: int,
             train_gpus: int, steps: int, group_size: int, prompts_per_step: int, seed: int = 0, *,
             colocated: bool = False, counters_every_s: float | None = None, progress: bool = False,
             log_path: str | Path | None = None, max_events: int | None = 50_000_000,
             samples: int | None = None, reward_timeout: Any = None, reward_workers: int = 0,
             reward_stage: bool = False, spare_gpus: int = 0, faults: Sequence[EngineFault] = (),
             stream_every_s: float = 10.0, ranker_recall: float | None = None, minibatches: int = 1,
             proximal_pass: bool | None = None) -> SimResult:
    """Run `steps` optimizer steps of `preset` (a configs/sched/*.toml name or a Preset) on simulated engines.

    num_engines engines of cost.gpus_per_engine GPUs each, and a train partition of train_gpus GPUs (with
    colocated=True the engines time-share the train GPUs instead). `samples`: stop instead once that many samples
    have been trained (train calls done) — the same amount of work for presets whose optimizer steps differ in
    size; `steps` is then only an upper bound. `reward_timeout`: an AdaptiveTimeout (rl/reward_timeout.py) applied
    to every sandboxed reward call (RollPacker §4.3); `reward_workers` scorers (0: unlimited) and `reward_stage`
    (score a round only once all of it has left the engines: veRL's synchronous reward stage), sim/backend.py;
    `spare_gpus` the rollout pool may scale out onto (StreamRL §4.2); `faults`: engines killed and brought back
    (Laminar §8.5; sim/backend.py `EngineFault`, which needs counters_every_s and a preset that isolates engine
    faults; the engines then stream partial trajectories every `stream_every_s`). `ranker_recall`: the preset's
    skewness-aware dispatch ranks with a simulated ranker whose recall of each round's longest 20% is this (StreamRL
    Table 4's figure; sim/ranker.py) instead of its own predictor (None: its own). `minibatches`: optimizer steps
    of a train call that steps over its groups (the trainer's train.minibatches; charged at cost.train_step_s each).
    `proximal_pass`: the trainer runs decoupled PPO, whose stepping calls of several steps first take a no-grad
    proximal pass (cost.proximal_s; nothing on a profile whose proximal_share is 0); None: the runtime's default,
    decoupled under a preset with a staleness bound >= 1 (train.py default_off_policy)."""
    name = preset if isinstance(preset, str) else "custom"
    policy = sched.load_preset(preset) if isinstance(preset, str) else preset
    if faults:
        allowed = policy.failures_isolated()
        kills = Counter(i for f in faults if not math.isinf(f.down_s) for i in f.engines)
        most = max(kills.values(), default=0)
        if not allowed or most > allowed:
            who = policy.isolator() or "no mechanism isolates engine faults; Laminar's rebalance does"
            raise ValueError(f"preset {name!r} recovers from {allowed} failures per engine ({who}); the faults fail "
                             f"an engine {most} times")
    w = get_workload(workload, seed)
    c = get_profile(cost)
    if ranker_recall is not None and not install(policy, NoisyRanker.with_recall(w, ranker_recall)):
        raise ValueError(f"preset {name!r} has no skewness-aware dispatch to give a ranker (ranker_recall)")
    if counters_every_s is None and policy.reads_counters():   # as the runtime's engines report (rollout_worker)
        counters_every_s = policy.counters_period_s()
    backend = SimBackend(c, w, num_engines, train_gpus, seed, colocated=colocated,
                         counters_every_s=counters_every_s, progress=progress, max_events=max_events,
                         stop_after_samples=samples, reward_timeout=reward_timeout,
                         reward_workers=reward_workers, reward_stage=reward_stage, spare_gpus=spare_gpus,
                         faults=faults, stream_every_s=stream_every_s, minibatches=minibatches,
                         proximal_pass=((policy.staleness_bound() or 0) >= 1 if proximal_pass is None
                                        else proximal_pass))
    log = EventLog(log_path)
    ctl = Controller(policy, prompt_source(w), group_size, prompts_per_step, steps, log=log)
    t0 = time.perf_counter()
    with rare_collections():
        try:
            ctl.run(backend)
        except StopSimulation:
            ctl.log_stats()
        finally:
            log.close()
        wall = time.perf_counter() - t0
        metrics = summarize(log.events, backend.num_engines)
    gpus = train_gpus if colocated else train_gpus + backend.num_engines * c.gpus_per_engine
    metrics.update({"samples_trained": backend.samples_trained, "preemptions": backend.preemptions,
                    "reprefill_s": backend.reprefill_s,
                    "reward_killed": backend.reward_killed, "reward_busy_s": backend.reward_busy_s,
                    "events": len(log.events), "wall_s": wall,
                    "gpus": gpus, "cost_profile": c.name, "workload": w.name, "preset": name,
                    # what is left when the run stops: materialised groups not trained, requests not settled
                    "backlog_groups": len(ctl.v.ready_groups()), "in_flight": ctl.v.in_flight()})
    return SimResult(name, log.events, metrics, wall, backend.num_engines, train_gpus, gpus, backend, ctl.v, policy)
