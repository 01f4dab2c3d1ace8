"""Rotary position embedding (the HF "rotate_half" layout) with the config's theta and optional scaling."""
from __future__ import annotations

import math

import torch

from model.config import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim // 2] in fp32, after the config's rope scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim))
    s = cfg.rope_scaling or {}
    kind = s.get("rope_type", "default")
    if kind == "linear":
        inv = inv / float(s["factor"])
    elif kind == "llama3":  # Llama 3.1: scale low frequencies, keep high ones, blend between
        factor, lo, hi = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_ctx = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old_ctx / lo, inv / factor, inv)
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_ctx / hi) & (wavelen <= old_ctx / lo)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class Rotary:
    """cos/sin tables computed from positions on the fly (no buffers, so meta-device init needs nothing special)."""

    def __init__(self, cfg: ModelConfig):
        self.inv_freq = inv_frequencies(cfg)
        self._dev: dict[torch.device, torch.Tensor] = {}

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, head_dim] in `dtype` (computed in fp32)."""
        inv = self._dev.get(positions.device)
        if inv is None:
            inv = self._dev[positions.device] = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]
