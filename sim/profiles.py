"""Named calibrations of the cost model (sim/cost.py), every constant with its source.

Sources are cited as: a paper's section/table, a public datasheet or model config, `assumption` (our choice, with
the reason), or `measured` (our own engine/trainer, see sim/calibrate.py).
Nothing here is tuned to make any policy or any paper figure come out a certain way; the reproduction script
(sim/repro/) compares against figures that none of these constants were derived from.

Roofline-derived profiles (`roofline`), per engine of `tp` GPUs:
    k1 = KV bytes per token / (tp * HBM bandwidth * bw_eff)       attention reads the whole KV once per step
    k2 = weight bytes      / (tp * HBM bandwidth * bw_eff)       the GEMMs read the weights once per step
    k3 = 2 * active params / (tp * peak bf16 FLOP/s * decode_mfu) per sequence once compute-bound
    k4 = step overhead + 2 * layers * all-reduce latency (tp > 1)
    KV capacity = (tp * HBM * mem_fraction - weight bytes - tp * 1 GB activations) / KV bytes per token
    train s/token/GPU = flops_factor * active params / (peak bf16 FLOP/s * train_mfu)
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from sim.cost import CostModel, RewardLatency, RewardTask


@dataclass(frozen=True)
class GPU:
    name: str
    bf16_flops: float   # dense peak
    hbm_bw: float       # bytes/s
    hbm_bytes: float
    source: str


@dataclass(frozen=True)
class Model:
    name: str
    params: float          # total (weights read per decode step)
    active_params: float   # per token (= params for dense models)
    layers: int
    kv_bytes_per_token: int  # 2 (K,V) * layers * kv_heads * head_dim * 2 bytes (bf16)
    source: str


H800 = GPU("H800-80GB", 989.5e12, 3.35e12, 80e9, "StreamRL Table 1")
H20 = GPU("H20-96GB", 148e12, 4.0e12, 96e9, "StreamRL Table 1")
A100_40G_PCIE = GPU("A100-40GB-PCIe", 312e12, 1.555e12, 40e9, "NVIDIA A100 datasheet")

QWEN3_0P6B = Model("Qwen3-0.6B", 0.596e9, 0.596e9, 28, 2 * 28 * 8 * 128 * 2,
                   "Qwen3-0.6B config.json (28 layers, 8 KV heads, tied embeddings: weights read once)")
QWEN3_1P7B = Model("Qwen3-1.7B", 1.72e9, 1.72e9, 28, 2 * 28 * 8 * 128 * 2,
                   "Qwen3-1.7B config.json (28 layers, 8 KV heads)")
QWEN25_7B = Model("Qwen2.5-7B", 7.61e9, 7.61e9, 28, 2 * 28 * 4 * 128 * 2, "Qwen2.5-7B config.json (4 KV heads)")
QWEN25_14B = Model("Qwen2.5-14B", 14.7e9, 14.7e9, 48, 2 * 48 * 8 * 128 * 2, "Qwen2.5-14B config.json")
QWEN25_32B = Model("Qwen2.5-32B", 32.5e9, 32.5e9, 64, 2 * 64 * 8 * 128 * 2, "Qwen2.5-32B config.json")
QWEN25_72B = Model("Qwen2.5-72B", 72.7e9, 72.7e9, 80, 2 * 80 * 8 * 128 * 2, "Qwen2.5-72B config.json")
QWEN3_30B_A3B = Model("Qwen3-30B-A3B", 30.5e9, 3.3e9, 48, 2 * 48 * 4 * 128 * 2, "Qwen3-30B-A3B config.json")

BYTES_PER_PARAM = 2  # bf16 weights
ASSUME_BW_EFF = "assumption: decode kernels reach ~70% of HBM bandwidth (bench/engine.py --device cuda measures ours)"
ASSUME_MFU_DECODE = "assumption: 50% of peak in compute-bound decode/prefill GEMMs"
ASSUME_OVERHEAD = "assumption: 2 ms/step scheduling+sampling+launch (CUDA graphs), plus 2 all-reduces per layer at TP>1"


def roofline(name: str, model: Model, gpu: GPU, tp: int, *, train_gpu: GPU, train_mfu: float, flops_factor: float,
             publish_bw: float, publish_fixed_s: float, load_bw: float, reward: RewardLatency,
             mem_fraction: float = 0.9, max_num_seqs: int = 256, bw_eff: float = 0.7, decode_mfu: float = 0.5,
             step_overhead_s: float = 0.002, allreduce_s: float = 1e-5, train_s_per_token: float | None = None,
             sources: dict[str, str] | None = None) -> CostModel:
    weight_bytes = model.params * BYTES_PER_PARAM
    bw = tp * gpu.hbm_bw * bw_eff
    kv_bytes = tp * gpu.hbm_bytes * mem_fraction - weight_bytes - tp * 1e9
    if kv_bytes <= 0:
        raise ValueError(f"profile {name}: {model.name} does not fit on {tp} x {gpu.name} at mem_fraction "
                         f"{mem_fraction}")
    src = {
        "k1": f"KV bytes/token ({model.source}) / ({tp} x {gpu.name} HBM bw, {gpu.source}) / bw_eff; {ASSUME_BW_EFF}",
        "k2": f"weight bytes ({model.params:.3g} params, bf16) / same bandwidth",
        "k3": f"2 * active params / (tp * peak bf16, {gpu.source}) / decode_mfu; {ASSUME_MFU_DECODE}",
        "k4": ASSUME_OVERHEAD,
        "prefill_s_per_token": f"2 * active params / (tp * peak) / prefill mfu; {ASSUME_MFU_DECODE}",
        "kv_capacity_tokens": f"(tp * HBM * mem_fraction {mem_fraction} - weights - 1 GB/GPU activations) / KV "
                              "bytes per token",
        "train_s_per_token": f"{flops_factor} * active params / ({train_gpu.name} peak, {train_gpu.source}) / "
                             f"MFU {train_mfu}",
        "publish_s": f"weight bytes / {publish_bw / 1e9:.3g} GB/s aggregate + {publish_fixed_s} s fixed",
        "load_s": f"weight bytes / (tp x {load_bw / 1e9:.3g} GB/s) (relay -> engine, each GPU loads its shard)",
        "max_num_seqs": f"{max_num_seqs}", "reward": "sim/profiles.py MATH_REWARD / MULTITASK_REWARD docstrings",
    }
    src.update(sources or {})
    return CostModel(
        name=name,
        k1=model.kv_bytes_per_token / bw,
        k2=weight_bytes / bw,
        k3=2 * model.active_params / (tp * gpu.bf16_flops * decode_mfu),
        k4=step_overhead_s + (2 * model.layers * allreduce_s if tp > 1 else 0.0),
        prefill_s_per_token=2 * model.active_params / (tp * gpu.bf16_flops * decode_mfu),
        kv_capacity_tokens=int(kv_bytes // model.kv_bytes_per_token),
        train_s_per_token=(train_s_per_token if train_s_per_token is not None
                           else flops_factor * model.active_params / (train_gpu.bf16_flops * train_mfu)),
        publish_s=weight_bytes / publish_bw + publish_fixed_s,
        load_s=weight_bytes / (tp * load_bw),
        reward=reward, max_num_seqs=max_num_seqs, gpus_per_engine=tp, sources=src)


# ------------------------------------------------------------------------------------------------- reward latency
MATH = RewardTask("math", 1.0, 0.02, 1.0, 2.0)
MATH_REWARD = RewardLatency((MATH,))
"""Rule-based math/exact-match verifier: 2 s timeout (RollPacker §5: "per-task timeouts of 30s and 2s"); the 20 ms
median is an assumption (string normalisation + sympy on a CPU)."""
MULTITASK_REWARD = RewardLatency((MATH, RewardTask("code", 1.0, 2.0, 0.25, 30.0, hang_frac=0.05, sandbox=True,
                                                   sigma_prompt=1.0),
                                  RewardTask("judge", 1.0, 2.0, 0.5, 30.0)))
"""RollPacker's uniform math / code / LLM-judge mix (§6), one task per prompt (per dataset): math as above; code
sandbox with a 30 s timeout that ~5% of runs hit and fail (§4.3: "around 5% of prompts hit this timeout"; the
adaptive timeout applies to it), its run time mostly the test case's (sigma 1.0 between prompts, 0.25 between the
solutions of one prompt); judge (Qwen2.5-7B-Instruct). Medians and sigmas are assumptions."""

# ------------------------------------------------------------------------------------------ RolloutPipe calibration
ROLLOUTPIPE_PROMPT_LEN = 400          # assumption: LSAT-AR / SciBench prompts with passage; not reported
ROLLOUTPIPE_RESPONSE_MEAN = 3450      # RolloutPipe §5.3: "3.3k–3.6k token range"
ROLLOUTPIPE_S_PER_GROUP = 587.4 / 96  # RolloutPipe Table 1: LSAT-AR Slime, R = 96 trainer compute per round / R
ROLLOUTPIPE_TRAIN_GPUS = 8            # RolloutPipe §5.1: "8 × RTX 4090 24GB GPUs with TP=4, DP=2"


def _rolloutpipe() -> CostModel:
    tokens_per_group = 8 * (ROLLOUTPIPE_PROMPT_LEN + ROLLOUTPIPE_RESPONSE_MEAN)
    per_token = ROLLOUTPIPE_S_PER_GROUP / tokens_per_group * ROLLOUTPIPE_TRAIN_GPUS
    return roofline(
        "rolloutpipe_qwen3_1p7b", QWEN3_1P7B, A100_40G_PCIE, 2, train_gpu=A100_40G_PCIE, train_mfu=0.0,
        flops_factor=0.0, train_s_per_token=per_token, publish_bw=12.5e9, publish_fixed_s=1.0, load_bw=20e9,
        reward=MATH_REWARD, mem_fraction=0.88, max_num_seqs=1024, allreduce_s=3e-5,
        sources={"reward": "MATH_REWARD: exact-match verifier (RolloutPipe §5.1), 2 s timeout (RollPacker §5)",
                 "train_s_per_token": "RolloutPipe Table 1 (LSAT-AR Slime R=96: 587.4 s / 96 groups) / (8 samples x "
                                      f"({ROLLOUTPIPE_PROMPT_LEN} prompt [assumption] + 3450 response [§5.3])) "
                                      "x 8 GPUs",
                 "engine": "RolloutPipe §5.1: rollout node = 2 x A100 40GB PCIe, TP=2 (one engine)",
                 "kv_capacity_tokens": "mem_fraction 0.88: assumption (SGLang static memory fraction)",
                 "max_num_seqs": "assumption: SGLang sizes its running batch from memory; 1024 seats",
                 "k4": ASSUME_OVERHEAD + "; 30 us all-reduce over PCIe (assumption)",
                 "publish_s": "not reported: assumption 100 Gb/s link between trainer and rollout nodes + 1 s",
                 "load_s": "assumption: relay on host, PCIe 4.0 x16 at 20 GB/s"})


# ---------------------------------------------------------------------------------- RollPacker (veRL colocated)
ROLLPACKER_CALIBRATION_SHARE = 0.22   # RollPacker Table 1 (veRL, 14B/16k): training 23% / 21% / 22% of the step
ROLLPACKER_TRAIN_MFU = 0.0972         # calibrated: ROLLPACKER_TRAIN_SOURCE
ROLLPACKER_TRAIN_SOURCE = (
    "flops_factor 10 = actor fwd+bwd (6) + old-logprob fwd (2) + reference fwd (2), RollPacker §6 (reference same "
    "size as actor); MFU 0.0972 calibrated from RollPacker Table 1: the MFU at which the simulated veRL 14B/16k step "
    "(sync, colocated, synchronous reward stage; seeds 0-2) spends Table 1's 22% training (the mean of its math / "
    "code / judge rows); rollout and reward do not depend on it there. Recomputed by "
    "sim.repro.rollpacker.calibrate_train_mfu (tests/sim/test_repro_figures.py checks the recorded value)")


def _rollpacker(model: Model, tp: int, name: str, train_mfu: float = ROLLPACKER_TRAIN_MFU,
                train_source: str = ROLLPACKER_TRAIN_SOURCE) -> CostModel:
    return roofline(
        name, model, H800, tp, train_gpu=H800, train_mfu=train_mfu, flops_factor=10.0,
        publish_bw=200e9, publish_fixed_s=1.0, load_bw=0.5 * H800.hbm_bw, reward=MULTITASK_REWARD,
        mem_fraction=0.6, max_num_seqs=256,
        sources={"engine": "RollPacker §6: H800, rollout TP 1/2/2 for 7B/14B/32B, vLLM v0.8.4",
                 "reward": "MULTITASK_REWARD: RollPacker §4.3/§5/§6 (math 2 s, code 30 s timeouts, ~5% hit)",
                 "max_num_seqs": "vLLM default max_num_seqs = 256",
                 "kv_capacity_tokens": "mem_fraction 0.6: assumption (colocated veRL leaves room for offloaded "
                                       "training state)",
                 "train_s_per_token": train_source,
                 "publish_s": "colocated: in-place reshard over NVLink (400 GB/s, StreamRL Table 1) at 50% + 1 s "
                              "(assumption)"})


# ---------------------------------------------------------------------------------------- StreamRL (disaggregated)
def _streamrl(model: Model, tp: int, name: str) -> CostModel:
    return roofline(
        name, model, H800, tp, train_gpu=H800, train_mfu=0.25, flops_factor=16.0,
        publish_bw=12.5e9, publish_fixed_s=1.0, load_bw=25e9, reward=MATH_REWARD, mem_fraction=0.9,
        max_num_seqs=256,
        sources={"engine": "StreamRL §7 testbed: H800 cluster; TP per model not in text: assumption 1/4/8",
                 "max_num_seqs": "vLLM default max_num_seqs = 256",
                 "reward": "MATH_REWARD: rule-based verifier (StreamRL §7), 2 s timeout (RollPacker §5)",
                 "train_s_per_token": "PPO: actor and critic fwd+bwd (6+6) + reference and value fwd (2+2) "
                                      "(StreamRL §7 trains with PPO; our FLOP count); MFU 0.25: assumption",
                 "publish_s": "8 x 200 Gb/s RDMA per node (StreamRL §7) shared by 8 GPUs = 25 GB/s, at 50% + 1 s"})


def _streamrl_cross_dc(model: Model, tp: int, name: str) -> CostModel:
    """StreamRL §7.3: the SGS on a cloud H20 cluster, the trainer on the H800 cluster, joined by an 80 Gb/s link."""
    return roofline(
        name, model, H20, tp, train_gpu=H800, train_mfu=0.25, flops_factor=16.0,
        publish_bw=80e9 / 8, publish_fixed_s=1.0, load_bw=0.5 * 100e9 / 8, reward=MATH_REWARD, mem_fraction=0.9,
        max_num_seqs=256,
        sources={"engine": "StreamRL §7.3: SGS on H20-96GB (Table 1), TP as the H800 profile's (assumption)",
                 "max_num_seqs": "vLLM default max_num_seqs = 256",
                 "reward": "MATH_REWARD: rule-based verifier (StreamRL §7), 2 s timeout (RollPacker §5)",
                 "train_s_per_token": "the H800 trainer of h800_streamrl_* (PPO FLOPs 6+6+2+2, MFU 0.25 assumed)",
                 "publish_s": "StreamRL §7.3: the 80 Gb/s dedicated link at line rate (DP rank 0 sends to one "
                              "remote instance, §6) + 1 s",
                 "load_s": "StreamRL §7: the H20 nodes' 100 Gb/s TCP network at 50% (the local broadcast)"})


# ------------------------------------------------------------------------------------ Laminar (relays, H800 cluster)
LAMINAR_NIC_BW = 0.5 * 8 * 400e9 / 8   # Laminar §8: "inter-machine bandwidth is 8x400 Gbps"; 50% RDMA efficiency
#                                      (the same assumption as the StreamRL profile)
LAMINAR_CHUNK = 32 * 2**20             # Laminar §7: "32MB chunk size"
LAMINAR_T_START = 5e-6                 # Laminar App. C: "2000 x 5us = 10ms" latency-term example


def laminar_publish_s(model: Model, rollout_machines: int) -> float:
    """Trainer -> master relay (one copy at NIC speed), then the master's chained broadcast to the other relays
    (sim.cost.relay_broadcast_s); a rollout then loads from its own machine's relay (load_s)."""
    from sim.cost import relay_broadcast_s
    nbytes = model.params * BYTES_PER_PARAM
    return nbytes / LAMINAR_NIC_BW + relay_broadcast_s(nbytes, rollout_machines - 1, LAMINAR_NIC_BW, LAMINAR_CHUNK,
                                                       LAMINAR_T_START)


