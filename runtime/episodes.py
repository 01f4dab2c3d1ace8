"""A rollout rank's multi-turn episodes (rl/env.py): what happens between a model turn and the next.

The engine holds a multi-turn request when a turn stops (engine/turns.py) and the worker hands its output here
(`turn_ended`). The environment reads the turn's text (`Environment.act`): no call, or `max_turns` turns done, and
the episode is over (the engine ends the request; the worker reports its one `trajectory_finished`). A call emits
`tool_started` and runs `Environment.run` on a thread of this rank's tool pool, beside decoding. `poll` (every
loop of the worker) takes the calls that returned or are past their deadline (`timeout_s` after the call was
made): each emits `tool_finished`, and its observation (a timeout or an exception is a failed one, whose text says
so; a timed-out thread is abandoned, whatever it returns later is ignored) is tokenised and appended to the
request (`LLMEngine.extend`), whose next turn then decodes on the KV it kept. An observation that leaves no room
under the response's token cap ends the episode ("length"). An environment whose own code raises (in `act` or
`observation`) ends it with finish_reason "error".
In a deterministic run (`lockstep`: the run's `deterministic = true`) `poll` first waits, up to their deadlines,
for every call in flight, so each observation joins the decode at the first poll after its call started whatever
the tool threads' timing, and the same seed gives the same batches. Otherwise that timing decides at which step an
observation joins, hence which rows decode together (and, on a CPU whose matmul results depend on a batch's rows,
the run itself).

The transcript's turns, the call a turn makes and the tool thread's body are rl/episode.py's and rl/tools.py's
(`next_call`, `model_turns`, `call_tool`, `timeout_observation`). An episode's state is its transcript (the
request's tokens and mask) plus counters (`EpisodeStats`, carried in a
partial trajectory's meta): an interrupted, aborted or migrated request, or one on an engine that failed, forgets
its call in flight (`abandon`); resumed, it continues from its transcript (its turns: the sampled spans of its
mask), a turn that had ended acted on again (`resume_held`).
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from typing import Any, Callable

from engine.engine import LLMEngine
from engine.sequence import RequestId, RequestOutput
from rl.env import Environment, Observation, ToolCall
from rl.episode import model_turns, next_call
from rl.tools import call_tool, timeout_observation


@dataclass
class EpisodeStats:
    """What a trajectory's meta says about its episode, resumes included: the calls that returned (or timed out;
    a call abandoned by an interrupt is run again where the episode resumes, and counted there)."""
    tool_calls: int = 0
    tool_failures: int = 0
    tool_seconds: float = 0.0


@dataclass
class InFlight:
    """A tool call running on the pool."""
    future: Future
    call: ToolCall
    turn: int
    started: float     # perf_counter when it was submitted
    deadline: float    # perf_counter after which its observation is a timeout


def count_turns(token_ids: list[int], mask: list[int] | None) -> int:
    """The model turns in a transcript (rl/episode.py: the runs of mask 1)."""
    return len(model_turns(token_ids, mask))


def last_turn(token_ids: list[int], mask: list[int] | None) -> list[int]:
    """The tokens of a transcript's last model turn."""
    turns = model_turns(token_ids, mask)
    return turns[-1] if turns else []


