"""StaleFlow's global consistency protocol (§4.2-4.3, Fig. 7-8): virtual staleness buffers, pure bookkeeping.

Buffer V_buf holds the `batch` entries trained as the model advances from V_buf to V_buf + 1. An entry is one GRPO
GROUP (§4.3: "Reserve/Occupy per group") carrying the group's version V = min over its members of V_traj (the
version of the engine a member was FIRST routed to, never changed by interrupts, partial rollout or migration).
A slot is empty, reserved (in flight) or occupied (all members generated and rewarded). Batch redundancy (Fig. 8b)
adds `extra` slots: the buffer is Ready at `batch` occupied, and its reserved entries are then dropped at once as
`surplus`, for the staleness manager to abort (aborts.py).

    can_assign(v)   the discriminator: a Reserve with V_traj = v would succeed (an empty slot in [v, v + eta])
    reserve(k, v)   worst-case Reserve: backward scan from V_buf = v + eta down to v, the LATEST empty slot
    admits(k, v)    a later member of reserved group k, routed at version v: v + eta >= the group's buffer
    join(k, v)      record it (the group's version becomes min(V, v))
    complete(k)     after reward of every member: delete the reserved entry, cascade the earliest reserved entry
                    that may live there into the hole ("keeps ready-to-use entries in earlier buffers while pushing
                    reserved entries toward later buffers"), then Occupy the EARLIEST empty slot
    remove(k)       filter / abort a group: its slot is refilled by moving occupied entries forward (§4.3)
    consume()       only a Ready buffer, only the oldest one (V_buf = v_next), in order

States: Waiting (an empty slot), Ready (`batch` occupied; it takes and holds no reservation), Stuck (full with a
reserved entry: training and more reservations wait for it). The paper leaves open a member routed after its
group's entry was reserved; ours joins only if its version still reaches the entry's buffer (`admits`), and the
group's version becomes the smaller of the two.

Invariants kept (`check`; random schedules in tests/sched/test_staleness.py):
    every entry in buffer b:  V + eta >= b  and  b >= V            (staleness b - V in [0, eta])
    buffers are consumed in version order, each only when Ready, with exactly `batch` occupied entries
    live entries <= (eta + 1) x (batch + extra): only buffers v_next .. v_next + eta hold entries (V_traj <= v_next)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WAITING, READY, STUCK = "waiting", "ready", "stuck"


class NotAdmissible(RuntimeError):
    """A Reserve (or a member joining a reserved group) that would break V_traj + eta >= V_buf."""


@dataclass
class Entry:
    key: int           # group id
    v: int             # the group's version: min V_traj of its members routed so far
    occupied: bool = False


class StalenessBuffers:
    def __init__(self, eta: int, batch: int, v_next: int = 0, extra: int = 0):
        if eta < 0 or batch < 1 or extra < 0:
            raise ValueError(f"staleness buffers need eta >= 0, batch >= 1 and extra >= 0, got {eta}, {batch} and "
                             f"{extra}")
        self.eta, self.batch, self.v_next, self.extra = eta, batch, v_next, extra
        self.buf: dict[int, list[Entry | None]] = {}
        self.loc: dict[int, tuple[int, int]] = {}
        self.n_occupied: dict[int, int] = {}   # buffer -> its occupied entries (kept with every Occupy and move)
        self.surplus: list[int] = []   # groups dropped from a buffer that became Ready (batch redundancy)

    # ---------------------------------------------------------------------------------------------- reading
    def slots(self, b: int) -> list[Entry | None]:
        if b not in self.buf:
            self.buf[b] = [None] * (self.batch + self.extra)
        return self.buf[b]

    def occupied(self, b: int) -> int:
        return self.n_occupied.get(b, 0)

    def state(self, b: int) -> str:
        s = self.buf.get(b)
        if s is not None and self.occupied(b) >= self.batch:
            return READY
        return STUCK if s is not None and all(e is not None for e in s) else WAITING

    def next_ready(self) -> bool:
        """Is the buffer the trainer consumes next (V_buf = v_next) Ready?"""
        return self.occupied(self.v_next) >= self.batch

    def entry(self, key: int) -> Entry | None:
        return self.buf[self.loc[key][0]][self.loc[key][1]] if key in self.loc else None

    def where(self, key: int) -> int | None:
        return self.loc[key][0] if key in self.loc else None

    def live(self) -> int:
        return len(self.loc)

    def window(self, v: int) -> range:
        """Buffers a trajectory of version v may train in, latest first, clipped to those not yet consumed."""
        return range(v + self.eta, max(v, self.v_next) - 1, -1)

    def _empty(self, b: int) -> int:
        s = self.buf.get(b)
        if s is None:
            return 0
        if self.extra and self.occupied(b) >= self.batch:
            return -1                                   # Ready: its spare slots take nothing more
        return next((i for i, e in enumerate(s) if e is None), -1)

    # ------------------------------------------------------------------------------------------ discriminator
    def can_assign(self, v: int) -> bool:
        """A simulated Reserve: would a new group of version v find an empty slot?"""
        return 0 <= v <= self.v_next and any(self._empty(b) >= 0 for b in self.window(v))

    def admits(self, key: int, v: int) -> bool:
        """May a member of group `key` be routed at version v? (A group not reserved yet: can_assign.)"""
        at = self.loc.get(key)
        if at is None:
            return self.can_assign(v)
        e = self.buf[at[0]][at[1]]
        return 0 <= v <= self.v_next and not e.occupied and v + self.eta >= at[0]  # type: ignore[union-attr]

    # ---------------------------------------------------------------------------------------------- tracker
    def reserve(self, key: int, v: int) -> int:
        if key in self.loc:
            raise ValueError(f"group {key} already holds an entry")
        if v < 0 or v > self.v_next:
            raise ValueError(f"version {v} is outside [0, {self.v_next}]: no newer version than the buffer being "
                             f"filled can exist")
        for b in self.window(v):
            i = self._empty(b)
            if i >= 0:
                self.slots(b)[i] = Entry(key, v)
                self.loc[key] = (b, i)
                return b
        raise NotAdmissible(f"no empty slot for version {v} in buffers {v}..{v + self.eta} (v_next {self.v_next})")

    def join(self, key: int, v: int) -> None:
        if key not in self.loc:
            self.reserve(key, v)
            return
        if not self.admits(key, v):
            raise NotAdmissible(f"group {key} in buffer {self.where(key)} cannot take a member of version {v} "
                                f"(eta {self.eta})")
        e = self.entry(key)
        e.v = min(e.v, v)  # type: ignore[union-attr]

    def complete(self, key: int) -> int:
        """Every member generated and rewarded: movement, then Occupy. Returns the buffer it now occupies."""
        hole_b, hole_i = self.loc.pop(key)
        e = self.buf[hole_b][hole_i]
        if e is None or e.occupied:
            raise ValueError(f"group {key} completed twice")
        self.buf[hole_b][hole_i] = None
        while (mover := self._earliest(lambda x, b: not x.occupied and x.v + self.eta >= hole_b, self.v_next,
                                       hole_b)) is not None:
            self._move(mover, (hole_b, hole_i))
            hole_b, hole_i = mover
        b = self.v_next
        while (i := self._empty(b)) < 0:
            b += 1
        assert b <= hole_b, "an empty slot at or before the final hole always exists"
        self.slots(b)[i] = Entry(key, e.v, occupied=True)
        self.loc[key] = (b, i)
        self.n_occupied[b] = self.n_occupied.get(b, 0) + 1
        self._trim(b)
        return b

    def remove(self, key: int) -> None:
        """Filter or abort group `key` (reserved or occupied); later occupied entries move forward into the hole."""
        hole_b, hole_i = self.loc.pop(key)
        if self.buf[hole_b][hole_i].occupied:  # type: ignore[union-attr]
            self.n_occupied[hole_b] -= 1
        self.buf[hole_b][hole_i] = None
        while (mover := self._earliest(lambda x, b: x.occupied, hole_b + 1, self.v_next + self.eta + 1)) is not None:
            self._move(mover, (hole_b, hole_i))
            self._trim(hole_b)
            hole_b, hole_i = mover

    def _trim(self, b: int) -> None:
        """Batch redundancy: once buffer b is Ready, its reserved entries are surplus (dropped, listed in `surplus`)."""
        if not self.extra or self.occupied(b) < self.batch:
            return
        s = self.buf[b]
        for i, e in enumerate(s):
            if e is not None and not e.occupied:
                s[i] = None
                del self.loc[e.key]
                self.surplus.append(e.key)

    def consume(self) -> list[int]:
        """Retire the Ready buffer v_next: its group ids, in slot order; afterwards they are no longer tracked."""
        if not self.next_ready():
            raise RuntimeError(f"buffer {self.v_next} consumed while {self.state(self.v_next)}")
        keys = [e.key for e in self.buf.pop(self.v_next) if e is not None]
        for k in keys:
            del self.loc[k]
        del self.n_occupied[self.v_next]
        self.v_next += 1
        return keys

    def _earliest(self, pred, lo: int, hi: int) -> tuple[int, int] | None:
        for b in range(lo, hi):
            for i, x in enumerate(self.buf.get(b, ())):
                if x is not None and pred(x, b):
                    return b, i
        return None

    def _move(self, src: tuple[int, int], dst: tuple[int, int]) -> None:
        x = self.buf[src[0]][src[1]]
        self.buf[src[0]][src[1]] = None
        self.slots(dst[0])[dst[1]] = x
        self.loc[x.key] = dst  # type: ignore[union-attr]
        if x.occupied:  # type: ignore[union-attr]
            self.n_occupied[src[0]] -= 1
            self.n_occupied[dst[0]] = self.n_occupied.get(dst[0], 0) + 1

    # ---------------------------------------------------------------------------------------------- checking
    def check(self) -> None:
        """Raise AssertionError if any invariant of the module docstring is broken."""
        n = 0
        for b, s in self.buf.items():
            assert len(s) == self.batch + self.extra, f"buffer {b} has {len(s)} slots"
            assert b >= self.v_next, f"buffer {b} is older than v_next {self.v_next}"
            occ = sum(e is not None and e.occupied for e in s)
            assert occ == self.occupied(b), f"buffer {b}: occupied count {self.occupied(b)} is not its {occ} entries"
            assert occ <= self.batch, f"buffer {b} holds {occ} occupied entries > batch {self.batch}"
            assert occ < self.batch or all(e is None or e.occupied for e in s), f"Ready buffer {b} holds a reservation"
            for i, e in enumerate(s):
                if e is None:
                    continue
                n += 1
                assert self.loc.get(e.key) == (b, i), f"group {e.key} misplaced"
                assert e.v + self.eta >= b >= e.v, f"group {e.key} (version {e.v}) in buffer {b}, eta {self.eta}"
        assert n == len(self.loc), "location index out of step"
        assert n <= (self.eta + 1) * (self.batch + self.extra), f"{n} live entries > (eta + 1) x slots"

    def copy(self) -> "StalenessBuffers":
        c = StalenessBuffers(self.eta, self.batch, self.v_next, self.extra)
        c.buf = {b: [None if e is None else Entry(e.key, e.v, e.occupied) for e in s] for b, s in self.buf.items()}
        c.loc = dict(self.loc)
        c.n_occupied = dict(self.n_occupied)
        return c

    def state_dict(self) -> dict[str, Any]:
        return {"eta": self.eta, "batch": self.batch, "v_next": self.v_next, "extra": self.extra,
                "buf": {str(b): [None if e is None else [e.key, e.v, e.occupied] for e in s]
                        for b, s in self.buf.items()}}

    @classmethod
    def from_state_dict(cls, d: dict[str, Any]) -> "StalenessBuffers":
        sb = cls(int(d["eta"]), int(d["batch"]), int(d["v_next"]), int(d.get("extra", 0)))
        for b, s in d["buf"].items():
            sb.buf[int(b)] = [None if x is None else Entry(int(x[0]), int(x[1]), bool(x[2])) for x in s]
            for i, x in enumerate(s):
                if x is not None:
                    sb.loc[int(x[0])] = (int(b), i)
            sb.n_occupied[int(b)] = sum(x is not None and bool(x[2]) for x in s)
        return sb