def _laminar(model: Model, tp: int, name: str, rollout_machines: int, colocated: bool = False) -> CostModel:
    """Laminar §8 testbed: H800-80GB machines of 8 GPUs, 8 x 400 Gb/s between machines, vLLM rollouts (TP 4 for
    32B, 8 for 72B), FSDP trainer, GRPO, rule-based math reward. Disaggregated presets publish through the relays;
    the colocated verl baseline reshards in place over NVLink (as the RollPacker profile)."""
    src = {"engine": f"Laminar §8/App. A.3: H800, rollout TP {tp}, vLLM 0.9.0",
           "max_num_seqs": "Laminar App. A.3: per-rollout max concurrency 1024 (verl's rollout default is also 1024)",
           "reward": "MATH_REWARD: rule-based math reward on DAPO-Math-17k (Laminar §8)",
           "train_s_per_token": "GRPO without critic or reference (DAPO-style clip-higher): actor fwd+bwd (6) + "
                                "old-logprob fwd (2); MFU 0.25: assumption (as the other H800 profiles)",
           "load_s": "relay (pinned host memory) -> GPU over PCIe, 25 GB/s per GPU: assumption (Laminar §4.2)"}
    if colocated:
        src.update({"kv_capacity_tokens": "mem_fraction 0.6: assumption (colocated verl keeps training state)",
                    "load_s": "colocated: the resharded weights are copied within HBM at 50% bandwidth",
                    "publish_s": "colocated: in-place reshard over NVLink (400 GB/s) at 50% + 1 s (assumption, as "
                                 "the RollPacker profile)"})
        return roofline(name, model, H800, tp, train_gpu=H800, train_mfu=0.25, flops_factor=8.0, publish_bw=200e9,
                        publish_fixed_s=1.0, load_bw=0.5 * H800.hbm_bw, reward=MATH_REWARD, mem_fraction=0.6,
                        max_num_seqs=1024, sources=src)
    src["publish_s"] = (f"relay model: weight bytes / NIC bw (trainer -> master) + chained broadcast over "
                        f"{rollout_machines - 1} relays (sim.cost.relay_broadcast_s, Laminar App. C; 32 MB chunks, "
                        "5 us start-up); NIC bw = 8 x 400 Gb/s (Laminar §8) at 50% (assumption)")
    src["kv_move_s_per_token"] = (f"repack moves a trajectory's KV, not its tokens: KV bytes/token "
                                  f"({model.kv_bytes_per_token / 1024:.0f} KiB, {model.source}) over the NIC, "
                                  "8 x 400 Gb/s (Laminar §8) at 50% (assumption, as publish_s); a move inside one "
                                  "machine (NVLink) would be faster")
    base = roofline(name, model, H800, tp, train_gpu=H800, train_mfu=0.25, flops_factor=8.0, publish_bw=1.0,
                    publish_fixed_s=0.0, load_bw=25e9, reward=MATH_REWARD, mem_fraction=0.9, max_num_seqs=1024,
                    sources=src)
    return replace(base, publish_s=laminar_publish_s(model, rollout_machines),
                   kv_move_s_per_token=model.kv_bytes_per_token / LAMINAR_NIC_BW)


