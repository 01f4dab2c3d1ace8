"""Per-token log-probability of a target and entropy, from final hidden states and the lm_head weight, without ever
materialising the full [T, V] logits (a 16k-token micro-batch of a 151,936-word vocabulary would be ~10 GB in fp32).

With z = (hidden @ weight.T).float() / temperature (rows [T, V]), lse = logsumexp(z), p = softmax(z):
  logprob[t] = z[t, target[t]] - lse[t],   entropy[t] = lse[t] - sum_v p[t, v] z[t, v]   (= -sum p log p).
Backward, with upstream gradients g_lp, g_ent [T] and E[z] = sum_v p z:
  dL/dz[t, v] = g_lp[t] * (onehot(target)[v] - p[t, v]) - g_ent[t] * p[t, v] * (z[t, v] - E[z][t]),
  dL/dlogits = dL/dz / temperature;  grad_hidden = dL/dlogits @ weight;  grad_weight = dL/dlogits.T @ hidden.

`ChunkedLogprobs` (a torch.autograd.Function) bounds the transient memory by `chunk_size` tokens x V:
- forward: token chunks; per chunk one matmul [C, V], then the row statistics (lse, target logit, E[z]); only
  lse and E[z] ([T] fp32 each) are saved, plus references to the inputs;
- backward: vocabulary chunks of about chunk_size * V / T words, so the transient [T, Vc] has the same size; each
  chunk's logits are recomputed, turned into dL/dlogits, and give grad_weight[chunk] in one matmul (no accumulation
  across chunks) and a contribution to grad_hidden (accumulated in fp32, [T, H]).
The row statistics and dL/dlogits are either plain PyTorch ops (`_stats_ref`, `_grad_ref`: the reference, CPU) or
two Triton kernels that read each logit once (kernels/triton_ops/logprobs.py). The matmuls are cuBLAS in both.
`token_logprobs_naive` (full log_softmax) is the oracle and the baseline.
"""
from __future__ import annotations

from typing import Callable

import torch

from kernels.dispatch import use_triton

# The default transient logits budget, chunk_size * V elements: ~32M (128 MiB in fp32) on CPU, ~128M on a GPU. The
# chunks are launched one by one from the host: at 128 tokens a chunk of Qwen3's vocabulary this head launched ~570 of
# the ~1,320 matmuls of each 16k-token micro-batch of the H200 GRPO step's host-bound training phase
# (bench/results/gpu-h200.md); 512 tokens a chunk launch ~4x fewer, for a peak still a few percent of the full
# logits' (425 MiB against 47 GiB measured at 128 tokens a chunk).
CHUNK_ELEMENTS = 1 << 25
CHUNK_ELEMENTS_GPU = 1 << 27


