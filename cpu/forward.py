"""CPU engines of small fp32 models: the whole model forward of a step in one C call (cpu/csrc/decode_forward.c,
called through ctypes), the CPU's counterpart of the CUDA graphs a GPU engine replays (engine/cuda_graphs.py).

Why: a decode step of a small model is a few dozen ops of a few microseconds of arithmetic each, and each op called from
Python costs as much again in dispatch, allocation and checks. The tiny model's decode step at 256 rows (the long vs-TRL
job, one thread): forward 3.1-3.4 ms op by op, 2.2-2.5 ms in one call; the job's engine round of 256 steps 1.04-1.09 ->
0.78-0.86 s (bench/results/cpu-vs-trl.md). The C forward runs the same kernels in the same order as the fused model
(engine/fused.py with the C kernels of cpu/ops.py) and the projections through the same BLAS call as `padded_linear`
(cpu/linear.py), so it gives the same bits (tests/cpu/test_cpu_forward.py): a sequence decodes the same tokens with it
or without it, whatever it is batched with.

The projections call the BLAS `sgemm_` that torch's own F.linear calls, found in torch's shared library
(`build.sgemm_address`); a torch build that does not export it (no MKL, another BLAS) keeps the op-by-op forward.

When: `EngineConfig.cpu_forward` (default on), fp32 on the CPU, the fused model (engine/fused.py) and the C paged
attention in use, no biases, every norm with one eps, and every Linear of the layers computed by `padded_linear`
(weights under `cpu_packed_min_weight`: the larger ones run oneDNN's packed path, which the C forward does not
reproduce). Else, or for a step whose KV slots are not all valid, the model runs op by op. The LM head stays in
Python (its rows are only the sampled ones), except in `steps`: several decode steps in one call, the LM head and the
sampling included (cpu/engine.py `CpuEngine` says when), which takes the per-step Python of the engine out of all but
one step in `cpu_decode_steps`: the long job's engine round 0.66-0.68 -> 0.48-0.485 s with 16
(bench/results/cpu-vs-trl.md).

The tables of addresses are rebuilt whenever a tensor behind them moved (a weight replaced rather than copied
into); loads copy into the parameters in place (ModelRunner.load_weights), which the C forward then simply reads.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from cpu import build
from cpu.attention import CpuPagedAttention
from cpu.linear import PackedLinears
from engine.attention import AttentionMetadata
from engine.fused import FusedTransformer
from model.transformer import RMSNorm, Transformer

SOURCE = build.CSRC / "decode_forward.c"

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
FORWARD = build.NativeLibrary(SOURCE, {
    "decode_forward_f32": ([ctypes.POINTER(ModelPtrs), _P, _P, _P, _P, _P, _I, _P, _P, _I, _I, _P, ctypes.c_int],
                           ctypes.c_int),
    "decode_steps_f32": ([ctypes.POINTER(ModelPtrs), _P, _I, _I] + [_P] * 5 + [_I, _P, _P, _I, _P, _P, _P, _I]
                         + [_P] * 3 + [ctypes.c_int], ctypes.c_int)},
    "the engine's forward runs op by op")


def available() -> bool:
    return build.sgemm_address() is not None and FORWARD.load() is not None


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


def why_not(model: Transformer, attn: CpuPagedAttention, packed: PackedLinears | None) -> str | None:
    """Why the C forward cannot run this engine's model (None: it can)."""
    cfg = model.config
    params = list(model.parameters())
    if not isinstance(model, FusedTransformer):
        return "the model runs the eager ops (fused_ops off, or no C kernels)"
    if any(p.device.type != "cpu" or p.dtype != torch.float32 for p in params):
        return "not an fp32 CPU model"
    if not attn.native:
        return "the C paged attention is not in use"
    if cfg.attention_bias or any(isinstance(m, nn.Linear) and m.bias is not None for m in model.model.layers.modules()):
        return "Linear layers with biases"
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    if len({m.eps for m in norms}) > 1:
        return "norms with different eps"
    linears = [m for m in model.model.layers.modules() if isinstance(m, nn.Linear)]
    small = {id(m) for m in packed.small} if packed is not None else set()
    if not all(id(m) in small for m in linears):
        return "Linear layers on oneDNN's packed path (weights of at least cpu_packed_min_weight elements)"
    if not available():
        return "the C forward is unavailable (no sgemm_ in torch's library, or no C compiler)"
    return None


