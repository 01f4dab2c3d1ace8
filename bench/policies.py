"""Scheduling presets for real, side by side: torchrun with 2 rollout + 2 train ranks on the long-tail workload.

    python bench/policies.py                       # sync and every preset (PRESETS), 24 rounds each
    python bench/policies.py --presets sync,rolloutpipe --widths 1,2,4 --repeats 3
    python bench/policies.py --presets sync,areal,laminar --corrections none,tis,m2po   # presets x corrections

Disaggregated pools on one CPU box (`--affinity partition`, perf.cpu_affinity): the two rollout ranks share one
core and the two train ranks the other, as the papers' rollout and train GPUs are separate; without it, four ranks
time-share two cores and overlapping training with rollout has no idle hardware to reclaim.
Each preset trains on the same number of samples (`--rounds` rounds of P prompts x G samples) of the
`repeat` task with capped answers (rl/tasks.py: most answers 1-4 tokens, one prompt in eight `--tail` 64-96 tokens,
the same length for a whole group: the synchronous baseline's trainer then waits ~45% of the time, the regime the
RolloutPipe paper measures, 47-52% for Slime), from the same random init and seed, with the same optimizer batch
where the preset has one: `--batch-groups U` groups (U x G samples) per optimizer step, so sync takes P/U
minibatch steps per round in one train call, `slime` takes them as P/U train calls after the barrier (Slime's
update schedule, the RolloutPipe paper's baseline) and the every-U presets (rolloutpipe, fgd_tailbatch) step every
U complete groups; the stream-trainer presets (rollpacker, streamrl) take
their one accumulated step per round by design (RollPacker §4.4, StreamRL §4). Runs alternate between presets
(`--repeats` rounds of the whole list) so that machine load hits them alike. Per preset (medians over repeats):
`loop s`, the training loop's wall time (first round start to last event, from the run's event log; process
start-up excluded and printed apart as `process s`); `samples/s` and `tokens/s`, trained samples and their response
tokens per second of loop; `reward`, the reward reached: the mean reward of the last quarter of the samples trained
(the last 6 of the default 24 rounds; every train call's own mean, weighted by its samples, from the run's
`train_step_done` events), so that a preset that trains fast but learns worse on the same samples shows it (under an
off-policy preset it is the reward of the stale samples it trained on); `trainer wait`, the trainer waiting ratio
(RolloutPipe §5.1, `sched.metrics.summarize`). The last line is the wall-clock ratio of each preset against sync
(median over repeats): `speedup vs sync: rolloutpipe 1.31x, ...`.
The machine's load average is printed beside every run: on shared cores, read the ratios with it.

`--corrections none,tis,m2po` runs every preset under every off-policy correction (`--train.correction=C`,
rl/correction.py; the whole matrix alternates per repeat) and prints one table, rows preset x correction
(bench/policy_table.py), with the mismatch the trainer measured beside the figures above: `KL k3`, the mean over the
run's steps of `mismatch_kl_k3` (KL(behaviour || trainer), metrics.jsonl), and the correction's `clipped` and
`masked` token fractions (`correction_clipped_frac` / `_masked_frac`; `-` without a correction); `vs sync` is
against sync under the same correction. Each run's own config.toml must record its correction.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.policy_table import matrix_summary, matrix_table  # noqa: E402
from config import TrainConfig  # noqa: E402
from sched import load_preset  # noqa: E402
from sched.events import read_events  # noqa: E402
from sched.metrics import summarize  # noqa: E402

# Every preset of configs/sched/, sync first (the baseline every ratio is against).
PRESETS: list[str] = ["sync"] + sorted(p.stem for p in (ROOT / "configs" / "sched").glob("*.toml") if p.stem != "sync")

# The long-tail length workload (rl/tasks.py `repeat` + per-prompt caps): identical for every preset.
WORKLOAD: tuple[str, ...] = (
    "--data.task=repeat", "--data.cap_at_answer=true", "--rollout.max_new_tokens=33",
    "--data.len_body_max=4", "--data.len_tail_min=24", "--data.len_tail_max=32", "--data.len_tail_frac=0.125",
)


@dataclass
class Run:
    """One preset variant under one correction: a name for the table, the preset, the correction
    (`train.correction`), and its extra overrides."""
    name: str
    preset: str
    overrides: tuple[str, ...] = ()
    correction: str = "none"
    makespans: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)      # trained response tokens
    rewards: list[float] = field(default_factory=list)   # reward reached (`reward_reached`)
    waits: list[float] = field(default_factory=list)
    loads: list[tuple[float, float]] = field(default_factory=list)   # 1-minute load average before, after
    kls: list[float] = field(default_factory=list)       # mean of the steps' mismatch_kl_k3
    clipped: list[float] = field(default_factory=list)   # mean of the steps' correction_clipped_frac
    masked: list[float] = field(default_factory=list)    # mean of the steps' correction_masked_frac

    def median(self, xs: list[float]) -> float:
        return statistics.median(xs) if xs else math.nan


def batch_overrides(preset: str, prompts: int, u: int) -> tuple[list[str], int]:
    """The overrides that give `preset` U groups per optimizer step where it has that knob, and the number of
    `train.steps` per round that follows: sync -> P/U minibatches in one call (one `train.steps` per round);
    every-U update (slime, rolloutpipe, fgd_tailbatch) -> U groups per handoff and per step (P/U `train.steps` per
    round); stream update -> one."""
    p = load_preset(preset)
    if p.update.name == "every_u":
        handoff = [f"--sched.handoff.groups={u}"] if p.handoff.name in ("cgp", "round_minibatches") else []
        return [f"--sched.update.groups={u}", *handoff], math.ceil(prompts / u)
    if p.update.name == "step_publish":
        return [f"--train.minibatches={math.ceil(prompts / u)}"], 1
    return [], 1


def reward_reached(events: list, share: float = 0.25) -> float:
    """Mean reward of the last `share` of the samples trained: the train calls from the end (`train_step_done`, each
    with its own reward mean and sample count) until they hold that share, weighted by their samples."""
    calls = [(e.data.get("samples", 0.0), e.data.get("reward_mean", 0.0)) for e in events
             if e.kind == "train_step_done"]
    want, n, total = share * sum(s for s, _ in calls), 0.0, 0.0
    for s, r in reversed(calls):
        if n >= want:
            break
        n, total = n + s, total + s * r
    return total / n if n else math.nan


def step_mean(rows: list[dict], key: str) -> float:
    """The mean of `key` over the metrics rows that have it (NaN when none does: a correction's fractions are only
    logged with a correction on)."""
    xs = [r[key] for r in rows if key in r]
    return statistics.fmean(xs) if xs else math.nan


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's metrics.jsonl rows, one per step."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def run_correction(run_dir: Path) -> str:
    """`train.correction` as the run's resolved config.toml records it."""
    with open(run_dir / "config.toml", "rb") as f:
        return tomllib.load(f)["train"]["correction"]


