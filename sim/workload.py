"""Workloads: how long each sampled response is, per prompt, with a long tail and within-group correlation.

Length model (`LengthModel`), per prompt p and sample k:

    z_p ~ N(0, 1)                      prompt difficulty (shared by the G samples of a group)
    e_pk ~ N(0, 1)                     per-sample noise
    len_pk = min(cap, median * exp(sigma_prompt * z_p + sigma_sample * e_pk))
    runaways: a runaway sample runs to the cap instead (repetition / endless reasoning); only the hardest
    `runaway_prompts` of the prompts (z_p above its quantile) are prone to it, and each of their samples runs away
    with probability runaway_p / runaway_prompts, so runaway_p stays the share of samples that run away
    (runaway_prompts = 1: every sample independently, with probability runaway_p)

so log-lengths within a group correlate with ICC = sigma_prompt^2 / (sigma_prompt^2 + sigma_sample^2). The papers
say difficult prompts "consistently produce long responses" (RollPacker §6.3) and that a group's trajectories "tend to
be either all long or all short" (StaleFlow App. C) but give no number: we take ICC = 0.6 (assumption). A tail tied to
the prompt matters for speculative execution: a runaway drawn independently per sample is removed by any
over-provisioning of responses, one that belongs to the prompt is not. A sample's
reward is correct with probability sigmoid(-1.5 z_p) (assumption: harder prompts are longer and solved less often;
no paper number; it only makes reward_mean non-trivial). Every value is a pure function of (seed, prompt index,
sample index), so a run is reproducible and an aborted-then-requeued sample regenerates the same length.

Trace replay (`TraceWorkload`, `--trace FILE.jsonl`): one JSON object per line, one line per prompt,
`{"prompt_len": int, "response_lens": [int, ...]}` (one entry per group member; extra keys are ignored). The trace
repeats from its start when a run needs more prompts than it has. A run may ask a prompt for more responses than
the trace recorded (a speculative preset launches ceil(1.25 G) per prompt, RollPacker §3): sample k >= n of a
prompt with n recorded responses is a draw, with replacement, from that prompt's own n recorded lengths (uniform,
a pure function of (seed, prompt index, k)), so the extra responses follow the prompt's own length distribution
and recorded samples keep their lengths.
"""
from __future__ import annotations

import hashlib
import json
import math
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from statistics import NormalDist
from typing import Any

from rl.jsonl import iter_jsonl


@dataclass(frozen=True)
class PromptSpec:
    prompt_len: int
    difficulty: float
    p_correct: float
    mix: float = 0.5             # a uniform in (0, 1) of the prompt's own: picks its task in a reward mix
    reward_z: float = 0.0        # a standard normal of the prompt's own: how slow its verifier runs


class Workload:
    """Base: a deterministic map (prompt index, sample index) -> lengths. Subclasses provide `name` and `max_len`
    (the response cap: a response of that length finishes with reason "length")."""
    name: str
    max_len: int
    multi_turn = False            # episodes with tool calls (sim/episodes.py); False: one model turn per sample

    def prompt(self, index: int) -> PromptSpec:
        raise NotImplementedError

    def episode(self, prompt_index: int, sample_index: int) -> Any:
        """A multi-turn workload's `sim.episodes.Episode` of this sample (its tool calls); None: single-turn."""
        return None

    def response_len(self, prompt_index: int, sample_index: int) -> int:
        raise NotImplementedError

    def with_seed(self, seed: int) -> "Workload":
        return self


_QUAD = struct.Struct("<4Q").unpack   # the 32-byte digest as four little-endian 64-bit integers
_TWO64 = 2.0**64


def _uniforms(*key: Any) -> tuple[float, float, float, float]:
    """Four independent uniforms in (0, 1) from a hash of `key`: stable across processes and platforms, and
    much cheaper than seeding a generator per sample."""
    a, b, c, d = _QUAD(hashlib.blake2b(":".join(map(str, key)).encode(), digest_size=32).digest())
    return (a + 0.5) / _TWO64, (b + 0.5) / _TWO64, (c + 0.5) / _TWO64, (d + 0.5) / _TWO64


