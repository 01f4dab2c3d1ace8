"""KV move vs re-prefill on real ranks: Laminar's repack forced often, the same job with
`perf.migrate_kv` on and off, alternating in one invocation.

    python bench/kv_move.py                        # 12 steps, 2 repeats of each
    python bench/kv_move.py --steps 4 --repeats 1  # quick

The job (bench/results/cpu-runtime.md "Migrated KV on real ranks"): torchrun, 2 train + 2 rollout CPU ranks, the
`laminar` preset, the long-tail `repeat` workload with a quarter of the prompts 24-32 tokens long, the repack checked
every `--period` s with the `drained` ramp-down test so that it fires many times in a short run. With the move on, a
migrated trajectory's KV goes over torch.distributed to the engine resuming it (runtime/kv_transfer.py); off, that
engine re-prefills prompt + generated tokens.

Per run, from the run's own event log: migrations (`trajectory_migrated`), KV tokens carried by them
(`trajectory_interrupted` data `kv_tokens`), tokens adopted as cached by the resuming engines and prefill tokens
of all engines (each engine's last `tokens_decoded` counters, sent every 8 engine steps: they lag the end a little,
alike for both settings), the N-step wall time (first event to the last `train_step_done`).
Last line: prefill tokens per migration off over on, and the N-step wall time off over on (medians over repeats).
On this tiny CPU model a re-prefill of ~30 tokens is cheap, so the time ratio is expected near 1; the token
figure is the mechanism's saving, which on a GPU at real lengths is the paper's 0.69 s repack overhead vs a
recompute.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ["--sched.preset=laminar", "--cluster.rollout_ranks=2", "--rollout.prompts_per_step=8",
       "--checkpoint.export_hf=false", "--data.task=repeat", "--data.cap_at_answer=true", "--rollout.max_new_tokens=33",
       "--data.len_body_max=4", "--data.len_tail_min=24", "--data.len_tail_max=32", "--data.len_tail_frac=0.25",
       "--sched.rebalance.idle_rule=drained", "--log.progress=false"]


@dataclass
class Run:
    migrate_kv: bool
    migrations: int
    kv_tokens: int
    adopted: int
    prefill: int
    wall_s: float

    @property
    def prefill_per_migration(self) -> float:
        return self.prefill / max(self.migrations, 1)

    def line(self) -> str:
        return (f"migrate_kv={str(self.migrate_kv).lower():5s}  {self.migrations:4d} migrations  "
                f"{self.kv_tokens:6d} KV tokens moved  {self.adopted:6d} adopted  {self.prefill:6d} prefill tokens "
                f"({self.prefill_per_migration:.1f} per migration)  {self.wall_s:6.2f} s")


def summarize(run_dir: Path, migrate_kv: bool) -> Run:
    """One finished run's figures from its event log."""
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines() if x.strip()]
    last: dict[int, dict] = {}
    for e in events:
        if e["kind"] == "tokens_decoded":
            last[e["rank"]] = e["data"]
    done = [e["t"] for e in events if e["kind"] == "train_step_done"]
    if not done:
        raise RuntimeError(f"{run_dir}: no train step finished (see its log)")
    return Run(migrate_kv,
               migrations=sum(e["kind"] == "trajectory_migrated" for e in events),
               kv_tokens=sum((e.get("data") or {}).get("kv_tokens", 0) for e in events
                             if e["kind"] == "trajectory_interrupted"),
               adopted=sum(d["kv_adopted"] for d in last.values()),
               prefill=sum(d["prefill"] for d in last.values()),
               wall_s=done[-1] - events[0]["t"])


def run_job(work: Path, tag: str, migrate_kv: bool, steps: int, period: float, timeout: float) -> Run:
    run_dir = work / tag
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "train.py", "--config",
           str(ROOT / "configs" / "tiny.toml"), f"--log.dir={run_dir}", f"--train.steps={steps}",
           f"--sched.rebalance.period_s={period}", f"--perf.migrate_kv={str(migrate_kv).lower()}", *JOB]
    with open(work / f"{tag}.log", "w") as log:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"run {tag} exited {proc.returncode}; its log: {work / f'{tag}.log'}")
    return summarize(run_dir, migrate_kv)


def ratio_line(runs: list[Run]) -> str:
    on = [r for r in runs if r.migrate_kv]
    off = [r for r in runs if not r.migrate_kv]
    per_on = statistics.median(r.prefill_per_migration for r in on)
    per_off = statistics.median(r.prefill_per_migration for r in off)
    wall = statistics.median(r.wall_s for r in off) / statistics.median(r.wall_s for r in on)
    per = f"{per_off / per_on:.1f}x" if per_on > 0 else "inf (none with the move)"
    return (f"re-prefill vs KV move: prefill tokens per migration {per_off:.1f} / {per_on:.1f} = {per}; "
            f"wall time off / on {wall:.2f}x")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--period", type=float, default=0.05, help="sched.rebalance.period_s (how often repack looks)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds a run may take before it is killed")
    ap.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
    a = ap.parse_args(argv)
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="kv_move-"))
    work.mkdir(parents=True, exist_ok=True)
    runs = []
    for rep in range(a.repeats):
        for on in ((True, False) if rep % 2 == 0 else (False, True)):
            r = run_job(work, f"{'on' if on else 'off'}-{rep}", on, a.steps, a.period, a.timeout)
            runs.append(r)
            print(r.line(), flush=True)
    print(f"runs in {work}")
    print(ratio_line(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
