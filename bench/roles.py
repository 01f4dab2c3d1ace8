"""Where each role's time goes: a py-spy profile of a whole run, bucketed per process (leader, train follower,
rollout rank, colocated rank) into the phases of a step, one table per role.

    py-spy record -r 100 --format raw --subprocesses -o prof.txt -- \\
        torchrun --nproc_per_node=4 train.py --config configs/tiny.toml --train.steps=60
    python bench/roles.py prof.txt

py-spy's raw format is one line per distinct stack, `frame;frame;... count`, each process's frames under a
`process PID:"cmdline"` frame. A sample goes to the first bucket whose pattern matches its stack (the order of
BUCKETS), or to "blocked" when its innermost frame is a wait (a lock, a queue, a gloo receive, a sleep); seconds
are samples / rate. Every thread of a process counts, so a role's seconds can exceed the run's wall time.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys

BUCKETS: list[tuple[str, str]] = [
    ("imports (start-up)", r"_find_and_load"),
    ("start-up: process groups, model, FSDP, engine",
     r"init_distributed|model_for_rank|build_run|make_trainer|make_engine|shard_model|prepare_run_dir"),
    ("teardown: checkpoint, HF export, summary, shutdown",
     r"save_checkpoint|export_hf|finish_run|destroy_process_group|Channel\.close|stop_workers"),
    ("train step (forward, backward, optimizer, FSDP collectives)", r"Trainer\.train_step"),
    ("weight publication (gather, pack, checksum, broadcast, relay)",
     r"WeightPublisher|TrainerThread\._publish|WeightReceiver|_into_relay|sync_engine|full_tensors"),
    ("engine weight load + checksum after it", r"load_weights|check_engine_weights|RolloutWorker\.load"),
    ("engine steps (decode, sampling, inline rewards)", r"RolloutWorker\._?step"),
    ("work item broadcast to the train followers", r"broadcast_item"),
    ("controller: apply events + event log", r"Controller\.apply|MetricsLogger|EventLog"),
    ("controller: decide + compose messages", r"Controller\.decide|RuntimeBackend\.(submit|command)"),
    ("control channel: pickle + send, receive + unpickle",
     r"Channel\.send|Channel\._receive_loop|Channel\.post|RolloutWorker\.flush"),
    ("watchdog + heartbeats", r"[Ww]atchdog"),
]
WAIT = re.compile(r"(Condition\.wait|Event\.wait|recv \(|Queue\.get|wait_tensor|\.join \(|sleep)")
ROLES = (("leader", "run_leader"), ("follower", "run_follower"), ("rollout", "run_rollout"),
         ("colocated", "run_colocated"))


def profile(lines: list[str]) -> tuple[dict[str, collections.Counter], dict[str, str]]:
    """Per process id: samples per bucket; and each process's role."""
    per: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    roles: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            continue
        stack, n = line.rstrip().rsplit(" ", 1)
        frames = stack.split(";")
        procs = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not procs:
            continue
        pid = frames[procs[-1]].split(":", 1)[0].split()[1]
        role = next((r for r, fn in ROLES if fn in stack), None)
        if role is not None:
            roles[pid] = role
        if WAIT.search(frames[-1]):
            per[pid]["blocked (waiting)"] += int(n)
            continue
        per[pid][next((b for b, p in BUCKETS if re.search(p, stack)), "other")] += int(n)
    return per, roles


def table(per: dict[str, collections.Counter], roles: dict[str, str], rate: float) -> str:
    out = []
    for pid in sorted(roles, key=lambda p: (roles[p], p)):
        c = per[pid]
        busy = sum(v for k, v in c.items() if k != "blocked (waiting)")
        out.append(f"{roles[pid]} (pid {pid}): busy {busy / rate:.1f} s")
        for k, v in sorted(c.items(), key=lambda kv: -kv[1]):
            out.append(f"    {k:62s} {v / rate:7.2f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="py-spy record --format raw --subprocesses output")
    ap.add_argument("--rate", type=float, default=100.0, help="py-spy's sampling rate (-r)")
    a = ap.parse_args(argv)
    with open(a.profile) as f:
        per, roles = profile(f.readlines())
    if not roles:
        print(f"error: {a.profile}: no process of train.py's roles in this profile", file=sys.stderr)
        return 2
    print(table(per, roles, a.rate))
    return 0


if __name__ == "__main__":
    sys.exit(main())
