"""The simulator checked against our own real runs: every preset's speedup over sync, measured and simulated.

    python -m sim.validate                        # the table, from the recorded summaries in sim/validation/
    python -m sim.validate --record               # re-record every preset on real ranks (bench/policies.py), then it
    python -m sim.validate --record --from DIR    # summarize the run directories of `bench/policies.py --out DIR`

Setting: bench/policies.py's (torchrun, 2 rollout + 2 train ranks with `--affinity partition`: the rollout ranks share
one core and the train ranks the other; its default 24 rounds of 16 prompts x 8 samples of the `repeat` task, one
prompt in eight with a 64-96 token answer; U = 2 groups per optimizer step where a preset has that knob; 24 rounds so
that the start-up inside the loop is ~5% of it). `--record` runs it as one
pair per preset, `bench/policies.py --presets sync,PRESET --repeats 1`: each preset right after a sync run of its own,
so that on a shared machine both see about the same load, and its measured speedup is that pair's ratio of
training-loop wall times (first round start to last event). It writes sim/validation/<preset>.json: the loop times,
samples trained, the trainer waiting ratio, the 1-minute load average before and after each run, the machine, the date
and the command. sync.json is the pairs' sync run recorded at the lowest load and also holds what the simulator is
calibrated from: `sim.calibrate.measure` on that run (decode step fit, its train calls taken apart into a cost per
call, per minibatch pass, per token and per optimizer step (`call_split`), the controller's CPU per trajectory it
handles, publication, load, reward latency), the engine's configuration, and its response lengths per prompt (the
workload, replayed as a trace).

The simulation: every preset on that one profile and trace (nothing from the other presets' runs), 2 engines + 2
train GPUs, the same optimizer steps and overrides as bench/policies.py gives it (`batch_overrides`, its
train.minibatches the optimizer steps of each stepping call); its speedup is
sync's simulated loop time over the preset's. What the profile takes from the sync run (`profile_from`): the decode
step from its busy spans whole (`span_fit`), the trainer's cost per call, per minibatch pass, per token and per
optimizer step (`call_split`: a call that only accumulates gradients pays its one pass without the step), decoupled
PPO's proximal pass at the share of its train calls spent in forward passes (charged to the presets with a staleness
bound >= 1, which train.py runs with decoupled PPO), the train leader's controller CPU per trajectory (the controller
runs in rank 0's process: each trajectory finishing while a call runs stretches the call by it), publication (an
overlapped one shares the train core with the call beside it, equal shares: PUBLISH_TRAIN_SHARE), load and reward
latency. A preset is within the tolerance
when |simulated / measured - 1| <= 15%. Deterministic; the simulation part takes seconds.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TextIO

import sched
from sched.events import read_events
from sched.metrics import summarize
from sim.calibrate import measure
from sim.cost import CostModel, RewardLatency, RewardTask
from sim.profiles import get_profile
from sim.run import simulate
from sim.workload import TraceWorkload

ROOT = Path(__file__).resolve().parents[1]
VALIDATION_DIR = Path(__file__).resolve().parent / "validation"
TOLERANCE = 0.15
PUBLISH_TRAIN_SHARE = 0.5   # an overlapped publication and the train call beside it share the train core equally
ENGINES, TRAIN_RANKS = 2, 2   # bench/policies.py: --cluster.rollout_ranks=2 of --nproc_per_node=4


def presets() -> list[str]:
    """Every configs/sched preset, sync first (the baseline every ratio is against)."""
    names = sorted(p.stem for p in sched.PRESET_DIR.glob("*.toml"))
    return ["sync"] + [n for n in names if n != "sync"]


# ------------------------------------------------------------------------------------------------- recording
class _Tee:
    """A text stream writing to several (the console and the recording's log)."""

    def __init__(self, *streams: TextIO):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            st.flush()


RUN_LINE = re.compile(r"^\s+(?P<name>\S+)\s+loop\s+[\d.]+ s\s+\(process\s+(?P<process>[\d.]+) s\).*"
                      r"load (?P<l0>[\d.]+) -> (?P<l1>[\d.]+)")


def bench_lines(log: str) -> dict[str, dict[str, float]]:
    """Per run name, what bench/policies.py printed beside it and the event log lacks: the process's wall time and
    the 1-minute load average before and after."""
    out = {}
    for line in log.splitlines():
        m = RUN_LINE.match(line)
        if m:
            out[m["name"]] = {"process_s": float(m["process"]), "load_before": float(m["l0"]),
                              "load_after": float(m["l1"])}
    return out


def machine() -> dict[str, Any]:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    import torch
    return {"cpus": os.cpu_count(), "cpu": cpu, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__}


def git_commit() -> str:
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10, check=False).stdout.strip()
    return ""


