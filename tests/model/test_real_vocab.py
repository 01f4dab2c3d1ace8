"""Qwen3's real tokenizer (151,669 tokens, its chat template) and a 151,936-row vocabulary through the parts that
see vocabulary size: prompt encoding, the engine's sampler, the trainer's chunked logprob recompute, the reward on
decoded text. The model is a random tiny Qwen3 with the real vocabulary (hidden 64: everything else small)."""
from __future__ import annotations

import pytest
import torch

from tests.support.real_vocab import QWEN_DIR, needs_qwen

pytestmark = [needs_qwen, pytest.mark.usefixtures("one_thread")]
QWEN3_VOCAB = 151_936  # Qwen3 config.json: the embedding has room beyond the tokenizer's 151,669 ids


@pytest.fixture(scope="module")
def tok():
    from model.tokenizer import load_tokenizer
    return load_tokenizer(QWEN_DIR)


def test_the_real_tokenizer_and_its_chat_template(tok):
    from engine.engine import eos_ids
    from model.tokenizer import encode_prompt
    from model.presets import preset_config
    assert len(tok) == 151_669 and tok.eos_token == "<|im_end|>" and tok.pad_token_id == 151_643
    ids = encode_prompt(tok, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}], True)
    assert tok.decode(ids) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+3?<|im_end|>\n" \
                              "<|im_start|>assistant\n"
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") == 151_644
    # the run's EOS set: the tokenizer's <|im_end|> plus the model config's <|endoftext|>
    cfg = preset_config("qwen3-0.6b", eos_token_id=[151_645, 151_643])
    assert eos_ids(cfg.eos_token_id, tok) == {151_645, 151_643} and cfg.vocab_size == QWEN3_VOCAB


def test_gsm8k_rows_through_the_chat_template_with_a_system_prompt(tok):
    from rl.data import PromptDataset
    rows = [(1, {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3 + 2 = 5\n#### 5"}),
            (2, {"question": "x " * 600, "answer": "#### 0"}),
            (3, {"question": [{"role": "system", "content": "Own."}, {"role": "user", "content": "1+1?"}],
                 "answer": "#### 2"})]
    ds = PromptDataset.from_records(rows, tok, 256, "question", "answer", chat_template=True,
                                    system_prompt="Put the answer in \\boxed{}.")
    assert [p.index for p in ds] == [0, 2] and ds.skipped_too_long == [1]
    first, own = (tok.decode(p.prompt_ids) for p in ds)
    assert first.startswith("<|im_start|>system\nPut the answer in \\boxed{}.<|im_end|>\n<|im_start|>user\nTom has")
    assert own.startswith("<|im_start|>system\nOwn.<|im_end|>")  # a prompt's own system message is kept


def test_engine_and_trainer_agree_on_logprobs_at_the_real_vocabulary(tok):
    from config import TrainConfig
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.sequence import GenRequest
    from model.presets import preset_config
    from model.tokenizer import encode_prompt
    from model.transformer import Transformer
    from rl.rewards import get_reward_fn
    from rl.types import Group, Trajectory
    from trainer.trainer import Trainer
    cfg = preset_config("tiny", vocab_size=QWEN3_VOCAB, eos_token_id=tok.eos_token_id)
    model = Transformer(cfg).init_weights(seed=0)
    engine = LLMEngine(model, EngineConfig(num_kv_tokens=1024, max_num_seqs=8, max_batch_tokens=256))
    prompt = encode_prompt(tok, "What is 2 + 3? Answer in \\boxed{}.", True)
    outs = engine.generate([GenRequest(prompt, SamplingParams(temperature=1.0, max_new_tokens=12, seed=i), group_id=0,
                                    sample_index=i) for i in range(4)])
    assert all(len(o.token_ids) >= 1 and max(o.token_ids) < QWEN3_VOCAB for o in outs)
    reward = get_reward_fn("math")
    texts = [tok.decode(o.token_ids, skip_special_tokens=False) for o in outs]
    scored = [reward(t, "#### 5") for t in texts]  # random weights: no answer, but scoring real text never fails
    assert all(not r.failed for r in scored)
    trajs = [Trajectory(0, i, prompt, o.token_ids, o.logprobs, o.versions, o.finish_reason, reward=float(i % 2))
             for i, o in enumerate(outs)]
    trainer = Trainer(Transformer(cfg).init_weights(seed=0), TrainConfig(lr=1e-4, micro_batch_tokens=64),
                      temperature=1.0, logprob_chunk=32)
    metrics = trainer.train_step([Group(0, 0, "5", trajs)])
    # the trainer recomputes the behaviour log-probs through the chunked path (chunks of 32 x 151,936 logits, more
    # than one chunk per micro-batch); before its update the ratio is 1 up to fp32 rounding
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=1e-4) and metrics["clip_frac_high"] == 0
    assert metrics["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(metrics["loss"]))


@pytest.mark.slow
def test_chunked_logprobs_at_the_real_vocabulary_use_a_fraction_of_naive_memory():
    from kernels.logprobs import token_logprobs, token_logprobs_naive
    from kernels.memtrack import LiveBytes
    torch.manual_seed(0)
    T, H = 256, 64
    h = torch.randn(T, H, requires_grad=True)
    w = (torch.randn(QWEN3_VOCAB, H) / H ** 0.5).requires_grad_()
    t = torch.randint(0, QWEN3_VOCAB, (T,))
    results = {}
    for name, fn in (("chunked", lambda: token_logprobs(h, w, t, chunk_size=32)),
                     ("naive", lambda: token_logprobs_naive(h, w, t))):
        with LiveBytes() as meter:
            lp, ent = fn()
            grads = torch.autograd.grad(lp.sum() + ent.sum(), (h, w))
        results[name] = (lp.detach(), ent.detach(), grads, meter.peak)
    (lp, ent, (gh, gw), peak), (lp0, ent0, (gh0, gw0), peak0) = results["chunked"], results["naive"]
    assert torch.allclose(lp, lp0, atol=1e-4) and torch.allclose(ent, ent0, atol=1e-4)
    assert torch.allclose(gh, gh0, atol=1e-4) and torch.allclose(gw, gw0, atol=1e-5)
    assert peak0 > 4 * peak, (peak0 / 2 ** 20, peak / 2 ** 20)  # the target: at most a quarter of naive
