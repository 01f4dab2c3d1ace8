"""The CPU engine's pre-packed Linear layers (cpu/linear.py): same results as F.linear for every row count,
only inside the engine's forward, never stale after a weight change, a bounded set of row counts."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cpu import linear as cpu_linear
from cpu.linear import CHUNK, PackedLinear, PackedLinears, row_pieces

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="torch built without oneDNN")


def model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(48, 96), nn.Linear(96, 40, bias=False))


@pytest.mark.parametrize("m", [1, 7, 8, 9, 63, 64, 65, 100, 255, 256, 257, 600])
def test_packed_matches_f_linear_for_every_row_count(m):
    net = model()
    packed = PackedLinears(net)
    x = torch.randn(m, 48)
    want = F.linear(F.linear(x, net[0].weight, net[0].bias), net[1].weight)
    with packed.active():
        got = net(x)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4


def test_row_pieces_cover_exactly_with_few_sizes():
    sizes = set()
    for m in range(1, 3 * CHUNK + 70):
        pieces = row_pieces(m)
        assert sum(rows for rows, _ in pieces) == m
        assert all(0 <= computed - rows <= 7 for rows, computed in pieces)
        sizes |= {computed for _, computed in pieces}
    assert len(sizes) <= 15, sorted(sizes)


def test_outside_the_engine_forward_it_is_nn_linear():
    net = model()
    packed = PackedLinears(net)
    assert all(type(m) is PackedLinear for m in net)
    x = torch.randn(5, 48)
    assert torch.equal(net(x), F.linear(F.linear(x, net[0].weight, net[0].bias), net[1].weight))
    assert set(net.state_dict()) == {"0.weight", "0.bias", "1.weight"}
    # another thread's / another model's forward never sees this table
    other = model(seed=1)
    PackedLinears(other)
    with packed.active():
        assert torch.equal(other(x), F.linear(F.linear(x, other[0].weight, other[0].bias), other[1].weight))


def test_a_weight_changed_in_place_is_never_computed_stale():
    net = model()
    packed = PackedLinears(net)
    x = torch.randn(9, 48)
    with torch.no_grad():
        net[1].weight.mul_(2.0)  # an optimizer-style update: the version counter moves
    with packed.active():
        got = net(x)
    assert (got - F.linear(F.linear(x, net[0].weight, net[0].bias), net[1].weight)).abs().max() < 1e-4
    # a .data copy (what load_weights does) does not move the counter: repack() is what makes it current
    net[0].weight.data.copy_(torch.randn(96, 48))
    packed.repack()
    with packed.active():
        got = net(x)
    assert (got - F.linear(F.linear(x, net[0].weight, net[0].bias), net[1].weight)).abs().max() < 1e-4


def test_a_deep_copy_computes_with_its_own_weights():
    net = model()
    packed = PackedLinears(net)
    twin = copy.deepcopy(net)
    with torch.no_grad():
        twin[0].weight.zero_()
    x = torch.randn(3, 48)
    with packed.active():
        assert torch.equal(twin(x), F.linear(F.linear(x, twin[0].weight, twin[0].bias), twin[1].weight))


def test_engine_load_weights_repacks():
    from engine import EngineConfig, GenRequest, LLMEngine, SamplingParams
    from model import ModelConfig, Transformer
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128, qk_norm=True)
    a, b = Transformer(cfg).init_weights(seed=0), Transformer(cfg).init_weights(seed=1)
    with torch.no_grad():
        for m in (a, b):
            for p in m.parameters():
                p.mul_(8.0)  # sharp logits, so greedy tokens differ between the two models
    greedy = SamplingParams(temperature=0, max_new_tokens=12)
    prompt = [3, 9, 27, 17, 51]
    want_b = LLMEngine(b, EngineConfig(max_num_seqs=4, cpu_packed_linear=False)).generate([GenRequest(prompt, greedy)])
    eng = LLMEngine(a, EngineConfig(max_num_seqs=4, cpu_packed_min_weight=0))
    assert eng.runner.packed is not None
    first = eng.generate([GenRequest(prompt, greedy)])[0].token_ids
    eng.load_weights(b.state_dict(), version=1)
    assert eng.generate([GenRequest(prompt, greedy)])[0].token_ids == want_b[0].token_ids != first


def test_only_weights_of_at_least_min_weight_elements_are_packed_and_every_row_is_batch_invariant():
    net = model()   # weights of 48 x 96 = 4608 and 96 x 40 = 3840 elements
    packed = PackedLinears(net, min_weight=4000)
    assert packed.layers == [net[0]] and packed.small == [net[1]] and type(net[1]) is PackedLinear
    x = torch.randn(300, 48)
    with packed.active():
        alone = torch.cat([net(x[i:i + 1]) for i in range(len(x))])
        for m in (1, 2, 3, 7, 8, 9, 64, 255, 300):   # 1-3 rows are another MKL kernel unpadded
            assert torch.equal(net(x[:m]), alone[:m]), m
        assert torch.equal(net(x[5:77]), alone[5:77])
    assert (alone - F.linear(F.linear(x, net[0].weight, net[0].bias), net[1].weight)).abs().max() < 1e-4
    # the engine's default threshold leaves a small model's layers to padded_linear: nothing to repack at a load
    from engine import EngineConfig, LLMEngine
    from model import ModelConfig, Transformer
    cfg = ModelConfig(family="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    packed = LLMEngine(Transformer(cfg).init_weights(seed=0), EngineConfig(max_num_seqs=4)).runner.packed
    assert packed.layers == [] and len(packed.small) == 4 * 1 + 3 + 1
