"""Shared plumbing for the Triton kernels: lazy jit, implementation choice, small launch helpers.

Two rules shape this file:
- `TRITON_INTERPRET=1` must be set before `import triton`: triton.language's own @jit helpers (tl.max, tl.sum,
  tl.cdiv, tl.zeros_like, ...) are built for one mode when triton is imported, and the interpreter cannot call the
  compiled-mode ones. So importing `kernels` never imports triton: each kernel file leaves `tl = None`, and
  `lazy_jit` imports triton, binds `tl` in the kernel's module and runs `triton.jit` at the first launch. A test
  module may then set the variable after some other module imported `kernels` (pytest collects every test module
  before it runs any), as long as nothing imported triton itself before.
- triton is optional: CPU machines without it run the PyTorch references.

Implementation choice (`impl` argument of every dispatcher, or the environment variable `TIDAL_KERNELS`):
  "auto"   Triton when every tensor is on CUDA and triton imports, the reference otherwise (default);
  "triton" always the Triton kernel (on CPU tensors this needs TRITON_INTERPRET=1: the tests' path);
  "ref"    always the plain-PyTorch reference.
"""
from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any, Callable

import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None

IMPLS = ("auto", "triton", "ref")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyJit:
    """A `@triton.jit` kernel compiled on first launch (`kernel[grid](...)`), once per interpreter setting."""

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn
        self._jitted: dict[bool, Any] = {}
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        key = interpreting()
        kernel = self._jitted.get(key)
        if kernel is None:
            import triton
            import triton.language
            if key and type(triton.language.standard.cdiv).__name__ == "JITFunction":
                raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its own helpers are "
                                   "compiled-mode functions the interpreter cannot call; set the variable earlier "
                                   "(before anything imports triton, e.g. in a conftest)")
            self.fn.__globals__["tl"] = triton.language
            kernel = self._jitted[key] = triton.jit(self.fn)
        return kernel[grid]


def lazy_jit(fn: Callable[..., Any]) -> LazyJit:
    return LazyJit(fn)


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
        raise RuntimeError("impl='triton' on CPU tensors needs TRITON_INTERPRET=1 (set before the first launch)")
    return True


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 132, an H100/H200, for CPU tensors)."""
    if device_index < 0 or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(t: torch.Tensor) -> int:
    return num_sms(t.device.index if t.is_cuda and t.device.index is not None else
                   (torch.cuda.current_device() if t.is_cuda else -1))
