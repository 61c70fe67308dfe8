"""Weight-push cost: push_weights (+ prefix-cache reset) and check_sync into a running in-process vLLM
engine, against a plain in-memory state-dict copy of the same bytes measured in the same process.

    .venv/bin/python bench/sync_bench.py                 # tiny model and a Qwen2.5-0.5B-shaped random model
    .venv/bin/python bench/sync_bench.py --only tiny

Targets on the CPU dev machine: tiny push + reset <= 20 ms; 0.5B-shaped push <= 5 s.
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
from transformers import AutoModelForCausalLM  # noqa: E402

import fsdp_train  # noqa: E402
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


def bench(name: str, path: str, reps: int) -> None:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    llm = rollout.make_engine(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3)
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    target = {n: torch.empty_like(p) for n, p in model.named_parameters()}

    def baseline():
        with torch.no_grad():
            for n, p in model.named_parameters():
                target[n].copy_(p)

    copy_s = timed(baseline, reps)
    push_s = timed(lambda: sync.push_weights(llm, sync.full_params(model)), reps)
    check_s = timed(
        lambda: sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model)), max(2, reps // 2)
    )
    diff = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model))
    gb = nbytes / 1e9
    print(f"{name}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, {gb:.3f} GB fp32")
    for label, times in (
        ("state-dict copy (baseline)", copy_s),
        ("push_weights + reset", push_s),
        ("check_sync", check_s),
    ):
        med = statistics.median(times)
        print(
            f"  {label:<28} median {med * 1000:9.1f} ms  min {min(times) * 1000:9.1f} ms  "
            f"{gb / med:7.2f} GB/s  ({med / statistics.median(copy_s):.1f}x baseline)"
        )
    print(f"  check_sync after push: {diff:.2e} nats")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["tiny", "0.5b"])
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


if __name__ == "__main__":
    main()
