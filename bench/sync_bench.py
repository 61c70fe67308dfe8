"""Weight-push cost: push_weights (+ prefix-cache reset), the exact proof of it (sync.with_bit_sums on the stream,
sync.check_push on the engine) and check_sync into a running in-process vLLM engine, against a plain in-memory
state-dict copy of the same bytes measured in the same process.

    .venv/bin/python bench/sync_bench.py                 # tiny model and a Qwen2.5-0.5B-shaped random model
    .venv/bin/python bench/sync_bench.py --only tiny
    .venv/bin/python bench/sync_bench.py --only moe      # a Mixture-of-Experts model against a dense one, same bytes

Targets on the CPU dev machine: tiny push + reset <= 20 ms; 0.5B-shaped push <= 5 s; a MoE push (its merged
experts split into the checkpoint's per-expert tensors, fsdp_train.checkpoint_names) costs what a dense model of
the same bytes costs, at Qwen3-30B-A3B's expert shape: time per GB within 1.5x of the dense one's.
"""

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig  # noqa: E402

import fsdp_train  # noqa: E402
import moe  # noqa: E402
import rollout  # noqa: E402
import sync  # noqa: E402
import tiny  # noqa: E402


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench(name: str, path: str, reps: int) -> float:
    """Prints the medians; returns the push's seconds per GB."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    _, split = fsdp_train.checkpoint_names(model)  # a MoE model's experts: per-expert tensors, as its checkpoint
    sync.record_cpu_packing()  # as grpo.start_engine: the proof reads what the CPU engine packs
    llm = rollout.make_engine(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    buffers = sync.engine_buffers(llm)
    repack = functools.partial(moe.repack_cpu_experts, bit_sum=sync.bit_sum)  # CPU-only, a MoE model's (grpo.py's)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    target = {n: torch.empty_like(p) for n, p in model.named_parameters()}

    def baseline():
        with torch.no_grad():
            for n, p in model.named_parameters():
                target[n].copy_(p)

    copy_s = timed(baseline, reps)
    pushed = sync.push_weights(llm, sync.full_params(model, split=split), repack)
    push_s = timed(lambda: sync.push_weights(llm, sync.full_params(model, split=split), repack), reps)
    sums = {}

    def push_and_prove():
        sums.clear()
        sync.push_weights(llm, sync.with_bit_sums(sync.full_params(model, split=split), sums), repack)
        sync.check_push(llm, sums, buffers)

    proven_s = timed(push_and_prove, reps)
    proof_s = timed(lambda: sync.check_push(llm, sums, buffers), reps)
    check_s = timed(
        lambda: sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model)), max(2, reps // 2)
    )
    diff = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model))
    gb = nbytes / 1e9
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"{name}: {params:.1f}M params, {gb:.3f} GB fp32, {pushed} tensors pushed")
    for label, times in (
        ("state-dict copy (baseline)", copy_s),
        ("push_weights + reset", push_s),
        ("push, its sums and its proof", proven_s),
        ("the proof (sync.check_push)", proof_s),
        ("check_sync", check_s),
    ):
        med = statistics.median(times)
        print(
            f"  {label:<28} median {med * 1000:9.1f} ms  min {min(times) * 1000:9.1f} ms  "
            f"{gb / med:7.2f} GB/s  ({med / statistics.median(copy_s):.1f}x baseline)"
        )
    print(f"  check_sync after push: {diff:.2e} nats; the exact proof costs "
          f"{statistics.median(proven_s) / statistics.median(push_s) - 1:+.1%} on the push")  # fmt: skip
    return statistics.median(push_s) / gb


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["tiny", "0.5b", "moe"])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    tok = tiny.build_tokenizer([r["question"] for r in tiny.make_dataset(0, 400, 10)["train"]])
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "tiny"):
            bench("tiny (tied)", tiny.save_random_model(os.path.join(tmp, "tiny"), tok), args.reps)
        if args.only in (None, "0.5b"):
            path = tiny.save_random_model(os.path.join(tmp, "q05b"), tok, **tiny.QWEN25_05B)
            bench("Qwen2.5-0.5B shape (tied)", path, max(3, args.reps // 3))
        if args.only in (None, "moe"):  # Qwen3-30B-A3B's expert shape (h 2048, I 768), 16 experts, 2 layers, against
            # a dense MLP of the same bytes (I = 16 x 768): 96 expert tensors of 6 MB (fp32) against 6 of 100 MB
            shape = dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4)
            shape.update(head_dim=128, tie_word_embeddings=False)
            dense = tiny.save_random_family_model(
                os.path.join(tmp, "dense"), tok, Qwen3Config, intermediate_size=12288, **shape
            )
            experts = dict(num_experts=16, num_experts_per_tok=8, moe_intermediate_size=768, **shape)
            mixture = tiny.save_random_family_model(os.path.join(tmp, "moe"), tok, Qwen3MoeConfig, **experts)
            reps = max(3, args.reps // 3)
            per_gb = [bench(n, p, reps) for n, p in (("dense Qwen3", dense), ("Qwen3-MoE, 16 experts", mixture))]
            print(f"MoE push time per GB / dense push time per GB: {per_gb[1] / per_gb[0]:.2f}")


if __name__ == "__main__":
    main()