def launch(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """One run: torchrun `cmd` from the repository root, one OpenMP thread per rank, its output captured."""
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def torchrun_cmd(run: Run, run_dir: Path, args: argparse.Namespace, port: int) -> list[str]:
    batch, per_round = batch_overrides(run.preset, args.prompts, args.batch_groups)
    steps = args.rounds * per_round
    lo, hi = args.tail
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4", "--master_port", str(port),
            "train.py", "--config", "configs/tiny.toml", "--log.progress=false", f"--log.dir={run_dir}",
            f"--sched.preset={run.preset}", "--cluster.rollout_ranks=2", f"--train.steps={steps}",
            f"--rollout.prompts_per_step={args.prompts}", f"--rollout.group_size={args.group_size}",
            "--checkpoint.export_hf=false", f"--perf.cpu_affinity={args.affinity}", *WORKLOAD,
            f"--data.len_tail_min={lo}", f"--data.len_tail_max={hi}", f"--rollout.max_new_tokens={hi + 1}", *batch,
            *args.extra, *run.overrides, *((f"--train.correction={run.correction}",) if args.matrix else ())]


def measure(run: Run, run_dir: Path, args: argparse.Namespace, port: int) -> None:
    cmd = torchrun_cmd(run, run_dir, args, port)
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    proc = launch(cmd, args.timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{run.name}: run failed (exit {proc.returncode})\n{' '.join(cmd)}\n"
                         f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    events = list(read_events(run_dir / "events.jsonl"))
    s = summarize(events, num_engines=2)
    trained = sum(len(e.data["groups"]) for e in events if e.kind == "train_started") * args.group_size
    run.makespans.append(s["makespan_s"])
    run.walls.append(wall)
    run.samples.append(trained)
    run.tokens.append(round(sum(e.data.get("samples", 0) * e.data.get("response_len_mean", 0) for e in events
                                if e.kind == "train_step_done")))
    run.rewards.append(reward_reached(events))
    run.waits.append(s["trainer_wait_ratio"])
    run.loads.append((load0, os.getloadavg()[0]))
    rows = read_metrics(run_dir)
    run.kls.append(step_mean(rows, "mismatch_kl_k3"))
    run.clipped.append(step_mean(rows, "correction_clipped_frac"))
    run.masked.append(step_mean(rows, "correction_masked_frac"))
    if args.matrix and (recorded := run_correction(run_dir)) != run.correction:
        raise SystemExit(f"{run_dir}: the run's config.toml has train.correction = {recorded!r}, not "
                         f"{run.correction!r}")
    label = f"{run.name}+{run.correction}" if args.matrix else run.name
    kl = f"  KL k3 {run.kls[-1]:.2e}" if args.matrix else ""
    print(f"  {label:<24} loop {s['makespan_s']:6.2f} s  (process {wall:5.1f} s)  {trained} samples  "
          f"reward {run.rewards[-1]:.3f}{kl}  trainer wait {s['trainer_wait_ratio']:.2f}  "
          f"load {load0:.2f} -> {run.loads[-1][1]:.2f}", flush=True)


def variants(args: argparse.Namespace) -> list[Run]:
    """Every preset variant (rolloutpipe once per `--widths` entry) under every correction, sync first."""
    runs = []
    for preset in args.presets:
        for c in args.corrections:
            if preset == "rolloutpipe" and args.widths:  # F_w: groups in service per engine
                runs += [Run(f"rolloutpipe[F_w={w}]", preset, (f"--sched.dispatch.width={w}",), c)
                         for w in args.widths]
            else:
                runs.append(Run(preset, preset, (), c))
    if runs[0].preset != "sync":
        raise SystemExit("--presets must start with sync (the baseline every ratio is against)")
    return runs


def corrections(text: str) -> list[str]:
    """`--corrections`: a comma-separated list of `train.correction` values (config.py TrainConfig)."""
    allowed = TrainConfig.__dataclass_fields__["correction"].metadata["choices"]
    out = text.split(",")
    if bad := [c for c in out if c not in allowed]:
        raise argparse.ArgumentTypeError(f"{', '.join(bad)} not one of {', '.join(allowed)}")
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", type=lambda s: s.split(","), default=PRESETS,
                    help=f"comma-separated, sync first (default: {','.join(PRESETS)})")
    ap.add_argument("--widths", type=lambda s: [int(w) for w in s.split(",")], default=[],
                    help="FGD frontier widths F_w (groups per engine) to sweep for rolloutpipe (default: the preset's)")
    ap.add_argument("--corrections", type=corrections, default=["none"],
                    help="comma-separated train.correction values (rl/correction.py): every preset under each, one "
                         "table of preset x correction (default: none, the single-correction table)")
    ap.add_argument("--rounds", type=int, default=24,
                    help="rounds of P prompts each preset trains on. 24 (~7 s of loop on 2 idle cores) keeps the "
                         "start-up inside the loop (the first train call's warm-up, an overlapping preset's first "
                         "publication and its pipeline filling: ~0.4 s more than sync's) near 5%% of the loop; at 12 "
                         "it moved the overlapping presets' ratios to sync by up to 10-13%%")
    ap.add_argument("--prompts", type=int, default=16, help="P: prompts (groups) per round")
    ap.add_argument("--group-size", type=int, default=8, help="G: samples per prompt")
    ap.add_argument("--batch-groups", type=int, default=2,
                    help="U: groups per optimizer step for the presets that have the knob (RolloutPipe: K=8, B=16)")
    ap.add_argument("--repeats", type=int, default=1, help="passes over the preset list (alternating)")
    ap.add_argument("--tail", type=lambda s: tuple(int(x) for x in s.split(",")), default=(64, 96),
                    help="MIN,MAX answer lengths of the long tail (1 prompt in 8; the others 1-4 tokens). 64,96 puts "
                         "the synchronous baseline's trainer wait at ~45%%, the RolloutPipe paper's regime (Slime: "
                         "47-52%%); the tests' WORKLOAD has 24,32")
    ap.add_argument("--affinity", default="partition", choices=("partition", "none"),
                    help="perf.cpu_affinity: partition (default) = rollout ranks on one core, train ranks on the "
                         "other, the papers' disaggregated pools; none = all four ranks share both cores")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--port", type=int, default=29700)
    ap.add_argument("--out", default="", help="keep the run directories here (default: a temporary directory)")
    ap.add_argument("extra", nargs="*", help="more overrides for every run, after --, e.g. -- --train.ppo_epochs=2")
    args = ap.parse_args(argv)
    args.matrix = args.corrections != ["none"]
    runs = variants(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="bench_policies_"))
    what = "runs of preset x correction" if args.matrix else "variants"
    print(f"{len(runs)} {what} x {args.repeats} repeats, {args.rounds} rounds of {args.prompts} prompts x "
          f"{args.group_size} samples, 2 rollout + 2 train ranks; runs in {out}", flush=True)
    for rep in range(args.repeats):
        order = runs if rep % 2 == 0 else runs[::-1]
        for i, run in enumerate(order):
            tag = f"{run.name}+{run.correction}" if args.matrix else run.name
            measure(run, out / f"{tag}-{rep}", args, args.port + 10 * (rep * len(runs) + i) % 2000)
    if args.matrix:
        print("\n" + "\n".join(matrix_table(runs)))
        print(json.dumps({f"{r.name}+{r.correction}": {
            "loop_s": r.makespans, "samples": r.samples, "tokens": r.tokens, "reward": r.rewards,
            "trainer_wait": r.waits, "kl_k3": r.kls, "clipped": r.clipped, "masked": r.masked, "load": r.loads}
            for r in runs}))
        print(matrix_summary(runs))
        return
    base = runs[0].median(runs[0].makespans)
    print(f"\n{'preset':<24} {'loop s':>8} {'process s':>10} {'samples/s':>10} {'tokens/s':>9} {'reward':>7}"
          f" {'trainer wait':>13} {'load':>6} {'vs sync':>8}")
    for r in runs:
        ms = r.median(r.makespans)
        load = statistics.mean(a for pair in r.loads for a in pair)
        print(f"{r.name:<24} {ms:8.2f} {r.median(r.walls):10.1f} {r.median(r.samples) / ms:10.1f} "
              f"{r.median(r.tokens) / ms:9.1f} {r.median(r.rewards):7.3f} {r.median(r.waits):13.2f} {load:6.2f} "
              f"{base / ms:7.2f}x")
    print(json.dumps({r.name: {"loop_s": r.makespans, "samples": r.samples, "tokens": r.tokens,
                               "reward": r.rewards, "trainer_wait": r.waits, "load": r.loads} for r in runs}))
    print("speedup vs sync: " + ", ".join(f"{r.name} {base / r.median(r.makespans):.2f}x" for r in runs[1:]))


if __name__ == "__main__":
    main()
