"""The one decoder (Qwen2 / Qwen3 / Llama): a plain nn.Module shared by the engine and the trainer.

Parameter names are exactly the Hugging Face ones (`model.layers.3.self_attn.q_proj.weight`, `lm_head.weight`),
so checkpoints load and save with no key mapping. Inputs are packed: `input_ids` and `positions` are [T] for all
sequences of a batch laid end to end, and the attention backend decides who attends to whom.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from model.attention import AttentionBackend, PackedCausal, positions_from_cu_seqlens
from model.config import ModelConfig
from model.rope import Rotary, apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and self.weight.dtype == torch.float32:  # same math, one fused op
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _attend(attn: AttentionBackend, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return attn(layer, q, k, v)


class Attention(nn.Module):
    rotate = staticmethod(apply_rotary)  # the rotary embedding of q and k (a trainer may swap in a fused one)
    attend = staticmethod(_attend)       # q, k, v through the backend (a trainer may swap in a fused kernel)

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h, d, b = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=b)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=b)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=b)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None   # Qwen3: per-head norms of q, k
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.n_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(T, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotate(q, cos, sin), self.rotate(k, cos, sin)
        out = self.attend(attn, self.layer, q, k, v)
        return self.o_proj(out.reshape(T, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = Rotary(cfg)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend) -> torch.Tensor:
        """input_ids, positions: [T] -> final (normed) hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for block in self.model.layers:
            x = block(x, cos, sin, attn)
        return self.model.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def forward_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Logits [T, vocab] for sequences packed end to end, each attending causally to itself only."""
        hidden = self(input_ids, positions_from_cu_seqlens(cu_seqlens), PackedCausal(cu_seqlens))
        return self.logits(hidden)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, seed: int | None = None) -> "Transformer":
        """Random init for models built from scratch (tests, the tiny default run): N(0, std), norms at one."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * std)
        return self


def swap_classes(model: nn.Module, swaps: dict[type, type]) -> int:
    """Set the class of every submodule whose exact class is a key of `swaps` to its value, in place: how kernels
    are applied from outside (trainer/fused.py, engine/fused.py), the values being subclasses with another
    forward and the same parameters and state dict. Returns how many modules were swapped."""
    n = 0
    for m in model.modules():
        cls = swaps.get(type(m))
        if cls is not None:
            m.__class__ = cls
            n += 1
    return n