def _staleflow() -> CostModel:
    """StaleFlow's own regression (Table 4, Qwen3-30B-A3B on H20) used verbatim, kv counted in tokens."""
    base = roofline("h20_qwen3_30b_a3b", QWEN3_30B_A3B, H20, 1, train_gpu=H20, train_mfu=0.25, flops_factor=6.0,
                    publish_bw=25e9, publish_fixed_s=1.0, load_bw=25e9, reward=MATH_REWARD, mem_fraction=0.9)
    src = dict(base.sources)
    src.update({k: "StaleFlow Table 4 (offline profiling + linear regression); kv in tokens (the unit Table 4's k1 "
                   "implies: sched/policies/staleflow/cost.py)" for k in ("k1", "k2", "k3", "k4")})
    src["reward"] = "MATH_REWARD: DAPO-Math rule-based reward (StaleFlow §6.1)"
    src["max_num_seqs"] = "assumption: vLLM default 256 (StaleFlow: vLLM rollout)"
    src["engine"] = ("TP=1 inferred: Table 4's k2 = 1.72 ms = active weights (3.3B x 2 B) / 4 TB/s H20 bandwidth")
    return replace(base, k1=7.28e-8, k2=1.72e-3, k3=1.25e-4, k4=1.07e-2, sources=src)