def _normal(u1: float, u2: float) -> float:
    """Box-Muller."""
    return math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)


def _reward_draws(seed: int, name: str, index: int) -> tuple[float, float]:
    """A prompt's own reward-side draws: `mix` (a uniform) and `reward_z` (a standard normal)."""
    u1, u2, u3, _ = _uniforms(seed, name, index, "reward")
    return u1, _normal(u2, u3)


def _phi(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


@dataclass(frozen=True)
class LengthModel(Workload):
    name: str
    median: float
    sigma_prompt: float
    sigma_sample: float
    max_len: int
    runaway_p: float = 0.0
    runaway_prompts: float = 1.0   # share of prompts (the hardest) whose samples may run away
    prompt_median: float = 300.0
    prompt_sigma: float = 0.5
    prompt_max: int = 2048
    min_len: int = 1
    seed: int = 0
    source: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.runaway_prompts <= 1 or not 0 <= self.runaway_p <= self.runaway_prompts:
            raise ValueError(f"workload {self.name}: need 0 < runaway_prompts <= 1 and 0 <= runaway_p <= "
                             f"runaway_prompts, got {self.runaway_p} and {self.runaway_prompts}")
        self._fresh_cache()

    def _fresh_cache(self) -> None:
        """Every prompt's spec once computed, and the runaway threshold, kept on the instance (pure functions of its
        fields; a hashed cache keyed by the model re-hashed all its fields on every call)."""
        object.__setattr__(self, "_specs", {})
        z = -math.inf if self.runaway_prompts >= 1 else NormalDist().inv_cdf(1 - self.runaway_prompts)
        object.__setattr__(self, "_runaway_z", z)

    def __getstate__(self) -> dict[str, Any]:
        """Pickled without the cache (a reproduction's pool ships the workload with every result)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_specs", "_runaway_z")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._fresh_cache()

    def with_seed(self, seed: int) -> "LengthModel":
        return replace(self, seed=seed)

    def prompt(self, index: int) -> PromptSpec:
        spec = self._specs.get(index)
        if spec is None:
            spec = self._specs[index] = _prompt_spec(self, index)
        return spec

    @property
    def runaway_z(self) -> float:
        """The difficulty above which a prompt is runaway-prone (-inf: every prompt)."""
        return self._runaway_z

    def response_len(self, prompt_index: int, sample_index: int) -> int:
        z = self.prompt(prompt_index).difficulty
        u1, u2, u3, _ = _uniforms(self.seed, self.name, prompt_index, sample_index)
        if z > self._runaway_z and u3 < self.runaway_p / self.runaway_prompts:
            return self.max_len
        x = self.median * math.exp(self.sigma_prompt * z + self.sigma_sample * _normal(u1, u2))
        return int(min(self.max_len, max(self.min_len, round(x))))

    @property
    def sigma(self) -> float:
        return math.hypot(self.sigma_prompt, self.sigma_sample)

    def mean(self) -> float:
        """Expected response length (closed form for the capped lognormal plus the runaway mass)."""
        return _capped_mean(self.median, self.sigma, self.max_len, self.runaway_p)


def _prompt_spec(m: LengthModel, index: int) -> PromptSpec:
    u1, u2, u3, u4 = _uniforms(m.seed, m.name, index)
    z, z_len = _normal(u1, u2), _normal(u3, u4)
    plen = int(min(m.prompt_max, max(1, round(m.prompt_median * math.exp(m.prompt_sigma * z_len)))))
    return PromptSpec(plen, z, 1.0 / (1.0 + math.exp(1.5 * z)), *_reward_draws(m.seed, m.name, index))


def _capped_mean(median: float, sigma: float, cap: float, runaway: float) -> float:
    mu = math.log(median)
    body = (math.exp(mu + sigma * sigma / 2) * _phi((math.log(cap) - mu - sigma * sigma) / sigma)
            + cap * (1 - _phi((math.log(cap) - mu) / sigma)))
    return (1 - runaway) * body + runaway * cap


def median_for_mean(target: float, sigma: float, cap: float, runaway: float) -> float:
    """The lognormal median whose capped mixture has mean `target` (fits a paper's reported mean length)."""
    lo, hi = 1.0, cap
    for _ in range(100):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if _capped_mean(mid, sigma, cap, runaway) < target else (lo, mid)
    return math.sqrt(lo * hi)


def _split(sigma: float, icc: float = 0.6) -> tuple[float, float]:
    return sigma * math.sqrt(icc), sigma * math.sqrt(1 - icc)


# RollPacker §2.2 (Qwen2.5-14B, 16k cap): "P75 ranging between 755 and 1.1k tokens, the longest responses can extend
# up to 16k tokens", §1: "the longest response 25×–32× longer than the medi[an]". We take max/median = 28.5 (middle)
# so median = cap / 28.5 and P75 = 930 (middle of 755–1.1k) so sigma = ln(930 / 575) / 0.674 = 0.713. The cap is
# reached through runaways tied to the prompt (§6.3: "some difficult prompts consistently produce long responses"):
# the hardest RP_RUNAWAY_PROMPTS = 3 / 128 of the prompts are prone, so a step of P0 = 128 prompts holds 3 of them on
# average and 95% of steps reach the cap (the paper's max = cap per step). The paper gives these statistics only for
# 14B/16k; for 7B/8k and 32B/32k we assume the same shape (same ratios to the cap).
#
# RP_RUNAWAY_RHO, the share of a prone prompt's samples that run to the cap, is set by §6.3's qualitative constraint
# (no number in the paper): with P fixed to P0 and R0 = 8, "a substantial reduction in rollout time is observed only
# when eta [for R] is increased to 1.5". A prompt launching ceil(eta R0) responses keeps its first R0 to finish, so
# it sheds at most 2 of 10 at eta 1.25 and at most 4 of 12 at eta 1.5; a runaway finishes last. For the step at 1.25
# to stay slow, a prone prompt must hold more runaways than it sheds (10 rho > 2), and for 1.5 to clear it, no more
# than it sheds (12 rho <= 4): rho in (0.2, 1/3]. We take the interval's midpoint, 4/15 ~ 0.27, so
# RP_RUNAWAY = 3/128 x 4/15 = 0.6% of samples run to the cap. tests/sim/test_repro_rollpacker.py checks the
# constraint in the simulator (the eta_R table at 32B/32k); it is not a row of the reproduction.
RP_RATIO, RP_P75_OVER_MEDIAN = 28.5, 930 / (16384 / 28.5)
RP_RUNAWAY_PROMPTS = 3 / 128
RP_RUNAWAY_RHO = (2 / 10 + 4 / 12) / 2
RP_RUNAWAY = RP_RUNAWAY_PROMPTS * RP_RUNAWAY_RHO
RP_SIGMA = math.log(RP_P75_OVER_MEDIAN) / 0.6745


def _rollpacker(cap: int, name: str) -> LengthModel:
    sp, ss = _split(RP_SIGMA)
    return LengthModel(name, cap / RP_RATIO, sp, ss, cap, RP_RUNAWAY, RP_RUNAWAY_PROMPTS, prompt_median=300, source=(
        "RollPacker §1/§2.2: P75 755–1.1k, max = cap, max/median 25–32x (14B/16k); same shape assumed at other "
        "caps; runaways tied to the hardest 3/128 of prompts, 4/15 of their samples (§6.3's eta_R constraint); "
        "ICC 0.6 and prompt lengths (median 300) are assumptions"))


# RolloutPipe reports no tail statistics: its workload borrows RollPacker's prone prompts (3/128), each with half its
# samples running to the cap (an assumption of its own: RollPacker's §6.3 share, RP_RUNAWAY_RHO, is a constraint of
# RollPacker's data set and is not applied here).
RO_RUNAWAY = RP_RUNAWAY_PROMPTS * 0.5


def _rolloutpipe() -> LengthModel:
    cap, sp_ss = 16384, _split(RP_SIGMA)
    med = median_for_mean(3450, RP_SIGMA, cap, RO_RUNAWAY)
    return LengthModel("rolloutpipe", med, *sp_ss, cap, RO_RUNAWAY, RP_RUNAWAY_PROMPTS, prompt_median=400, source=(
        "RolloutPipe §5.3: mean response 3.3k–3.6k (median fitted so the mean is 3.45k); tail shape from RollPacker "
        "(not reported by RolloutPipe; prone prompts' runaway share 1/2, an assumption); cap 16384 and prompt "
        "median 400 are assumptions"))


def _p99_over_p50(cap: int, name: str, source: str, prompt_median: float = 300) -> LengthModel:
    sigma = math.log(10) / 2.326  # p99 / p50 = 10
    return LengthModel(name, cap / 10, *_split(sigma), cap, 0.0, prompt_median=prompt_median, source=source)


# StreamRL's 20K data set (DeepSeek-R1 responses to CodeMath prompts, replayed; §7 Dataset): its length histogram is
# Fig. 7 only. "The maximum output length is 20K": the longest response of a round of 1024 prompts (the quantile
# 1 - 1/1024, z = 3.10) sits at the cap. The log-sigma is the largest on a 0.05 grid for which Algorithm 1's split
# balances the 10K data set's first iterations (Fig. 11: StreamRL scales out only "after iteration 10 and 16"): the
# two stages within 10% and generation behind by less than one more node saves (seed 0, the simulated H800 engines
# and trainer, the Table 4 ranker; 0.5 leaves generation 6 s behind where a node saves 3 s; the test in
# tests/sim/test_streamrl_repro.py): 0.45, so median = cap / 4.0 and p99 / p50 = 2.8
# (Laminar's p99 / p50 = 10 puts 1% of every round at the cap, and Algorithm 1 then cannot balance Fig. 11's start:
# generation is a cap-length decode whatever its GPUs). The 10K and 5K data sets are its lengths halved and quartered.
STREAMRL_SIGMA = 0.45
STREAMRL_ROUND_MAX_Z = NormalDist().inv_cdf(1 - 1 / 1024)


def _streamrl(cap: int, name: str, source: str) -> LengthModel:
    return LengthModel(name, cap * math.exp(-STREAMRL_ROUND_MAX_Z * STREAMRL_SIGMA), *_split(STREAMRL_SIGMA), cap,
                       0.0, prompt_median=300, source=source)


WORKLOADS: dict[str, Workload] = {w.name: w for w in [
    _rollpacker(8192, "rollpacker_7b_8k"), _rollpacker(16384, "rollpacker_14b_16k"),
    _rollpacker(32768, "rollpacker_32b_32k"), _rolloutpipe(),
    _streamrl(20480, "streamrl_20k", "StreamRL §7: 'the maximum output length is 20K' (the longest of a "
              "1024-prompt round, p99.9), log-sigma 0.45 chosen by Fig. 11's balanced start (Algorithm 1 balances "
              "the 10K data set's first iterations: tests/sim/test_streamrl_repro.py); median = cap / 4"),
    _streamrl(10240, "streamrl_10k", "StreamRL §7: the 20K dataset's lengths halved"),
    _streamrl(5120, "streamrl_5k", "StreamRL §7: the 20K dataset's lengths quartered"),
    _p99_over_p50(16384, "laminar_16k", "Laminar §8: max output 16K; §1/Fig. 2: p99 ~ 10x p50; median = cap/10"),
    _p99_over_p50(20480, "staleflow_20k", "StaleFlow §6.1: response limit 20K, group-correlated (App. C); no "
                  "numbers: StreamRL-like shape assumed"),
    LengthModel("cpu_tiny", 10, *_split(0.5), 32, 0.0, prompt_median=4, prompt_sigma=0.2, prompt_max=16,
                source="our tiny `reverse` run (sim/profiles.py cpu_tiny): max_new_tokens 32, mean response 11.4 "
                       "tokens (median 10 here), prompts of ~4 tokens"),
]}


def get_workload(name: str | Workload, seed: int = 0) -> Workload:
    if isinstance(name, Workload):
        return name.with_seed(seed)
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; workloads: {sorted(WORKLOADS)} (or --trace FILE.jsonl)")
    return WORKLOADS[name].with_seed(seed)


@dataclass(frozen=True)
class RampedWorkload(Workload):
    """A workload whose response lengths scale linearly with the prompt index, from `start` x to `end` x over the
    first `prompts` prompts (StreamRL §7.4 Fig. 11: "linearly scale the output length of the dataset to adjust the
    maximum output length from 10K to 20K", as lengths grow during RL training); the cap is the base's."""
    base: Workload
    start: float
    end: float
    prompts: int

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"{self.base.name}@{self.start:g}-{self.end:g}x/{self.prompts}"

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return self.base.max_len

    def with_seed(self, seed: int) -> "RampedWorkload":
        return replace(self, base=self.base.with_seed(seed))

    def prompt(self, index: int) -> PromptSpec:
        return self.base.prompt(index)

    def response_len(self, prompt_index: int, sample_index: int) -> int:
        scale = self.start + (self.end - self.start) * min(1.0, prompt_index / max(1, self.prompts))
        return max(1, min(self.max_len, round(self.base.response_len(prompt_index, sample_index) * scale)))


# ---------------------------------------------------------------------------------------------------- traces
class TraceError(ValueError):
    """A malformed trace row; the message names the file, line and field."""


@dataclass(frozen=True)
class TraceWorkload(Workload):
    name: str
    rows: tuple[tuple[int, tuple[int, ...]], ...]
    path: str = ""
    seed: int = 0

    def with_seed(self, seed: int) -> "TraceWorkload":
        return replace(self, seed=seed)

    @property
    def max_len(self) -> int:  # type: ignore[override]
        return max(max(lens) for _, lens in self.rows)

    def prompt(self, index: int) -> PromptSpec:
        return PromptSpec(self.rows[index % len(self.rows)][0], 0.0, 0.5, *_reward_draws(self.seed, self.name, index))

    def response_len(self, prompt_index: int, sample_index: int) -> int:
        lens = self.rows[prompt_index % len(self.rows)][1]
        if sample_index < len(lens):
            return lens[sample_index]
        u = _uniforms(self.seed, self.name, "extra", prompt_index, sample_index)[0]   # module docstring: the rule
        return lens[min(len(lens) - 1, int(u * len(lens)))]


def load_trace(path: str | Path) -> TraceWorkload:
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: trace file does not exist")
    rows = []
    for n, row in iter_jsonl(path, TraceError):
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
        for key in ("prompt_len", "response_lens"):
            if key not in row:
                raise TraceError(f"{path}:{n}: field {key!r} is missing")
        plen, lens = row["prompt_len"], row["response_lens"]
        if not _pos_int(plen):
            raise TraceError(f"{path}:{n}: field 'prompt_len' must be a positive integer, got {plen!r}")
        if not isinstance(lens, list) or not lens:
            raise TraceError(f"{path}:{n}: field 'response_lens' must be a non-empty list, got {lens!r}")
        for j, x in enumerate(lens):
            if not _pos_int(x):
                raise TraceError(f"{path}:{n}: field 'response_lens'[{j}] must be a positive integer, got {x!r}")
        rows.append((plen, tuple(lens)))
    if not rows:
        raise TraceError(f"{path}: trace holds no rows")
    return TraceWorkload(f"trace:{path.name}", tuple(rows), str(path))


def _pos_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1


def save_trace(workload: Workload, path: str | Path, num_prompts: int, group_size: int) -> Path:
    """Write `num_prompts` prompts of `workload` as a trace (for replay elsewhere, or to edit by hand)."""
    path = Path(path)
    with open(path, "w") as f:
        for i in range(num_prompts):
            lens = [workload.response_len(i, k) for k in range(group_size)]
            f.write(json.dumps({"prompt_len": workload.prompt(i).prompt_len, "response_lens": lens}) + "\n")
    return path
