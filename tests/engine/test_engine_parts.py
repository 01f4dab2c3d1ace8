"""Engine parts without a model: block manager, scheduler, sampler, and the batched CPU attention against the
kernels' references."""
import math

import pytest
import torch

from engine.attention import batched_decode, batched_prefill
from engine.block_manager import BlockManager
from engine.sampler import Sampler, counter_uniform, sample_inverse_cdf
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.sequence import GenRequest, Sequence
from kernels.paged_attention import paged_decode_ref, paged_prefill_ref

CPU = torch.device("cpu")


def seq(n_prompt: int, group: int = -1, **params) -> Sequence:
    return Sequence(GenRequest(list(range(3, 3 + n_prompt)), SamplingParams(**params), group_id=group), 0.0)


def full(bm: BlockManager) -> bool:
    return bm.num_free == bm.num_blocks and not any(bm.ref_counts)


# ---- block manager ---------------------------------------------------------------------------------------------
def test_allocate_fork_cow_free():
    bm = BlockManager(10, 4)
    a, b = seq(6), seq(6)
    assert bm.blocks_needed(a, 6) == 2
    assert bm.allocate(a, 6) == []
    a.num_cached_tokens = 6
    bm.fork(a, b)
    b.num_cached_tokens = 6
    assert bm.num_used == 2 and bm.ref_counts[a.block_table[1]] == 2
    # b writes position 6, inside the shared partial block: it gets a private copy of that block
    assert bm.blocks_needed(b, 1) == 1
    copies = bm.allocate(b, 1)
    assert copies == [(a.block_table[1], b.block_table[1])] and b.block_table[0] == a.block_table[0]
    assert bm.num_used == 3
    # a is now the block's only holder: it writes in place
    assert bm.blocks_needed(a, 1) == 0 and bm.allocate(a, 1) == []
    a.num_cached_tokens = b.num_cached_tokens = 7
    assert bm.allocate(a, 2) == [] and len(a.block_table) == 3  # crossing into a new block
    bm.free(a)
    bm.free(b)
    assert full(bm)


def test_fork_at_block_boundary_needs_no_copy():
    bm = BlockManager(4, 4)
    a, b = seq(8), seq(8)
    bm.allocate(a, 8)
    a.num_cached_tokens = 8
    bm.fork(a, b)
    b.num_cached_tokens = 8
    assert bm.blocks_needed(b, 1) == 1 and bm.allocate(b, 1) == []
    bm.free(b)
    bm.free(a)
    assert full(bm)


def test_freed_blocks_are_reused():
    bm = BlockManager(3, 2)
    for _ in range(5):
        s = seq(6)
        bm.allocate(s, 6)
        assert bm.num_free == 0
        bm.free(s)
    assert full(bm)


def test_blocks_are_taken_lowest_id_first_whatever_order_they_were_freed_in():
    """A round's sequences get their blocks side by side in the order they grow (the CPU paged attention reads them
    one row after the other), not in the order the previous round's sequences happened to free theirs."""
    bm = BlockManager(12, 2)
    old = [seq(6) for _ in range(3)]
    for s in old:
        bm.allocate(s, 6)
    for s in (old[1], old[2], old[0]):   # freed out of order, each table freed last block first
        bm.free(s)
    new = [seq(2) for _ in range(4)]
    for step in range(3):   # four sequences growing in lockstep, a block each per step
        for s in new:
            bm.allocate(s, 2 * (step + 1) - s.num_cached_tokens)
            s.num_cached_tokens = 2 * (step + 1)
    assert [s.block_table for s in new] == [[0, 4, 8], [1, 5, 9], [2, 6, 10], [3, 7, 11]]


# ---- scheduler -------------------------------------------------------------------------------------------------
def run_fake(sched: Scheduler, steps: int = 1000, gen: int = 3) -> list[Sequence]:
    """Drive the scheduler as the engine does, with a fake 'model' that appends token 7 to each sampled seq."""
    done = []
    for _ in range(steps):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        assert batch.num_batched_tokens <= sched.max_batch_tokens
        assert len(sched.running) <= sched.max_num_seqs
        assert batch.seqs[:batch.num_decode] == [s for s, n in zip(batch.seqs, batch.num_tokens) if n == 1]
        sched.postprocess(batch)
        for s in batch.sample_seqs:
            s.token_ids.append(7)
            if s.num_generated >= gen:
                sched.finish(s)
                done.append(s)
    return done