# ------------------------------------------------------------------------------------ our own engine and trainer
def _cpu_tiny() -> CostModel:
    """Our engine and trainer on this 2-core CPU box with the `tiny` model (configs/tiny.toml shapes), measured by
    `python -m sim.calibrate RUN_DIR --prompt-tokens 4` on a 60-step sync run of the synthetic `reverse` task (4 ranks:
    3 train + 1 rollout, 4 prompts x 8 per step, max_new_tokens 32, max_num_seqs 64, kv_cache_tokens 4096): decode fit
    over 177 counter intervals, mean batch 10.9. The tiny model on CPU is compute-bound per token, so k1 = k2 = 0.
    Check: simulating that run (sync, workload cpu_tiny, 1 engine, 3 train GPUs, 60 steps) against its own
    events.jsonl is in sim/README.md, "Validation against our own run"."""
    measured = "measured (sim.calibrate on a 60-step tiny sync run, 2-core CPU)"
    return CostModel(
        name="cpu_tiny", k1=0.0, k2=0.0, k3=4.6e-5, k4=2.3e-3, prefill_s_per_token=4.6e-5, kv_capacity_tokens=4096,
        train_s_per_token=4.9e-4, publish_s=0.092, load_s=3.2e-3, max_num_seqs=64,
        reward=RewardLatency((RewardTask("reverse", 1.0, 4e-6, 0.5, 5.0),)),
        sources={"k1": "0: the tiny model on CPU is compute-bound; KV reads are negligible",
                 "k2": "0: weight reads are folded into the per-sequence compute k3",
                 "k3": f"{measured}: least-squares step = k3 * n + k4 over tokens_decoded intervals",
                 "k4": measured, "prefill_s_per_token": "assumption: one decode token's compute (k3)",
                 "train_s_per_token": f"{measured}: median step_time_s / (response + 4 prompt tokens per sample) x 3 "
                                      "train ranks",
                 "publish_s": f"{measured}: weight_sync_s", "load_s": f"{measured}: version_published -> "
                 "weights_loaded", "reward": f"{measured}: reward scored in the same engine step",
                 "kv_capacity_tokens": "run config rollout.kv_cache_tokens", "max_num_seqs": "run config"})


