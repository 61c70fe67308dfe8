"""Tests that need a CUDA GPU and vLLM's GPU build: on a CPU they skip, with one line saying why; `make test` runs
them where a GPU is (docs/tests.md: 'On a GPU'). They fit in about 7 minutes of one H100, engine start-ups included:

- the recipe at a small real shape (Qwen2.5-0.5B's, random weights) for 2 steps through bench/recipe.py: bf16
  compute with fp32 master weights, sleep mode, torch.compile and CUDA graphs, the exact proof after every push;
- R3 against vLLM's own routing (tests/helpers/gpu_worker.py): in fp32 the trainer's log-probs replaying vLLM's routing
  are vLLM's; in bf16 replaying it brings the trainer closer to vLLM than its own routing does;
- the tiny demo learning (bf16);
- a push that never happens, caught by the exact proof at step 1 in bf16 (where the log-prob probe only warns);
- packed micro-batches in bf16 (FlashAttention's varlen kernel where flash-attn is installed) as close to the fp32
  oracle as transformers' own bf16 forward of each sequence alone.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from grpo_runs import one_error_line, read_metrics, run_grpo

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's GPU build (none here)"),
]
SYNC = 1e-4  # vLLM against the trainer in fp32 after a push (docs/cpu-notes.md), as the CPU tests
BF16 = ["model.compute_dtype=bfloat16", "rollout.dtype=bfloat16"]


def python(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def test_the_recipe_at_a_small_real_shape_proves_every_push(tmp_path):
    """bench/recipe.py at Qwen2.5-0.5B's shape (gsm8k.yaml: bf16 compute, fp32 master weights, activation
    checkpointing, compile, CUDA graphs, sleep level 1), 2 steps of 16 prompts x 4 x 64 tokens: each step pushed and
    proven bit for bit (timing_s/push_proof), the probe logged, vLLM's bf16 log-probs near the trainer's."""
    python(
        "bench/recipe.py",
        "--shape",
        "0.5b",
        "--steps",
        "2",
        "--prompts",
        "16",
        "--n",
        "4",
        "--response",
        "64",
        "--out",
        str(tmp_path),
    )
    steps = [r for r in read_metrics(tmp_path / "run") if "training/global_step" in r]
    assert [r["training/global_step"] for r in steps] == [1, 2]
    assert all(r["timing_s/push_proof"] > 0 and "rollout/sync_check" in r for r in steps)
    assert all(r["rollout/logprob_diff_mean"] < 0.1 and r["perf/vllm_pool_gb"] > 0 for r in steps)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_r3_replays_vllms_own_routing(dtype, tmp_path):
    """vLLM returns each token's experts (its Model Runner V2); the trainer replaying them computes vLLM's policy:
    in fp32 to fp32 noise, while its own routing may pick other experts; in bf16 closer than its own routing."""
    report = json.loads(python("tests/helpers/gpu_worker.py", str(tmp_path), dtype).stdout.strip().splitlines()[-1])
    print(dtype, report)
    if dtype == "float32":
        assert report["replayed"] <= SYNC, report
    else:
        assert report["replayed"] < report["own"] and report["disagreement"] > 0, report


def test_the_tiny_demo_learns_on_the_gpu(tiny_build, tmp_path):
    """make demo's run (tiny.yaml, 2 ranks' batch on one GPU) in bf16: greedy validation accuracy rises from the
    warm start's 0 (it does not write '#### N') as GRPO teaches the format (docs/demo.md)."""
    run_grpo(
        tmp_path,
        1,
        *BF16,
        "trainer.total_steps=40",
        "trainer.val_every=20",
        "data.val_max_samples=100",
        "data.train_batch_size=16",
        "actor.ppo_mini_batch_size=16",
        "actor.lr=1e-4",
    )
    val = [
        r["val-core/openai/gsm8k/reward/mean@1"]
        for r in read_metrics(tmp_path)
        if "val-core/openai/gsm8k/reward/mean@1" in r
    ]
    print("greedy validation accuracy:", val)
    assert val[-1] >= 0.5 and val[-1] > val[0], val


def test_a_push_that_never_happens_is_caught_at_step_1(tiny_build, tmp_path):
    """tests/helpers/grpo_without_push.py (the engine keeps the initial weights) in bf16: the exact proof stops the run
    at step 1's push, in one line naming the step and the first group whose weights the engine does not hold."""
    proc = run_grpo(
        tmp_path,
        1,
        *BF16,
        "trainer.total_steps=2",
        "trainer.val_every=0",
        "actor.lr=1e-3",
        script="tests/helpers/grpo_without_push.py",
        check=False,
    )
    line = one_error_line(proc)
    assert line.startswith("error: step 1: the engine's ") and "is not what the trainer pushed" in line, line


def test_packed_micro_batches_in_bf16_are_as_close_as_each_sequence_alone(tiny_tokenizer, tmp_path):
    """bf16 compute (fp32 master weights, FSDP2's mixed precision): the model's attention is flash_attention_2 where
    flash-attn is installed (FlashAttention's varlen kernel through the packed row's cu_seq_lens), else
    fsdp_train.varlen_attention; packed rows stay apart (packs_exactly). Its packed log-probs are as close to the fp32
    oracle (each sequence alone through transformers' own model) as transformers' own bf16 forward of each sequence
    alone (within 4x its error, against a leak between rows of whole nats): packing adds no error of its own."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import is_flash_attn_2_available

    import fsdp_train as ft
    import tiny

    path = tiny.save_random_model(str(tmp_path / "model"), tiny_tokenizer, seed=1, tie_word_embeddings=False)
    _, _, device = ft.init_distributed()
    model = ft.load_model(path, device=device, compute_dtype=torch.bfloat16)
    attention = model.get_decoder().config._attn_implementation
    assert attention == ("flash_attention_2" if is_flash_attn_2_available() else ft.VARLEN_ATTENTION)
    assert model.packs_sequences
    g = torch.Generator().manual_seed(0)
    lengths = [(1, 12), (6, 0), (5, 1), (10, 30), (20, 35), (8, 17), (3, 9)]
    prompts = [torch.randint(3, 300, (p,), generator=g).tolist() for p, _ in lengths]
    responses = [torch.randint(3, 300, (r,), generator=g).tolist() for _, r in lengths]
    batch = ft.make_batch(prompts, responses, pad_id=0)
    packed, _ = ft.compute_logprobs(model, batch, temperature=1.0, max_tokens=40)

    @torch.no_grad()
    def alone(dtype):  # [B, R]: each sequence alone through transformers' own model
        own = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        out = torch.zeros(batch["response_mask"].shape, dtype=torch.float64)
        for i, (p, r) in enumerate(zip(prompts, responses, strict=True)):
            if r:
                logits = own(input_ids=torch.tensor([p + r], device=device)).logits[0, len(p) - 1 : -1].double()
                out[i, : len(r)] = (
                    torch.log_softmax(logits, -1).gather(-1, torch.tensor(r, device=device)[:, None])[:, 0].cpu()
                )
        return out

    oracle, bf16 = alone(torch.float32), alone(torch.bfloat16)
    own_error = (bf16 - oracle).abs().max().item()
    packed_error = (packed.double() - oracle).abs().max().item()
    print(f"packed bf16 ({attention}): {packed_error:.3g}; transformers' bf16, each alone: {own_error:.3g}")
    assert 0 < packed_error <= 4 * own_error
