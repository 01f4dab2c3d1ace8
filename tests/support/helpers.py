"""Tiny models and tokenizers built here, never fetched: random weights in real Qwen2/Qwen3/Llama shapes."""
from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("qwen2", "qwen3", "llama")


def hf_config(family: str, vocab_size: int = 128, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config
    base = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2)
    if family == "qwen3":
        base.update(head_dim=32, tie_word_embeddings=True)  # explicit head_dim != hidden/heads, as in real Qwen3
    elif family == "qwen2":
        base.update(tie_word_embeddings=False)
    elif family == "llama":
        base.update(num_key_value_heads=1, rope_parameters=dict(  # GQA 4:1 and Llama-3.1 rope scaling
            rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
            original_max_position_embeddings=64))
    base.update(overrides)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[family]
    return cls(**base)


def make_hf_model(family: str, path: str | Path | None = None, seed: int = 0, **overrides):
    """A transformers model of `family` with every parameter random (biases and norms too, so parity tests see
    them), saved with save_pretrained to `path` if given. Returns the HF model in eval mode (fp32)."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf_config(family, **overrides), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.05 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(str(path))
    return model