def test_scheduler_respects_budgets_and_chunks_long_prompts():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=3, max_batch_tokens=8)
    seqs = [seq(n) for n in (20, 3, 5, 9, 1)]
    for s in seqs:
        sch.add(s)
    first = sch.schedule()
    assert first.seqs == [seqs[0]] and first.num_tokens == [8] and first.sample_seqs == []  # a chunk, no sample
    sch.postprocess(first)
    assert len(run_fake(sch)) == 5 and full(bm)


def test_scheduler_preempts_when_blocks_run_out_and_recovers():
    bm = BlockManager(6, 2)  # 12 token slots for 4 sequences that need 8 each
    sch = Scheduler(bm, max_num_seqs=4, max_batch_tokens=16)
    seqs = [seq(4) for _ in range(4)]
    for s in seqs:
        sch.add(s)
    done = run_fake(sch, gen=4)
    assert sorted(map(id, done)) == sorted(map(id, seqs))
    assert sch.num_preemptions > 0 and full(bm)
    assert all(s.num_generated == 4 for s in seqs)


def test_group_is_prefilled_once_and_forks():
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_batch_tokens=64)
    group = [seq(10, group=5) for _ in range(4)]
    for s in group:
        sch.add(s)
    batch = sch.schedule()
    assert batch.seqs == [group[0]] and batch.num_tokens == [10]  # prompt computed once
    assert batch.sample_seqs == group and batch.sample_rows == [0, 0, 0, 0]  # all sample from its logits
    assert bm.num_used == 3 and all(s.block_table == group[0].block_table for s in group)
    sch.postprocess(batch)
    for s in group:
        s.token_ids.append(7)
    batch = sch.schedule()  # each writes position 10 in the shared partial block: 3 copies, the last in place
    assert len(batch.copies) == 3 and bm.num_used == 6
    assert len({s.block_table[2] for s in group}) == 4 and len({s.block_table[0] for s in group}) == 1
    sch.postprocess(batch)
    for s in list(sch.running):
        sch.finish(s)
    assert full(bm)


def test_group_leader_abort_hands_over_to_a_fork():
    bm = BlockManager(32, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_batch_tokens=6)
    group = [seq(10, group=1) for _ in range(3)]
    for s in group:
        sch.add(s)
    sch.postprocess(sch.schedule())  # the leader has 6 of its 10 prompt tokens cached; two forks wait on it
    assert group[0].forks == group[1:]
    sch.remove(group[0])
    assert sch.running == [group[1]] and group[1].num_cached_tokens == 6 and group[1].forks == [group[2]]
    sch.remove(group[2])  # a fork still waiting for its leader
    assert group[1].forks == []
    assert len(run_fake(sch)) == 1 and full(bm) and len(sch.free_seats) == 8


