"""The reproduction framework: settings, memoised runs, rows, the hit rule, several seeds, the CLI's table.

A paper is a `Paper`: its rows (`Row`: a figure, the paper's value or range, how we compute ours from simulations),
the components its reproduction simulates and those it does not, and the notes it prints (what the simulator chose:
a GPU split, a ranker's measured recall). Every simulated row runs on several seeds; the table shows the mean and the
spread, and the hit is judged on the mean.

The hit rule and the accounting (sim/README.md, "The hit rule"):
- a row is a hit when our mean lies within 20% of the paper's range: in [0.8 lo, 1.2 hi] (a point value is a range
  of one; "< x" is (0, x]);
- a speedup row (kind SPEEDUP) counts only if our gain is at least half the paper's smallest gain as well:
  ours - 1 >= (lo - 1) / 2, so 1.00x against 1.12-2.12x is a miss, not a hit;
- every judged row prints its margin: how far inside the band (a hit) or outside it (a miss) the mean lies, as a
  fraction of the nearest band end;
- a hit is **weak**, and counted apart from the solid hits, when it is an edge hit (margin under EDGE, 3%), when a
  decomposition row it sums (`parts`: the per-step rows of a cumulative table) misses, so that the total agrees
  through compensating errors, or when the row names a `caveat` (why its agreement does not test the mechanism);
- a bound row (kind BOUND: the paper's "up to x", "at most x", "< x" about our own system) is judged by the same band
  and reported apart: a band that a result of no gain, or a synchronous system, would pass tests nothing;
- an arithmetic row (kind ARITHMETIC: a closed-form figure of the paper's own constants, not a simulation) is
  printed, labelled, and not counted.
"""
from __future__ import annotations

import gc
import math
import multiprocessing
import os
import statistics
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Callable

import sched
from rl.reward_timeout import AdaptiveTimeout
from sim.run import SIM_GC_THRESHOLD, SimResult, rare_collections, simulate

NA = "policy not available yet"
POOL_DEADLINE_S = 4 * 3600.0   # a backstop against a hung worker, far above any reproduction's time (minutes)
LEVEL, SPEEDUP, BOUND, ARITHMETIC = "level", "speedup", "bound", "arithmetic"
KINDS = (LEVEL, SPEEDUP, BOUND, ARITHMETIC)
EDGE = 0.03      # a hit whose margin is under this fraction of the band's nearest end is an edge hit (weak)


@dataclass(frozen=True)
class Setting:
    workload: str
    cost: str
    num_engines: int
    train_gpus: int
    prompts: int
    group_size: int
    rounds: int
    colocated: bool = False
    sim: tuple = ()               # further simulate() keyword arguments as (name, value) pairs (hashable; see
    #                               sim_kwargs)


def sim_kwargs(s: Setting) -> dict[str, Any]:
    """simulate()'s extra keyword arguments of a setting; ("adaptive_timeout", True) becomes a fresh
    rl.reward_timeout.AdaptiveTimeout with the paper's constants (RollPacker §4.3) for each run."""
    kw = dict(s.sim)
    if kw.pop("adaptive_timeout", False):
        kw["reward_timeout"] = AdaptiveTimeout()
    return kw


@dataclass(frozen=True)
class SimSpec:
    """One simulation a row reads: everything simulate() takes, hashable (the memo's key) and picklable (a pool's
    task). `overrides`: ((table, ((key, value), ...)), ...) over the preset; `counters_every_s` and `progress`: the
    engines' counters (simulate())."""
    preset: str
    overrides: tuple
    setting: Setting
    seed: int
    counters_every_s: float | None = None
    progress: bool = False

    @property
    def kind(self) -> tuple:
        """The spec without its seed: runs of one kind on other seeds take about as long (the pool's ordering)."""
        return (self.preset, self.overrides, self.setting, self.counters_every_s, self.progress)

    def run(self) -> SimResult:
        s = self.setting
        policy = sched.load_preset(self.preset, {k: dict(v) for k, v in self.overrides})
        r = simulate(policy, s.workload, s.cost, s.num_engines, s.train_gpus, steps=10**9, group_size=s.group_size,
                     prompts_per_step=s.prompts, seed=self.seed, colocated=s.colocated,
                     samples=s.rounds * s.prompts * s.group_size, counters_every_s=self.counters_every_s,
                     progress=self.progress, **sim_kwargs(s))
        r.preset = self.preset
        return r


