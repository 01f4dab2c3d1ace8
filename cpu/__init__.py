"""The optional C backend for CPU runs: kernels in C (csrc/), compiled at first use with the system compiler and
called through ctypes, and the engine and trainer paths that use them. Samples drawn with it differ from the torch
path's in the last bits (its sampler's exp is a polynomial). The core never imports this package: `enable()`
registers its parts into registries the core owns, and the entry points (train.py, rollout.py, bench/) call it.

  build.py            cc + cache + flock: `NativeLibrary`, one per C source; torch's `sgemm_` for the C matmuls
  ops.py              RMSNorm, rotary, SwiGLU, the whole MLP: autograd (trainer) and forward-only (engine) ops
  sample.py           temperature sampling of fp32 logits
  attention.py        the engine's paged attention (`CpuPagedAttention`, a subclass of engine/attention.py's)
  train_attention.py  the trainer's causal attention over a packing's rows
  linear.py           the engine's Linear layers on oneDNN-packed weights (or MKL on rows padded to 8)
  forward.py          the engine's whole model forward, and several decode steps, in one C call
  engine.py           `CpuEngine` / `CpuModelRunner`: the engine with the paths above
  trainer.py          the trainer's ops and attention, as trainer/fused.py takes them
  process.py          a CPU rank's threads, core affinity and allocator

The one switch is the config key `perf.cpu_backend` (c | torch), which `enable(cfg)` reads. Where a C source does
not build (no compiler), its parts warn once and keep the torch path.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from config import Config
    from runtime.topology import Topology

_registered = False


def enable(cfg: Config | None = None, topo: Topology | None = None) -> None:
    """Register the CPU backend into the core (idempotent): its forward-only kernels into kernels/dispatch.py
    (rms_norm, rope, silu_mul, sample), its kernel family into engine/fused.py, `CpuEngine` for models on the CPU into
    engine/engine.py, its train ops and attention into trainer/fused.py. With the run's config and topology, also set
    up this rank's process (process.py: core affinity, torch threads, allocator). `perf.cpu_backend = "torch"` in the
    config registers nothing: the run keeps PyTorch's ops."""
    global _registered
    if not _registered and (cfg is None or cfg.perf.cpu_backend == "c"):
        from cpu import engine, ops, sample, trainer
        from engine.engine import register_engine
        from engine.fused import register_ops
        from kernels.dispatch import register_impl
        from trainer.fused import register_train_ops
        register_impl("rms_norm", "cpu_c", ops.rms_norm_impl, ops.fused)
        register_impl("rope", "cpu_c", ops.rope_impl, ops.fused)
        register_impl("silu_mul", "cpu_c", ops.silu_mul_impl, ops.fused)
        register_impl("sample", "cpu_c", sample.sample_impl, ops.fused)
        register_ops(engine.engine_ops)
        register_engine(engine.pick_engine)
        register_train_ops(trainer.BACKEND)
        _registered = True
    if cfg is not None and topo is not None:
        from cpu import process
        process.setup(cfg, topo)
