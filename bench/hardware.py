"""The hardware's own figures, the denominators of every GPU ratio the benches report: a device's dense bf16 peak and
its spec HBM bandwidth, looked up by the name CUDA gives it (never re-measured: a matmul rate measured in each process
moved 694-800 TFLOP/s in one day on one H200, so a faster step could read a lower MFU).

    MFU            = achieved model TFLOP/s / the dense bf16 peak (the denominator torchtitan and Megatron use)
    floor (engine) = (weight + KV bytes read) / spec HBM bandwidth + prefill FLOPs / the dense bf16 peak
    floor fraction = floor / measured seconds (1.0 = at the hardware's limit)

Source of the table: NVIDIA's H100 and H200 Tensor Core GPU datasheets (dense figures: the datasheets print bf16 with
2:4 sparsity, 1,979 TFLOP/s, twice the dense 989.4)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class DeviceSpec:
    """One device's datasheet figures."""
    name: str
    bf16_tflops: float   # dense bf16 tensor-core peak, TFLOP/s
    hbm_tbs: float       # spec memory bandwidth, TB/s (10^12 bytes/s)
    source: str

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.hbm_tbs * 1e12


DATASHEET = "NVIDIA H100/H200 Tensor Core GPU datasheet (dense bf16; spec HBM bandwidth)"
SPECS: dict[str, DeviceSpec] = {
    "H100 SXM": DeviceSpec("H100 SXM", 989.4, 3.35, DATASHEET),
    "H200": DeviceSpec("H200", 989.4, 4.8, DATASHEET),
}
# the CPU dry run's stand-in: round numbers so its fractions are computed by the same code; not a measurement
CPU_DRY_RUN = DeviceSpec("CPU (dry run)", 1.0, 0.05, "nominal values for the CPU dry run, not a datasheet")


def spec_for(device_name: str) -> DeviceSpec | None:
    """The spec of a device by its CUDA name ("NVIDIA H200", "NVIDIA H100 80GB HBM3"), or None for a device not in
    the table (an H100 PCIe or NVL has other peaks: it is not guessed)."""
    n = device_name.upper()
    if "CPU" in n and "DRY" in n:
        return CPU_DRY_RUN
    if "H200" in n:
        return SPECS["H200"]
    if "H100" in n and not any(k in n for k in ("PCIE", "NVL")) and any(k in n for k in ("SXM", "HBM3")):
        return SPECS["H100 SXM"]
    return None


def require_spec(device_name: str) -> DeviceSpec:
    """spec_for, or a one-line error naming the device and the table's entries."""
    spec = spec_for(device_name)
    if spec is None:
        raise ValueError(f"no datasheet figures for device {device_name!r} (known: {', '.join(SPECS)}): MFU and "
                         f"floor fractions need its dense bf16 peak and HBM bandwidth in bench/hardware.py SPECS")
    return spec


def local_spec(device: str) -> DeviceSpec | None:
    """The spec of this process's device: CPU_DRY_RUN on "cpu", else the current CUDA device's, or None."""
    if device == "cpu":
        return CPU_DRY_RUN
    import torch
    return spec_for(torch.cuda.get_device_name())


def mfu(tflops: float, spec: DeviceSpec | None) -> float | None:
    """Achieved TFLOP/s over the dense bf16 peak; None without a spec."""
    return None if spec is None else tflops / spec.bf16_tflops


# ------------------------------------------------------------------------------------------- the engine's floor

def prefill_flops(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int, inter: int, vocab: int,
                  prompt_lens: list[int]) -> float:
    """Model FLOPs of prefilling `prompt_lens` (chunking does not change the total): 2 x non-embedding weights per
    token, causal attention's QK^T and PV, lm_head on each prompt's last position."""
    qkvo = hidden * (2 * heads + 2 * kv_heads) * head_dim
    dense = layers * (qkvo + 3 * hidden * inter)
    return sum(2 * dense * p + 4 * layers * heads * head_dim * p * p / 2 + 2 * vocab * hidden for p in prompt_lens)


@dataclass
class Traffic:
    """What an engine's steps read, summed as they run (bench/engine.run_engine fills it): decode-only steps apart."""
    decode_bytes: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    run_bytes: float = 0.0    # every step, mixed prefill steps included
    steps: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def decode_fraction(self, spec: DeviceSpec | None) -> float | None:
        """Decode steps' floor (their bytes over the spec bandwidth) over their measured time."""
        if spec is None or not self.decode_s:
            return None
        return self.decode_bytes / spec.hbm_bytes_s / self.decode_s


def workload_floor_s(weight_bytes: float, kv_bytes_per_token: float, prompt_lens: list[int], out_lens: list[int],
                     max_num_seqs: int, flops_prefill: float, spec: DeviceSpec) -> float:
    """The whole run's floor for a workload, whatever engine runs it: every sequence admitted at once (up to
    `max_num_seqs`, then in arrival order as slots free), one decode step per token position reading the weights once
    and each live sequence's whole context; prefill FLOPs at the peak. Engine-independent, so the same floor divides
    our time and a peer's (a lower bound: preemptions and chunked prefill only add)."""
    live: list[tuple[int, int]] = []   # (context so far, tokens left) of the sequences decoding
    queue = list(zip(prompt_lens, out_lens))
    read = 0.0
    while queue or live:
        while queue and len(live) < max_num_seqs:
            p, o = queue.pop(0)
            live.append((p, o))
        read += weight_bytes + kv_bytes_per_token * sum(c for c, _ in live)
        live = [(c + 1, o - 1) for c, o in live if o > 1]
    return read / spec.hbm_bytes_s + flops_prefill / spec.peak_flops


def engine_workload_floor(shape: dict[str, int], n: int, lo: int, hi: int, seed: int, max_num_seqs: int,
                          spec: DeviceSpec, dtype_bytes: int = 2) -> float:
    """workload_floor_s of bench/engine.py's workload (its `workload` generator: prompt and output lengths drawn
    from `seed`), for a Qwen3-shaped model given as bench/engine.py SHAPES gives it, tied embeddings counted once."""
    rng = random.Random(seed)
    prompt_lens = []
    for _ in range(n):  # bench/engine.workload's draws, without the token ids' values
        p = rng.randint(lo, hi)
        for _ in range(p):
            rng.randrange(3, shape["vocab_size"] - 1)
        prompt_lens.append(p)
    out_lens = [rng.randint(lo, hi) for _ in range(n)]
    h, L, H, K, D, F, V = (shape[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                              "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size"))
    params = V * h + L * (h * (2 * H + 2 * K) * D + 3 * h * F + 2 * h + 2 * D) + h
    kv = 2 * L * K * D * dtype_bytes
    return workload_floor_s(params * dtype_bytes, kv, prompt_lens, out_lens, max_num_seqs,
                            prefill_flops(h, L, H, K, D, F, V, prompt_lens), spec)
