"""The trainer's causal attention kernel on CPU (cpu/train_attention.py, cpu/csrc/train_attention.c) against
SDPA through the packings' own backends: values and gradients of packed causal sequences and of prompt-shared
families (head dims on and off the vector path, GQA, rows that end mid-vector, children with no tokens), its
plan's checks, NaN propagation, independence from the thread count, and the trainer's swapped model using it."""
from __future__ import annotations

import copy

import pytest
import torch

from cpu import train_attention as cpu_attention
from model.attention import PackedCausal, SharedPrefixCausal, cu_seqlens_from_lengths

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason=f"no C compiler: {cpu_attention.ATTENTION.error}")


def qkv(T: int, hq: int, hkv: int, d: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(T, h, d, generator=g) * 1.5 for h in (hq, hkv, hkv)]


def run(f, q, k, v):
    """f(q, k, v) and the gradients of <f(q, k, v), a fixed random tensor> with respect to q, k, v."""
    xs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    out = f(*xs)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(9))
    (out * w).sum().backward()
    return [out.detach(), *(x.grad for x in xs)]


def assert_close(got, want, tol=2e-5):
    for a, b in zip(got, want):
        assert a.shape == b.shape
        assert (a - b).abs().max().item() <= tol * max(1.0, b.abs().max().item())


def kernel(backend):
    plan = cpu_attention.CausalRows.build(backend.row_spans(), backend.num_tokens)
    return lambda q, k, v: cpu_attention.causal_rows_attention(q, k, v, plan)


@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 16), (2, 2, 32), (4, 1, 8), (3, 3, 12), (2, 1, 64), (2, 2, 128)])
def test_packed_sequences_match_sdpa(hq, hkv, d):
    lengths = [1, 17, 64, 5, 100]   # one token; a row ending mid-vector; exactly four vectors; several blocks
    q, k, v = qkv(sum(lengths), hq, hkv, d)
    ref = PackedCausal.from_lengths(lengths)
    assert_close(run(kernel(ref), q, k, v), run(lambda *x: ref(0, *x), q, k, v))


@pytest.mark.parametrize("way", ["rows", "masked"])
def test_prompt_shared_families_match_both_sdpa_ways(way):
    plens = [7, 1, 20]
    child_lens = [9, 0, 33, 4, 0, 0, 16, 1]   # the second family's children have no tokens
    child_fam = [0, 0, 0, 1, 1, 1, 2, 2]
    ref = SharedPrefixCausal(plens, child_lens, child_fam)
    T = sum(plens) + sum(child_lens)
    q, k, v = qkv(T, 4, 2, 16, seed=1)
    want = run(lambda *x: (ref.padded if way == "rows" else ref.masked)(0, *x), q, k, v)
    assert_close(run(kernel(ref), q, k, v), want)


def test_a_query_never_sees_a_later_token_nor_another_row():
    lengths = [30, 30]
    q, k, v = qkv(60, 2, 2, 16, seed=2)
    backend = PackedCausal.from_lengths(lengths)
    base = run(kernel(backend), q, k, v)[0]
    k2, v2 = k.clone(), v.clone()
    k2[20:], v2[20:] = 99.0, -99.0   # the first row's later tokens and all of the second
    out = run(kernel(backend), q, k2, v2)[0]
    assert torch.equal(out[:20], base[:20])


def test_the_plan_rejects_rows_that_do_not_cover_the_tokens_once():
    build = cpu_attention.CausalRows.build
    with pytest.raises(ValueError, match="token 4 is the query of no row"):
        build([[(0, 4, 0, 0)], [(5, 3, 0, 0)]], 8)
    with pytest.raises(ValueError, match="of several"):
        build([[(0, 5, 0, 0)], [(4, 4, 0, 0)]], 8)
    with pytest.raises(ValueError, match="leaves the 8 packed tokens"):
        build([[(0, 9, 0, 0)]], 8)
    with pytest.raises(ValueError, match=r"prefix \[0, 4\) is no row of task 1"):
        build([[(0, 4, 0, 0)], [(4, 4, 0, 4)]], 8)
    q, k, v = qkv(8, 2, 2, 16)
    with pytest.raises(ValueError, match="8 tokens for a plan of 9"):
        cpu_attention.causal_rows_attention(q, k, v, build([[(0, 9, 0, 0)]], 9))
    with pytest.raises(ValueError, match="not a multiple"):
        cpu_attention.causal_rows_attention(q[:, :1].expand(8, 3, 16), k, v, build([[(0, 8, 0, 0)]], 8))


def test_a_nan_reaches_the_queries_that_see_it_and_no_other():
    q, k, v = qkv(40, 2, 1, 16, seed=3)
    v[5, 0, 3] = float("nan")
    backend = SharedPrefixCausal([10], [15, 15], [0, 0])   # the NaN lies in the shared prompt
    out, dq, dk, dv = run(kernel(backend), q, k, v)
    assert torch.isnan(out[5:]).any(-1).any(-1).all() and torch.isfinite(out[:5]).all()
    lonely = PackedCausal.from_lengths([20, 20])
    q2, k2, v2 = qkv(40, 2, 1, 16, seed=3)
    q2[25] = float("nan")
    out = run(kernel(lonely), q2, k2, v2)[0]
    assert torch.isnan(out[25]).all() and torch.isfinite(out[:25]).all() and torch.isfinite(out[26:]).all()


def test_results_do_not_depend_on_the_thread_count():
    backend = SharedPrefixCausal([12, 9], [40, 33, 0, 21], [0, 0, 1, 1])
    q, k, v = qkv(backend.num_tokens, 4, 2, 16, seed=4)
    threads = torch.get_num_threads()
    runs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            runs.append(run(kernel(backend), q, k, v))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other))


def test_the_swapped_trainer_model_attends_through_the_kernel_with_sdpa_values(monkeypatch):
    from model.presets import preset_config
    from model.transformer import Transformer
    from trainer.fused import use_fused_train_ops
    cfg = preset_config("tiny", vocab_size=40, eos_token_id=1)
    plain = Transformer(cfg).init_weights(seed=3)
    fused = copy.deepcopy(plain)
    use_fused_train_ops(fused, "cpu")
    calls = []
    real = cpu_attention.causal_rows_attention
    monkeypatch.setattr(cpu_attention, "causal_rows_attention", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 40, (50,), generator=torch.Generator().manual_seed(1))
    cu = cu_seqlens_from_lengths([20, 30])
    outs = []
    for m in (plain, fused):
        logits = m.forward_packed(ids, cu)
        logits.logsumexp(-1).sum().backward()
        outs.append((logits.detach(), {n: p.grad for n, p in m.named_parameters()}))
    assert len(calls) == cfg.num_layers   # the fused model's layers, none of the plain one's
    (a, ga), (b, gb) = outs
    assert_close([b], [a], 1e-5)
    for n in ga:
        assert_close([gb[n]], [ga[n]], 1e-4)


def test_a_backend_that_lists_rows_without_the_memo_still_takes_the_kernel():
    from trainer.fused import _attend

    class Bare:   # a fork's backend: rows listed, no `derived` memo, no scale
        def row_spans(self):
            return [[(0, 5, 0, 0)], [(5, 9, 0, 0)]]

        def __call__(self, *a):
            raise AssertionError("the kernel should have run")

    q, k, v = qkv(14, 2, 1, 16, seed=5)
    want = PackedCausal.from_lengths([5, 9])(0, q, k, v)
    assert_close([_attend(Bare(), 0, q, k, v)], [want])