def sync_trace(run_dir: Path, events: list) -> list[list[Any]]:
    """[prompt tokens, [response tokens of each sample]] per prompt, in the order the run drew them (group ids are
    draw order): the prompts' token counts from the run's own dataset and sampler (runtime.build), the lengths from
    its trajectory_finished events."""
    from config import load_config
    from runtime.build import build_run
    lens: dict[int, dict[int, int]] = {}
    for e in events:
        if e.kind == "trajectory_finished":
            lens.setdefault(e.group_id, {})[e.req_id] = int(e.data["tokens"])
    cfg = load_config(run_dir / "config.toml", [])
    items = build_run(cfg, True).source(max(lens) + 1)
    return [[len(items[g].prompt_ids), [n for _, n in sorted(lens[g].items())]] for g in sorted(lens)]


def counters_interval(events: list) -> float:
    """Median seconds between an engine's consecutive tokens_decoded reports (the runtime sends one every 8 engine
    steps; the simulator's counters tick on time)."""
    last: dict[int, float] = {}
    gaps = []
    for e in events:
        if e.kind == "tokens_decoded":
            if e.engine in last:
                gaps.append(e.t - last[e.engine])
            last[e.engine] = e.t
        elif e.kind == "engine_idle":
            last.pop(e.engine, None)
    return statistics.median(gaps) if gaps else 0.0


def summarize_run(name: str, run_dir: Path, printed: dict[str, float], meta: dict[str, Any]) -> dict[str, Any]:
    """One preset's checked-in summary (a few KB; the sync run's carries the calibration and its trace)."""
    events = list(read_events(run_dir / "events.jsonl"))
    s = summarize(events, num_engines=ENGINES)
    calls = [e for e in events if e.kind == "train_started"]
    done = [e for e in events if e.kind == "train_step_done"]
    fin = [e.data["tokens"] for e in events if e.kind == "trajectory_finished"]
    with open(run_dir / "metrics.jsonl") as f:
        metrics = [json.loads(line) for line in f if line.strip()]
    group_size = meta["setting"]["group_size"]
    out: dict[str, Any] = {
        "preset": name, **meta, "load_avg_1min": [printed.get("load_before"), printed.get("load_after")],
        "loop_s": s["makespan_s"], "process_s": printed.get("process_s"),
        "samples": sum(len(e.data["groups"]) for e in calls) * group_size,
        "train_calls": len(calls), "optimizer_steps": int(sum(m.get("optimizer_steps", 0) for m in metrics)),
        "train_compute_s": s["train_compute_s"],
        "forward_s": sum(e.data.get("forward_s", 0.0) for e in done),
        "proximal_s": sum(e.data.get("proximal_s", 0.0) for e in done),
        "versions_published": sum(e.kind == "version_published" for e in events),
        "trainer_wait_ratio": s["trainer_wait_ratio"], "engine_idle_ratio": s["engine_idle_ratio"],
        "responses": len(fin), "response_len_mean": statistics.fmean(fin) if fin else 0.0,
        "loop_after_first_sixth_s": loop_after(events, s["makespan_s"], 1 / 6)}
    if name == "sync":
        trace = sync_trace(run_dir, events)
        plen = statistics.fmean(p for p, lens in trace for _ in lens)
        cal = measure(run_dir, TRAIN_RANKS, plen)
        cal.pop("run", None)
        out.update(calibration={**cal, "prompt_tokens_mean": plen, "counters_interval_s": counters_interval(events)},
                   engine_config=_engine_config(run_dir), trace=trace)
    return out


