"""python -m sim profiles [NAME ...]   every cost constant with its source
   python -m sim workloads             each workload's length statistics (one 128 x 8 step, seed 0) and source
   python -m sim split --workload W --cost C --gpus N [--prompts P --group-size G]
                                       StreamRL's Algorithm 1: the generation / training split for a workload"""
from __future__ import annotations

import statistics
import sys

from sim.profiles import PROFILES, describe, get_profile
from sim.workload import WORKLOADS


def workloads() -> str:
    lines = []
    for name, w in WORKLOADS.items():
        x = sorted(w.response_len(p, k) for p in range(128) for k in range(8))
        med = statistics.median(x)
        lines.append(f"{name:20s} median {med:6.0f}  P75 {x[int(0.75 * len(x))]:6d}  mean {statistics.fmean(x):6.0f}  "
                     f"max {x[-1]:6d}  max/median {x[-1] / med:5.1f}  cap {w.max_len}\n    {w.source}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["profiles"]:
        print("\n\n".join(describe(get_profile(n)) for n in (argv[1:] or sorted(PROFILES))))
    elif argv[:1] == ["workloads"]:
        print(workloads())
    elif argv[:1] == ["split"]:
        from sim.split import main as split
        return split(argv[1:])
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
