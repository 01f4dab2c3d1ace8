"""The elastic rollout pool: the decisions that change which engines roll out, and how many there are. The request
lifecycle (sched/lifecycle.py) holds one `EnginePool` as `Lifecycle.pool`; the controller performs `LendEngines` /
`ReturnEngines` / `AddEngines` / `Reshard` (sched/decisions.py) through it, and it writes the views' `engines`
(their `lent` flags, new `EngineView`s) and `tp`, nothing else.

Only on a backend that says `elastic` (the simulator: sim/backend.py):
- lend: engines leave rollout for the trainer (RollPacker §4.4's elastic scale-down); a lent engine takes no request
  until it is back (`give_back`), and holds nothing but requests on their way out when it leaves; at least one engine
  stays in rollout.
- add_engines: new engines join rollout, ids after the last (StreamRL §4.2's scale-out).
- reshard: the pool rebuilt at another tensor-parallel size on the same GPUs, engines 0..n-1 (RollPacker §4.2's
  planner); only with nothing in flight, waiting, lent or loading.
An added or resharded engine joins with no weights and takes no request before its first `weights_loaded`
(`Lifecycle.admit` refuses it). Each change is logged (`engines_lent`, `engines_added`, `engines_resharded`).
"""
from __future__ import annotations

from typing import Callable

from sched.base import InvariantError
from sched.decisions import AddEngines, LendEngines, Reshard, ReturnEngines
from sched.events import Event
from sched.resources import EngineView
from sched.views import RequestState, Views

S = RequestState


class EnginePool:
    def __init__(self, v: Views, emit: Callable[[Event], None]):
        self.v, self.emit = v, emit

    def lend(self, cmd: LendEngines) -> None:
        """Engines leave rollout for the trainer: each must hold nothing but requests on their way out (being
        interrupted or migrated away, or aborted), and at least one engine stays in rollout."""
        v = self.v
        if not v.elastic:
            raise InvariantError("LendEngines on a backend that cannot lend engines to the trainer")
        out = set(cmd.engines)
        if any(not 0 <= i < len(v.engines) or v.engines[i].lent for i in out) or len(out) >= len(v.rollout_engines()):
            raise InvariantError(f"LendEngines {sorted(out)}: unknown or lent already, or no engine left in rollout")
        for r in v.requests.in_state(S.RUNNING, S.REQUEUEING):
            if r.engine in out:
                raise InvariantError(f"engine {r.engine} lent to the trainer while request {r.req_id} runs there")
        for i in out:
            v.engines[i].lent = True
        self.emit(Event("engines_lent", v.now, data={"engines": sorted(out), "lent": True}))

    def give_back(self, cmd: ReturnEngines) -> None:
        for i in cmd.engines:
            if not self.v.engines[i].lent:
                raise InvariantError(f"ReturnEngines: engine {i} is not lent")
            self.v.engines[i].lent = False
        self.emit(Event("engines_lent", self.v.now, data={"engines": sorted(cmd.engines), "lent": False}))

    def add_engines(self, cmd: AddEngines) -> None:
        """New engines join rollout (ids after the last), without weights yet."""
        v = self.v
        if not v.elastic or cmd.count < 1:
            raise InvariantError(f"AddEngines({cmd.count}) on a backend that cannot scale out, or nothing to add")
        new = list(range(len(v.engines), len(v.engines) + cmd.count))
        v.engines += [EngineView(engine=i) for i in new]
        self.emit(Event("engines_added", v.now, data={"engines": new}))

    def reshard(self, cmd: Reshard) -> None:
        """The pool rebuilt at TP cmd.tp on the same GPUs: new engines 0..n-1, without weights."""
        v = self.v
        gpus = len(v.engines) * v.tp
        if not v.elastic or cmd.tp not in v.tp_sizes or gpus % cmd.tp:
            raise InvariantError(f"Reshard(tp={cmd.tp}) of {gpus} rollout GPUs: the backend reshards only to "
                                 f"{v.tp_sizes}")
        if v.in_flight() or v.requests.count(S.PENDING) or any(e.lent or e.loading for e in v.engines):
            raise InvariantError(f"Reshard(tp={cmd.tp}) with requests in flight or waiting, or engines lent or "
                                 f"loading")
        v.engines = [EngineView(engine=i) for i in range(gpus // cmd.tp)]
        v.tp = cmd.tp
        self.emit(Event("engines_resharded", v.now, data={"tp": cmd.tp, "engines": len(v.engines)}))
