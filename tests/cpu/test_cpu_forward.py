"""The CPU engine's whole forward in one C call (cpu/forward.py, cpu/csrc/decode_forward.c): the same
bits as the op-by-op forward for decode, prefill chunks and mixed batches of any row count, on one thread and two,
with and without Qwen3's head norms; used only where it reproduces that forward; never reading stale weights; bad
input raises before anything is written."""
from __future__ import annotations

import dataclasses
import random
import shutil

import pytest
import torch
from torch import nn

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from cpu.forward import why_not
from cpu import build as cpu_native
from cpu import forward as cpu_forward
from model.presets import preset_config
from model.transformer import Transformer

pytestmark = pytest.mark.skipif(not cpu_forward.available(), reason="no C compiler or no sgemm_ in torch's library")

V = 20


def tiny(qk_norm: bool = True, seed: int = 0) -> Transformer:
    cfg = dataclasses.replace(preset_config("tiny", vocab_size=V, eos_token_id=1), qk_norm=qk_norm)
    return Transformer(cfg).init_weights(seed=seed)


def engine(model: Transformer, on: bool = True, **kw) -> LLMEngine:
    cfg = dict(block_size=16, num_kv_tokens=64 * 100, max_num_seqs=48, max_batch_tokens=200, seed=0, cpu_forward=on,
               cpu_decode_steps=1)   # one step a call here: tests/cpu/test_engine_decode_steps.py runs several
    return LLMEngine(model, EngineConfig(**{**cfg, **kw}))


def requests(n: int = 45, seed: int = 0) -> list[GenRequest]:
    """Prompts of 3-60 tokens (prefilled in chunks beside decodes under a 200-token budget), 1-40 new tokens."""
    rng = random.Random(seed)
    return [GenRequest([rng.randrange(2, V) for _ in range(rng.randrange(3, 60))],
                       SamplingParams(temperature=1.0, max_new_tokens=rng.randrange(1, 40), ignore_eos=True, seed=i),
                       group_id=i) for i in range(n)]


def run(eng: LLMEngine, reqs: list[GenRequest]) -> list[tuple[list[int], list[float]]]:
    return [(r.token_ids, r.logprobs) for r in eng.generate(reqs)]


class Counting:
    """Wraps the runner's C forward: the row count of every step it computed."""

    def __init__(self, inner):
        self.inner, self.rows = inner, []

    def __call__(self, ids, positions, meta):
        self.rows.append(ids.shape[0])
        return self.inner(ids, positions, meta)


@pytest.mark.slow
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("qk_norm", [True, False])
def test_same_tokens_and_logprobs_bit_for_bit_as_op_by_op(threads, qk_norm):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        on, off = engine(tiny(qk_norm)), engine(tiny(qk_norm), on=False)
        assert on.runner.cpu_forward is not None and off.runner.cpu_forward is None
        on.runner.cpu_forward = counting = Counting(on.runner.cpu_forward)
        assert run(on, requests()) == run(off, requests())
        # it ran every step: prefill chunks, mixed steps and decodes, row counts off multiples of 8 included
        assert len(counting.rows) > 40 and any(t % 8 for t in counting.rows) and max(counting.rows) > 48
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("change", ["fused_ops", "packed", "batched_attention", "off"])
def test_used_only_where_it_reproduces_the_op_by_op_forward(change):
    kw = {"fused_ops": dict(fused_ops=False), "packed": dict(cpu_packed_min_weight=0),
          "batched_attention": dict(attention="batched"), "off": dict(on=False)}[change]
    eng = engine(tiny(), **kw)
    assert eng.runner.cpu_forward is None
    if change != "off":
        assert why_not(eng.runner.model, eng.runner.attn, eng.runner.packed) is not None
    ref = engine(tiny()).runner
    assert why_not(ref.model, ref.attn, ref.packed) is None


def test_a_model_with_biases_keeps_the_op_by_op_forward():
    m = tiny()
    a = m.model.layers[0].self_attn
    a.q_proj.bias = nn.Parameter(torch.zeros(a.q_proj.out_features))
    eng = engine(m)
    assert eng.runner.cpu_forward is None
    assert "biases" in why_not(eng.runner.model, eng.runner.attn, eng.runner.packed)


