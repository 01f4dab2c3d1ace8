"""Every scheduling preset in configs/sched/*.toml on one common long-tail workload, side by side.

    python -m sim.compare [--gpus 64] [--trace FILE.jsonl] [--seed 0] [--out runs/compare] [--json]
    python -m sim.compare --presets sync --sched.dispatch=fewest_tokens      # one policy, no preset file written
    python -m sim.compare --workload agentic_7b_8k [--tool-trace SECONDS.json]  # multi-turn, tool-using episodes

`--presets a,b` runs only those presets; `--sched.KIND=NAME` and `--sched.KIND.PARAM=V` change the mechanisms of
every preset run, read by the same code as train.py's (config.load_config, then sched.load_preset).

Setting (defaults): RollPacker's 7B/8k long-tail workload (sim/workload.py) on the h800_7b cost profile, GPUs split
half engines (TP 1) and half trainer, GRPO groups of 8, 128 prompts per round (RollPacker's P0), and each preset runs
until it has trained `--rounds` rounds' worth of samples (the same work for presets whose optimizer steps differ;
the default 5 covers a whole tail-batching period, so deferred long prompts are paid for).
Columns:
    throughput              trained samples / seconds from the first round start to the last train call's end
    tokens_per_s            trained tokens (prompt + response) over the same window (StaleFlow's and Laminar's
                            throughput; samples/s favours a design that trains a short-biased subset)
    trained_len_ratio       mean trained response length / mean generated (finished) one: below 1, that bias
    rollout_to_train_end_s  RolloutPipe's "main time", mean over rounds (sched/metrics.py)
    trainer_wait_ratio      RolloutPipe §5.1: trainer wait / (wait + compute)
    engine_idle_ratio       1 - decode busy time / (engines x makespan)
    calls_redone            (a multi-turn workload only) tool calls made again: the request was interrupted,
                            migrated or requeued while its call ran, and the call starts over when it resumes
A preset that fails is a row with its error, not a crash. Each preset's timeline goes to OUT/<preset>.png.
Progress goes to stderr, one line per preset as it ends (`[3/15] laminar 4.1 s`); stdout holds only the table.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import sched
from sched.base import Preset
from sim.profiles import get_profile
from sim.run import draw_timeline, simulate
from sim.episodes import load_latency_trace
from sim.workload import get_workload, load_trace, TraceError

KEYS = ("preset", "throughput", "tokens_per_s", "trained_len_ratio", "rollout_to_train_end_s", "trainer_wait_ratio",
        "engine_idle_ratio")


def presets() -> list[str]:
    return sorted(p.stem for p in sched.PRESET_DIR.glob("*.toml"))


def throughput(events: list, samples: int) -> float:
    starts = [e.t for e in events if e.kind == "round_started"]
    ends = [e.t for e in events if e.kind == "train_step_done"]
    return samples / (max(ends) - min(starts)) if starts and ends and max(ends) > min(starts) else 0.0


def trained_tokens(events: list) -> tuple[float, float]:
    """(tokens trained, mean trained response length / mean finished response length) of a run's event log."""
    done = [e.data for e in events if e.kind == "train_step_done" and e.data.get("samples")]
    n = sum(d["samples"] for d in done)
    trained = sum(d["samples"] * d.get("response_len_mean", 0.0) for d in done) / n if n else 0.0
    fin = [e.data.get("tokens", 0) for e in events if e.kind == "trajectory_finished"]
    generated = sum(fin) / len(fin) if fin else 0.0
    return sum(d.get("tokens", 0.0) for d in done), (trained / generated if generated else 0.0)


def calls_redone(events: list) -> int:
    """Tool calls started again for a (request, turn) that had already started one (sim/engine.py: a request
    interrupted on a tool makes its call again when it resumes)."""
    starts = [(e.req_id, e.data.get("turn")) for e in events if e.kind == "tool_started"]
    return len(starts) - len(set(starts))


def with_overrides(args: list[str], presets: list[str]) -> dict[str, Preset]:
    """Each of `presets` with the `--sched.KIND=NAME` / `--sched.KIND.PARAM=V` overrides `args` laid over it, read as
    train.py reads them. Raises ValueError naming the bad argument or key."""
    overrides, sources = sched.command_line_overrides(args)
    return {name: sched.load_preset(name, overrides, sources) for name in presets}


