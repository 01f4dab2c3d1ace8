"""StreamRL (§7): disaggregated stream generation and skewness-aware dispatch against colocated baselines."""
from __future__ import annotations

from typing import Callable

from sim.profiles import BYTES_PER_PARAM, QWEN25_72B
from sim.repro.core import Paper, Row, Runs, Setting
from sim.repro.figures import after_warmup_throughput

# StreamRL §7: H800 cluster, global batch 1024 (PPO: one sample per prompt), 7B on the 20K dataset; verl colocated
# on all 32 GPUs vs StreamRL disaggregated 16 + 16 (its GPU split is in Fig. 10 only: an even split is assumed).
# Throughput is the paper's (§7 Metrics): "the sample throughput over 20 consecutive training iterations after
# warm-up", i.e. samples trained per second from the end of the first iteration to the end of the last (3
# iterations here, the first one the warm-up: the asynchronous mode cannot overlap anything in it, and counting it
# would measure pipeline fill, not the steady state the paper reports). The same definition for every row of this
# paper, baseline included.
SR_VERL = Setting("streamrl_20k", "h800_streamrl_7b", 32, 32, 1024, 1, 3, colocated=True)
SR_DIS = Setting("streamrl_20k", "h800_streamrl_7b", 16, 16, 1024, 1, 3)
SR_WARMUP = 1



def sr_speedup(new: tuple, base: tuple) -> Callable[[Runs], float | None]:
    def f(runs: Runs) -> float | None:
        a, b = runs.get(*new), runs.get(*base)
        return None if a is None or b is None else after_warmup_throughput(a) / after_warmup_throughput(b)
    return f


STREAMRL = [
    Row("72B weight transfer over 80 Gb/s, bf16 (§7.3)", (0.0, 10.0), "< 10 s",
        lambda runs: QWEN25_72B.params * BYTES_PER_PARAM / (80e9 / 8), "{:.1f} s"),
    Row("StreamRL-Sync vs verl, 7B/20K (§7.1; range over 9 settings)", (1.12, 2.12), "1.12–2.12x",
        sr_speedup(("streamrl", SR_DIS), ("sync", SR_VERL)), "{:.2f}x"),
    Row("StreamRL-Async vs verl (§7.1)", (1.30, 2.66), "1.30–2.66x",
        sr_speedup(("streamrl_async", SR_DIS), ("sync", SR_VERL)), "{:.2f}x"),
]

PAPER = Paper(STREAMRL)
