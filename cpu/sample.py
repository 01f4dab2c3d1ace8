"""Temperature sampling for CPU engines: the C kernel of `cpu/csrc/sample.c`, built and cached by cpu/build.py and
registered into kernels/sample.py's dispatcher by `cpu.enable`. Contract: kernels.sample.sample_ref (one token per
row by inverse CDF with the given uniform, and its logprob under log_softmax(logits / T)).

The reference materialises the scaled logits, log-probs, probabilities and their cumulative sum, each a [B, V] fp32
pass, then a search and two gathers: about ten op launches whatever the size. The kernel reads each row three times
(max, sum, running sum to the drawn token) and writes two numbers. On the tiny model's long rollout (256 rows of 20
logits a decode step) the reference took ~40 us a step, the kernel ~3 us; at a 151,936-token vocabulary it saves
the four [B, V] intermediates. Logprobs agree with the reference to fp32 rounding (its exp is the kernels'
polynomial, relative error ~2e-7); tokens agree wherever u does not fall within that rounding of a token's
boundary (tests/kernels/test_kernels_sample.py).
"""
from __future__ import annotations

import ctypes

import torch

from cpu import build
from kernels.sample import sample_ref

SOURCE = build.CSRC / "sample.c"
_P, _I = ctypes.c_void_p, ctypes.c_int64
SAMPLE = build.NativeLibrary(SOURCE, {"sample_f32": ([_P, _I, _I, _I, _P, _P, _P, _P, ctypes.c_int], None)},
                                  "the PyTorch sampler runs instead")


def available() -> bool:
    return SAMPLE.load() is not None


def sample_c(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] fp32 on the CPU (rows contiguous), temps [B] > 0, u [B] in [0, 1) -> (tokens [B] int64,
    logprobs [B] fp32); see `kernels.sample.sample_ref`."""
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    B, V = x.shape
    temps = temps.to(torch.float32).contiguous()
    u = u.to(torch.float32).contiguous()
    tokens = torch.empty(B, dtype=torch.int64)
    logprobs = torch.empty(B, dtype=torch.float32)
    if B:
        SAMPLE.require().sample_f32(x.data_ptr(), B, V, x.stride(0), temps.data_ptr(), u.data_ptr(),
                                    tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
    return tokens, logprobs


def sample_impl(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What `cpu.enable` registers for kernels/sample.py's dispatcher: the kernel, or the reference where it does not
    build."""
    return sample_c(logits, temps, u) if available() else sample_ref(logits, temps, u)