RESULTS_DIR = Path(__file__).resolve().parents[1] / "bench" / "results"
H100_CAMPAIGN = RESULTS_DIR / "h100-2026-11-24.json"
CALIBRATING_SECTIONS = ("engine", "e2e", "grpo_step")   # what a campaign file needs to give a profile


def device_tag(device: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200': the first word naming a model number."""
    words = [w.lower() for w in device.replace("-", " ").split()]
    return next((w for w in words if any(ch.isdigit() for ch in w)), words[-1] if words else "gpu")


def measured(path: Path, name: str | None = None) -> CostModel:
    """Our engine and trainer on one GPU with a Qwen3-0.6B shape, every constant read from a merged `bench/gpu.py`
    results file (`python bench/gpu.py --report A.json B.json C.json --save bench/results/<device>-<date>.json`);
    named `<device tag>_qwen3_0p6b` unless `name` says otherwise. The decode line is the engine section's whole
    decode steps as one effective bandwidth: k1 and k2 are KV and weight bytes over the measured bytes/time of every
    pure-decode step of its 256-sequence run (scheduling, sampling and launches folded in, so k3 = k4 = 0); that
    run's separately timed 60 steps at batch 255 are the check (tests/sim/test_sim_engine.py). Prefill is an upper
    bound: a whole mixed step charged to its 2048 batch tokens. Training, publication, load and reward latency are
    `sim.calibrate` on the campaign's colocated `train.py` run; the KV pool is the colocated GRPO step's engine's."""
    data = json.loads(path.read_text())
    sec = {k: v["results"] for k, v in data["sections"].items() if v.get("status") == "ok"}
    missing = [k for k in CALIBRATING_SECTIONS if k not in sec]
    if missing:
        raise ValueError(f"{path.name}: no calibration without the sections {missing} (ok)")
    name = name or f"{device_tag(data['meta']['device'])}_qwen3_0p6b"
    eng, cal, grpo = sec["engine"], sec["e2e"]["calibration"], sec["grpo_step"]
    bw = eng["decode_gbs"] * 1e9
    weight_bytes = QWEN3_0P6B.params * BYTES_PER_PARAM
    ph = eng["phases_ms"]
    src = f"measured ({path.name}, {data['meta']['device']}, {data['meta']['date']})"
    return CostModel(
        name=name, k1=QWEN3_0P6B.kv_bytes_per_token / bw, k2=weight_bytes / bw, k3=0.0, k4=0.0,
        prefill_s_per_token=ph["prefill_step"] / 1e3 / 2048, kv_capacity_tokens=int(grpo["kv_tokens"]),
        train_s_per_token=cal["train_s_per_token_one_rank"], publish_s=cal["publish_s"], load_s=cal["load_s"],
        max_num_seqs=int(eng["prompts"]),
        reward=RewardLatency((RewardTask("math", 1.0, cal["reward_s_median"], 0.5, 5.0),)),
        sources={"k1": f"{src}: KV bytes/token ({QWEN3_0P6B.source}) / {bw / 1e9:.0f} GB/s, the engine section's "
                       "decode bytes per second", "k2": f"{src}: weight bytes / the same bandwidth",
                 "k3": "0: compute and per-step overheads are folded into the measured bandwidth",
                 "k4": "0: as k3", "prefill_s_per_token": f"{src}: a mixed prefill step / its 2048 batch tokens "
                 "(an upper bound)", "kv_capacity_tokens": f"{src}: the colocated GRPO step's engine pool",
                 "train_s_per_token": f"{src}: sim.calibrate on the colocated train.py run (one GPU)",
                 "publish_s": f"{src}: sim.calibrate weight_sync_s", "load_s": f"{src}: sim.calibrate load",
                 "reward": f"{src}: median reward latency; sigma 0.5 and the 5 s limit are assumptions",
                 "max_num_seqs": "the engine section's max_num_seqs"})


def h100_measured(path: Path = H100_CAMPAIGN) -> CostModel:
    """The first GPU campaign's calibration (one H100, `H100_CAMPAIGN`)."""
    return measured(path, "h100_qwen3_0p6b")


def campaign_profiles(results_dir: Path = RESULTS_DIR) -> list[CostModel]:
    """A measured profile for every campaign file in `results_dir` that has the calibrating sections (files without
    them, e.g. one section's raw output, are skipped): the newest file of a device gets `<tag>_qwen3_0p6b`, every
    file also `<tag>_qwen3_0p6b_<date>`."""
    found = []
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
            ok = {k for k, v in data.get("sections", {}).items() if v.get("status") == "ok"}
            if set(CALIBRATING_SECTIONS) <= ok:
                found.append((data["meta"]["date"], device_tag(data["meta"]["device"]), path))
        except (OSError, ValueError, KeyError, AttributeError):
            continue
    out, newest = [], {}
    for date, tag, path in sorted(found):
        out.append(measured(path, f"{tag}_qwen3_0p6b_{date.split()[0]}"))
        newest[tag] = path
    return out + [measured(path, f"{tag}_qwen3_0p6b") for tag, path in newest.items()]


PROFILES: dict[str, CostModel] = {p.name: p for p in [
    _rolloutpipe(),
    _rollpacker(QWEN25_7B, 1, "h800_7b"), _rollpacker(QWEN25_14B, 2, "h800_14b"),
    _rollpacker(QWEN25_32B, 2, "h800_32b"),
    _streamrl(QWEN25_7B, 1, "h800_streamrl_7b"), _streamrl(QWEN25_32B, 4, "h800_streamrl_32b"),
    _streamrl(QWEN25_72B, 8, "h800_streamrl_72b"), _streamrl_cross_dc(QWEN25_7B, 1, "h20_h800_streamrl_7b"),
    _staleflow(), _cpu_tiny(), *campaign_profiles(),
    _laminar(QWEN25_32B, 4, "h800_laminar_32b", rollout_machines=8),
    _laminar(QWEN25_32B, 4, "h800_laminar_32b_colocated", rollout_machines=16, colocated=True),
    # verl at Laminar's largest scale (§2.3: 72B on 1024 H800, math GRPO): colocated on 128 machines
    _laminar(QWEN25_72B, 8, "h800_laminar_72b_colocated", rollout_machines=128, colocated=True),
    # the one-step pipeline at the same scale (§2.3), Table 2's row 5: 768 rollout GPUs on 96 machines
    _laminar(QWEN25_72B, 8, "h800_laminar_72b", rollout_machines=96)]}
PROFILES["h800_streamrl"] = PROFILES["h800_streamrl_7b"]  # StreamRL's 7B (its dynamic-adjustment and cross-DC runs)

# The same engines at another TP size (RollPacker §4.2's planner reshards the rollout pool between steps): the
# roofline rebuilt at that TP; training constants stay the profile's.
TP_VARIANTS: dict[str, Callable[[int, str], CostModel]] = {
    "h800_7b": lambda tp, name: _rollpacker(QWEN25_7B, tp, name),
    "h800_14b": lambda tp, name: _rollpacker(QWEN25_14B, tp, name),
    "h800_32b": lambda tp, name: _rollpacker(QWEN25_32B, tp, name)}


def get_profile(name: str | CostModel) -> CostModel:
    if isinstance(name, CostModel):
        return name
    if name not in PROFILES:
        raise ValueError(f"unknown cost profile {name!r}; profiles: {sorted(PROFILES)}")
    return PROFILES[name]


def at_tp(c: CostModel, tp: int) -> CostModel:
    """Profile `c` with its engines at TP `tp` (named base@tpN); ValueError where the profile has no TP variants or
    the model does not fit at that TP."""
    base = c.name.split("@")[0]
    if base not in TP_VARIANTS:
        raise ValueError(f"cost profile {c.name!r} has no TP variants (sim/profiles.py TP_VARIANTS)")
    if tp == PROFILES[base].gpus_per_engine:
        v = PROFILES[base]
    else:
        v = TP_VARIANTS[base](tp, f"{base}@tp{tp}")
    return replace(v, train_s_per_token=c.train_s_per_token, train_overhead_s=c.train_overhead_s,
                   train_step_s=c.train_step_s)


def tp_sizes(c: CostModel, gpus: int, max_tp: int = 8) -> tuple[int, ...]:
    """The power-of-two TP sizes (up to max_tp, one server) dividing `gpus` at which the profile's model fits on its
    engines; () for a profile without TP variants."""
    if c.name.split("@")[0] not in TP_VARIANTS:
        return ()
    out = []
    tp = 1
    while tp <= max_tp:
        if gpus % tp == 0:
            try:
                at_tp(c, tp)
                out.append(tp)
            except ValueError:               # the model does not fit at this TP
                pass
        tp *= 2
    return tuple(out)


def describe(p: CostModel) -> str:
    """Every constant of a profile with its source (python -m sim profiles [NAME ...])."""
    lines = [f"{p.name}: {p.sources.get('engine', '')}".rstrip(": ")]
    for k in ("k1", "k2", "k3", "k4", "prefill_s_per_token", "kv_capacity_tokens", "max_num_seqs", "gpus_per_engine",
              "train_s_per_token", "publish_s", "load_s"):
        lines.append(f"  {k:20s} {getattr(p, k):<12.4g} {p.sources.get(k, '')}")
    for k in ("train_step_s", "train_overhead_s", "kv_move_s_per_token"):
        if getattr(p, k):
            lines.append(f"  {k:20s} {getattr(p, k):<12.4g} {p.sources.get(k, '')}")
    lines.append(f"  {'reward':20s} mean {p.reward.mean():<7.3g} {p.sources.get('reward', '')}")
    return "\n".join(lines)

