"""The reproduction framework: settings, memoised runs, rows, the hit rule, several seeds, the CLI's table.

A paper is a `Paper`: its rows (`Row`: a figure, the paper's value or range, how we compute ours from simulations),
the components its reproduction simulates and those it does not, and the notes it prints (what the simulator chose:
a GPU split, a ranker's measured recall). Every simulated row runs on several seeds; the table shows the mean and the
spread, and the hit is judged on the mean.

The hit rule (sim/README.md, "The hit rule"):
- a row is a hit when our mean lies within 20% of the paper's range: in [0.8 lo, 1.2 hi] (a point value is a range
  of one; "< x" is (0, x]);
- a speedup row (kind SPEEDUP) counts only if our gain is at least half the paper's smallest gain as well:
  ours - 1 >= (lo - 1) / 2, so 1.00x against 1.12-2.12x is a miss, not a hit;
- an arithmetic row (kind ARITHMETIC: a closed-form figure, not a simulation) is printed, labelled, and not counted.
"""
from __future__ import annotations

import math
import multiprocessing
import statistics
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

import sched
from rl.reward_timeout import AdaptiveTimeout
from sim.run import SimResult, simulate

NA = "policy not available yet"
LEVEL, SPEEDUP, ARITHMETIC = "level", "speedup", "arithmetic"


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


class Runs:
    """Memoised simulations of one seed: (preset or (preset, overrides), setting) -> SimResult; `memo` for any other
    seeded computation a row shares with another (a profile of generation times, a chosen split)."""

    def __init__(self, seed: int):
        self.seed, self.cache = seed, {}

    def get(self, preset: str, s: Setting, overrides: tuple = ()) -> SimResult | None:
        """None when the preset does not exist; raises what the simulation raised."""
        if not (sched.PRESET_DIR / f"{preset}.toml").is_file():
            return None
        key = (preset, overrides, s)
        if key not in self.cache:
            policy = sched.load_preset(preset, {k: dict(v) for k, v in overrides})
            self.cache[key] = simulate(policy, s.workload, s.cost, s.num_engines, s.train_gpus, steps=10**9,
                                       group_size=s.group_size, prompts_per_step=s.prompts, seed=self.seed,
                                       colocated=s.colocated, samples=s.rounds * s.prompts * s.group_size,
                                       **sim_kwargs(s))
            self.cache[key].preset = preset
        return self.cache[key]

    def memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        if key not in self.cache:
            self.cache[key] = fn()
        return self.cache[key]


@dataclass
class Row:
    figure: str
    paper: tuple[float, float]
    paper_text: str
    compute: Callable[[Runs], float | None]   # None: a needed preset does not exist
    fmt: str = "{:.1%}"
    kind: str = LEVEL                         # LEVEL | SPEEDUP | ARITHMETIC
    setting: str = ""                         # what this row's runs simulate (components), beside the figure


@dataclass
class Paper:
    rows: list[Row]
    components: str = ""                      # what the reproduction simulates, and what it does not
    notes: list[Callable[[Runs], str]] = field(default_factory=list)   # printed from the first seed's runs
    seeds: int = 3                            # default number of seeds (0, 1, ...)


def judge(row: Row, value: float) -> bool | None:
    """The hit rule (module docstring); None for an arithmetic row (not counted)."""
    if row.kind == ARITHMETIC:
        return None
    lo, hi = row.paper
    ok = 0.8 * lo <= value <= 1.2 * hi
    if row.kind == SPEEDUP:
        ok = ok and value - 1 >= 0.5 * (lo - 1)
    return ok


# ------------------------------------------------------------------------------------------------- evaluation


def row_values(rows: list[Row], runs: Runs) -> list[Any]:
    out: list[Any] = []
    for row in rows:
        try:
            v = row.compute(runs)
            out.append(None if v is None else float(v))
        except Exception as e:  # a failing run is a miss, shown with its error
            out.append(f"failed: {type(e).__name__}: {e}"[:120])
    return out


def _seed_job(paper: str, seed: int, with_notes: bool, train_speed: float) -> tuple[list[Any], list[str]]:
    from sim.repro import PAPERS
    with _training_speed(train_speed):
        p = PAPERS[paper]
        runs = Runs(seed)
        values = row_values(p.rows, runs)
        notes = []
        if with_notes:
            for note in p.notes:
                try:
                    notes.append(note(runs))
                except Exception as e:
                    notes.append(f"note failed: {type(e).__name__}: {e}"[:160])
        return values, notes


class _training_speed:
    """Every cost profile trains `factor` times faster per token while in the block (the --train-speed
    sensitivity), restored on exit."""

    def __init__(self, factor: float):
        self.factor = factor

    def __enter__(self) -> None:
        from dataclasses import replace
        from sim.profiles import PROFILES
        self.saved = dict(PROFILES)
        if self.factor != 1.0:
            for name, c in self.saved.items():
                PROFILES[name] = replace(c, train_s_per_token=c.train_s_per_token / self.factor)

    def __exit__(self, *exc: Any) -> None:
        from sim.profiles import PROFILES
        PROFILES.clear()
        PROFILES.update(self.saved)


def evaluate(paper: str, seeds: list[int], jobs: int, train_speed: float = 1.0
             ) -> tuple[list[list[Any]], list[str]]:
    """Every row on every seed (seeds in parallel processes when jobs > 1): per row its values by seed, and the
    notes from the first seed."""
    if jobs <= 1 or len(seeds) <= 1:
        results = [_seed_job(paper, s, i == 0, train_speed) for i, s in enumerate(seeds)]
    else:
        ctx = multiprocessing.get_context("fork")
        with ProcessPoolExecutor(max_workers=min(jobs, len(seeds)), mp_context=ctx) as pool:
            futs = [pool.submit(_seed_job, paper, s, i == 0, train_speed) for i, s in enumerate(seeds)]
            results = [f.result() for f in futs]
    per_row = [[vals[i] for vals, _ in results] for i in range(len(results[0][0]))]
    return per_row, results[0][1]


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


def default_jobs() -> int:
    """One process per default seed (3), whatever the cores: the OS shares them, and the last seed does not run
    alone after the others."""
    return 3
