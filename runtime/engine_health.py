"""Engine-fault isolation on a rollout rank (Laminar §3.3), when the preset's mechanisms isolate engine faults
(Preset.failures_isolated; never in colocated mode, where the rank is a trainer shard too).

The counters carry each request's new tokens (payload `partials`) to the controller's partial-response pool
(sched/partials.py). An exception in the engine's step (an allocation failure included) or non-finite logits fail the
engine, not the rank: it drops everything it held, reports `engine_failed` (with what it held) and voids the Starts
and LoadWeights that arrive until the controller's ResetEngine; it then rebuilds (weights that are not finite
reloaded from the relay) and reports `engine_recovered`. Publications and KV transfers go on throughout, so no peer
waits for it. Past `failures_isolated` failures, or when a rebuild fails, the engine is retired and the run goes on
without it. Test fault injection's `fail` (runtime/faults.py) raises inside the engine step, as a real failure would.

Invariant kept: what a failed engine held is reported once, and nothing the controller sent before it heard of the
failure enters the engine.
"""
from __future__ import annotations

import sys
import time
from enum import Enum
from typing import Callable

from engine.engine import LLMEngine
from engine.sequence import RequestOutput
from runtime.faults import injected_engine_fault
from runtime.kv_migration import KVMigration
from runtime.messages import Start
from runtime.relay import Relay
from sched.decisions import LoadWeights, ResetEngine


class Health(str, Enum):
    """The engine's state under fault isolation (the module docstring)."""
    OK = "ok"                 # it runs
    FAILED = "failed"         # its step failed; reported; what the controller sent before it heard is void here
    REBUILDING = "rebuilding"  # the controller took its requests back (ResetEngine): it rebuilds, then rejoins


class EngineHealth:
    """One engine's fault state (`state`, `failures`, `retired`) and what isolating a failure does: `check` each
    engine step, `fail`, `void` the messages sent before the controller heard, `rebuild`, and the `partials`
    streamed to the controller's pool. `isolated` = 0: a failure ends the run."""

    def __init__(self, engine: LLMEngine, relay: Relay, kv: KVMigration, *, rank: int, engine_index: int,
                 isolated: int, event: Callable[..., None], flush: Callable[[], None]):
        self.engine, self.relay, self.kv, self.rank, self.engine_index = engine, relay, kv, rank, engine_index
        self.event, self.flush = event, flush
        self.isolated = isolated                       # engine failures survived (0: a failure ends the run)
        self.state = Health.OK
        self.failures = 0
        self.retired = False                           # failed more often than isolated: never rejoins
        self.failed_at = self.down_until = 0.0         # perf_counter of the failure; no rebuild before
        self.streamed: dict[int, int] = {}             # req_id -> tokens the controller's pool holds

    @property
    def ok(self) -> bool:
        return self.state is Health.OK

    @property
    def rebuild_due(self) -> bool:
        """The controller took the engine's requests back and the engine is not retired: it rebuilds."""
        return self.state is Health.REBUILDING and not self.retired

    def check(self, finished: list[RequestOutput]) -> None:
        """After an engine step: raise the engine failure a fault injection made due, and, when isolating, one for
        non-finite logits (a request that finished with `error`)."""
        injected = injected_engine_fault()   # runtime/faults.py `fail`
        if injected is not None:
            raise injected
        bad = [o.request_id for o in finished if o.finish_reason == "error"]
        if bad and self.isolated:
            raise FloatingPointError(f"non-finite logits for request(s) {bad[:4]}: the engine's state is not finite")

    def void(self, msg: Start | LoadWeights | ResetEngine) -> None:
        """A Start or LoadWeights the controller sent before it heard of the failure is void (it takes those
        requests back itself); a KV transfer such a Start announced is still received (its sender waits for it)
        and dropped. ResetEngine: from now on the controller knows, and the engine may rebuild."""
        if isinstance(msg, ResetEngine):
            self.state = Health.REBUILDING
            return
        if self.state is Health.REBUILDING:
            raise RuntimeError(f"rank {self.rank}: sent {type(msg).__name__} while its engine is failed and the "
                               f"controller knows it")
        if isinstance(msg, Start):
            for req in msg.requests:
                src = req.partial.meta.get("kv_rank") if req.partial is not None else None
                if src is not None and src != self.rank:
                    self.kv.expect_void(req.req_id, src)

    def fail(self, err: Exception, finished: list[RequestOutput]) -> dict[int, int]:
        """Isolate a failed engine step: drop everything the engine held (its state cannot be trusted after a
        failed step), report what it held (`engine_failed`; the controller resumes those requests from the
        partial-response pool) and take no work until the controller says it took them back (ResetEngine). Past
        `isolated` failures the engine is retired. Returns what it held: tokens by request id."""
        held = {rid: s.num_generated for rid, s in self.engine.seqs.items()}
        held.update({o.request_id: len(o.token_ids) for o in finished})
        held.update(self.kv.void_incoming())
        self.engine.reset()
        self.streamed.clear()
        self.kv.out.clear()
        self.failures += 1
        self.retired = self.failures > self.isolated
        self.state = Health.FAILED
        self.failed_at = time.perf_counter()
        self.down_until = self.failed_at + getattr(err, "down_s", 0.0)
        error = f"{type(err).__name__}: {err}"
        print(f"rank {self.rank}: engine {self.engine_index} failed ({error}); {len(held)} requests taken back"
              + (", retired" if self.retired else ", rebuilding"), file=sys.stderr, flush=True)
        self.event("engine_failed", version=self.engine.version,
                   data={"error": error, "held": held, "permanent": self.retired, "failures": self.failures})
        return held

    def rebuild(self) -> None:
        """Rebuild a failed engine and rejoin (`engine_recovered`): its pool is fresh (reset at the failure, and
        nothing entered it since: Starts are void until ResetEngine); weights that are not finite are reloaded from
        the relay. A rebuild that fails retires the engine (§3.3: the fault persists)."""
        if time.perf_counter() < self.down_until:
            return
        reloaded = False
        try:
            if not self.engine.weights_finite():
                self.relay.take(wait=True)
                if self.relay.version < 0:
                    raise RuntimeError("its weights are not finite and its relay holds none")
                self.engine.load_weights(self.relay.tensors.items(), self.relay.version)
                reloaded = True
                if not self.engine.weights_finite():
                    raise RuntimeError(f"the relay's weights (v{self.relay.version}) are not finite either")
        except Exception as err:
            self.retired = True
            self.event("engine_failed", version=self.engine.version,
                       data={"error": f"rebuild failed: {type(err).__name__}: {err}", "held": {}, "permanent": True,
                             "failures": self.failures})
            self.flush()
            return
        self.state = Health.OK
        self.event("engine_recovered", version=self.engine.version,
                   data={"down_s": time.perf_counter() - self.failed_at, "reloaded": reloaded})
        self.flush()

    def partials(self) -> dict[int, tuple]:
        """Each request's tokens since the last stream, for the controller's partial-response pool (sched/partials.py):
        (start index, ids, behaviour log-probs, per-token versions), and a multi-turn request's loss mask over them."""
        out, streamed = {}, {}
        for rid, s in self.engine.seqs.items():
            k, n = self.streamed.get(rid, 0), s.num_generated
            if n > k:
                out[rid] = (k, s.token_ids[s.num_prompt_tokens + k:], s.logprobs[k:], s.versions[k:])
                if s.request.multi_turn:
                    out[rid] += (s.mask()[k:],)
            streamed[rid] = n
        self.streamed = streamed
        return out
