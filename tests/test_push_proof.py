"""The exact proof of every push (sync.check_push): per group of weights, the bit sums of what the trainer pushed
against what the engine computes with, in every dtype; the engine's buffers held to their values at load.

- The pieces, in process: bit sums unchanged by fusion, reordering and zero padding, changed by one bit; the groups.
- Planted faults (tests/push_proof_worker.py, one process, an engine at a time): in the CPU engines the suite runs
  (fp32 and bf16 tiny Qwen2, LoRA's merged push, a tiny Qwen3-MoE) each fault is caught and named: one tensor not
  sent (a linear weight the CPU engine packs away; one expert), the tied head left stale, a layer one step behind,
  a buffer the reload resets; a correct push passes.
- Every run of the suite proves every push: a mismatch would stop it (grpo.update_weights).
"""

import json

import pytest
import torch
import transformers

import sync
import tiny
from conftest import run_python


def test_bit_sums_see_one_bit_and_not_the_layout():
    """A sum of bit patterns: the same for a tensor fused with another (qkv), reordered (a packed layout) or padded
    with zeros (a padded vocabulary); another for one bit flipped; bf16 and fp32 as their own bits."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(8, 4, generator=g), torch.randn(2, 4, generator=g)
    assert sync.bit_sum(torch.cat([q, k])) == (sync.bit_sum(q) + sync.bit_sum(k)) % sync.MODULUS
    big = torch.tensor([2.0**62], dtype=torch.float64)  # bits 0x43D0...: two of them fused wrap an int64 sum
    assert sync.bit_sum(torch.cat([big, big])) == (sync.bit_sum(big) + sync.bit_sum(big)) % sync.MODULUS
    assert sync.bit_sum(q.t().contiguous()) == sync.bit_sum(q) == sync.bit_sum(q[torch.randperm(8, generator=g)])
    assert sync.bit_sum(torch.cat([q, torch.zeros(5, 4)])) == sync.bit_sum(q)
    flipped = q.clone()
    flipped.view(torch.int32)[3, 1] ^= 1  # the lowest mantissa bit of one weight
    assert sync.bit_sum(flipped) != sync.bit_sum(q)
    assert sync.bit_sum(torch.tensor([1.0, 2.0], dtype=torch.bfloat16)) == 0x3F80 + 0x4000


def test_weights_group_by_layer_head_and_embedding():
    assert sync.weight_group("model.layers.3.mlp.down_proj.weight") == "layer 3"
    assert sync.weight_group("model.layers.12.self_attn.qkv_proj.weight") == "layer 12"  # vLLM's fused name
    assert sync.weight_group("gpt_neox.layers.0.attention.dense.weight") == "layer 0"
    assert sync.weight_group("lm_head.weight") == sync.weight_group("embed_out.weight") == "head"
    assert sync.weight_group("model.embed_tokens.weight") == sync.weight_group("gpt_neox.embed_in.weight")
    assert sync.weight_group("model.norm.weight") == "other"


@pytest.fixture(scope="module")
def planted(tiny_build, tiny_tokenizer, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("push-proof")
    moe = tiny.save_random_family_model(
        str(root / "moe"),
        tiny_tokenizer,
        transformers.Qwen3MoeConfig,
        seed=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        norm_topk_prob=True,
    )
    proc = run_python("tests/push_proof_worker.py", tiny_build["model"], moe, str(root), timeout=900)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["fp32", "bf16", "lora", "moe"])
def test_each_planted_fault_is_caught_and_named(planted, engine):
    """A correct push passes, before and after the faults; each fault stops the proof naming where it is."""
    found = planted[engine]
    print(engine, json.dumps(found, indent=1))
    assert found["clean"] == "" and found["clean_again"] == ""
    layer = "layer 1" if engine == "lora" else "layer 0"  # the unsent tensor's (push_proof_worker.UNSENT)
    assert found["unsent"].startswith(f"the engine's {layer} is not what the trainer pushed"), found["unsent"]
    assert found["behind"].startswith("the engine's layer 1 is not what the trainer pushed"), found["behind"]
    if engine in ("fp32", "bf16"):  # tied heads that train
        assert found["stale_head"].startswith("the engine's head is not what the trainer pushed"), found["stale_head"]
    assert "cos_sin_cache changed since it loaded" in found["buffer"], found["buffer"]
    assert all("\n" not in message for message in found.values())