def loop_after(events: list, makespan: float, share: float) -> float:
    """The loop's seconds after the train call that completes the first `share` of the samples trained (the start-up
    left out: the first call's warm-up, an overlapping preset's pipeline filling)."""
    t0 = min(e.t for e in events)
    done = [(e.t - t0, e.data.get("samples", 0.0)) for e in events if e.kind == "train_step_done"]
    total, n = sum(x for _, x in done), 0.0
    for t, x in done:
        n += x
        if n >= share * total - 1e-9:
            return makespan - t
    return makespan


def _engine_config(run_dir: Path) -> dict[str, Any]:
    from config import load_config
    r = load_config(run_dir / "config.toml", []).rollout
    return {"max_num_seqs": r.max_num_seqs, "kv_cache_tokens": r.kv_cache_tokens, "kv_block_size": r.kv_block_size}


def run_setting(run_dir: Path) -> dict[str, Any]:
    """bench/policies.py's setting as the sync run `run_dir` ran it (its config.toml): rounds (sync steps once a
    round), prompts x group size per round, U groups per optimizer step (sync's minibatches: P / U), the tail."""
    from config import load_config
    c = load_config(run_dir / "config.toml", [])
    return {"rounds": c.train.steps, "prompts": c.rollout.prompts_per_step, "group_size": c.rollout.group_size,
            "batch_groups": c.rollout.prompts_per_step // c.train.minibatches,
            "tail": [c.data.len_tail_min, c.data.len_tail_max], "affinity": c.perf.cpu_affinity,
            "rollout_ranks": c.cluster.rollout_ranks, "train_ranks": TRAIN_RANKS}


def bench_argv(out: Path, preset: str, port: int | None = None) -> list[str]:
    return ["--presets", f"sync,{preset}", "--repeats", "1", "--out", str(out),
            *(["--port", str(port)] if port is not None else [])]


def free_port(step: int = 10) -> int:
    """A port p with p and p + step free now (bench/policies.py's two runs of a pair rendezvous on them): not its
    default 29700, which another bench on the machine may hold."""
    from runtime.ports import free_port as pick
    return pick((step,))


def record(out_dir: Path, runs: Path | None, names: list[str]) -> None:
    """Run bench/policies.py's setting as one pair (sync, preset) per preset, each preset right after a sync run of its
    own so that both see the same machine load (or read the run directories such a recording left in `runs`:
    runs/<preset>/{sync-0,<preset>-0,bench.log}), and write one summary per preset into `out_dir`. sync's summary, the
    run the simulator is calibrated from, is the pairs' sync run recorded at the lowest load average (the least
    disturbed by other jobs)."""
    from bench import policies
    if runs is None:
        runs = Path(tempfile.mkdtemp(prefix="sim_validate_"))
        for name in names[1:]:
            (runs / name).mkdir()
            with open(runs / name / "bench.log", "w") as log, contextlib.redirect_stdout(_Tee(sys.stdout, log)):
                policies.main(bench_argv(runs / name, name, free_port()))
    first = runs / names[1] / "sync-0" / "events.jsonl"
    stamp = datetime.datetime.fromtimestamp(first.stat().st_mtime, datetime.timezone.utc)
    meta = {"recorded": {"date": stamp.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine(), "commit": git_commit(),
                         "command": "python bench/policies.py " + " ".join(bench_argv(Path("DIR"), "PRESET")),
                         "rerecord": "python -m sim.validate --record"},
            "setting": run_setting(first.parent)}
    out_dir.mkdir(parents=True, exist_ok=True)
    calib = min(names[1:], key=lambda n: _mean_load(_printed(runs / n, "sync")))
    summaries = {"sync": {**summarize_run("sync", runs / calib / "sync-0", _printed(runs / calib, "sync"), meta),
                          "pair": calib}}
    for name in names[1:]:
        pair_sync = summarize_run(f"sync[{name}]", runs / name / "sync-0", _printed(runs / name, "sync"), meta)
        summaries[name] = {**summarize_run(name, runs / name / f"{name}-0", _printed(runs / name, name), meta),
                           "sync_loop_s": pair_sync["loop_s"], "sync_load_avg_1min": pair_sync["load_avg_1min"]}
    for name, summary in summaries.items():
        path = out_dir / f"{name}.json"
        path.write_text(_dump(summary) + "\n")
        print(f"wrote {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def _mean_load(printed: dict[str, float]) -> float:
    return (printed["load_before"] + printed["load_after"]) / 2 if printed else float("inf")


def _printed(pair_dir: Path, name: str) -> dict[str, float]:
    log = pair_dir / "bench.log"
    return bench_lines(log.read_text() if log.is_file() else "").get(name, {})


def _dump(summary: dict[str, Any]) -> str:
    """JSON with the trace one prompt a line (small and diffable)."""
    trace = summary.pop("trace", None)
    text = json.dumps(summary, indent=1)
    if trace is None:
        return text
    rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in trace)
    return text[:-2] + f',\n "trace": [\n  {rows}\n ]\n}}'


