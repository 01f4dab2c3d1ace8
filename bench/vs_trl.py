"""End to end against TRL's GRPOTrainer on the same job, alternating runs in one invocation.

    pip install -e ".[bench]"                      # trl: a benchmark-only dependency, never needed by the job
    python bench/vs_trl.py                         # tiny default (150 steps) + long generations, every mode
    python bench/vs_trl.py --trl-python PY --repeats 2   # PY: the python of a venv with trl installed
    python bench/vs_trl.py --quick --skip-trl      # the machinery in a few steps (the suite runs this)
    python bench/vs_trl.py --settings tiny --seed 1   # another sampling seed on both sides (reward curves)

The job is the README's (configs/tiny.toml) on both sides: the same random-init tiny Qwen3-shaped model (our
`Transformer.init_weights(seed=0)`, saved in the HF layout by model/hf_io.py), our character tokenizer as a HF
tokenizer, our reverse-task prompts and positional reward (rl/tasks.py; the response decoded as our rollout ranks
decode it: final EOS dropped, other special tokens kept), G = 8, 32 prompts per step, temperature 1, lr 1e-3,
AdamW betas (0.9, 0.99), no weight decay, grad clip 1, clip 0.2 / 0.28, token-mean loss ("dapo"), no KL, advantages
normalised by the group std, one optimizer step per batch of 256 samples, fp32 on CPU. Our `warmup_steps = 1` gives
the full lr at the first step (trainer/optim.py `lr_factor`), which is TRL's `lr_scheduler_type = "constant"`
(transformers' "constant_with_warmup" with 1 warmup step would give lr 0 at the first step).

Settings:
    tiny   the README job: reverse task, 4 new tokens, `--steps` steps (150)
    long   long generations, same model shape: the `repeat` task with every answer `--long-len` symbols long
           (rl/tasks.py LengthDist with the whole mass in the tail), `--long-steps` steps, every response exactly
           `--long-len` tokens on both sides (a random-init model samples EOS within ~20 tokens, so the length is
           fixed instead): ours `perf.ignore_eos` (EOS sampled as an ordinary token), TRL
           `generation_kwargs = {"min_new_tokens": L}` (EOS masked out until L); both train on all L tokens
Modes: `trl` (GRPOTrainer, 1 process, in a subprocess run by `--trl-python`, the interpreter that has trl, at
`--threads` torch threads: equal threads with our colocated process), `trl_default` (the same at torch's own default,
one thread per core: TRL as a user runs it), `colocated` (ours, 1 process: `torchrun --nproc_per_node=1 ...
--cluster.colocate=true`, at `--threads`) and `disagg` (ours, the README command: 1 rollout rank + 3 FSDP2 train
ranks, each at our default `perf.cpu_threads = 1`). Our default is one thread per rank, so `--threads 1` (the
default) runs our side at its defaults in both comparisons; the two TRL modes give the two ratio lines: at equal
threads, and each side at its own defaults (what a user sees). Runs alternate (the order rotates every repeat).

Per run: the wall time of the N steps from the run's own timestamps (ours: first event of events.jsonl to the last
`train_step_done`; TRL: `on_train_begin` to the last `on_step_end`), the total wall time of the process (start-up,
checkpoint and teardown included), completion tokens per second over the N steps, the mean reward of the first 10
and last 10 steps, and the peak resident memory of all its processes together (/proc, sampled every 0.2 s).
The last two lines: TRL's N-step wall time over ours, per mode and setting (medians over repeats), with TRL at
equal threads (`trl`) and at its own default threads (`trl_default`).

Allocator: our CPU ranks keep freed heap memory for reuse (cpu/process.py, `perf.cpu_keep_freed_memory`, on
by default). TRL runs as a new user runs it, with glibc's default thresholds, unless `--trl-allocator kept` gives its
process the same settings through glibc's environment variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_):
the comparison with that difference removed (TRL's long job gained 13-14% from it: bench/results/cpu-vs-trl.md).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODES = ("trl", "trl_default", "colocated", "disagg")
TRL_MODES = ("trl", "trl_default")
TRL_LABEL = {"trl": "at equal threads (TRL at --threads)", "trl_default": "each side at its defaults (TRL at "
             "torch's default threads)"}
SETTINGS = ("tiny", "long")
TINY_CONFIG = ROOT / "configs" / "tiny.toml"


class TrlMissing(RuntimeError):
    """The interpreter given for the TRL side cannot import trl."""


@dataclass
class Setting:
    """One job, as overrides of configs/tiny.toml (ours) and the same numbers for TRL."""
    name: str
    steps: int
    task: str = "reverse"
    max_new_tokens: int = 4
    answer_len: int = 0            # repeat task: every answer this long

    def overrides(self) -> list[str]:
        out = [f"--train.steps={self.steps}", f"--rollout.max_new_tokens={self.max_new_tokens}"]
        if self.task == "repeat":
            n = self.answer_len
            out += ["--data.task=repeat", "--data.len_body_max=1", f"--data.len_tail_min={n}",
                    f"--data.len_tail_max={n}", "--data.len_tail_frac=1.0", "--perf.ignore_eos=true",
                    f"--rollout.kv_cache_tokens={256 * (n + 32)}", f"--train.micro_batch_tokens={64 * (n + 16)}"]
        return out


@dataclass
class Result:
    mode: str
    setting: str
    steps_s: float            # wall time of the N steps, from the run's own timestamps
    total_s: float            # process wall time, start-up and teardown included
    tokens: int               # completion tokens over the N steps
    rewards: list[float]
    peak_rss: int             # bytes, all processes of the run together
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.steps_s, 1e-9)

    def reward_span(self) -> tuple[float, float]:
        k = min(10, len(self.rewards))
        return (statistics.fmean(self.rewards[:k]), statistics.fmean(self.rewards[-k:])) if k else (0.0, 0.0)

    def line(self) -> str:
        a, b = self.reward_span()
        return (f"{self.setting:5s} {self.mode:11s} {len(self.rewards):4d} steps {self.steps_s:7.2f} s  total "
                f"{self.total_s:7.2f} s  {self.tok_s / 1e3:6.2f}k tok/s  reward {a:.2f} -> {b:.2f}  "
                f"peak {self.peak_rss / 2**30:.2f} GiB")


# ------------------------------------------------------------------------------------------ the shared job
def synthetic_task(s: Setting, num_prompts: int = 1024, seed: int = 0):
    from rl.tasks import LengthDist, SyntheticTask
    lengths = LengthDist(1, s.answer_len, s.answer_len, 1.0) if s.task == "repeat" else LengthDist()
    return SyntheticTask(s.task, num_prompts, seed, lengths=lengths)


def save_hf_job(s: Setting, out: Path) -> None:
    """The model and tokenizer both sides start from: our tiny preset, random init seed 0, in the HF layout."""
    from model.hf_io import save_model
    from model.presets import preset_config
    from model.transformer import Transformer
    tok = synthetic_task(s).tokenizer(out)
    cfg = preset_config("tiny", vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    save_model(Transformer(cfg).init_weights(seed=0), cfg, out)


# ------------------------------------------------------------------------------------------------ TRL side
def trl_job(spec: dict[str, Any]) -> None:
    """Run in the subprocess (the interpreter that has trl): GRPOTrainer on the saved model; results to JSON."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    s = Setting(**spec["setting"])
    model_dir, out = Path(spec["model_dir"]), Path(spec["out"])
    if spec["threads"] is not None:          # None: torch's default (one thread per core), as a user runs TRL
        torch.set_num_threads(spec["threads"])
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    task = synthetic_task(s)
    eos = tok.eos_token_id
    ds = Dataset.from_list([{"prompt": p, "answer": a} for p, a in task.prompts()])

    def reward(prompts, completions, completion_ids, answer, **kw) -> list[float]:
        texts = [tok.decode(ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=False)
                 for ids in completion_ids]
        return [task.score(t, a).reward for t, a in zip(texts, answer)]

    times: dict[str, Any] = {"steps": [], "rewards": [], "lengths": []}

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times["begin"] = time.time()

        def on_step_end(self, args, state, control, **kw):
            times["steps"].append(time.time())

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                times["rewards"].append(float(logs["reward"]))
                times["lengths"].append(float(logs.get("completions/mean_length", 0.0)))

    g, p = 8, 32
    args = GRPOConfig(
        output_dir=str(out.parent / "trl-out"), max_steps=s.steps, learning_rate=1e-3, adam_beta1=0.9,
        adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, lr_scheduler_type="constant", warmup_steps=0,
        per_device_train_batch_size=g * p, gradient_accumulation_steps=1, num_generations=g,
        generation_batch_size=g * p, max_completion_length=s.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0,
        beta=0.0, loss_type="dapo", epsilon=0.2, epsilon_high=0.28, scale_rewards="group", num_iterations=1,
        seed=spec.get("seed", 0), use_cpu=True, bf16=False, fp16=False, logging_steps=1, save_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": s.max_new_tokens} if s.task == "repeat" else None)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok,
                          callbacks=[Clock()])
    trainer.train()
    out.write_text(json.dumps(times))