class Missing(BaseException):
    """A row read a simulation its Runs has not got yet, while the pool collects what it must run (`evaluate`).
    A BaseException, so that a row's own `except Exception` lets it through."""


class Runs:
    """Memoised simulations of one seed: SimSpec -> SimResult; `memo` for any other seeded computation a row shares
    with another (a profile of generation times, a chosen split). While `wanted` is a dict (`evaluate` with a pool),
    a simulation not yet run is added to it and raises Missing instead of running here, so a row is computed again
    as results arrive, until it reads nothing missing: a row must be a pure function of its runs (`values` keeps
    what each row and note computed, by its function). `first`: the first seed's Runs (itself for the first seed),
    where a choice made once for every seed (a tuned GPU split) reads its runs. `keep_policy`: whether a result
    keeps its Preset as it ended (`Paper.reads_policy`), `kinds` the event kinds it carries (`Paper.reads_kinds`;
    `_strip`)."""

    def __init__(self, seed: int, first: "Runs | None" = None, keep_policy: bool = True,
                 kinds: frozenset[str] | None = None):
        self.seed, self.cache = seed, {}
        self.first = self if first is None else first
        self.wanted: dict[SimSpec, None] | None = None
        self.values: dict[Callable[["Runs"], Any], Any] = {}
        self.keep_policy, self.kinds = keep_policy, kinds

    def get(self, preset: str, s: Setting, overrides: tuple = (), counters_every_s: float | None = None,
            progress: bool = False) -> SimResult | None:
        """None when the preset does not exist; raises what the simulation raised."""
        if not (sched.PRESET_DIR / f"{preset}.toml").is_file():
            return None
        spec = SimSpec(preset, overrides, s, self.seed, counters_every_s, progress)
        r = self.cache.get(spec)
        if r is None:
            if self.wanted is not None:
                self.wanted[spec] = None
                raise Missing
            r = self.cache[spec] = _strip(spec.run(), self.keep_policy, self.kinds)
        if isinstance(r, Exception):    # the pool's run of it failed
            raise r
        return r

    def memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]

    def value(self, fn: Callable[["Runs"], Any]) -> Any:
        """A row's or a note's value on these runs, computed once (`values`)."""
        if fn not in self.values:
            self.values[fn] = fn(self)
        return self.values[fn]


def _strip(r: SimResult, keep_policy: bool, kinds: frozenset[str] | None = None) -> SimResult:
    """A result as the rows read it: without the Preset as it ended unless the paper reads it (a Laminar run's
    experience buffer alone pickles to ~10 MB, a second in each direction between a worker and this process); with
    only the event kinds the paper reads, when it names them (SimResult.ship_only: the per-request kinds, most of a
    run's events, are packed in ~0.3 s of a worker's time per Laminar-sized run and seldom read)."""
    if not keep_policy:
        r.policy = None
    if kinds is not None:
        r.ship_only(kinds)
    return r


def gather(fns: list[Callable[[], Any]]) -> list[Any]:
    """Every fn's value; when some read simulations not run yet (Missing), all are still called before Missing is
    raised, so the pool queues every simulation they need at once (a loop that stopped at its first Missing would
    queue them one after another)."""
    out, missing = [], False
    for fn in fns:
        try:
            out.append(fn())
        except Missing:
            missing = True
    if missing:
        raise Missing
    return out


@dataclass
class Row:
    figure: str
    paper: tuple[float, float]
    paper_text: str
    compute: Callable[[Runs], float | None]   # None: a needed preset does not exist
    fmt: str = "{:.1%}"
    kind: str = LEVEL                         # LEVEL | SPEEDUP | BOUND | ARITHMETIC
    setting: str = ""                         # what this row's runs simulate (components), beside the figure
    parts: tuple[str, ...] = ()               # figures of the decomposition rows this cumulative row sums: a hit
    #                                           while one of them misses is weak (compensating errors)
    caveat: str = ""                          # why a hit here does not test the mechanism (then it is weak)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"row {self.figure!r}: kind must be one of {KINDS}, got {self.kind!r}")


