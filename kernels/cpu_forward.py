"""The engine's whole model forward in one C call on the CPU (fp32): kernels/csrc/decode_forward.c, built and cached
like the other C kernels (kernels/cpu_native.py), called through ctypes.

The projections call the BLAS `sgemm_` that torch's own F.linear calls, found in torch's shared library
(`cpu_native.sgemm_address`); a torch build that does not export it (no MKL, another BLAS) keeps the op-by-op
forward.
engine/cpu_forward.py decides when the engine uses it and fills the pointer tables below from the model.
`decode_steps` runs several decode steps in one call (forward, LM head, sampling; engine/engine.py `_steps_ahead`).
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from kernels import cpu_native

SOURCE = Path(__file__).with_name("csrc") / "decode_forward.c"


class LayerPtrs(ctypes.Structure):
    """One decoder layer's weights and KV pool (`layer_ptrs` in the C file): addresses of contiguous fp32 tensors;
    q_norm / k_norm NULL for models without per-head norms."""
    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "q_proj", "k_proj", "v_proj", "q_norm", "k_norm", "o_proj", "post_norm", "gate", "up", "down",
        "k_cache", "v_cache")]


class ModelPtrs(ctypes.Structure):
    """The model (`model_ptrs`): sgemm's address, the layers, the embedding and final norm, the shapes."""
    _fields_ = [("sgemm", ctypes.c_void_p), ("layers", ctypes.POINTER(LayerPtrs)), ("embed", ctypes.c_void_p),
                ("final_norm", ctypes.c_void_p)] + [(name, ctypes.c_int64) for name in (
                    "num_layers", "vocab", "hidden", "heads", "kv_heads", "head_dim", "inter", "block_size",
                    "num_blocks")] + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_P, _I = ctypes.c_void_p, ctypes.c_int64
FORWARD = cpu_native.NativeLibrary(SOURCE, {
    "decode_forward_f32": ([ctypes.POINTER(ModelPtrs), _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _P, ctypes.c_int],
                           ctypes.c_int),
    "decode_steps_f32": ([ctypes.POINTER(ModelPtrs), _P, _I, _I] + [_P] * 5 + [_I, _P, _P, _I, _P, _P, _P, _I]
                         + [_P] * 3 + [ctypes.c_int], ctypes.c_int)},
    "the engine's forward runs op by op")

def available() -> bool:
    return cpu_native.sgemm_address() is not None and FORWARD.load() is not None


def _check(args: dict[str, tuple[torch.Tensor, torch.dtype, tuple[int, ...] | None]]) -> None:
    for name, (t, dtype, shape) in args.items():
        if t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() or (shape and tuple(t.shape) != shape):
            raise ValueError(f"cpu forward: {name} must be a contiguous CPU {dtype} tensor"
                             f"{f' of shape {shape}' if shape else ''}, got {t.dtype} {tuple(t.shape)} on {t.device}")


def _raise_for(rc: int, model: ModelPtrs, block_tables: torch.Tensor) -> None:
    if rc == -2:
        raise IndexError(f"cpu forward: a token id outside the {model.vocab} of the vocabulary, a slot outside the "
                         f"{model.num_blocks * model.block_size} of the pool, a row's sequence outside the "
                         f"{block_tables.shape[0]} rows of the block table or a block outside the pool")
    if rc != 0:
        raise MemoryError("cpu forward: could not allocate its scratch memory")


def decode_steps(model: ModelPtrs, lm_head: torch.Tensor, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, block_tables: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor,
                 temps: torch.Tensor, u: torch.Tensor, stops: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """k = slots.shape[0] decode steps of T rows in one call (decode_steps_f32 in the C file): row t computes `ids`[t]
    (int64 [T], its sequence's last token) at step 0 and the token it sampled at step j - 1 at step j, writing its
    K / V to slots[j, t] and attending to the first row_len[t] + j pool tokens of sequence row_seq[t]; rotary cos /
    sin [k, T, head_dim]; the LM head `lm_head` [vocab, hidden]; temperature sampling with temps [T] and uniforms
    u [k, T]. A row stops at a token of its row of `stops` [T, S] (int64, -1 padded) or a non-finite logits row.
    Returns tokens [k, T] (int64), their logprobs [k, T] (fp32, NaN for a non-finite row) and counts [T] (int32: the
    tokens each row sampled, the stopping one included; past them, and past the steps run, the arrays hold
    nothing). Raises IndexError as `decode_forward` does."""
    k, T = slots.shape
    _check({"ids": (ids, torch.int64, (T,)), "slots": (slots, torch.int64, (k, T)),
            "row_seq": (row_seq, torch.int32, (T,)), "row_len": (row_len, torch.int32, (T,)),
            "block_tables": (block_tables, torch.int32, None),
            "cos": (cos, torch.float32, (k, T, model.head_dim)), "sin": (sin, torch.float32, (k, T, model.head_dim)),
            "temps": (temps, torch.float32, (T,)), "u": (u, torch.float32, (k, T)),
            "stops": (stops, torch.int64, (T, stops.shape[1] if stops.dim() == 2 else -1)),
            "lm_head": (lm_head, torch.float32, (model.vocab, model.hidden))})
    tokens, logprobs = torch.empty(k, T, dtype=torch.int64), torch.empty(k, T)
    counts = torch.zeros(T, dtype=torch.int32)
    rc = FORWARD.require().decode_steps_f32(
        ctypes.byref(model), lm_head.data_ptr(), k, T, ids.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        slots.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], row_seq.data_ptr(), row_len.data_ptr(),
        block_tables.shape[0], temps.data_ptr(), u.data_ptr(), stops.data_ptr(), stops.shape[1], tokens.data_ptr(),
        logprobs.data_ptr(), counts.data_ptr(), torch.get_num_threads())
    _raise_for(rc, model, block_tables)
    return tokens, logprobs, counts


def decode_forward(model: ModelPtrs, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   block_tables: torch.Tensor, row_seq: torch.Tensor, row_len: torch.Tensor) -> torch.Tensor:
    """Final hidden states [T, hidden] of tokens `ids` [T] (int64) at rotary cos / sin [T, head_dim]: every layer's
    new K / V written to `slots` [T] (int64) of its pool, row t attending to the first row_len[t] pool tokens of
    sequence row_seq[t] (int32, a row of block_tables [S, W] int32). Raises IndexError on ids, slots, sequences or
    blocks out of range (before anything is written)."""
    T = ids.shape[0]
    args = {"ids": (ids, torch.int64, (T,)), "slots": (slots, torch.int64, (T,)),
            "row_seq": (row_seq, torch.int32, (T,)), "row_len": (row_len, torch.int32, (T,)),
            "block_tables": (block_tables, torch.int32, None), "cos": (cos, torch.float32, (T, model.head_dim)),
            "sin": (sin, torch.float32, (T, model.head_dim))}
    _check(args)
    out = torch.empty(T, model.hidden)
    rc = FORWARD.require().decode_forward_f32(
        ctypes.byref(model), ids.data_ptr(), cos.data_ptr(), sin.data_ptr(), slots.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], row_seq.data_ptr(), row_len.data_ptr(), block_tables.shape[0],
        T, out.data_ptr(), torch.get_num_threads())
    _raise_for(rc, model, block_tables)
    return out
