"""RunList: a read-only list stored as runs of equal values, for the fake token ids, logprobs and per-token versions
of simulated trajectories. A thousand-prompt round of 8 samples x 16k tokens would otherwise hold hundreds of
millions of list slots; here each trajectory costs a few runs and still has the simulated length, indexes, iterates
(at C speed, so `min(traj.versions)` stays cheap) and compares equal to the plain list it stands for.
"""
from __future__ import annotations

import bisect
import itertools
from typing import Any, Iterable, Iterator

from rl.types import RunLengthSequence

FAKE_TOKEN, FAKE_LOGPROB = 7, -1.0   # every simulated response token's id and behaviour log-probability


class RunList(RunLengthSequence):
    __slots__ = ("_runs", "_len", "_ends")

    def __init__(self, runs: Iterable[tuple[Any, int] | list]):
        self._runs = tuple((v, int(c)) for v, c in runs if int(c) > 0)
        self._len = sum(c for _, c in self._runs)
        self._ends: list[int] | None = None

    @classmethod
    def of(cls, value: Any, n: int) -> "RunList":
        return _trusted(((value, n),) if n > 0 else (), max(0, n))

    def __reduce__(self) -> tuple:
        """Pickled as its runs (a reproduction's pool ships ~300k of them per large run): 3x faster to load than
        the slots-state default (a module function, which pickle writes once, not a bound method per object)."""
        return _trusted, (self._runs, self._len)

    @property
    def runs(self) -> tuple[tuple[Any, int], ...]:
        return self._runs

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            return list(self)[i]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("RunList index out of range")
        if self._ends is None:
            self._ends = list(itertools.accumulate(c for _, c in self._runs))
        return self._runs[bisect.bisect_right(self._ends, i)][0]

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain.from_iterable(itertools.repeat(v, c) for v, c in self._runs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RunList):
            return self._runs == other._runs
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    def __repr__(self) -> str:
        return f"RunList({list(self._runs)!r})"

    def tolist(self) -> list[Any]:
        return list(self)


def _trusted(runs: tuple[tuple[Any, int], ...], n: int) -> RunList:
    """A RunList from runs already in canonical form (positive int counts summing to n): no validation pass."""
    out = RunList.__new__(RunList)
    out._runs, out._len, out._ends = runs, n, None
    return out


trusted_runs = _trusted

_FAKES: dict[tuple[Any, int], RunList] = {}


def fake_run(value: Any, n: int) -> RunList:
    """RunList.of(value, n) for FAKE_TOKEN or FAKE_LOGPROB, one shared object per (value, length): every simulated
    trajectory carries two of them (~10^5 a run), and a RunList is read-only."""
    out = _FAKES.get((value, n))
    if out is None:
        if value not in (FAKE_TOKEN, FAKE_LOGPROB):
            raise ValueError(f"fake_run is for FAKE_TOKEN and FAKE_LOGPROB, not {value!r}")
        out = _FAKES[value, n] = RunList.of(value, n)
    return out


def partial_chunk(done: int, runs: list[list[int]], version: int, k: int) -> tuple[int, RunList, RunList, RunList]:
    """A request's whole trajectory so far as a partial-response pool chunk (sched/partials.py): `done` settled
    tokens under the version runs `runs`, plus `k` lazy ones under `version`; start 0, run-length."""
    vs = [(v, c) for v, c in runs]
    if k:
        if vs and vs[-1][0] == version:
            vs[-1] = (version, vs[-1][1] + k)
        else:
            vs.append((version, k))
    n = done + k
    return 0, _trusted(((FAKE_TOKEN, n),), n), _trusted(((FAKE_LOGPROB, n),), n), _trusted(tuple(vs), n)