# ------------------------------------------------------------------------------------------------ simulating
def load_recorded(directory: Path = VALIDATION_DIR) -> dict[str, dict[str, Any]]:
    """The recorded summaries by preset, sync first (FileNotFoundError without a sync.json)."""
    if not (directory / "sync.json").is_file():
        raise FileNotFoundError(f"{directory}/sync.json: no recorded sync run (python -m sim.validate --record)")
    found = {p.stem: json.loads(p.read_text()) for p in directory.glob("*.json")}
    return {n: found[n] for n in [*presets(), *sorted(found)] if n in found}


def profile_from(sync: dict[str, Any]) -> CostModel:
    """cpu_tiny with every constant sim.calibrate measures re-measured on the recorded sync run; the prefill cost is
    cpu_tiny's assumption (one decode token's compute, k3) and the engine's limits are the run's configuration.
    The decode step is sim.calibrate's span_fit where the recording has it (each busy span whole: its tokens and
    steps against its seconds, so that the sync run's generation time is reproduced), else its decode_fit (the
    intervals inside the spans, which leave out each span's first, largest batches)."""
    cal, eng = sync["calibration"], sync["engine_config"]
    decode_src = "span_fit" if "span_k3" in cal else "decode_fit"
    if "span_k3" in cal:
        k3, k4 = cal["span_k3"], cal["span_k4"]
    elif "k3" in cal:
        k3, k4 = cal["k3"], cal["k4"]
    else:   # every interval at one batch size: no slope, the step time at that batch is all fixed cost
        k3, k4 = 0.0, cal["step_s"]
    # a fit through the origin (k4 clipped to 0) charges k3 per sequence; k2 = k3 keeps that (max(k3, k3 n) = k3 n
    # for n >= 1) and gives the step the floor the cost model requires (k2 + k4 > 0)
    k2 = k3 if k4 <= 0 else 0.0
    base = get_profile("cpu_tiny")
    reward = RewardLatency((RewardTask("repeat", 1.0, max(cal.get("reward_s_median") or 0.0, 1e-6), 0.5, 5.0),))
    src = "sim.calibrate on the recorded sync run (sim/validation/sync.json)"
    # the trainer: sim.calibrate's call_split of sync's calls (per call, per minibatch pass, per token, per optimizer
    # step) where the recording has it, else its train_fit (per token and per step: sync's calls all take the same
    # steps, so its fixed time per call goes to the steps) or its median seconds per token alone
    opt_s = cal.get("optimizer_step_s", 0.0)
    if "split_pass_s" in cal:
        train = dict(train_s_per_token=cal["split_s_per_token_one_rank"], train_step_s=cal["split_pass_s"] + opt_s,
                     train_overhead_s=cal["split_call_s"])
        accumulate, fit_src = cal["split_pass_s"], src + ": call_split"
    elif "train_fit_s_per_token_one_rank" in cal:
        train = dict(train_s_per_token=cal["train_fit_s_per_token_one_rank"], train_step_s=cal["train_step_s"],
                     train_overhead_s=cal["train_call_s"])
        # a call that only accumulates gradients (the stream trainers' calls between steps) pays a minibatch's
        # pass: sync's fixed time per step less the optimizer step's own
        accumulate = max(0.0, train["train_step_s"] - opt_s)
        fit_src = src + (f", train_fit: {cal['train_fit_assumed']}" if cal.get("train_fit_assumed") else "")
    else:
        train = dict(train_s_per_token=cal["train_s_per_token_one_rank"], train_step_s=0.0, train_overhead_s=0.0)
        accumulate, fit_src = 0.0, src
    # decoupled PPO's proximal pass (the presets with a staleness bound >= 1 train with it, train.py): a no-grad
    # forward of every minibatch, charged at the share of sync's train time its forward passes took
    prox = cal.get("train_forward_share") or 0.0
    return replace(base, name="cpu_tiny@validation", k2=k2, k3=k3, k4=k4, prefill_s_per_token=k3, **train,
                   proximal_share=prox, train_accumulate_s=accumulate,
                   controller_s_per_trajectory=cal.get("controller_s_per_trajectory", 0.0),
                   train_cold_s=cal.get("split_first_pass_extra_s", 0.0),
                   publish_s=cal.get("publish_s") or 0.0, publish_train_share=PUBLISH_TRAIN_SHARE,
                   load_s=cal.get("load_s") or 0.0, reward=reward, max_num_seqs=eng["max_num_seqs"],
                   kv_capacity_tokens=eng["kv_cache_tokens"], block_size=eng["kv_block_size"],
                   sources={**base.sources, **{k: src for k in ("publish_s", "load_s", "reward")},
                            **{k: f"{src}: {decode_src}" for k in ("k3", "k4")},
                            **{k: fit_src for k in train},
                            "train_accumulate_s": fit_src + ": one minibatch's pass without its optimizer step",
                            "controller_s_per_trajectory": src + ": call_split, the leader's CPU outside its "
                                                           "trainer thread per trajectory handled between calls",
                            "publish_train_share": "assumption: an equal share of one processor (the bench's "
                                                   "--affinity partition puts rank 0, whose thread sends the "
                                                   "weights, on the train ranks' core)",
                            "train_cold_s": src + ": call_split, a call's first pass over its others (every sync "
                                                  "call comes after the trainer idled)",
                            "proximal_share": src + ": train_forward_share, the forward passes' share of its train "
                                              "calls (a no-grad forward taken to cost the forward with grad)"})