# ---- sampler ---------------------------------------------------------------------------------------------------
def logits_batch(B=6, V=50, seed=0):
    return torch.randn(B, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_top_k_1_and_tiny_top_p_all_pick_the_argmax():
    logits = logits_batch()
    s = Sampler(CPU)
    want = logits.argmax(-1).tolist()
    for p in (SamplingParams(temperature=0), SamplingParams(top_k=1), SamplingParams(top_p=1e-6)):
        toks, lps, slps = s(logits, [p] * 6, [0] * 6)
        assert toks == want
        assert slps == pytest.approx([0.0] * 6, abs=1e-6)
        t = 1.0
        ref = torch.log_softmax(logits / t, -1)[torch.arange(6), torch.tensor(want)]
        assert lps == pytest.approx(ref.tolist(), abs=1e-5)  # raw logprob: untruncated


def test_seeded_rows_reproduce_independently_of_the_batch():
    logits = logits_batch()
    ps = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(6)]
    a = Sampler(CPU, seed=1)(logits, ps, [5] * 6)[0]
    b = Sampler(CPU, seed=2)(logits, ps, [5] * 6)[0]
    assert a == b  # the engine's own generator plays no part
    # row 3 alone, with the same seed and token index, draws the same token
    assert Sampler(CPU)(logits[3:4], [ps[3]], [5])[0] == [a[3]]
    # rows mixed with unseeded ones keep their draws
    mixed = [ps[0], SamplingParams(temperature=1.0), ps[2]]
    got = Sampler(CPU)(logits[[0, 1, 2]], mixed, [5, 0, 5])[0]
    assert got[0] == a[0] and got[2] == a[2]
    # another token index or another seed is another draw
    many = torch.zeros(64, 1000)  # uniform over 1000 tokens: 64 independent draws repeat few of them
    by_index = Sampler(CPU)(many, [ps[0]] * 64, list(range(64)))[0]
    by_seed = Sampler(CPU)(many, [SamplingParams(temperature=1.0, seed=s) for s in range(64)], [0] * 64)[0]
    assert len(set(by_index)) > 55 and len(set(by_seed)) > 55