@dataclass
class Paper:
    rows: list[Row]
    components: str = ""                      # what the reproduction simulates, and what it does not
    notes: list[Callable[[Runs], str]] = field(default_factory=list)   # printed from the first seed's runs
    seeds: int = 3                            # default number of seeds (0, 1, ...)
    reads_policy: bool = False                # a row or note reads a run's `policy` (else results go without it)
    reads_kinds: frozenset[str] | None = None   # the only event kinds its rows and notes read, through `of`
    #                                             (results carry no other; None: every kind)


def band(row: Row) -> tuple[float, float]:
    """The values a row's mean may take to hit: [0.8 lo, 1.2 hi], its lower end raised for a speedup row to half
    the paper's smallest gain (module docstring)."""
    lo, hi = row.paper
    low = 0.8 * lo
    if row.kind == SPEEDUP:
        low = max(low, 1 + 0.5 * (lo - 1))
    return low, 1.2 * hi


def judge(row: Row, value: float) -> bool | None:
    """The hit rule (module docstring); None for an arithmetic row (not counted)."""
    if row.kind == ARITHMETIC:
        return None
    low, high = band(row)
    return low <= value <= high


def margin(row: Row, value: float) -> float:
    """How far `value` lies inside the row's band (> 0) or outside it (< 0), as a fraction of the nearest band end;
    a band end at 0 ("< x") bounds nothing below."""
    low, high = band(row)
    if value > high:
        return -(value - high) / high
    if value < low:
        return -(low - value) / low
    inside = (high - value) / high
    return min(inside, (value - low) / low) if low > 0 else inside


# ------------------------------------------------------------------------------------------------- evaluation


def row_values(rows: list[Row], runs: Runs, progress: Callable[[str], None] | None = None) -> list[Any]:
    out: list[Any] = []
    for i, row in enumerate(rows):
        if progress is not None:
            progress(f"seed {runs.seed}: row {i + 1}/{len(rows)} {row.figure}")
        try:
            v = runs.value(row.compute)
            out.append(None if v is None else float(v))
        except Exception as e:  # a failing run is a miss, shown with its error
            out.append(f"failed: {type(e).__name__}: {e}"[:120])
    return out


def _notes(p: Paper, runs: Runs) -> list[str]:
    out = []
    for note in p.notes:
        try:
            out.append(runs.value(note))
        except Exception as e:
            out.append(f"note failed: {type(e).__name__}: {e}"[:160])
    return out


