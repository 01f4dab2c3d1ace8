"""The trainer's causal attention on CPU as one C kernel each way (`cpu/csrc/train_attention.c`), built and cached by
cpu/build.py.

SDPA's CPU flash kernel serves the trainer's packed sequences only through a padded [B, H, Lmax, D] copy, and a
prompt-shared packing (model/attention.py `SharedPrefixCausal`) through rows that gather the prompt again for every
child and compute its queries again. The kernel reads the packed tensors in place: a `CausalRows` plan lists rows
(query tokens, and the prefix they see whole), a prompt's queries are computed once, and a prompt's key and value
gradients are summed over its children inside the kernel. At head_dim 16, where SDPA's CPU kernel is far from the
core's rate, one micro-batch of the long vs-TRL job (8 prompts of 12 tokens x 8 children of 255, 4 query and 2 kv
heads, one thread) takes 32-35 ms forward + backward against SDPA's 62-68 ms through the rows, and the job's train
step 0.94-0.97 s against 1.20-1.25 s (bench/results/cpu-vs-trl.md). Same values as SDPA to fp32 rounding
(tests/cpu/test_cpu_attention.py); results do not depend on the thread count (see the C file).

Only fp32 CPU tensors take this path (`fused`); anything else, or a failed build, keeps the backend's own SDPA call
(cpu/trainer.py decides per call).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
import torch

from cpu import build

SOURCE = build.CSRC / "train_attention.c"

_P, _I = ctypes.c_void_p, ctypes.c_int64
ATTENTION = build.NativeLibrary(SOURCE, {
    "attention_fwd": ([_P] * 5 + [_P, _I, _P, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int], ctypes.c_int),
    "attention_bwd": ([_P] * 9 + [_P, _I, _P, _I, _I, _I, _I, ctypes.c_float, ctypes.c_int], ctypes.c_int),
}, "the trainer keeps SDPA")


def available() -> bool:
    return ATTENTION.load() is not None


def fused(*tensors: torch.Tensor) -> bool:
    """Whether these tensors take the kernel: fp32 on the CPU, with the kernel built."""
    return all(t.device.type == "cpu" and t.dtype == torch.float32 for t in tensors) and available()


@dataclass(frozen=True)
class CausalRows:
    """Who attends to whom, as the kernel reads it. `rows` [R, 4] int64: (first query token, query count, first
    prefix token, prefix count); row r's query i sees the whole prefix and the row's own tokens up to i. `tasks`
    [n + 1] int64: task t is rows tasks[t]..tasks[t + 1], the rows whose prefixes and queries share tokens (a
    prompt's row and its children's), computed in order by one thread."""
    rows: torch.Tensor
    tasks: torch.Tensor
    num_tokens: int

    @classmethod
    def build(cls, tasks: list[list[tuple[int, int, int, int]]], num_tokens: int) -> "CausalRows":
        """From each task's rows (query start, query count, prefix start, prefix count). Raises ValueError unless
        every token is the query of exactly one row and each row's prefix, when it has one, is the query tokens
        of a row of its own task (a child's prefix is its prompt's row)."""
        flat = [row for task in tasks for row in task]
        rows = torch.tensor(flat, dtype=torch.int64).reshape(-1, 4)
        qs, nq = rows[:, 0], rows[:, 1]
        if len(flat) and (int(nq.min()) < 1 or int(qs.min()) < 0 or int((qs + nq).max()) > num_tokens):
            raise ValueError(f"attention rows: a row has no query or leaves the {num_tokens} packed tokens")
        cover = torch.zeros(num_tokens + 1, dtype=torch.int64)
        cover.index_add_(0, qs, torch.ones_like(qs)).index_add_(0, qs + nq, -torch.ones_like(qs))
        bad = (cover.cumsum(0)[:num_tokens] != 1).nonzero()
        if len(bad):
            raise ValueError(f"attention rows: token {int(bad[0])} is the query of no row or of several")
        for t, task in enumerate(tasks):
            runs = {(q0, n) for q0, n, _, _ in task}
            for _, _, ps, n in task:
                if n and (ps, n) not in runs:
                    raise ValueError(f"attention rows: prefix [{ps}, {ps + n}) is no row of task {t}")
        bounds = [0]
        for task in tasks:
            bounds.append(bounds[-1] + len(task))
        return cls(rows, torch.tensor(bounds, dtype=torch.int64), num_tokens)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CausalRows) -> None:
    if q.dim() != 3 or k.shape != v.shape or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} are not "
                         "[T, Hq, D], [T, Hkv, D], [T, Hkv, D]")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} kv heads")
    if q.shape[0] != plan.num_tokens:
        raise ValueError(f"attention: {q.shape[0]} tokens for a plan of {plan.num_tokens}")


class CausalRowsAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CausalRows,
                scale: float) -> torch.Tensor:
        _check(q, k, v, plan)
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        T, Hq, D = q.shape
        o, lse = torch.empty_like(q), q.new_empty(T, Hq)
        rc = ATTENTION.require().attention_fwd(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr(), plan.rows.data_ptr(),
            plan.rows.shape[0], plan.tasks.data_ptr(), plan.tasks.numel() - 1, Hq, k.shape[1], D, scale,
            torch.get_num_threads())
        if rc:
            raise MemoryError("attention_fwd: no memory for its scratch rows")
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.plan, ctx.scale = plan, scale
        return o

    @staticmethod
    def backward(ctx, do: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None, None]:
        q, k, v, o, lse = ctx.saved_tensors
        plan = ctx.plan
        do = do.contiguous()
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rc = ATTENTION.require().attention_bwd(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), do.data_ptr(), lse.data_ptr(), dq.data_ptr(),
            dk.data_ptr(), dv.data_ptr(), plan.rows.data_ptr(), plan.rows.shape[0], plan.tasks.data_ptr(),
            plan.tasks.numel() - 1, q.shape[1], k.shape[1], q.shape[2], ctx.scale, torch.get_num_threads())
        if rc:
            raise MemoryError("attention_bwd: no memory for its scratch rows")
        return dq, dk, dv, None, None


def causal_rows_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: CausalRows,
                          scale: float | None = None) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] (fp32, CPU) -> [T, Hq, D], each query attending as `plan` says."""
    return CausalRowsAttention.apply(q, k, v, plan, q.shape[-1] ** -0.5 if scale is None else float(scale))