@dataclass(frozen=True)
class _Trace(TraceWorkload):
    """A TraceWorkload whose cap is computed once (the engine asks for it at every finish)."""

    @functools.cached_property
    def max_len(self) -> int:  # type: ignore[override]
        return max(max(lens) for _, lens in self.rows)


def trace_from(sync: dict[str, Any]) -> TraceWorkload:
    """The sync run's lengths as a trace: prompt i of a simulation is the i-th prompt the sync run drew (a preset that
    draws more prompts than sync's 192 wraps around to the first)."""
    return _Trace("validation:sync", tuple((int(p), tuple(int(x) for x in lens)) for p, lens in sync["trace"]))


def sim_setting(preset: str, setting: dict[str, Any]) -> tuple[sched.Preset, int, int]:
    """The preset with bench/policies.py's scheduling overrides for it, its train calls that step (train.steps), and
    the optimizer steps each of them takes (train.minibatches: P / U for sync's one call a round, else 1)."""
    from bench import policies
    overrides, per_round = policies.batch_overrides(preset, setting["prompts"], setting["batch_groups"])
    tables, sources = sched.command_line_overrides([a for a in overrides if a.startswith("--sched.")])
    mb = [int(a.split("=", 1)[1]) for a in overrides if a.startswith("--train.minibatches=")]
    return sched.load_preset(preset, tables, sources), setting["rounds"] * per_round, mb[-1] if mb else 1


def simulate_loop(preset: str, cost: CostModel, workload: TraceWorkload, sync: dict[str, Any]) -> float:
    """The simulated training loop's wall time (summarize's makespan, as measured on the real run)."""
    setting = sync["setting"]
    policy, steps, minibatches = sim_setting(preset, setting)
    every = sync["calibration"].get("counters_interval_s") or None
    r = simulate(policy, workload, cost, ENGINES, TRAIN_RANKS, steps=steps, group_size=setting["group_size"],
                 prompts_per_step=setting["prompts"], seed=0, counters_every_s=every, minibatches=minibatches)
    return float(r.metrics["makespan_s"])


@dataclass
class Row:
    preset: str
    real_loop_s: float
    sim_loop_s: float
    real: float           # measured speedup over sync (loop time ratio)
    sim: float            # simulated speedup over sync
    load: float           # mean 1-minute load average before and after the pair's two real runs
    sync_loop_s: float    # the loop time of the sync run it is measured against (its pair's)
    sim_sync_s: float     # the simulated sync loop

    @property
    def error(self) -> float:
        return self.sim / self.real - 1.0

    @property
    def within(self) -> bool:
        return abs(self.error) <= TOLERANCE