@dataclass(frozen=True)
class Sensitivity:
    """A sensitivity run, not the reproduction: every cost profile trains `train_speed` times faster per token and
    prefills at `prefill_cost` times its seconds per token (both are assumptions in most profiles: `python -m sim
    profiles`). The default changes nothing."""
    train_speed: float = 1.0
    prefill_cost: float = 1.0

    def __post_init__(self) -> None:
        for name in ("train_speed", "prefill_cost"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def label(self) -> str:
        """What the run changed, for the command's last line ("" for the reproduction itself)."""
        parts = ([f"training {self.train_speed:g}x faster per token"] if self.train_speed != 1.0 else []) + \
                ([f"prefill {self.prefill_cost:g}x the seconds per token"] if self.prefill_cost != 1.0 else [])
        return ", ".join(parts)


class _scaled_profiles:
    """Every cost profile scaled by `s` while in the block, restored on exit."""

    def __init__(self, s: Sensitivity):
        self.s = s

    def __enter__(self) -> None:
        from dataclasses import replace
        from sim.profiles import PROFILES
        self.saved = dict(PROFILES)
        if self.s != Sensitivity():
            for name, c in self.saved.items():
                PROFILES[name] = replace(c, train_s_per_token=c.train_s_per_token / self.s.train_speed,
                                         prefill_s_per_token=c.prefill_s_per_token * self.s.prefill_cost)

    def __exit__(self, *exc: Any) -> None:
        from sim.profiles import PROFILES
        PROFILES.clear()
        PROFILES.update(self.saved)


def _run_spec(job: tuple[SimSpec, Sensitivity, bool, frozenset[str] | None]
              ) -> tuple[SimSpec, SimResult | Exception, float]:
    """A pool's task (spec, sensitivity, keep_policy, kinds): the simulation, or the error it raised (Runs.get raises it
    where a row reads it), and the CPU seconds it took. The result travels without its views (every request and
    group of the run: about half its pickled bytes and time, ~1.4 s for a Laminar-sized AReaL run; rows read the
    backlog from its metrics), without its policy unless the paper reads it (`_strip`), and without the per-request
    progress in its counter reports (23 -> 11 MB and 1.8 -> 0.5 s of unpickling for a StaleFlow run)."""
    spec, sens, keep_policy, kinds = job
    t0 = time.process_time()
    with _scaled_profiles(sens):
        try:
            r: SimResult | Exception = spec.run()
            if isinstance(r, SimResult):
                _strip(r, keep_policy, kinds)
                r.views = None
                for e in r.events:      # each counter report's per-request progress: read by the policy during
                    if e.kind == "tokens_decoded":    # the run, by no row; half a StaleFlow run's pickled bytes
                        e.data.pop("progress", None)  # and three quarters of its unpickling in this process
        except Exception as e:
            r = e
    return spec, r, time.process_time() - t0


Task = tuple[int, Callable[[Runs], Any]]   # a row's or a note's function on the Runs of one seed (its index)


def _tasks(p: Paper, all_runs: list[Runs]) -> list[Task]:
    """Every row on every seed, and the notes on the first."""
    return [(i, fn) for i in range(len(all_runs))
            for fn in [row.compute for row in p.rows] + (list(p.notes) if i == 0 else [])]


def _ask(all_runs: list[Runs], task: Task) -> dict[SimSpec, None]:
    """The simulations a row or note reads that no Runs has yet: it is computed up to its reads, the missing ones
    collected (not run); if none is missing it keeps its value (Runs.value). Every Runs collects (a row may read
    the first seed's); an error is left for the final pass to report."""
    asked: dict[SimSpec, None] = {}
    for runs in all_runs:
        runs.wanted = asked
    try:
        all_runs[task[0]].value(task[1])
    except (Missing, Exception):
        pass
    finally:
        for runs in all_runs:
            runs.wanted = None
    return asked


def _next_spec(todo: list[SimSpec], running: list[SimSpec], seconds: dict[tuple, float]) -> SimSpec:
    """Which simulation a free worker takes: first one of each kind not timed yet (its time is learned), then the
    longest by its kind's time on another seed (longest first: the pool does not end on one long run while the
    other workers idle), then the rest in the order the rows asked."""
    busy = {s.kind for s in running}
    for s in todo:
        if s.kind not in seconds and s.kind not in busy:
            return s
    timed = [s for s in todo if s.kind in seconds]
    return max(timed, key=lambda s: seconds[s.kind]) if timed else todo[0]


def evaluate(paper: str, seeds: list[int], jobs: int, sens: Sensitivity = Sensitivity(),
             progress: Callable[[str], None] | None = None) -> tuple[list[list[Any]], list[str]]:
    """Every row on every seed: per row its values by seed, and the notes from the first seed. With jobs > 1 the
    simulations run in a pool of `jobs` processes (`_pooled`): the rows are computed up to what they read, every
    simulation missing on any seed is queued at once, and each row is computed again as soon as what it waited for
    is back, so a run chosen from another's figures (a tuned split) starts at once; the final pass reads the rows'
    values. `progress` receives a line per finished simulation (pool) or per row
    computed in this process (jobs = 1)."""
    from sim.repro import PAPERS
    p = PAPERS[paper]
    first = Runs(seeds[0], keep_policy=p.reads_policy, kinds=p.reads_kinds)
    all_runs = [first] + [Runs(s, first, p.reads_policy, p.reads_kinds) for s in seeds[1:]]
    by_seed = {runs.seed: runs for runs in all_runs}
    # the results make a large long-lived heap and little cyclic garbage: collecting as the defaults do took half
    # this process's time (rows and pool), at SIM_GC_THRESHOLD still a fifth; none until the rows are computed
    with rare_collections((0, 0, 0)):
        if jobs > 1:
            _pooled(paper, p, all_runs, by_seed, jobs, sens, progress)
        with _scaled_profiles(sens):
            results = [(row_values(p.rows, runs, progress if jobs == 1 else None), _notes(p, runs) if i == 0 else [])
                       for i, runs in enumerate(all_runs)]
        for runs in all_runs:   # the results freed here, by their reference counts: the first collection after
            runs.cache.clear()  # the block would scan every object of them (~3 s for Laminar's), and the
            runs.values.clear()  # interpreter's last one at exit again
    per_row = [[vals[i] for vals, _ in results] for i in range(len(p.rows))]
    return per_row, results[0][1]


def _pooled(paper: str, p: Paper, all_runs: list[Runs], by_seed: dict[int, Runs], jobs: int, sens: Sensitivity,
            progress: Callable[[str], None] | None = None) -> None:
    """Every simulation the rows read, run in a pool of `jobs` processes into the Runs' caches, `jobs` + 1 at a time
    (one queued, so that no worker waits for the next pick, `_next_spec`). Each row and note is computed up to its
    reads (`_ask`) and computed again as soon as every simulation it waited for is back, what it then reads joining
    the queue (a run chosen from another run's figures starts as soon as that run is back), until nothing is
    missing. One deadline (POOL_DEADLINE_S) for the whole pool: TimeoutError past it;
    a worker that dies fails the command with the pool's error. The workers collect garbage at the simulator's
    thresholds (SIM_GC_THRESHOLD), the pool's pickling of each result included (at the interpreter's defaults the
    small objects it makes set off collections that each scan the run's whole heap: 2.1 CPU-s for a Laminar run's
    result against 0.9 s): each result they send leaves ~450k objects in reference cycles behind, which a worker
    that never collected would keep."""
    # the workers fork outside the sensitivity block, with the profiles as defined; each task applies it itself
    pool = ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("fork"), initializer=gc.set_threshold,
                               initargs=SIM_GC_THRESHOLD)
    seconds: dict[tuple, float] = {}          # each kind's CPU seconds, learned from its first run
    todo: list[SimSpec] = []
    running: dict[Any, SimSpec] = {}
    queued: set[SimSpec] = set()              # every simulation ever queued
    blocked: dict[Task, set[SimSpec]] = {}    # a row or note -> the simulations it waits for
    waiters: dict[SimSpec, list[Task]] = {}
    t0 = time.monotonic()
    end, finished = t0 + POOL_DEADLINE_S, 0

    def ask(tasks: list[Task]) -> None:
        with _scaled_profiles(sens):
            for task in tasks:
                specs = _ask(all_runs, task)
                if specs:
                    blocked[task] = set(specs)
                for s in specs:
                    waiters.setdefault(s, []).append(task)
                    if s not in queued:
                        queued.add(s)
                        todo.append(s)

    try:
        ask(_tasks(p, all_runs))
        while todo or running:
            while todo and len(running) <= jobs:
                s = _next_spec(todo, list(running.values()), seconds)
                todo.remove(s)
                running[pool.submit(_run_spec, (s, sens, p.reads_policy, p.reads_kinds))] = s
            done, _ = wait(list(running), timeout=max(0.0, end - time.monotonic()), return_when=FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"{paper}: {len(running)} of {len(queued)} simulations did not finish within "
                                   f"{POOL_DEADLINE_S:.0f} s")
            unblocked: list[Task] = []
            for fut in done:
                del running[fut]
                spec, r, secs = fut.result()
                seconds.setdefault(spec.kind, secs)
                by_seed[spec.seed].cache[spec] = r
                finished += 1
                if progress is not None:
                    progress(f"{finished}/{len(queued)} simulations done ({spec.preset}, seed {spec.seed}; "
                             f"{time.monotonic() - t0:.0f} s)")
                for task in waiters.pop(spec, []):
                    blocked[task].discard(spec)
                    if not blocked[task]:
                        del blocked[task]
                        unblocked.append(task)
            ask(unblocked)      # each row whose runs are all back: computed again, its further reads queued
    except BaseException:
        for proc in list((getattr(pool, "_processes", None) or {}).values()):   # no public way to stop a
            proc.kill()                                                          # running task
        raise
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def summary(row: Row, values: list[Any]) -> tuple[str, bool | None, float | None]:
    """(what the table prints, hit or not (None: not counted), the mean) for a row's per-seed values."""
    bad = next((v for v in values if isinstance(v, str)), None)
    if bad is not None:
        return bad, False, None
    if any(v is None for v in values):
        return NA, False, None
    mean = statistics.fmean(values)
    if row.kind == ARITHMETIC:
        return f"{row.fmt.format(mean)} (arithmetic)", None, mean
    text = row.fmt.format(mean)
    if len(values) > 1 and not all(math.isclose(v, values[0]) for v in values):
        text += f" [{row.fmt.format(min(values))}, {row.fmt.format(max(values))}]"
    return text, judge(row, mean), mean


