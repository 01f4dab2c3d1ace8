"""Which implementation a dispatcher runs: the Triton kernel (kernels/triton_ops/), a C kernel for CPU tensors where
the op has one (kernels/cpu_train.py: RMSNorm, rotary embedding, SwiGLU), or the PyTorch reference.

`impl` argument of every dispatcher, or the environment variable `TIDAL_KERNELS` when it is None:
  "auto"   Triton when every tensor is on CUDA and triton is installed; the C kernel when every tensor is fp32 on
           the CPU, no gradient is recorded for them and the C kernels build; the reference otherwise (default);
  "triton" always the Triton kernel (on CPU tensors this needs TRITON_INTERPRET=1: the tests' path);
  "ref"    always the plain-PyTorch reference.
Deciding imports nothing: the dispatchers import kernels.triton_ops only once this file said Triton, so a machine
without triton, or a CPU run without the interpreter, never imports it.
"""
from __future__ import annotations

import importlib.util
import os

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

IMPLS = ("auto", "triton", "ref")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def resolve_impl(impl: str | None) -> str:
    """The `impl` argument, or the TIDAL_KERNELS variable when it is None (default "auto")."""
    impl = impl or os.environ.get("TIDAL_KERNELS", "auto")
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def use_triton(impl: str | None, *tensors: torch.Tensor) -> bool:
    """Resolve `impl` (see `resolve_impl`) to Triton (True) or the reference (False). Forcing "triton" on CPU
    tensors outside the interpreter is an error, not a silent fallback."""
    impl = resolve_impl(impl)
    if impl == "ref":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if impl == "auto":
        return HAS_TRITON and on_cuda
    if not HAS_TRITON:
        raise RuntimeError("impl='triton' but triton is not installed")
    if not on_cuda and not interpreting():
        raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before triton is imported)")
    return True


def use_cpu_c(impl: str | None, *tensors: torch.Tensor) -> bool:
    """Whether a dispatcher with a C kernel runs it (see the module docstring): forward only, so never while autograd
    records any of the tensors."""
    if resolve_impl(impl) != "auto":
        return False
    if not all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors):
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    from kernels import cpu_train
    return cpu_train.available()