def token_logprobs_naive(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         temperature: float = 1.0, with_entropy: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Full-vocabulary log_softmax (materialises [T, V] logits): the oracle and the bench baseline."""
    logits = hidden @ weight.T
    logp = (logits.to(_acc_dtype(logits.dtype)) / temperature).log_softmax(-1)
    lp = logp.gather(-1, targets.long()[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Softmax statistics dtype: fp32, or fp64 for fp64 inputs (exact oracle tests)."""
    return torch.promote_types(dtype, torch.float32)


# ---- row statistics and dL/dlogits: PyTorch reference ----------------------------------------------------------

def _stats_ref(raw: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw logits [C, V] (any float dtype) -> lse, target logit, E[z] ([C] fp32; E[z] None without entropy)."""
    z = raw.to(_acc_dtype(raw.dtype))
    z.div_(temperature)
    lse = torch.logsumexp(z, -1)
    zt = z.gather(-1, targets.long()[:, None]).squeeze(-1)
    if not with_entropy:
        return lse, zt, None
    p = z.sub(lse[:, None]).exp_()
    ez = torch.bmm(p[:, None, :], z[:, :, None]).view(-1)  # sum_v p z without another [C, V] temporary
    return lse, zt, ez


def _grad_ref(raw: torch.Tensor, targets: torch.Tensor, col0: int, lse: torch.Tensor, ez: torch.Tensor | None,
              g_lp: torch.Tensor, g_ent: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """raw logits [T, Vc] of vocabulary columns [col0, col0 + Vc) -> dL/dlogits [T, Vc] in raw's dtype."""
    z = raw.to(_acc_dtype(raw.dtype))
    z.div_(temperature)
    dz = z.sub(lse[:, None]).exp_()  # p
    coef = (g_lp[:, None].expand_as(dz) if g_ent is None
            else z.sub_(ez[:, None]).mul_(g_ent[:, None]).add_(g_lp[:, None]))
    dz.mul_(coef).neg_()
    local = targets.long() - col0
    hit = (local >= 0) & (local < raw.shape[1])
    rows = hit.nonzero().squeeze(-1)
    dz[rows, local[rows]] += g_lp[rows]
    return dz.div_(temperature).to(raw.dtype)


def _row_ops(triton: bool) -> tuple[Callable, Callable]:
    """(row statistics, dL/dlogits): the Triton kernels' launchers or the references above."""
    if triton:
        from kernels.triton_ops.logprobs import grad_triton, stats_triton
        return stats_triton, grad_triton
    return _stats_ref, _grad_ref


# ---- the autograd Function and the public entry point ----------------------------------------------------------

class ChunkedLogprobs(torch.autograd.Function):
    """(hidden [T, H], weight [V, H], targets [T]) -> (logprobs [T] fp32, entropy [T] fp32 or empty)."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float,
                chunk_size: int, with_entropy: bool, triton: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.set_materialize_grads(False)  # an unused output (say, entropy only logged) skips its gradient terms
        T = hidden.shape[0]
        stats, _ = _row_ops(triton)
        lse = torch.empty(T, dtype=_acc_dtype(hidden.dtype), device=hidden.device)
        lp = torch.empty_like(lse)
        ez = torch.empty_like(lse) if with_entropy else None
        for i in range(0, T, chunk_size):
            j = min(i + chunk_size, T)
            raw = hidden[i:j] @ weight.T
            lse[i:j], zt, ez_c = stats(raw, targets[i:j], temperature, with_entropy)
            lp[i:j] = zt - lse[i:j]
            if with_entropy:
                ez[i:j] = ez_c
            del raw
        ctx.save_for_backward(hidden, weight, targets, lse, ez if with_entropy else lse)
        ctx.cfg = (temperature, chunk_size, with_entropy, triton)
        ent = lse - ez if with_entropy else lse.new_empty(0)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp: torch.Tensor | None, g_ent: torch.Tensor | None):
        hidden, weight, targets, lse, ez = ctx.saved_tensors
        temperature, chunk_size, with_entropy, triton = ctx.cfg
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        T, V = hidden.shape[0], weight.shape[0]
        if g_lp is None and (g_ent is None or not with_entropy):
            return None, None, None, None, None, None, None
        g_lp = torch.zeros_like(lse) if g_lp is None else g_lp.to(lse.dtype).contiguous()
        g_ent = g_ent.to(lse.dtype).contiguous() if with_entropy and g_ent is not None else None
        _, grad = _row_ops(triton)
        gh = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device) if need_h else None
        gw = torch.empty_like(weight) if need_w else None
        vc = max(1, chunk_size * V // max(T, 1))
        vc = vc if vc < 256 else vc // 256 * 256  # matmul-friendly widths
        for a in range(0, V, vc):
            b = min(a + vc, V)
            dz = grad(hidden @ weight[a:b].T, targets, a, lse, ez if g_ent is not None else None, g_lp, g_ent,
                      temperature)
            if need_w:
                torch.mm(dz.T, hidden, out=gw[a:b])
            if need_h:
                if gh.dtype == dz.dtype:
                    gh.addmm_(dz, weight[a:b])
                else:
                    gh += dz @ weight[a:b]
            del dz
        return (gh.to(hidden.dtype) if need_h else None), gw, None, None, None, None, None


def default_chunk_size(vocab: int, device_type: str = "cpu") -> int:
    """Tokens per forward chunk so that a chunk's logits hold about the device's budget of values (CHUNK_ELEMENTS,
    CHUNK_ELEMENTS_GPU on CUDA; a power of two >= 16)."""
    budget = CHUNK_ELEMENTS_GPU if device_type == "cuda" else CHUNK_ELEMENTS
    c = max(16, budget // max(vocab, 1))
    return 1 << (c.bit_length() - 1)


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                   chunk_size: int | None = None, with_entropy: bool = True, *, impl: str | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden [..., H] (final, normed hidden states), weight [V, H] (lm_head; may be tied to the embedding),
    targets [...] int ids in [0, V) -> (logprobs [...] fp32, entropy [...] fp32 or None), differentiable w.r.t.
    hidden and weight, with transient memory bounded by chunk_size tokens x V logits (default: default_chunk_size
    for the device).
    impl: "auto" (Triton row kernels on CUDA), "triton", "ref" (see kernels/dispatch.py); the matmuls are torch's."""
    lead = hidden.shape[:-1]
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1)
    t1 = t1 if t1.is_contiguous() else t1.contiguous()
    chunk = chunk_size or default_chunk_size(weight.shape[0], hidden.device.type)
    triton = use_triton(impl, h2, weight) and hidden.dtype != torch.float64  # fp64: always the reference
    lp, ent = ChunkedLogprobs.apply(h2, weight, t1, float(temperature), int(chunk), bool(with_entropy), triton)
    return lp.view(lead), (ent.view(lead) if with_entropy else None)