def check_trl(python: str) -> None:
    r = subprocess.run([python, "-c", "import trl; print(trl.__version__)"], capture_output=True, text=True)
    if r.returncode != 0:
        raise TrlMissing(f"{python} cannot import trl: install the benchmark extra (pip install -e '.[bench]') or "
                         f"point --trl-python at an interpreter that has trl (or pass --skip-trl)")


# --------------------------------------------------------------------------------------------- measuring
class PeakRSS:
    """Peak of the summed resident memory of a process and all its descendants, sampled from /proc."""

    def __init__(self, pid: int, every: float = 0.2):
        self.pid, self.every, self.peak = pid, every, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _tree(self) -> list[int]:
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    with open(f"/proc/{d}/stat") as f:
                        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    continue
                children.setdefault(ppid, []).append(int(d))
        out, todo = [], [self.pid]
        while todo:
            p = todo.pop()
            out.append(p)
            todo += children.get(p, [])
        return out

    def _rss(self) -> int:
        total = 0
        for p in self._tree():
            try:
                with open(f"/proc/{p}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def launch(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> tuple[float, int]:
    t = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
        mem = PeakRSS(proc.pid)
        rc = proc.wait()
        peak = mem.stop()
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {rc}; last lines of {log}:\n"
                           + "\n".join(log.read_text().splitlines()[-20:]))
    return time.time() - t, peak