def test_counter_uniforms_are_uniform_independent_and_pure():
    n = 1 << 16
    seeds = [i // 256 * 7919 + (1 << 40) for i in range(n)]  # 256 seeds, large ones too
    counters = [i % 256 for i in range(n)]
    u = torch.from_numpy(counter_uniform(seeds, counters))
    assert u.dtype == torch.float32 and 0 <= float(u.min()) and float(u.max()) < 1
    hist = torch.histc(u, bins=64, min=0, max=1)
    chi2 = float(((hist - n / 64) ** 2 / (n / 64)).sum())
    assert chi2 < 120, chi2  # 63 dof: p < 1e-5 beyond ~120
    grid = u.view(256, 256)  # seed x counter: no correlation along either axis
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        corr = float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
        assert abs(corr) < 0.02, corr
    # a pure function of (seed, counter), whatever else is asked alongside; any Python int is a seed
    assert counter_uniform(seeds[300:301], counters[300:301])[0] == u[300]
    assert counter_uniform([-3, 2**70], [0, 0]).tolist() == counter_uniform([2**64 - 3, 2**70 % 2**64], [0, 0]).tolist()
    # seeded rows sample the softmax: 20k requests, one draw each
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    toks = Sampler(CPU)(base.repeat(20000, 1), [SamplingParams(seed=s) for s in range(20000)], [0] * 20000)[0]
    freq = torch.bincount(torch.tensor(toks), minlength=5).float() / 20000
    assert (freq - torch.softmax(base, -1)).abs().max() < 0.015


def test_sampling_distribution_matches_softmax_with_truncation():
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    N = 20000
    logits = base.repeat(N, 1)
    s = Sampler(CPU, seed=0)
    cases = [(SamplingParams(temperature=1.0), torch.softmax(base, -1)),
             (SamplingParams(temperature=0.5), torch.softmax(base / 0.5, -1)),
             (SamplingParams(top_k=2), torch.softmax(base[:2], -1)),
             (SamplingParams(top_p=0.8), None)]
    for p, want in cases:
        toks, lps, slps = s(logits, [p] * N, [0] * N)
        freq = torch.bincount(torch.tensor(toks), minlength=5).float() / N
        if want is None:  # top-p 0.8: probabilities .61 .22 .14 ... -> nucleus is the first three tokens
            probs = torch.softmax(base, -1)
            want = probs[:3] / probs[:3].sum()
        want = torch.nn.functional.pad(want, (0, 5 - want.numel()))
        assert (freq - want).abs().max() < 0.015, (p, freq, want)
        # the sampling logprob is the log of the truncated distribution; the raw one ignores truncation
        tok = toks[0]
        assert slps[0] == pytest.approx(math.log(want[tok]), abs=1e-5)
        assert lps[0] == pytest.approx(torch.log_softmax(base / max(p.temperature, 1e-9), -1)[tok].item(), abs=1e-5)


def test_inverse_cdf_never_picks_a_token_of_zero_probability():
    """u at both ends of [0, 1), where u * total rounds up to the total, zero-probability tokens before, between
    and after the positive ones, and a row with no positive probability (an error row: kept in bounds)."""
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0],
                          [0.1, 0.0, 0.0, 0.0, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 1e-30],
                          [1 / 3, 1 / 3, 0.0, 1 / 3, 0.0, 0.0],
                          [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    top = 1 - 2 ** -24  # the largest float32 below 1
    for u in (0.0, 1e-8, 0.3 / 1.0, 0.5, top):
        idx = sample_inverse_cdf(probs, torch.full((5,), u, dtype=torch.float32)).tolist()
        assert all(probs[r, i] > 0 for r, i in enumerate(idx[:4])), (u, idx)
        assert 0 <= idx[4] < 6
    assert sample_inverse_cdf(probs[:1], torch.tensor([top])).item() == 3
    assert sample_inverse_cdf(probs[:1], torch.tensor([0.0])).item() == 1
    assert sample_inverse_cdf(probs[:1], torch.tensor([0.3 - 1e-6])).item() == 1
    assert sample_inverse_cdf(probs[:1], torch.tensor([0.3 + 1e-6])).item() == 3


def test_params_validation():
    for bad in (dict(temperature=-0.1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1), dict(max_new_tokens=0)):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- batched CPU attention vs the kernels' references ----------------------------------------------------------
def paged_setup(seed=0, Hq=4, Hkv=2, D=16, bs=4, nblocks=40):
    g = torch.Generator().manual_seed(seed)
    kc = torch.randn(nblocks, bs, Hkv, D, generator=g)
    vc = torch.randn(nblocks, bs, Hkv, D, generator=g)
    ctx = torch.tensor([1, 7, 16, 13], dtype=torch.int32)
    perm = torch.randperm(nblocks, generator=g)
    bt = torch.zeros(4, 6, dtype=torch.int32)
    used = 0
    for b, n in enumerate(ctx.tolist()):
        k = -(-n // bs)
        bt[b, :k] = perm[used:used + k]
        used += k
    return g, kc, vc, bt, ctx


def test_batched_decode_matches_reference():
    g, kc, vc, bt, ctx = paged_setup()
    q = torch.randn(4, 4, 16, generator=g)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.25)
    assert (batched_decode(q, kc, vc, bt, ctx, 0.25, int(ctx.max())) - ref).abs().max() < 1e-5
    assert (batched_decode(q, kc, vc, bt, ctx, 0.25) - ref).abs().max() < 1e-5


def test_batched_decode_in_context_length_groups_matches_reference():
    g = torch.Generator().manual_seed(2)
    kc, vc = torch.randn(300, 4, 2, 16, generator=g), torch.randn(300, 4, 2, 16, generator=g)
    ctx = torch.randint(1, 40, (24,), generator=g).to(torch.int32)
    bt = torch.randperm(300, generator=g)[:240].view(24, 10).to(torch.int32)
    q = torch.randn(24, 4, 16, generator=g)
    ref = paged_decode_ref(q, kc, vc, bt, ctx, 0.25)
    for groups in (1, 3, 8):
        assert (batched_decode(q, kc, vc, bt, ctx, 0.25, groups=groups, min_group=2) - ref).abs().max() < 1e-5


def test_batched_prefill_matches_reference():
    g, kc, vc, bt, ctx = paged_setup(seed=1)
    q_lens = torch.tensor([1, 7, 5, 2])  # a whole prompt, extensions of cached prefixes, a single token
    cu = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    q = torch.randn(int(q_lens.sum()), 4, 16, generator=g)
    ref = paged_prefill_ref(q, kc, vc, cu, ctx, bt, 0.3)
    assert (batched_prefill(q, kc, vc, cu, ctx, bt, 0.3, int(ctx.max()), 7) - ref).abs().max() < 1e-5
    assert (batched_prefill(q, kc, vc, cu, ctx, bt, 0.3) - ref).abs().max() < 1e-5