class CpuForward:
    """`forward(ids, positions, meta)` -> final hidden states, as `model(ids, positions, attn)` gives them."""

    def __init__(self, model: Transformer, attn: CpuPagedAttention):
        self.model, self.attn = model, attn
        self.ptrs: ModelPtrs | None = None
        self.key: tuple[int, ...] = ()

    def _tensors(self) -> list[torch.Tensor | None]:
        """Every tensor the C forward reads, looked up afresh (a replaced parameter or module is seen) through the
        modules' own dicts: nn.Module attribute lookups would cost ~45 us a step, these ~5."""
        w = _weight
        d = self.model._modules["model"]._modules
        out = [w(d["embed_tokens"]), w(d["norm"])]
        for i, block in enumerate(d["layers"]._modules.values()):
            b = block._modules
            a, mlp = b["self_attn"]._modules, b["mlp"]._modules
            out += [w(b["input_layernorm"]), w(a["q_proj"]), w(a["k_proj"]), w(a["v_proj"]), w(a.get("q_norm")),
                    w(a.get("k_norm")), w(a["o_proj"]), w(b["post_attention_layernorm"]), w(mlp["gate_proj"]),
                    w(mlp["up_proj"]), w(mlp["down_proj"]), self.attn.k_caches[i], self.attn.v_caches[i]]
        return out

    def _shapes(self, tensors: list[torch.Tensor | None]) -> list[tuple[int, ...] | None]:
        """The shape the C forward assumes for each of `tensors` (None: a head norm the model does not have)."""
        cfg = self.model.config
        H, D, Q, KV = cfg.hidden_size, cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        I, pool = tensors[2 + LAYER_FIELDS.index("gate")].shape[0], tuple(self.attn.k_caches[0].shape)
        layer = [(H,), (Q, H), (KV, H), (KV, H), (D,), (D,), (H, Q), (H,), (I, H), (I, H), (H, I), pool, pool]
        shapes: list[tuple[int, ...] | None] = [(tensors[0].shape[0], H), (H,)]
        for i in range(cfg.num_layers):
            shapes += [None if t is None else want for t, want in zip(tensors[2 + i * len(layer):], layer)]
        return shapes

    def _build(self, tensors: list[torch.Tensor | None]) -> None:
        # the C code trusts these: a weight replaced by one of another dtype or shape must not be read as this one
        for t, want in zip(tensors, self._shapes(tensors)):
            if t is not None and (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous()
                                  or tuple(t.shape) != want):
                raise ValueError(f"cpu forward: every weight and cache must be a contiguous fp32 CPU tensor of the "
                                 f"model's shape; got {t.dtype} {tuple(t.shape)} on {t.device} where {want} was due")
        cfg, d = self.model.config, self.model.model
        per = len(LAYER_FIELDS)
        addr = [t.data_ptr() if t is not None else None for t in tensors]
        layers = (LayerPtrs * cfg.num_layers)(*[
            LayerPtrs(*addr[2 + i * per:2 + (i + 1) * per]) for i in range(cfg.num_layers)])
        kc = self.attn.k_caches[0]
        self.ptrs = ModelPtrs(
            sgemm=build.sgemm_address(), layers=ctypes.cast(layers, ctypes.POINTER(LayerPtrs)),
            embed=tensors[0].data_ptr(), final_norm=tensors[1].data_ptr(), num_layers=cfg.num_layers,
            vocab=d.embed_tokens.weight.shape[0], hidden=cfg.hidden_size, heads=cfg.num_heads,
            kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, inter=d.layers[0].mlp.gate_proj.weight.shape[0],
            block_size=kc.shape[1], num_blocks=kc.shape[0], eps=d.norm.eps, scale=self.attn.scale)
        self._layers = layers   # the structs' memory lives as long as the table that points at it

    def table(self) -> ModelPtrs:
        """The C forward's table of addresses, rebuilt if a tensor behind it moved since."""
        tensors = self._tensors()
        key = tuple(t.data_ptr() if t is not None else 0 for t in tensors)
        if key != self.key or self.ptrs is None:
            self._build(tensors)
            self.key = key
        return self.ptrs

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        table = self.table()
        cos, sin = self.model.rotary.cos_sin(positions, torch.float32)
        return decode_forward(table, ids, cos.contiguous(), sin.contiguous(), meta.slot_mapping, meta.block_tables,
                              meta.query_seq, meta.query_len)

    def steps(self, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
              block_tables: torch.Tensor, row_len: torch.Tensor, temps: torch.Tensor, u: torch.Tensor,
              stops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k = slots.shape[0] decode steps of the rows of `block_tables` in one call, the LM head and temperature
        sampling included (`decode_steps`)."""
        T = ids.shape[0]
        return decode_steps(self.table(), self.model.lm_head.weight, ids, cos.contiguous(), sin.contiguous(),
                            slots.contiguous(), block_tables, torch.arange(T, dtype=torch.int32), row_len, temps, u,
                            stops)


LAYER_FIELDS = [name for name, _ in LayerPtrs._fields_]


def _weight(module: nn.Module | None) -> torch.Tensor | None:
    return None if module is None else module._parameters["weight"]