HIT, WEAK, MISS, HOLDS, FAILS, NOT_COUNTED = "hit", "weak", "miss", "bound holds", "bound fails", "not counted"


@dataclass
class Verdict:
    """A row's place in the accounting: `status` (HIT, WEAK, MISS; HOLDS or FAILS for a bound row; NOT_COUNTED for
    an arithmetic row), what the table's hit column prints, and for a weak hit why ("edge", "compensating",
    "caveat")."""
    text: str
    status: str
    mark: str
    why: str = ""


def verdicts(rows: list[Row], per_row: list[list[Any]]) -> list[Verdict]:
    """Every row's verdict (module docstring): the hit rule with each judged row's margin, and weak hits (edge,
    compensating: a `parts` row misses, caveat) apart from the solid ones. Raises ValueError when a row's `parts`
    names no row of the paper."""
    figures = {row.figure for row in rows}
    for row in rows:
        unknown = [p for p in row.parts if p not in figures]
        if unknown:
            raise ValueError(f"row {row.figure!r}: parts name no row of the paper: {unknown}")
    judged = [summary(row, values) for row, values in zip(rows, per_row)]
    hit_of = {row.figure: ok for row, (_, ok, _) in zip(rows, judged)}
    out = []
    for row, (text, ok, mean) in zip(rows, judged):
        if ok is None:
            out.append(Verdict(text, NOT_COUNTED, "n/a"))
            continue
        m = f" ({margin(row, mean):+.0%})" if mean is not None else ""
        if row.kind == BOUND:
            out.append(Verdict(text, HOLDS if ok else FAILS, ("holds" if ok else "fails") + m + ", bound"))
            continue
        if not ok:
            out.append(Verdict(text, MISS, "no" + m))
            continue
        missed = [p for p in row.parts if not hit_of[p]]
        why = ("edge" if margin(row, mean) < EDGE else
               "compensating" if missed else
               "caveat" if row.caveat else "")
        if not why:
            out.append(Verdict(text, HIT, "yes" + m))
            continue
        detail = {"edge": "edge", "compensating": f"compensating: {'; '.join(missed)} miss",
                  "caveat": row.caveat}[why]
        out.append(Verdict(text, WEAK, f"weak{m}: {detail}", why))
    return out