def rows(recorded: dict[str, dict[str, Any]] | None = None) -> list[Row]:
    """One row per recorded preset other than sync."""
    recorded = recorded if recorded is not None else load_recorded()
    sync = recorded["sync"]
    cost, workload = profile_from(sync), trace_from(sync)
    base_sim = simulate_loop("sync", cost, workload, sync)
    out = []
    for name, rec in recorded.items():
        if name == "sync":
            continue
        sim_s = simulate_loop(name, cost, workload, sync)
        loads = [x for x in [*rec.get("sync_load_avg_1min", []), *rec.get("load_avg_1min", [])] if x is not None]
        sync_s = rec.get("sync_loop_s", sync["loop_s"])   # against the sync run of its own pair
        out.append(Row(name, rec["loop_s"], sim_s, sync_s / rec["loop_s"], base_sim / sim_s,
                       statistics.fmean(loads) if loads else float("nan"), sync_s, base_sim))
    return out


def format_table(rs: list[Row], sync: dict[str, Any]) -> str:
    """The table, with the simulated sync loop beside the real one it was calibrated on."""
    sim_sync_s = rs[0].sim_sync_s if rs else float("nan")
    head = (f"{'preset':18s} {'loop s':>7s} {'sync s':>7s} {'load':>5s} {'real speedup':>12s} {'simulated':>9s} "
            f"{'error':>7s}  within 15%")
    lines = [head, "-" * len(head)]
    sl = [x for x in sync.get("load_avg_1min", []) if x is not None]
    lines.append(f"{'sync':18s} {sync['loop_s']:7.2f} {'':>7s} {statistics.fmean(sl) if sl else float('nan'):5.1f} "
                 f"{'':>12s} {'':>9s} {'':>7s}  calibration run; simulated loop {sim_sync_s:.2f} s")
    for r in rs:
        lines.append(f"{r.preset:18s} {r.real_loop_s:7.2f} {r.sync_loop_s:7.2f} {r.load:5.1f} {r.real:11.2f}x "
                     f"{r.sim:8.2f}x {r.error:+7.1%}  {'yes' if r.within else 'NO'}")
    k = sum(r.within for r in rs)
    lines.append(f"sim.validate: {k}/{len(rs)} presets within 15% of the measured speedup over sync")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true",
                    help="run bench/policies.py's setting for every preset on real ranks and rewrite the summaries")
    ap.add_argument("--from", dest="runs", type=Path,
                    help="with --record: summarize these run directories (bench/policies.py --out DIR, its console "
                         "output in DIR/bench.log) instead of running")
    ap.add_argument("--presets", type=lambda s: s.split(","), help="with --record: only these (sync first)")
    ap.add_argument("--dir", type=Path, default=VALIDATION_DIR, help="the summaries' directory")
    args = ap.parse_args(argv)
    if args.record:
        names = args.presets or presets()
        if names[0] != "sync":
            ap.error("--presets must start with sync (the run the simulator is calibrated from)")
        record(args.dir, args.runs, names)
    try:
        recorded = load_recorded(args.dir)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    rs = rows(recorded)
    sync = recorded["sync"]
    rec = sync["recorded"]
    loads = [x for r in recorded.values() for k in ("load_avg_1min", "sync_load_avg_1min") for x in r.get(k, [])
             if x is not None]
    syncs = [r["sync_loop_s"] for r in recorded.values() if "sync_loop_s" in r]
    print(f"real runs: {rec['date']}, {rec['machine']['cpus']} CPUs ({rec['machine']['cpu']}), commit {rec['commit']}, "
          f"1-minute load {min(loads, default=0):.1f}-{max(loads, default=0):.1f}; the pairs' identical sync runs "
          f"took {min(syncs, default=0):.2f}-{max(syncs, default=0):.2f} s (the load's noise on one pair's ratio)")
    print(f"simulator: {profile_from(sync).name}, calibrated from the sync run alone; {len(rs) + 1} presets simulated "
          f"in {time.perf_counter() - t0:.1f} s")
    print(format_table(rs, sync))
    return 0


if __name__ == "__main__":
    sys.exit(main())
