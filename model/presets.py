"""Named model shapes for random-init runs (tests, the tiny default, benchmarks). Real shapes from the public
config.json files of Qwen3; `tiny` is small enough to learn the synthetic task on CPU in minutes."""
from __future__ import annotations

from model.config import ModelConfig

_SHAPES = {
    #             hidden  inter  layers heads kv  head_dim  vocab   tied   rope_theta
    "tiny":       (64,    256,   2,     4,    2,  16,       None,   False, 10000.0),
    "qwen3-0.6b": (1024,  3072,  28,    16,   8,  128,      151936, True,  1e6),
    "qwen3-1.7b": (2048,  6144,  28,    16,   8,  128,      151936, True,  1e6),
    "qwen3-8b":   (4096,  12288, 36,    32,   8,  128,      151936, False, 1e6),
}
PRESETS = tuple(_SHAPES)


def preset_config(name: str, vocab_size: int | None = None, max_position_embeddings: int = 4096,
                  eos_token_id: int | None = None, dtype: str = "float32") -> ModelConfig:
    """A Qwen3-family ModelConfig. vocab_size overrides the preset's (and is required for `tiny`, whose
    vocabulary is the synthetic task's tokenizer)."""
    if name not in _SHAPES:
        raise ValueError(f"unknown model preset {name!r}; presets: {list(PRESETS)}")
    h, i, n, heads, kv, d, vocab, tied, theta = _SHAPES[name]
    vocab = vocab_size or vocab
    if vocab is None:
        raise ValueError(f"model preset {name!r} needs a vocab_size (the tokenizer's)")
    return ModelConfig(family="qwen3", vocab_size=vocab, hidden_size=h, intermediate_size=i, num_layers=n,
                       num_heads=heads, num_kv_heads=kv, head_dim=d, rms_norm_eps=1e-6, rope_theta=theta,
                       max_position_embeddings=max_position_embeddings, tie_word_embeddings=tied, qk_norm=True,
                       dtype=dtype, eos_token_id=eos_token_id)
