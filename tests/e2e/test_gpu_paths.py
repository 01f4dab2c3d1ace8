"""What had only run on CPU and can run on one GPU: KV export/import and `load_weights` with decode under CUDA graphs,
a DCP checkpoint saved and resumed by the trainer on the device, and a relay chain of two engines sharing the GPU with
one train rank. Each is marked `gpu` and skipped without CUDA; their CPU analogues:
tests/runtime/test_kv_migration.py (KV moves), tests/engine/test_engine.py (load_weights),
tests/trainer/test_trainer_dist.py and tests/e2e/test_train_e2e.py (resume), tests/runtime/test_publish_relay.py
(the chain over gloo).

Two NCCL ranks of one communicator cannot share one GPU with the NCCL torch 2.11 ships (2.28: "Duplicate GPU
detected"): one GPU holds one train rank, and engines that share it form no KV group (perf.migrate_kv off;
runtime/topology.py shared_devices), their weights reaching them as host memory over gloo."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
from model import Transformer
from model.presets import preset_config
from tests.support.engine import drain, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
ROOT = Path(__file__).resolve().parents[2]


def sharp(seed: int) -> Transformer:
    """The `tiny` preset, weights scaled up so greedy outputs vary, on the GPU in fp32 (exact comparisons)."""
    model = Transformer(preset_config("tiny", vocab_size=128)).init_weights(seed=seed).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(3.0)
    return model.to("cuda")


def cuda_engine(model: Transformer, **kw) -> LLMEngine:
    cfg = dict(block_size=16, num_kv_tokens=4096, max_num_seqs=8, max_batch_tokens=256, cuda_graphs=True)
    cfg.update(kw)
    eng = LLMEngine(model, EngineConfig(**cfg))
    assert eng.runner.graphs is not None
    return eng


GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20)


def test_kv_exported_mid_decode_is_adopted_by_another_cuda_engine_and_decoding_continues():
    model = sharp(0)
    ps = prompts((7, 13, 30))
    want = cuda_engine(model).generate([GenRequest(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(ps)])
    src, dst = cuda_engine(model), cuda_engine(model, block_size=32)   # another block size: other slots
    ids = [src.add_request(GenRequest(p, GREEDY, request_id=f"r{i}")) for i, p in enumerate(ps)]
    for _ in range(6):
        src.step()
    moved = src.export(ids[1], with_kv=True)
    assert moved.kv is not None and moved.kv.data.is_cuda and 0 < len(moved.token_ids) < 20
    prefill0 = dst.num_prefill_tokens
    dst.import_request(moved)
    got = {o.request_id: o for o in drain(dst) + drain(src)}
    src.release_kv(ids[1])
    assert dst.num_prefill_tokens == prefill0                # adopted: nothing re-prefilled
    assert src.runner.graphs.num_replays > 0 and dst.runner.graphs.num_replays > 0
    for w in want:
        assert got[w.request_id].token_ids == w.token_ids, w.request_id
        assert torch.allclose(torch.tensor(got[w.request_id].logprobs), torch.tensor(w.logprobs), atol=1e-4)


def test_load_weights_under_cuda_graphs_generates_with_the_new_weights():
    """The graphs captured under weights A replay with weights B copied in place: the outputs are B's."""
    ps = prompts((9, 4, 21))
    want_b = cuda_engine(sharp(1)).generate([GenRequest(p, GREEDY) for p in ps])
    eng = cuda_engine(sharp(0))
    before = eng.generate([GenRequest(p, GREEDY) for p in ps])
    replays = eng.runner.graphs.num_replays
    assert replays > 0 and [o.token_ids for o in before] != [o.token_ids for o in want_b]
    assert eng.load_weights(iter(sharp(1).state_dict().items()), version=1) > 0   # a fresh copy of weights B
    after = eng.generate([GenRequest(p, GREEDY) for p in ps])
    assert eng.runner.graphs.num_replays > replays
    assert [o.token_ids for o in after] == [o.token_ids for o in want_b]
    assert all(set(o.versions) == {1} for o in after)


DCP_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import cpu; cpu.enable()
    from bench.train import init_one_rank
    from config import TrainConfig
    from tests.support.trainer import SMOOTH_ADAM, make_groups, tiny_model
    from trainer import Trainer
    from trainer.fsdp import full_state_dict
    device = sys.argv[2] if len(sys.argv) > 2 else "cuda"
    init_one_rank(device)
    cfg = TrainConfig(lr=1e-2, micro_batch_tokens=24, steps=4, **SMOOTH_ADAM)
    a = Trainer(tiny_model(), cfg, device=device)
    for s in (1, 2):
        a.train_step(make_groups(s))
    path = a.save_checkpoint(sys.argv[1])
    b = Trainer(tiny_model(seed=7), cfg, device=device)
    b.load_checkpoint(path)
    resumed = b.step
    wa, wb = full_state_dict(a.model), full_state_dict(b.model)
    same = all(torch.equal(wa[n], wb[n]) for n in wa)
    before = {n: w.float().clone() for n, w in wa.items()}
    la, lb = a.train_step(make_groups(3))["loss"], b.train_step(make_groups(3))["loss"]
    wa, wb = full_state_dict(a.model), full_state_dict(b.model)
    norm = lambda d: sum(float(v.float().pow(2).sum()) for v in d.values()) ** 0.5
    update = norm({n: wa[n].float() - before[n] for n in wa})
    apart = norm({n: wa[n].float() - wb[n].float() for n in wa})
    print(json.dumps(dict(path=str(path), sharded=a.sharded, same_after_load=same, step=resumed, loss=[la, lb],
                          update=update, apart=apart)))
""")


def test_dcp_checkpoint_saved_and_resumed_on_the_gpu(tmp_path):
    """The trainer (FSDP2 over a one-rank NCCL group on the GPU) saves through DCP and a fresh trainer loads it:
    weights, optimizer state and step counter as saved, and the next step is the same step."""
    proc = subprocess.run([sys.executable, "-c", DCP_SCRIPT, str(tmp_path / "ckpt")], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["sharded"] and r["path"].endswith("step_2") and r["step"] == 2
    assert r["same_after_load"] and math.isclose(r["loss"][0], r["loss"][1], rel_tol=1e-5), r
    # The step after the resume is the same step: bitwise on a CPU, but a GPU's backward sums with atomics (flash
    # attention's dQ, index_add_), so two runs of one step differ in the last bits. A lost optimizer state (moments
    # or the step count behind Adam's bias correction) moves the weights by the order of the update itself.
    assert r["update"] > 0 and r["apart"] <= 1e-2 * r["update"], r


def test_a_relay_chain_of_two_engines_sharing_the_gpu_with_the_train_rank(tmp_path):
    """`torchrun train.py` with one train rank and two rollout ranks on one GPU, `cluster.relay = "chain"`: every
    publication goes trainer -> relay 1 -> relay 2 in host memory, and both engines load every version."""
    run = tmp_path / "run"
    args = ["train.py", "--config", "configs/tiny.toml", "--train.steps=3", "--log.progress=false",
            f"--log.dir={run}", "--checkpoint.export_hf=false", "--cluster.rollout_ranks=2", "--cluster.backend=auto",
            "--deterministic=false", "--cluster.relay=chain", "--perf.migrate_kv=false",
            "--rollout.gpu_memory_fraction=0.1"]
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    events = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines() if line.strip()]
    loaded = [e for e in events if e.get("kind") == "weights_loaded"]
    ranks = {e.get("rank") for e in loaded}
    assert len(ranks) == 2 and len(loaded) >= 2 * 3, (ranks, len(loaded))
