"""StaleFlow's staleness buffers (sched/policies/staleflow/buffers.py): the paper's worked example, each operation,
and random reserve / join / complete / remove / consume schedules that must never break V_traj + eta >= V_buf."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sched.policies.staleflow.buffers import READY, STUCK, WAITING, NotAdmissible, StalenessBuffers


def test_reserve_is_worst_case_and_occupy_is_greedy():
    sb = StalenessBuffers(eta=1, batch=2)
    assert sb.reserve(10, 0) == 1 and sb.reserve(11, 0) == 1       # latest buffer first (V_traj + eta)
    assert sb.reserve(12, 0) == 0 and sb.reserve(13, 0) == 0
    assert not sb.can_assign(0)                                     # both buffers of its window are full
    with pytest.raises(NotAdmissible):
        sb.reserve(14, 0)
    assert sb.state(0) == STUCK and sb.state(1) == STUCK
    # group 10 (buffer 1) finishes first: it moves to the earliest empty slot, the earliest reserved entry
    # of buffer 0 (group 12) moves up into its place
    assert sb.complete(10) == 0
    assert sb.where(12) == 1 and sb.where(10) == 0
    sb.check()
    assert sb.complete(13) == 0 and sb.state(0) == READY and sb.next_ready()
    assert sb.consume() == [10, 13]                                 # slot order
    assert sb.v_next == 1
    assert sb.can_assign(1) and sb.reserve(14, 1) == 2              # window 1..2
    sb.check()


def test_fig7_shape_stuck_buffer_blocks_old_version_but_not_new():
    sb = StalenessBuffers(eta=1, batch=3)
    for k in range(6):
        sb.reserve(k, 0)                      # fills buffers 1 then 0 with version-0 groups
    assert sb.state(0) == STUCK and not sb.can_assign(0)
    with pytest.raises(ValueError):
        sb.reserve(9, 1)                      # version 1 cannot exist before buffer 0 is consumed
    for k in (3, 4, 5):
        sb.complete(k)
    assert sb.next_ready() and sorted(sb.consume()) == [3, 4, 5]
    assert sb.can_assign(1) and sb.admits(0, 0) and sb.where(0) == 1  # group 0 still reserved in buffer 1
    assert sb.reserve(6, 1) == 2


def test_a_later_member_joins_only_within_its_groups_buffer_window():
    sb = StalenessBuffers(eta=2, batch=1, v_next=3)
    assert sb.reserve(7, 3) == 5
    assert sb.admits(7, 3) and not sb.admits(7, 2)  # 2 + 2 < 5
    with pytest.raises(NotAdmissible):
        sb.join(7, 2)
    sb.join(7, 3)
    assert sb.entry(7).v == 3
    sb.complete(7)
    assert sb.where(7) == 3 and not sb.admits(7, 3)   # occupied: no more members


def test_remove_moves_occupied_entries_forward_and_consume_needs_ready():
    sb = StalenessBuffers(eta=1, batch=1, v_next=1)
    assert sb.reserve(1, 1) == 2 and sb.reserve(2, 0) == 1
    sb.complete(1)            # group 2 (version 0) may not move up to buffer 2, buffer 1 is full: 1 stays in 2
    assert sb.where(1) == 2 and sb.state(1) == STUCK and sb.state(2) == READY
    with pytest.raises(RuntimeError):
        sb.consume()          # only the oldest buffer, and only when Ready
    sb.remove(2)              # group 2 filtered: group 1 moves forward into buffer 1
    assert sb.where(1) == 1 and sb.next_ready() and sb.consume() == [1]
    assert sb.state(2) == WAITING and sb.live() == 0


def test_state_dict_round_trips():
    sb = StalenessBuffers(eta=2, batch=2, v_next=1)
    for k, v in ((1, 1), (2, 0), (3, 1)):
        sb.reserve(k, v)
    sb.complete(2)
    back = StalenessBuffers.from_state_dict(sb.state_dict())
    assert back.state_dict() == sb.state_dict()
    back.check()
    assert back.loc == sb.loc


OPS = st.lists(st.tuples(st.sampled_from(["reserve", "join", "complete", "remove", "consume"]),
                         st.integers(0, 10**6), st.integers(0, 3)), min_size=1, max_size=200)


@settings(max_examples=300, deadline=None)
@given(eta=st.integers(0, 3), batch=st.integers(1, 4), extra=st.sampled_from([0, 0, 1, 2]), ops=OPS)
def test_random_schedules_keep_the_staleness_bound(eta, batch, extra, ops):
    """Also with batch redundancy (`extra` spare entries): a buffer is Ready at `batch` occupied, its reserved
    entries are dropped as surplus at once, and exactly `batch` groups are consumed from it."""
    sb = StalenessBuffers(eta, batch, extra=extra)
    next_key, consumed = 0, []
    members: dict[int, int] = {}
    for op, pick, back in ops:
        v = max(0, sb.v_next - back)            # any version up to the newest that can exist
        reserved = [k for k, (b, i) in sb.loc.items() if not sb.buf[b][i].occupied]
        if op == "reserve":
            ok = sb.can_assign(v)
            try:
                b = sb.reserve(next_key, v)
                assert ok and v <= b <= v + eta
                members[next_key] = v
            except NotAdmissible:
                assert not ok
            next_key += 1
        elif op == "join" and reserved:
            k = reserved[pick % len(reserved)]
            if sb.admits(k, v):
                sb.join(k, v)
                members[k] = min(members[k], v)
            else:
                with pytest.raises(NotAdmissible):
                    sb.join(k, v)
        elif op == "complete" and reserved:
            sb.complete(reserved[pick % len(reserved)])
        elif op == "remove" and sb.loc:
            keys = sorted(sb.loc)
            k = keys[pick % len(keys)]
            sb.remove(k)
            members.pop(k)
        elif op == "consume":
            if sb.next_ready():
                version = sb.v_next
                keys = sb.consume()
                assert len(keys) == batch
                for k in keys:
                    assert members[k] + eta >= version >= members[k]   # staleness in [0, eta] at consumption
                    consumed.append((version, k))
            else:
                with pytest.raises(RuntimeError):
                    sb.consume()
        for k in sb.surplus:
            assert k not in sb.loc and extra > 0
            members.pop(k)
        sb.surplus.clear()
        sb.check()
        assert sb.live() <= (eta + 1) * (batch + extra)
        for k, (b, i) in sb.loc.items():
            assert sb.buf[b][i].v == members[k]
    assert [c[0] for c in consumed] == sorted(c[0] for c in consumed)   # in version order
    assert len({k for _, k in consumed}) == len(consumed)


@settings(max_examples=100, deadline=None)
@given(eta=st.integers(0, 3), batch=st.integers(1, 4), extra=st.sampled_from([0, 1, 3]), seed=st.integers(0, 10**6))
def test_a_saturating_schedule_always_makes_progress(eta, batch, extra, seed):
    """Reserve whatever the newest version admits, complete in random order, consume when Ready: the buffers
    never deadlock (every Stuck buffer clears once its reserved groups complete), spare entries or not."""
    import random
    rng = random.Random(seed)
    sb = StalenessBuffers(eta, batch, extra=extra)
    key = 0
    for _ in range(40):
        while sb.can_assign(sb.v_next):
            v = rng.randint(max(0, sb.v_next - eta), sb.v_next)
            sb.reserve(key, v if sb.can_assign(v) else sb.v_next)
            key += 1
        reserved = [k for k, (b, i) in sb.loc.items() if not sb.buf[b][i].occupied]
        rng.shuffle(reserved)
        for k in reserved[:rng.randint(1, max(1, len(reserved)))]:
            if k in sb.loc:                     # not dropped as surplus by an earlier completion
                sb.complete(k)
            sb.check()
        while sb.next_ready():
            sb.consume()
    assert sb.v_next >= 10