def trl_env(allocator: str = "default") -> dict[str, str]:
    """The TRL process's environment; allocator "kept": glibc keeps freed memory as our CPU ranks' mallopt does."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    if allocator == "kept":
        from cpu.process import MMAP_THRESHOLD_MAX, TRIM_THRESHOLD
        env.update(MALLOC_MMAP_THRESHOLD_=str(MMAP_THRESHOLD_MAX), MALLOC_TRIM_THRESHOLD_=str(TRIM_THRESHOLD))
    elif allocator != "default":
        raise ValueError(f"allocator must be 'default' or 'kept', got {allocator!r}")
    return env


def run_trl(s: Setting, work: Path, python: str, threads: int | None, seed: int = 0,
            allocator: str = "default") -> Result:
    """TRL's run at `threads` torch threads (None: torch's default), mode `trl` or `trl_default` accordingly."""
    mode = "trl" if threads is not None else "trl_default"
    model_dir, out = work / f"hf-{s.name}", work / f"{mode}-{s.name}.json"
    spec = {"setting": vars(s), "model_dir": str(model_dir), "out": str(out), "threads": threads, "seed": seed}
    env = trl_env(allocator)
    total, peak = launch([python, str(Path(__file__).resolve()), "--trl-job", json.dumps(spec)],
                         work / f"{mode}-{s.name}.log", env)
    t = json.loads(out.read_text())
    lengths = t["lengths"]
    return Result(mode, s.name, t["steps"][-1] - t["begin"], total, round(sum(lengths) * 256), t["rewards"], peak)


def run_ours(s: Setting, mode: str, work: Path, tag: str, threads: int, seed: int = 0) -> Result:
    run_dir = work / f"{mode}-{s.name}-{tag}"
    nproc = 1 if mode == "colocated" else 4
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "train.py", "--config",
           str(TINY_CONFIG), f"--log.dir={run_dir}", "--log.progress=false", f"--seed={seed}", *s.overrides()]
    if mode == "colocated":
        cmd += ["--cluster.colocate=true", "--cluster.world_size=1", f"--perf.cpu_threads={threads}"]
    total, peak = launch(cmd, work / f"{mode}-{s.name}-{tag}.log")
    return ours_result(run_dir, mode, s.name, total, peak)


def ours_result(run_dir: Path, mode: str, setting: str, total: float, peak: int) -> Result:
    """A finished run's figures from its own logs: the N steps from the first event to the last step's end."""
    with open(run_dir / "events.jsonl") as f:
        first = json.loads(f.readline())["t"]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    tokens = sum(round(r["response_len_mean"] * r["samples"]) for r in rows)
    return Result(mode, setting, rows[-1]["time_s"] - first, total, tokens, [r["reward_mean"] for r in rows], peak,
                  {"step_time_s": statistics.median(r.get("step_time_s", 0.0) for r in rows)})


def load_avg() -> float:
    return os.getloadavg()[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter with trl installed (the TRL side)")
    ap.add_argument("--skip-trl", action="store_true", help="ours only (no ratios)")
    ap.add_argument("--steps", type=int, default=150, help="steps of the tiny setting")
    ap.add_argument("--long-steps", type=int, default=6, help="steps of the long-generation setting")
    ap.add_argument("--long-len", type=int, default=256, help="answer length of the long-generation setting")
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0, help="sampling seed of both sides (TRL's `seed`, our `seed`); the "
                    "model's init and the prompts stay seed 0, so runs of other seeds compare reward curves")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the 1-process runs at equal threads "
                    "(mode trl and ours colocated; 1 is our default; mode trl_default leaves TRL at torch's default; "
                    "on a shared 2-core machine 2 threads can be 50x slower under load)")
    ap.add_argument("--trl-allocator", default="default", choices=("default", "kept"),
                    help="kept: TRL's process keeps freed memory as our CPU ranks do (glibc MALLOC_* variables)")
    ap.add_argument("--quick", action="store_true", help="2 steps, tiny setting, colocated and TRL only")
    ap.add_argument("--work", default=None, help="directory for the runs (default: a temporary one)")
    ap.add_argument("--trl-job", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.trl_job is not None:
        trl_job(json.loads(a.trl_job))
        return 0
    if a.quick:
        a.steps, a.settings, a.modes = 2, "tiny", "trl,colocated"
    modes = [m for m in a.modes.split(",") if m and not (a.skip_trl and m in TRL_MODES)]
    settings = {"tiny": Setting("tiny", a.steps),
                "long": Setting("long", a.long_steps, "repeat", a.long_len, a.long_len)}
    for name in a.settings.split(","):
        if name not in settings:
            ap.error(f"unknown setting {name!r}; settings: {', '.join(SETTINGS)}")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    if any(m in TRL_MODES for m in modes):
        try:
            check_trl(a.trl_python)
        except TrlMissing as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="vs_trl-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[Result] = []
    for name in a.settings.split(","):
        s = settings[name]
        if any(m in TRL_MODES for m in modes):
            save_hf_job(s, work / f"hf-{s.name}")
        for rep in range(a.repeats):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            for m in order:
                load = load_avg()
                r = (run_trl(s, work, a.trl_python, a.threads if m == "trl" else None, a.seed, a.trl_allocator)
                     if m in TRL_MODES else run_ours(s, m, work, str(rep), a.threads, a.seed))
                results.append(r)
                print(f"{r.line()}  load {load:.1f}->{load_avg():.1f}", flush=True)
    print(f"runs in {work}")
    print(summary(results, [n for n in a.settings.split(",")], modes))
    return 0


def summary(results: list[Result], settings: list[str], modes: list[str]) -> str:
    """Medians per (setting, mode) as a table, then a ratio line per TRL mode run (TRL's N-step wall time over
    ours), each labelled: at equal threads, and each side at its own defaults."""
    lines = ["| setting | mode | N steps (s) | total (s) | completion tok/s | reward first 10 -> last 10 | peak RSS |",
             "|---|---|---|---|---|---|---|"]
    med: dict[tuple[str, str], float] = {}
    for s in settings:
        for m in modes:
            rs = [r for r in results if r.setting == s and r.mode == m]
            if not rs:
                continue
            med[s, m] = statistics.median(r.steps_s for r in rs)
            spans = [r.reward_span() for r in rs]
            lines.append(f"| {s} | {m} | {med[s, m]:.2f} | {statistics.median(r.total_s for r in rs):.2f} | "
                         f"{statistics.median(r.tok_s for r in rs) / 1e3:.2f}k | "
                         f"{statistics.fmean(a for a, _ in spans):.2f} -> "
                         f"{statistics.fmean(b for _, b in spans):.2f} | "
                         f"{max(r.peak_rss for r in rs) / 2**30:.2f} GiB |")
    ours = [m for m in modes if m not in TRL_MODES]
    trls = [t for t in TRL_MODES if any((s, t) in med for s in settings)]
    for t in trls:
        ratios = [f"{s} {m} {med[s, t] / med[s, m]:.2f}x" for s in settings for m in ours
                  if (s, m) in med and (s, t) in med]
        lines.append(f"TRL wall / ours, {TRL_LABEL[t]}: " + (", ".join(ratios) if ratios else "n/a"))
    if not trls:
        lines.append("TRL wall / ours: n/a (no TRL run)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
