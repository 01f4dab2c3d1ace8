"""Temperature sampling by inverse CDF (kernels/sample.py): the Triton kernel and the CPU's C kernel against the
reference, edge rows (masked vocabulary, non-finite logits, u at both ends), their distribution, and the engine's
sampler taking them for plain temperature sampling only."""
from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import ERROR_TOKEN, Sampler
from engine.sampling import SamplingParams
from cpu import sample as cpu_sample
from kernels.dispatch import interpreting
from kernels.sample import sample, sample_ref

needs_interpreter = pytest.mark.skipif(not interpreting(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1")


def _triton(logits, temps, u):
    return sample(logits, temps, u, impl="triton")


def _c(logits, temps, u):
    return cpu_sample.sample_c(logits.float(), temps, u)


@pytest.fixture(params=["triton", "c"])
def kernel(request):
    """Each kernel with the reference's contract: Triton (under the interpreter) and C (fp32 CPU logits)."""
    if request.param == "triton" and not interpreting():
        pytest.skip("Triton on CPU tensors needs TRITON_INTERPRET=1")
    if request.param == "c" and not cpu_sample.available():
        pytest.skip(f"the C sampling kernel does not build here: {cpu_sample.SAMPLE.error}")
    return _triton if request.param == "triton" else _c
TOP = 1 - 2 ** -24  # the largest float32 below 1


def _agrees(logits, temps, u, tok, lp):
    """The kernel's token is the reference's, or the two sit on either side of a cdf step within rounding."""
    ref_tok, ref_lp = sample_ref(logits, temps, u)
    probs = torch.softmax(logits.double() / temps.double()[:, None], -1)
    cdf = probs.cumsum(-1)
    for r in range(logits.shape[0]):
        t, target = int(tok[r]), float(u[r])
        if t != int(ref_tok[r]):
            below = float(cdf[r, t - 1]) if t else 0.0
            assert min(abs(below - target), abs(float(cdf[r, t]) - target)) < 1e-5, (r, t, int(ref_tok[r]))
        assert probs[r, t] > 0
    torch.testing.assert_close(lp, torch.log(probs.gather(1, tok[:, None])[:, 0]).float(), atol=1e-5, rtol=1e-5)
    return int((tok == ref_tok).sum())


@pytest.mark.parametrize("V", [7, 1000, 4096, 9000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(kernel, V, dtype):
    g = torch.Generator().manual_seed(V)
    B = 6
    logits = (torch.randn(B, V, generator=g) * 3).to(dtype)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.5, 2.0])
    u = torch.rand(B, generator=g)
    u[0], u[1] = 0.0, TOP
    tok, lp = kernel(logits, temps, u)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert _agrees(logits, temps, u, tok, lp) >= B - 1


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy on the non-finite rows
def test_kernel_edge_rows(kernel):
    V = 50
    logits = torch.randn(6, V)
    logits[0, :20] = float("-inf")        # a masked vocabulary: leading
    logits[0, 30:] = float("-inf")        # and trailing
    logits[1, :] = float("-inf")          # nothing to sample
    logits[2, 5] = float("nan")
    logits[3, 7] = float("inf")
    logits[4, :-1] = float("-inf")        # one token left
    temps = torch.ones(6)
    for u in (0.0, 0.5, TOP):
        tok, lp = kernel(logits, temps, torch.full((6,), u))
        assert 20 <= tok[0] < 30 and math.isfinite(lp[0])
        assert all(0 <= t < V for t in tok.tolist())
        assert all(math.isnan(x) for x in lp[1:4].tolist())
        assert tok[4] == V - 1 and lp[4].item() == pytest.approx(0.0, abs=1e-6)
        assert math.isfinite(lp[5])
    first, _ = kernel(logits[:1], temps[:1], torch.zeros(1))
    last, _ = kernel(logits[:1], temps[:1], torch.full((1,), TOP))
    assert first.item() == 20 + int((logits[0, 20:30] > -1e9).int().argmax()) and last.item() == 29


def test_kernel_distribution_matches_softmax(kernel):
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    N = 500  # evenly spaced u: each token's share of them is its probability to within 1 / N
    u = (torch.arange(N) + 0.5) / N
    tok, _ = kernel(base.repeat(N, 1), torch.full((N,), 0.7), u)
    freq = torch.bincount(tok, minlength=6).float() / N
    assert (freq - torch.softmax(base / 0.7, -1)).abs().max() <= 1.01 / N and freq[5] == 0


def test_sample_rejects_bad_shapes():
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(3, 5), torch.ones(2), torch.zeros(3))
    with pytest.raises(ValueError, match="logits"):
        sample(torch.zeros(5), torch.ones(5), torch.zeros(5))


@needs_interpreter
def test_sampler_takes_the_kernel_for_plain_temperature_only(monkeypatch):
    """With Triton chosen the sampler runs the kernel for a batch of plain temperature rows (same tokens and
    logprobs as the reference path, errors still ERROR_TOKEN) and the reference path when a row is greedy or
    truncates."""
    from kernels.triton_ops import sample as kts
    calls, real = [], kts.sample_triton

    def spy(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(kts, "sample_triton", spy)
    logits = torch.randn(5, 300, generator=torch.Generator().manual_seed(2)) * 2
    logits[4, 3] = float("nan")
    plain = [SamplingParams(temperature=0.9, seed=i) for i in range(5)]
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    got = Sampler(torch.device("cpu"))(logits, plain, [3] * 5)
    assert calls == [1]
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    want = Sampler(torch.device("cpu"))(logits, plain, [3] * 5)
    assert got[0][4] == ERROR_TOKEN == want[0][4]
    assert got[0][:4] == want[0][:4]
    torch.testing.assert_close(torch.tensor(got[1][:4]), torch.tensor(want[1][:4]), atol=1e-5, rtol=1e-5)
    assert got[2][:4] == got[1][:4]  # no truncation: the sampling logprob is the logprob
    monkeypatch.setenv("TIDAL_KERNELS", "triton")
    for mixed in ([SamplingParams(temperature=0)] + plain[1:], [SamplingParams(top_p=0.5)] + plain[1:]):
        Sampler(torch.device("cpu"))(logits[:4], mixed[:4], [0] * 4)
    assert calls == [1]


@pytest.mark.skipif(not cpu_sample.available(), reason="the C sampling kernel does not build here")
def test_sampler_takes_the_c_kernel_on_cpu_for_plain_temperature_only(monkeypatch):
    """On fp32 CPU logits (TIDAL_KERNELS auto) a plain temperature batch runs the C kernel, with the reference
    path's tokens (up to cdf ties) and logprobs; a greedy or truncating row, or bf16 logits, keep the reference."""
    calls, real = [], cpu_sample.sample_c

    def spy(*a):
        calls.append(1)
        return real(*a)
    monkeypatch.setattr(cpu_sample, "sample_c", spy)
    monkeypatch.delenv("TIDAL_KERNELS", raising=False)
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(3)) * 2
    logits[5, 7] = float("inf")
    plain = [SamplingParams(temperature=0.8, seed=i) for i in range(6)]
    got = Sampler(torch.device("cpu"))(logits, plain, [7] * 6)
    assert calls == [1]
    monkeypatch.setenv("TIDAL_KERNELS", "ref")
    want = Sampler(torch.device("cpu"))(logits, plain, [7] * 6)
    assert got[0][5] == ERROR_TOKEN == want[0][5] and math.isnan(got[1][5])
    assert sum(a == b for a, b in zip(got[0][:5], want[0][:5])) >= 4
    torch.testing.assert_close(torch.tensor(got[1][:5]), torch.tensor(want[1][:5]), atol=1e-5, rtol=1e-5)
    assert got[2][:5] == got[1][:5] and math.isnan(got[2][5])   # no truncation: the sampling logprob is the logprob
    monkeypatch.delenv("TIDAL_KERNELS")
    for mixed in ([SamplingParams(temperature=0)] + plain[1:], [SamplingParams(top_k=5)] + plain[1:]):
        Sampler(torch.device("cpu"))(logits[:4], mixed[:4], [0] * 4)
    Sampler(torch.device("cpu"))(logits[:4].bfloat16(), plain[:4], [0] * 4)
    assert calls == [1]


def test_sampler_reworks_its_per_row_params_when_the_batch_changes():
    """The sampler reuses what it worked out of a batch's params while the rows hold the same params objects; a
    batch with other params in the same places (or another length) is worked out afresh."""
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)) * 3
    seeded = [SamplingParams(temperature=1.0, seed=i) for i in range(4)]
    greedy = [SamplingParams(temperature=0.0)] * 4
    s, fresh = Sampler(torch.device("cpu")), lambda: Sampler(torch.device("cpu"))
    assert s(logits, seeded, [0] * 4) == fresh()(logits, seeded, [0] * 4)
    assert s(logits, list(seeded), [1] * 4) == fresh()(logits, seeded, [1] * 4)   # same objects: reused
    assert s(logits, greedy, [2] * 4)[0] == logits.argmax(-1).tolist()           # other objects: greedy now
    hot = [SamplingParams(temperature=50.0, seed=i) for i in range(3)]
    assert s(logits[:3], hot, [3] * 3) == fresh()(logits[:3], hot, [3] * 3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernel_on_cuda_at_a_real_vocabulary():
    """Qwen3's 151,936-entry vocabulary in bf16 on the GPU: the reference's tokens (up to cdf ties), its logprobs,
    and exact frequencies under evenly spaced u."""
    g = torch.Generator().manual_seed(5)
    B, V = 64, 151_936
    logits = (torch.randn(B, V, generator=g) * 3).to(torch.bfloat16)
    temps, u = torch.rand(B, generator=g) + 0.5, torch.rand(B, generator=g)
    tok, lp = sample(logits.cuda(), temps.cuda(), u.cuda())
    assert _agrees(logits.float(), temps, u, tok.cpu(), lp.cpu()) >= B - 2
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")], device="cuda")
    N = 4096
    tok, _ = sample(base.repeat(N, 1), torch.full((N,), 0.7, device="cuda"), (torch.arange(N, device="cuda") + 0.5) / N)
    freq = torch.bincount(tok, minlength=6).float() / N
    assert (freq - torch.softmax(base / 0.7, -1)).abs().max() <= 1.01 / N and freq[5] == 0
