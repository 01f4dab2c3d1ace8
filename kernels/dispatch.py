"""Which implementation a dispatcher runs: the Triton kernel (kernels/triton_ops/), an implementation a backend
registered for the op (`register_impl`: the optional cpu/ package registers its C kernels for fp32 CPU tensors),
or the PyTorch reference.

`impl` argument of every dispatcher, or the environment variable `TIDAL_KERNELS` when it is None:
  "auto"   Triton when every tensor is on CUDA and triton is installed; else the first registered implementation
           of the op that accepts the tensors, while no gradient is recorded for them (the dispatchers are forward
           only); the reference otherwise (default);
  "triton" always the Triton kernel (on CPU tensors this needs TRITON_INTERPRET=1: the tests' path);
  "ref"    always the plain-PyTorch reference.
Deciding imports nothing: the dispatchers import kernels.triton_ops only once this file said Triton, so a machine
without triton, or a CPU run without the interpreter, never imports it.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Callable

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


@dataclass(frozen=True)
class Impl:
    """An implementation of a dispatcher's op that a backend registered: `fn` takes the dispatcher's arguments
    (without `impl`), `accepts(*tensors)` says whether it takes these tensors (e.g. fp32 on the CPU, its library
    built)."""
    backend: str
    fn: Callable[..., object]
    accepts: Callable[..., bool]


REGISTRY: dict[str, list[Impl]] = {}   # op ("rms_norm", "rope", "silu_mul", "sample") -> its registered impls


def register_impl(op: str, backend: str, fn: Callable[..., object], accepts: Callable[..., bool]) -> None:
    """Register `fn` as `backend`'s implementation of `op` (registering a backend's op again replaces it)."""
    impls = [i for i in REGISTRY.get(op, []) if i.backend != backend]
    REGISTRY[op] = impls + [Impl(backend, fn, accepts)]


def impl_for(op: str, impl: str | None, *tensors: torch.Tensor) -> Callable[..., object] | None:
    """The registered implementation of `op` a dispatcher runs on these tensors, None for none: only under "auto",
    never while autograd records any of the tensors, else the first whose `accepts` takes them."""
    impls = REGISTRY.get(op)
    if not impls or resolve_impl(impl) != "auto":
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return next((i.fn for i in impls if i.accepts(*tensors)), None)
