"""StaleFlow's routing strategy: Algorithm 3 (§5.3, App. D), the multi-level queue + waterfall + cost-model marginal
gain (Eq. 3-4), and its vanilla ablation (§6.5), both on a snapshot and the TS in MLQ order (store.py, whose
`routable` is Algorithm 2). Algorithm 1's line 16 calls the preset's one (algorithm1.py); Algorithm 4 calls it for a
tentative plan.

Alg. 3 in words: TS trajectories are taken in MLQ order (smaller V_traj first,
"higher staleness and thus higher routing priority"; initial trajectories of new groups last; FIFO within a queue).
For each, the candidates are the instances Alg. 2 admits, visited by ascending version ("instances with a smaller
version should be prioritized, as they admit fewer feasible routing options"); in each version group the one with
the largest marginal gain dT_i (Eq. 3) is chosen if dT_i >= mu x dT_ideal (Eq. 4); else the next group is tried, and
if none qualifies the trajectory and everything behind it is withheld until a later pass. Each route updates the
snapshot (S' of Eq. 3) and the staleness buffers (Reserve for a group's first member, join for later ones).

Invariant kept: a trajectory is routed only where Alg. 2 admits it, and its Reserve is committed before the next
trajectory is tried, so nothing routed lacks a buffer entry with V_traj + eta >= V_buf.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Callable

from sched.policies.staleflow.buffers import StalenessBuffers
from sched.policies.staleflow.cost import InstanceSnap, ThroughputModel
from sched.policies.staleflow.store import Item, commit, routable

# a routing strategy, as the design calls it: (snapshot, TS items, buffers, until=instance) -> [(instance, item)]
Route = Callable[..., list[tuple[int, Item]]]


def marginal_routes(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
                    model: ThroughputModel, mu: float, until: int | None = None) -> list[tuple[int, Item]]:
    """Alg. 3 on a snapshot (mutated copy) and buffers (mutated: pass a copy for a tentative plan). `until`: stop
    at the first trajectory routed to that instance (Alg. 4 only asks whether there is one)."""
    snaps = dict(snaps)
    # Alg. 2 per instance (routable()) depends only on the instance's version: candidates are grouped by version
    # (instances without weights or mid-Pull take nothing), and each trajectory asks once per distinct version.
    by_ver: dict[int, list[int]] = {}
    for e in sorted(snaps):
        if snaps[e].version >= 0 and not snaps[e].loading:
            by_ver.setdefault(snaps[e].version, []).append(e)
    versions = sorted(by_ver)
    out: list[tuple[int, Item]] = []
    for it in items:
        ok = [u for u in versions if routable(buffers, it, snaps[by_ver[u][0]])]
        if not ok:
            break                                   # head-of-line: lower queues wait for this one
        L = it.length
        floor = mu * model.ideal_gain(L)
        chosen = None
        for ver in ok:
            gain, best = model.best_gain([snaps[e] for e in by_ver[ver]], L)
            if gain >= floor and model.fits(best, L):
                chosen = best
                break
        if chosen is None:
            break                                   # withheld: no instance gains enough now
        commit(buffers, it, chosen.version)
        snaps[chosen.engine] = model.after_route(chosen, L)
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out


def fewest_routes(snaps: dict[int, InstanceSnap], items: Iterable[Item], buffers: StalenessBuffers,
                  until: int | None = None) -> list[tuple[int, Item]]:
    """The vanilla routing: each TS trajectory to the instance with the fewest trajectories. When that instance is
    mid-Pull, the Route waits for the Pull to land (§5.2), so the trajectory and the queue behind it wait for a
    later pass instead of piling onto the instances that already pulled (after a vanilla sync every instance pulls
    at once, and the first to land would otherwise take the whole store)."""
    load = {e: s.running + s.waiting for e, s in snaps.items()}
    # as in marginal_routes, Alg. 2 is asked once per distinct instance version (instances without weights or
    # mid-Pull take nothing)
    by_ver: dict[int, list[InstanceSnap]] = {}
    for s in snaps.values():
        if s.version >= 0 and not s.loading:
            by_ver.setdefault(s.version, []).append(s)
    pulling = [s for s in snaps.values() if s.loading and s.version >= 0]
    out: list[tuple[int, Item]] = []
    for it in items:
        cands = [s for ver, ss in by_ver.items() if routable(buffers, it, ss[0]) for s in ss]
        if not cands:
            break                                   # MLQ head-of-line, as in Alg. 3
        chosen = min(cands, key=lambda s: (load[s.engine], s.engine))
        if any(load[s.engine] < load[chosen.engine] for s in pulling):
            break                                   # the least-loaded instance is mid-Pull: wait for it
        commit(buffers, it, chosen.version)
        load[chosen.engine] += 1
        out.append((chosen.engine, it))
        if until is not None and chosen.engine == until:
            break
    return out

