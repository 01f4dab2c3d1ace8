"""One decoder definition (Qwen2 / Qwen3 / Llama) shared by the engine and the trainer."""
from model.attention import AttentionBackend, PackedCausal, cu_seqlens_from_lengths, positions_from_cu_seqlens
from model.config import ModelConfig, ModelConfigError
from model.hf_io import CheckpointError, load_model, save_model
from model.transformer import Transformer

__all__ = ["AttentionBackend", "PackedCausal", "cu_seqlens_from_lengths", "positions_from_cu_seqlens", "ModelConfig",
           "ModelConfigError", "CheckpointError", "load_model", "save_model", "Transformer"]