def run_one(name: str, args: argparse.Namespace, workload: Any, out: Path | None,
            preset: Preset | None = None) -> dict[str, Any]:
    """One preset's row; `preset`: its mechanisms already built (with overrides), else loaded from its file."""
    try:
        engines, train = max(1, args.gpus // 2), max(1, args.gpus - args.gpus // 2)
        samples = args.rounds * args.prompts * args.group_size
        cost = get_profile(args.cost)
        if getattr(args, "switch_s", 0.0):
            cost = dataclasses.replace(cost, switch_s=args.switch_s)
        r = simulate(preset or name, workload, cost, engines, train, steps=10**9, group_size=args.group_size,
                     prompts_per_step=args.prompts, seed=args.seed, samples=samples)
        m = r.metrics
        tokens, ratio = trained_tokens(r.events)
        row = {"preset": name, "throughput": throughput(r.events, m["samples_trained"]),
               "tokens_per_s": throughput(r.events, tokens), "trained_len_ratio": ratio,
               "rollout_to_train_end_s": m.get("rollout_to_train_end_s"),
               "trainer_wait_ratio": m.get("trainer_wait_ratio"), "engine_idle_ratio": m.get("engine_idle_ratio")}
        if getattr(workload, "multi_turn", False):
            row["calls_redone"] = calls_redone(r.events)
        if out is not None:
            draw_timeline(r.events, out / f"{name}.png", name, r.num_engines)
        return row
    except Exception as e:  # one broken preset must not hide the others
        row = {k: None for k in KEYS}
        row.update(preset=name, error=f"{type(e).__name__}: {e}")
        if args.verbose:
            traceback.print_exc()
        return row


def format_table(rows: list[dict[str, Any]]) -> str:
    w = max([17, *(len(r["preset"]) for r in rows)])      # the preset column fits the longest name
    head = (f"{'preset':{w}s} {'samples/s':>10s} {'tokens/s':>10s} {'trained/gen len':>16s} "
            f"{'rollout_to_train_end_s':>23s} {'trainer_wait':>13s} {'engine_idle':>12s}")
    tools = any("calls_redone" in r for r in rows)
    if tools:
        head += f" {'calls_redone':>13s}"
    lines = [head, "-" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['preset']:{w}s} FAILED: {r['error']}")
            continue
        r2t = r["rollout_to_train_end_s"]
        lines.append(f"{r['preset']:{w}s} {r['throughput']:10.2f} {r['tokens_per_s']:10.0f} "
                     f"{r['trained_len_ratio']:16.2f} {('%.1f' % r2t) if r2t is not None else '-':>23s} "
                     f"{r['trainer_wait_ratio']:13.1%} {r['engine_idle_ratio']:12.1%}"
                     + (f" {r.get('calls_redone', 0):13d}" if tools else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=64, help="simulated GPUs, half engines and half trainer")
    ap.add_argument("--trace", help="replay response lengths from a JSONL trace instead of the workload model")
    ap.add_argument("--workload", default="rollpacker_7b_8k",
                    help="a workload of sim/workload.py or sim/episodes.py (agentic_7b_8k: multi-turn tool use)")
    ap.add_argument("--tool-trace", help="a multi-turn workload's tool latency from recorded seconds "
                                         "(sim/episodes.py: a JSON list, {\"seconds\": [...]}, or JSON Lines)")
    ap.add_argument("--cost", default="h800_7b", help="cost profile (sim/profiles.py)")
    ap.add_argument("--switch-s", type=float, default=0.0,
                    help="seconds an engine lent to the trainer or given back takes to change role each way "
                         "(cost.switch_s; verl_hybrid's Hybrid replicas sleeping and waking); default: the profile's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds' worth of samples each preset trains (5 = one tail-batching period, 4 short + 1 long)")
    ap.add_argument("--prompts", type=int, default=128, help="prompts per round")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--out", default="runs/compare", help="directory for the timeline pictures")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the table as a JSON list of rows")
    ap.add_argument("--verbose", action="store_true", help="print tracebacks of failing presets")
    ap.add_argument("--presets", help="comma-separated presets to run (default: every configs/sched/*.toml)")
    args, extra = ap.parse_known_args(argv)
    if args.gpus < 2:
        ap.error("--gpus must be at least 2 (one engine, one train GPU)")
    if args.switch_s < 0:
        ap.error(f"--switch-s must be >= 0 seconds, got {args.switch_s}")
    names = presets()
    chosen = [p for p in (args.presets or "").split(",") if p] or names
    unknown = [p for p in chosen if p not in names]
    if unknown:
        ap.error(f"--presets: no configs/sched/<name>.toml for {', '.join(unknown)}; presets: {', '.join(names)}")
    try:
        workload = load_trace(args.trace) if args.trace else get_workload(args.workload, args.seed)
        if args.tool_trace:
            if not workload.multi_turn:
                raise ValueError(f"--tool-trace needs a multi-turn workload (agentic_7b_8k); {workload.name} has "
                                 f"no tool calls")
            workload = workload.with_latency(load_latency_trace(args.tool_trace))
        built = with_overrides(extra, chosen) if extra else {}
    except (TraceError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = None if args.no_plots else Path(args.out)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, name in enumerate(chosen, 1):
        t = time.perf_counter()
        rows.append(run_one(name, args, workload, out, built.get(name)))
        failed = " (failed)" if "error" in rows[-1] else ""
        print(f"[{i}/{len(chosen)}] {name} {time.perf_counter() - t:.1f} s{failed}", file=sys.stderr, flush=True)
    if extra and not args.json:
        print(f"sched overrides, every preset: {' '.join(extra)}")
    print(json.dumps(rows) if args.json else format_table(rows))
    if out is not None and not args.json:
        print(f"timelines: {out}/<preset>.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