def test_new_weights_are_read_whether_copied_in_or_replaced():
    on, off = engine(tiny()), engine(tiny(), on=False)
    run(on, requests(5))
    new = tiny(seed=3).state_dict()
    for eng in (on, off):
        eng.runner.load_weights(new)   # copied into the parameters in place
    assert run(on, requests(12, seed=2)) == run(off, requests(12, seed=2))
    # a parameter replaced by another tensor (not copied into): the address table is rebuilt
    for eng in (on, off):
        mlp = eng.runner.model.model.layers[1].mlp
        mlp.down_proj.weight = nn.Parameter(mlp.down_proj.weight.detach() * 1.5)
    assert run(on, requests(12, seed=4)) == run(off, requests(12, seed=4))


@pytest.mark.parametrize("change", ["dtype", "shape"])
def test_a_weight_replaced_by_one_the_c_code_cannot_read_raises(change):
    eng = engine(tiny())
    run(eng, requests(3))
    attn = eng.runner.model.model.layers[0].self_attn
    w = attn.o_proj.weight.detach()
    attn.o_proj.weight = nn.Parameter(w.double() if change == "dtype" else w[:, :32].clone())
    with pytest.raises(ValueError, match="cpu forward: every weight"):
        eng.runner.cpu_forward.table()


def step_args(**bad) -> dict:
    """A valid 2-token step (sequence 0 and 1, one token each in blocks 0 and 1), with some arguments replaced."""
    cos, sin = tiny().rotary.cos_sin(torch.zeros(2, dtype=torch.long), torch.float32)
    args = dict(ids=torch.tensor([3, 4]), cos=cos, sin=sin, slots=torch.tensor([0, 16]),
                block_tables=torch.tensor([[0], [1]], dtype=torch.int32),
                row_seq=torch.tensor([0, 1], dtype=torch.int32), row_len=torch.tensor([1, 1], dtype=torch.int32))
    return {**args, **bad}


@pytest.mark.parametrize("bad", ["token id", "slot", "sequence", "block", "dtype", "shape"])
def test_bad_input_raises_before_the_pool_is_written(bad):
    fwd = engine(tiny()).runner.cpu_forward
    assert cpu_forward.decode_forward(fwd.table(), **step_args()).shape == (2, 64)
    pools = [c.clone() for c in fwd.attn.k_caches + fwd.attn.v_caches]
    change = {"token id": dict(ids=torch.tensor([3, V])), "slot": dict(slots=torch.tensor([0, 64 * 100])),
              "sequence": dict(row_seq=torch.tensor([0, 2], dtype=torch.int32)),
              "block": dict(block_tables=torch.tensor([[0], [400]], dtype=torch.int32)),
              "dtype": dict(ids=torch.tensor([3, 4], dtype=torch.int32)),
              "shape": dict(slots=torch.tensor([0]))}[bad]
    with pytest.raises(ValueError if bad in ("dtype", "shape") else IndexError, match="cpu forward"):
        cpu_forward.decode_forward(fwd.table(), **step_args(**change))
    assert all(torch.equal(a, b) for a, b in zip(pools, fwd.attn.k_caches + fwd.attn.v_caches))


def test_the_build_is_redone_when_a_source_it_includes_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    shutil.copytree(cpu_native.SOURCE.parent, src)
    first = cpu_native.build(source=src / "decode_forward.c")
    other = src / "train_attention.c"   # not included
    other.write_text(other.read_text() + "\n/* changed */\n")
    assert cpu_native.build(source=src / "decode_forward.c") == first
    (src / "train_ops.c").write_text((src / "train_ops.c").read_text() + "\n/* changed */\n")
    assert cpu_native.build(source=src / "decode_forward.c") != first


def test_the_engine_bench_prints_the_ratio_against_op_by_op_last(capsys):
    from bench import engine as be
    be.main(["--shape", "tiny", "--num-prompts", "6", "--min-len", "8", "--max-len", "24", "--max-num-seqs", "4",
             "--skip-hf", "--op-by-op-baseline", "--repeats", "1"])
    lines = capsys.readouterr().out.strip().splitlines()
    name, ratio = lines[-1].split(": ")
    assert name == "engine_vs_op_by_op" and ratio.endswith("x") and float(ratio[:-1]) > 0
    assert any(line.startswith("engine with its forward op by op:") for line in lines)