def count_line(paper: str, rows: list[Row], vs: list[Verdict]) -> str:
    """The command's last line: solid hits over the counted rows, weak hits by reason, bound rows and arithmetic
    rows apart."""
    counted = [v for row, v in zip(rows, vs) if row.kind in (LEVEL, SPEEDUP)]
    solid = sum(v.status == HIT for v in counted)
    weak = [v.why for v in counted if v.status == WEAK]
    line = f"{paper}: {solid}/{len(counted)} headline figures within 20%"
    if weak:
        reasons = ", ".join(f"{weak.count(w)} {w}" for w in ("edge", "compensating", "caveat") if w in weak)
        line += f", {len(weak)} more weak ({reasons})"
    bounds = [v for row, v in zip(rows, vs) if row.kind == BOUND]
    if bounds:
        line += (f"; {sum(v.status == HOLDS for v in bounds)}/{len(bounds)} bound row{'s' * (len(bounds) != 1)} "
                 "hold, not counted")
    arith = sum(row.kind == ARITHMETIC for row in rows)
    if arith:
        line += f"; {arith} arithmetic row{'s' * (arith != 1)} not counted"
    return line


def default_jobs() -> int:
    """A worker per core (at least 2): the pool's tasks are single simulations, so more cores finish sooner."""
    return max(2, os.cpu_count() or 1)