class Episodes:
    """The rank's episodes between turns: their calls in flight on the tool pool and their counters. `event` emits
    the worker's events; `encode` / `decode` are the tokenizer's (text of a turn, tokens of an observation)."""

    def __init__(self, env: Environment, engine: LLMEngine, *, encode: Callable[[str], list[int]],
                 decode: Callable[[list[int]], str], event: Callable[..., None], tool_workers: int = 4,
                 lockstep: bool = False):
        if tool_workers < 1:
            raise ValueError(f"tool_workers must be >= 1, got {tool_workers}")
        self.env, self.engine, self.encode, self.decode, self.event = env, engine, encode, decode, event
        self.lockstep = lockstep
        self.pool = ThreadPoolExecutor(tool_workers, thread_name_prefix="tool")
        self.calls: dict[RequestId, InFlight] = {}
        self.stats: dict[RequestId, EpisodeStats] = {}
        self.errors: dict[RequestId, str] = {}   # episodes the environment's own code ended, and why

    @property
    def pending(self) -> bool:
        """Tool calls in flight (the worker polls instead of blocking on its channel)."""
        return bool(self.calls)

    def next_deadline_s(self) -> float:
        """Seconds until the earliest call in flight times out (0 when none is in flight)."""
        if not self.calls:
            return 0.0
        return max(0.0, min(c.deadline for c in self.calls.values()) - time.perf_counter())

    # ---- a turn ended ----------------------------------------------------------------------------------------
    def turn_ended(self, out: RequestOutput) -> RequestOutput | None:
        """A held request's turn ended: start its tool call (None), or end its episode (its final output)."""
        rid, turn = out.request_id, count_turns(out.token_ids, out.mask)
        self.stats.setdefault(rid, EpisodeStats())
        try:   # None: no call in the turn, or it was the max_turns-th
            call = next_call(self.env, self.decode, out.prompt_ids, out.token_ids, out.mask)
        except Exception as e:   # noqa: BLE001: the environment's bug ends this episode, not the rank
            return self._error(rid, f"act: {type(e).__name__}: {e}")
        if call is None:
            return self.engine.end(rid)
        now = time.perf_counter()
        self.calls[rid] = InFlight(self.pool.submit(call_tool, self.env, call), call, turn, now,
                                   now + float(self.env.timeout_s))
        self.event("tool_started", req_id=rid, group_id=out.group_id, data={"turn": turn, "tool": call.name})
        return None

    def resume_held(self, rid: RequestId, meta: dict[str, Any]) -> RequestOutput | None:
        """A request resumed from a partial whose last turn had ended (imported held): its counters from the
        partial's `meta`, and its turn acted on again."""
        self.stats[rid] = EpisodeStats(**{k: meta[k] for k in asdict(EpisodeStats()) if k in meta})
        return self.turn_ended(self.engine.seqs[rid].output())

    def resumed(self, rid: RequestId, meta: dict[str, Any]) -> None:
        """A request resumed mid-turn: its counters from the partial's `meta`."""
        self.stats[rid] = EpisodeStats(**{k: meta[k] for k in asdict(EpisodeStats()) if k in meta})

    # ---- calls returning -------------------------------------------------------------------------------------
    def poll(self) -> list[RequestOutput]:
        """Take the calls that returned or timed out: each observation appended to its request (queued to decode
        on), or its episode ended when it does not fit. Returns the episodes that ended."""
        ended = []
        if self.lockstep and self.calls:   # every call's observation at this poll, or its timeout
            last = max(c.deadline for c in self.calls.values())
            wait([c.future for c in self.calls.values()], timeout=max(0.0, last - time.perf_counter()))
        now = time.perf_counter()
        for rid, c in list(self.calls.items()):
            if c.future.done():
                obs = c.future.result()
            elif now >= c.deadline:
                c.future.cancel()   # still queued: never runs; running: abandoned, its result ignored
                obs = timeout_observation(self.env)
            else:
                continue
            del self.calls[rid]
            out = self._observe(rid, c, obs, now)
            if out is not None:
                ended.append(out)
        return ended

    def _observe(self, rid: RequestId, c: InFlight, obs: Observation, now: float) -> RequestOutput | None:
        seconds = now - c.started
        stats = self.stats[rid]
        stats.tool_calls += 1
        stats.tool_failures += obs.failed
        stats.tool_seconds += seconds
        seq = self.engine.seqs[rid]
        self.event("tool_finished", req_id=rid, group_id=seq.request.group_id,
                   data={"turn": c.turn, "seconds": round(seconds, 6), "failed": bool(obs.failed)})
        try:
            ids = self.encode(self.env.observation(obs))
            if not ids:
                raise ValueError(f"observation {obs.text[:40]!r} tokenizes to no tokens")
        except Exception as e:   # noqa: BLE001
            return self._error(rid, f"observation: {type(e).__name__}: {e}")
        if len(ids) > self.engine.room(rid):   # the response's token cap
            return self.engine.end(rid, "length")
        self.engine.extend(rid, ids)
        return None

    def _error(self, rid: RequestId, why: str) -> RequestOutput:
        self.errors[rid] = why
        return self.engine.end(rid, "error")

    # ---- leaving -------------------------------------------------------------------------------------------------
    def meta(self, rid: RequestId, done: bool = True) -> dict[str, Any]:
        """The episode's counters for its trajectory's meta (`done`: it left this rank, forgotten here)."""
        stats = self.stats.pop(rid, None) if done else self.stats.get(rid)
        error = self.errors.pop(rid, None) if done else self.errors.get(rid)
        return {**asdict(stats or EpisodeStats()), **({"env_error": error} if error else {})}

    def abandon(self, rid: RequestId) -> None:
        """The request left the engine (interrupt, abort, migration, engine failure): its call in flight, if any,
        is abandoned (its result ignored)."""
        c = self.calls.pop(rid, None)
        if c is not None:
            c.future.cancel()

    def clear(self) -> None:
        """Every episode gone (the engine was reset)."""
        for rid in list(self.calls):
            self.abandon(rid)
        self.stats.clear()
        self.errors.clear()

    def close(self) -> None:
        """Abandon the calls in flight; never waits for a tool thread."""
        self.clear()
        self.pool.shutdown(wait=False, cancel_futures=True)
