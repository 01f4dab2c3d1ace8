"""bench/vs_vllm.py without a GPU: the floor's arithmetic on a hand-computed case, and the dry run (our engine at tiny
sizes on the CPU, vLLM's side up to its import)."""
from __future__ import annotations

import json

import pytest

from bench import vs_vllm

# vocab 10, hidden 2, MLP 3, one layer, one head of dim 2, one KV head, tied embedding, 2-byte weights
HAND = vs_vllm.Shape(vocab_size=10, hidden_size=2, intermediate_size=3, num_hidden_layers=1, num_attention_heads=1,
                     num_key_value_heads=1, head_dim=2)


def test_shape_counts_by_hand():
    assert HAND.linear_params() == 4 + 4 + 4 + 4 + 18          # q, k, v, o: 2x2 each; gate, up, down: 2x3 each
    assert HAND.weight_bytes() == 2 * (34 + 2 * 2 + 2 * 2 + 2 + 20)  # + layer norms, q/k norms, final norm, embedding
    assert HAND.kv_bytes_per_token() == 2 * 1 * 1 * 2 * 2       # K and V, one layer, one KV head of dim 2, 2 bytes
    untied = vs_vllm.Shape(**{**HAND.__dict__, "tie_word_embeddings": False})
    assert untied.weight_bytes() == HAND.weight_bytes() + 2 * 20


def test_decode_steps_fill_free_slots_in_arrival_order():
    assert vs_vllm.decode_steps([5, 2, 3], 1) == 4 + 1 + 2
    assert vs_vllm.decode_steps([5, 2, 3], 2) == 4             # slots: 4 | 1 then 2 -> 3
    assert vs_vllm.decode_steps([5, 2, 3], 8) == 4
    assert vs_vllm.decode_steps([], 4) == 0


@pytest.mark.parametrize("max_num_seqs, steps", [(1, 1 + 3), (2, 3)])
def test_floor_by_hand(max_num_seqs, steps):
    prompts, outs = [3, 5], [2, 4]
    f = vs_vllm.floor_seconds(HAND, prompts, outs, max_num_seqs, hbm_bytes_s=2.0, peak_flops=4.0)
    kv_tokens = (3 + 1) + (5 + 1) + (5 + 2) + (5 + 3)          # contexts attended by the decode steps
    assert f["decode_bytes"] == steps * 128 + kv_tokens * 8
    # linear: 2 FLOPs x 34 weights x 8 prompt tokens; attention: 4 x dim 2 x (6 + 15) causal pairs; LM head: 2 x 20 x 2
    assert f["prefill_flops"] == 2 * 34 * 8 + 4 * 2 * (6 + 15) + 2 * 20 * 2 == 792
    assert f["decode_s"] == f["decode_bytes"] / 2.0 and f["prefill_s"] == 792 / 4.0
    assert f["total_s"] == f["decode_s"] + f["prefill_s"]


def test_dry_run(tmp_path, capsys):
    out = tmp_path / "vs.json"
    res = vs_vllm.main(["--dry-run", "--repeats", "1", "--num-seqs", "4", "--min-len", "4", "--max-len", "12",
                        "--out", str(out)])
    lines = capsys.readouterr().out.strip().splitlines()
    saved = json.loads(out.read_text())
    assert saved["ours"]["tokens"] == saved["workload"]["output_tokens"] == res["workload"]["output_tokens"]
    ours = saved["ours"]
    assert ours["tok_s"] == pytest.approx(ours["tokens"] / ours["seconds"])
    assert ours["floor_fraction"] == pytest.approx(saved["floor"]["total_s"] / ours["seconds"])
    assert saved["vllm_llm_kwargs"] == {"skip_tokenizer_init": True, "gpu_memory_utilization": 0.4,
                                        "max_num_seqs": 256, "enable_prefix_caching": False,
                                        "max_num_batched_tokens": 16384}
    assert "skipped" in saved["vllm"] and "ours_over_vllm" not in saved
    assert any(ln.startswith(("vllm: not importable", "vllm ")) for ln in lines)
    assert lines[-1] == "ours / vLLM throughput: n/a (no vLLM run)"


def test_vllm_plan_matches_the_workload():
    args = vs_vllm.parse_args(["--dry-run"])
    prompts, outs = vs_vllm.workload(5, 3, 9, 100, seed=1)
    kwargs, tps, sps = vs_vllm.vllm_plan("/m", prompts, outs, args)
    assert kwargs["model"] == "/m" and [t["prompt_token_ids"] for t in tps] == prompts
    assert [s["max_tokens"] for s in sps] == outs and all(s["ignore_eos"] and "seed" not in s for s in sps)
    assert all(3 <= len(p) <= 9 for p in prompts) and all(3 <= o <= 9 for o in outs)
    assert vs_vllm.workload(5, 3, 9, 100, seed=1) == (prompts, outs)
    # one step budget for both sides: a 2048-token budget against vLLM's 16384 once cost our prefill 8x the steps
    assert kwargs["max_num_batched_tokens"] == vs_vllm.step_tokens(args) == args.max_batch_tokens


def test_bad_lengths_are_a_clear_error(capsys):
    with pytest.raises(SystemExit):
        vs_vllm.parse_args(["--dry-run", "--min-len", "9", "--max-len", "3"])
    assert "--min-len (9) <= --max-len (3)" in capsys.readouterr().err
