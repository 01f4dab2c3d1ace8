"""Our simulated numbers beside a paper's headline figures.

    python -m sim.repro PAPER [--seeds 0,1,2] [--jobs 2]      PAPER: rolloutpipe | rollpacker | streamrl | staleflow
                                                              | laminar

Prints the paper's simulated components, then `figure | ours | paper | hit (margin) | setting` rows (ours: the mean
over the seeds, with the smallest and largest in brackets) and the notes the reproduction prints (what the simulator
chose), and last `PAPER: K/N headline figures within 20%, W more weak (...); B/M bound rows hold, not counted` under
the hit rule and accounting of sim/repro/core.py (within 20% of the paper's range; a speedup counts only if our gain
is at least half the paper's smallest gain; edge hits, hits through compensating errors and caveated hits are weak
and apart; "up to" and "< x" rows are bounds, apart; arithmetic rows are labelled and not counted). A row whose
policy has no preset yet prints "policy not available yet" and counts as a miss; a run that fails prints its error
and counts as a miss. Progress goes to stderr (one line per finished simulation; `--quiet` for none). Honesty rules:
the settings are the papers' (model, hardware, batch, group size, GPU split or the paper's rule for it); the cost constants and workloads come from
sim/profiles.py and sim/workload.py, none derived from any figure reproduced here. Each paper's module
(sim/repro/<paper>.py) holds its settings, rows and assumptions.
"""
from __future__ import annotations

import argparse
import sys
import textwrap

from sim.repro import laminar, rolloutpipe, rollpacker, staleflow, streamrl
from sim.repro.core import (ARITHMETIC, BOUND, LEVEL, NA, SPEEDUP, Paper, Row, Runs, Sensitivity, Setting,
                            count_line, default_jobs, evaluate, judge, margin, verdicts)

PAPERS: dict[str, Paper] = {"rolloutpipe": rolloutpipe.PAPER, "rollpacker": rollpacker.PAPER,
                            "streamrl": streamrl.PAPER, "staleflow": staleflow.PAPER, "laminar": laminar.PAPER}

__all__ = ["ARITHMETIC", "BOUND", "LEVEL", "NA", "PAPERS", "SPEEDUP", "Paper", "Row", "Runs", "Setting", "judge",
           "main", "margin"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paper", choices=sorted(PAPERS))
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="comma-separated seeds (default: 0, 1, 2)")
    ap.add_argument("--jobs", type=int, default=default_jobs(),
                    help="simulations run in parallel worker processes, every seed's at once (default: one per "
                         "core, at least 2; 1: all in this process)")
    ap.add_argument("--train-speed", type=float, default=1.0, metavar="F",
                    help="sensitivity, not the reproduction: every cost profile trains F times faster per token "
                         "(training speed is an assumption in most profiles: `python -m sim profiles`)")
    ap.add_argument("--prefill-cost", type=float, default=1.0, metavar="P",
                    help="sensitivity, not the reproduction: every cost profile spends P times its seconds per "
                         "prefilled token (prompts, recomputes, re-prefills; the prefill rate is an assumption)")
    ap.add_argument("--quiet", action="store_true", help="no progress lines on stderr (one per finished "
                    "simulation, or per row with --jobs 1); stdout has the table either way")
    args = ap.parse_args(argv)
    try:
        sens = Sensitivity(args.train_speed, args.prefill_cost)
    except ValueError as e:
        ap.error(str(e).replace("train_speed", "--train-speed").replace("prefill_cost", "--prefill-cost"))
    paper = PAPERS[args.paper]
    seeds = args.seeds if args.seeds else list(range(paper.seeds))
    print(f"{args.paper}: seeds {', '.join(map(str, seeds))}; ours = mean [min, max] over the seeds")
    if paper.components:
        print(textwrap.fill(paper.components, 118))
    per_row, notes = evaluate(args.paper, seeds, args.jobs, sens,
                              progress=None if args.quiet else lambda line: print(f"[{args.paper}] {line}",
                                                                                   file=sys.stderr, flush=True))
    print("figure | ours | paper | hit (margin) | setting")
    for row, v in zip(paper.rows, verdicts(paper.rows, per_row)):
        print(f"{row.figure} | {v.text} | {row.paper_text} | {v.mark} | {row.setting}".rstrip(" |"), flush=True)
    for line in notes:
        print(textwrap.fill(line, 118))
    note = f" (sensitivity run: {sens.label()})" if sens.label() else ""
    print(count_line(args.paper, paper.rows, verdicts(paper.rows, per_row)) + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
