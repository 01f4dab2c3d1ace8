"""Model shape: one dataclass for the Qwen2, Qwen3 and Llama families, read from / written to HF `config.json`."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

FAMILIES = {
    # model_type -> (architecture name, q/k-norm, attention bias on q/k/v)
    "qwen2": ("Qwen2ForCausalLM", False, True),
    "qwen3": ("Qwen3ForCausalLM", True, False),
    "llama": ("LlamaForCausalLM", False, False),
}
SUPPORTED_ROPE = ("default", "linear", "llama3")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # config names -> dtypes


class ModelConfigError(ValueError):
    """A config.json this code cannot run faithfully (unknown family, unsupported option, bad shape)."""


@dataclass
class ModelConfig:
    family: str  # "qwen2" | "qwen3" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF rope_parameters minus rope_theta, or None for default
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    attention_bias: bool = False
    dtype: str = "float32"  # the checkpoint's storage dtype
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    hf_config: dict[str, Any] = field(default_factory=dict, repr=False)  # the original, written back on save

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ModelConfigError(f"model_type {self.family!r} is not supported; supported: {sorted(FAMILIES)}")
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}")
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ModelConfigError(f"head_dim={self.head_dim} must be positive and even for rotary embeddings")
        rope_type = (self.rope_scaling or {}).get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE:
            raise ModelConfigError(f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE}")
        if self.dtype not in DTYPES:
            raise ModelConfigError(f"dtype {self.dtype!r} is not supported; supported: {sorted(DTYPES)}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V one token occupies across all layers, in the storage dtype."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.torch_dtype.itemsize

    def num_params(self) -> int:
        """Parameters of the model these shapes make (runtime/memory_plan.py)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = h * (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        attn = qkv + self.num_heads * self.head_dim * h + (qkv // h if self.attention_bias else 0)
        block = attn + 3 * h * i + 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        return v * h * (1 if self.tie_word_embeddings else 2) + self.num_layers * block + h

    # ---- HF config.json ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if not isinstance(d, dict):
            raise ModelConfigError(f"{source}: expected a JSON object of model settings, got {type(d).__name__}")
        family = d.get("model_type")
        if family not in FAMILIES:
            raise ModelConfigError(f"{source}: model_type {family!r} is not supported; supported: {sorted(FAMILIES)}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            if not isinstance(d.get(key), int) or isinstance(d[key], bool) or d[key] <= 0:
                raise ModelConfigError(f"{source}: {key} must be a positive integer, got {d.get(key)!r}")
        for key in ("num_key_value_heads", "head_dim", "max_position_embeddings"):  # optional, but typed if given
            if d.get(key) is not None and (not isinstance(d[key], int) or isinstance(d[key], bool) or d[key] <= 0):
                raise ModelConfigError(f"{source}: {key} must be a positive integer, got {d[key]!r}")
        for key in ("rms_norm_eps", "rope_theta"):
            if d.get(key) is not None and (not isinstance(d[key], (int, float)) or isinstance(d[key], bool)):
                raise ModelConfigError(f"{source}: {key} must be a number, got {d[key]!r}")
        for key in ("rope_parameters", "rope_scaling"):
            if d.get(key) is not None and not isinstance(d[key], dict):
                raise ModelConfigError(f"{source}: {key} must be an object, got {d[key]!r}")
        if d.get("use_sliding_window"):
            raise ModelConfigError(f"{source}: use_sliding_window=true is not supported")
        if d.get("mlp_bias"):
            raise ModelConfigError(f"{source}: mlp_bias=true is not supported")
        if d.get("hidden_act", "silu") != "silu":
            raise ModelConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} is not supported (only silu)")
        # transformers >= 5 writes rope_parameters={rope_theta, rope_type, ...}; older files: rope_theta/rope_scaling.
        rope = dict(d.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", d.get("rope_theta", 10000.0))
        if not isinstance(theta, (int, float)) or isinstance(theta, bool):
            raise ModelConfigError(f"{source}: rope_parameters.rope_theta must be a number, got {theta!r}")
        scaling = rope or dict(d.get("rope_scaling") or {})
        if "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling.get("rope_type", "default") == "default":
            scaling = None
        n_heads = d["num_attention_heads"]
        _, qk_norm, bias = FAMILIES[family]
        dtype = d.get("dtype") or d.get("torch_dtype") or "float32"
        try:
            return cls(
                family=family,
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_layers=d["num_hidden_layers"],
                num_heads=n_heads,
                num_kv_heads=d.get("num_key_value_heads") or n_heads,
                head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=scaling,
                max_position_embeddings=d.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                qk_norm=qk_norm,
                attention_bias=bias if d.get("attention_bias") is None else bool(d["attention_bias"]) or bias,
                dtype=str(dtype).replace("torch.", ""),
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id"),
                hf_config=dict(d),
            )
        except ModelConfigError as e:  # __post_init__'s checks do not know the file
            raise ModelConfigError(f"{source}: {e}") from None

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        f = Path(path) / "config.json"
        if not f.is_file():
            raise FileNotFoundError(f"{path}: no config.json (expected a Hugging Face model directory)")
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelConfigError(f"{f}: not valid JSON ({e})") from None
        return cls.from_hf(d, source=str(f))

    def to_hf(self) -> dict[str, Any]:
        """config.json contents. Fields we know overwrite the original's; everything else is kept as it was."""
        arch, _, _ = FAMILIES[self.family]
        rope = {"rope_theta": self.rope_theta, "rope_type": "default", **(self.rope_scaling or {})}
        d = dict(self.hf_config)
        d.pop("rope_scaling", None)
        d.pop("torch_dtype", None)
        d.update(
            architectures=[arch], model_type=self.family, vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_parameters=rope,
            max_position_embeddings=self.max_position_embeddings, tie_word_embeddings=self.tie_word_embeddings,
            hidden_act="silu", dtype=self.dtype, bos_token_id=self.bos_token_id, eos_token_id=self.eos_token_id,
        )
        if self.family != "qwen2":
            d["attention_bias"] = self.attention_bias
        return d
