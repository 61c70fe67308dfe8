"""Packed micro-batches (model.use_remove_padding, fsdp_train.pack) against the padded ones they replaced, in ONE
process, alternating (padded packed padded packed ...) after a warm-up of each, so the machine's drift hits both.

    .venv/bin/python bench/packing.py                          # tiny and Qwen2.5-0.5B shapes (~25 min on 2 cores)
    .venv/bin/python bench/packing.py --only 0.5b --rows 16 --layers 4 --rounds 3

Workload: ROWS rows with GSM8K's lengths (bench/train_bench.gsm8k_like_lengths: prompts ~93 tokens, 55..173;
responses ~232, long-tailed to the budget 1024), a GRPO mini-batch of them (advantages, old and reference log-probs),
cut by a budget of 4,096 tokens: at the 0.5B shape 16 rows, whose padded micro-batches hold as much padding as the seed
recipe's batch on one GPU (128 rows, 16,384 tokens: 72% of the padded tokens real, 76% of the head's positions;
here 75% and 74%) at a size a CPU trains in minutes.
Models: random weights at the tiny shape and at Qwen2.5-0.5B's (vocabulary 151,936; --layers keeps the layer shape
and cuts their number: 24 layers of fp32 training are slow on 2 cores).
The paths, each with the same fsdp_train.train_step and compute_logprobs around it:
  padded  the code before packing, swapped in: micro-batches of at most `budget` PADDED tokens (rows by length),
          each [b, longest prompt + longest response] through transformers' SDPA with the 2-D mask, the head at
          every response column (padding included);
  packed  fsdp_train as it is: micro-batches of at most `budget` real tokens, one packed row each, varlen_attention
          (flash_attention_2 on a GPU that has it), the head at the response tokens only.
Printed per path: real tokens / tokens computed (token-wise layers), micro-batches, the reference pass's and the
update's seconds (medians; on CPU the process's CPU seconds at one thread, OMP_NUM_THREADS=1 unless set: wall time
on a shared machine moves by tens of percent with other processes' load), their sum, the trainer's share of a step
(old-log-prob pass + reference + update: 2 x ref + update), and each pass's peak memory above
what is resident before it (CPU: the process's resident high-water mark, reset before each pass; GPU:
max_memory_allocated). Then packed / padded.
Targets at the 0.5B shape: update + reference <= 0.80x padded, peak memory no higher at the same budget.
"""

import argparse
import contextlib
import ctypes
import gc
import os
import random
import statistics
import sys
import tempfile
import time

if os.environ.get("MALLOC_MMAP_THRESHOLD_") is None:  # glibc then returns every freed block >= 64 KiB to the OS, so
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # the resident high-water mark measures each pass (bench/memory.py)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # CPU: one thread, whose CPU time is the pass's work (see above)
    os.execv(sys.executable, [sys.executable, *sys.argv])

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from torch.distributed.fsdp import register_fsdp_forward_method  # noqa: E402
from train_bench import gsm8k_like_lengths  # noqa: E402

import config  # noqa: E402
import fsdp_train as ft  # noqa: E402
import grpo  # noqa: E402
import losses  # noqa: E402
import tiny  # noqa: E402

LOSS = ["actor.entropy_coeff=0.003", "actor.kl_loss_coef=0.001", "data.max_response_length=1024"]


def grpo_batch(lengths, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = ft.make_batch(
        [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lengths],
        [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in lengths],
        pad_id=0,
    )
    shape = b["response_mask"].shape  # [B, R]
    b["old_logprobs"] = -torch.rand(shape, generator=g) * 3 - 10
    b["ref_logprobs"] = -torch.rand(shape, generator=g) * 3 - 10
    b["advantages"] = torch.randn(len(lengths), 1, generator=g) * b["response_mask"]
    return b


# ------------------------------------------------------------------ the padded path, as fsdp_train had it
def padded_micro_batches(batch: dict, max_tokens: int, num_groups: int = 0) -> list[list[int]]:
    """Row groups of at most max_tokens PADDED tokens (rows x (longest prompt + longest response)), longest first."""
    p_width = batch["input_ids"].shape[1] - batch["response_mask"].shape[1]
    p_lens = batch["attention_mask"][:, :p_width].sum(-1).tolist()
    r_lens = batch["attention_mask"][:, p_width:].sum(-1).tolist()
    order = sorted(range(len(p_lens)), key=lambda i: -(p_lens[i] + r_lens[i]))
    groups, p_max, r_max = [], 0, 0
    for i in order:
        p_new, r_new = max(p_max, p_lens[i]), max(r_max, r_lens[i])
        if groups and (len(groups[-1]) + 1) * (p_new + r_new) <= max_tokens:
            groups[-1].append(i)
            p_max, r_max = p_new, r_new
        else:
            groups.append([i])
            p_max, r_max = p_lens[i], r_lens[i]
    while len(groups) < num_groups and max(map(len, groups), default=0) > 1:
        big = max(groups, key=len)
        groups.remove(big)
        groups += [big[: len(big) // 2], big[len(big) // 2 :]]
    return groups + [[] for _ in range(num_groups - len(groups))]


def padded_logprobs(model, input_ids, attention_mask, r_width, temperature, entropy_fn, entropy_grad, chunk_size):
    """[b, R] log-probs (entropy) of the padded micro-batch: the decoder on [b, P + R] with the 2-D mask, the head
    at the b * R response columns."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    hidden = ft.final_hidden(model, input_ids, attention_mask, position_ids)[:, -r_width - 1 : -1]  # [b, R, h]
    b, h = hidden.shape[0], hidden.shape[-1]
    logp, entropy = ft.chunked_logprobs(
        hidden.reshape(b * r_width, h),
        input_ids[:, -r_width:].reshape(-1),
        ft.logits_head(model),
        temperature,
        chunk_size,
        entropy_fn,
        entropy_grad,
    )
    return logp.view(b, r_width).clone(), (entropy.view(b, r_width).clone() if entropy is not None else None)


def padded_forward(model, mb, temperature, entropy_fn=None, entropy_grad=True, chunk_size=ft.LOGPROB_CHUNK):
    r_width = mb["response_mask"].shape[1]
    return model.padded_logprobs(
        mb["input_ids"], mb["attention_mask"], r_width, temperature, entropy_fn, entropy_grad, chunk_size
    )


@contextlib.contextmanager
def padded(model):
    """fsdp_train with the padded path swapped in, and the model on transformers' SDPA."""
    decoder = model.get_decoder()
    attention = decoder.config._attn_implementation
    saved = ft._forward, ft.micro_batches
    ft._forward, ft.micro_batches = padded_forward, padded_micro_batches
    decoder.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        ft._forward, ft.micro_batches = saved
        decoder.set_attn_implementation(attention)


# ------------------------------------------------------------------ measurements
def resident_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def timed_peak(fn, device) -> tuple[float, float]:
    """(seconds, peak MB above what is resident or allocated when fn starts). Seconds: on GPU wall time; on CPU this
    process's CPU time (one thread: its work, which other processes on a shared machine move far less than its wall
    time)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        base = resident_mb("VmRSS:")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the resident high-water mark (VmHWM) back to the current resident size
    start = time.perf_counter() if device.type == "cuda" else time.process_time()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter() - start, (torch.cuda.max_memory_allocated() - base) / 2**20
    return time.process_time() - start, resident_mb("VmHWM:") - base


def computed_tokens(batch: dict, groups: list[list[int]], packed: bool) -> int:
    """Tokens the token-wise layers see: the real ones packed; rows x width of each padded micro-batch."""
    if packed:
        return int(batch["attention_mask"].sum())
    return sum(len(g) * ft.select(batch, g)["input_ids"].shape[1] for g in groups if g)


def compare(name: str, path: str, lengths, budget: int, rounds: int, checkpointing: bool, compute_dtype) -> None:
    _, _, device = ft.init_distributed()
    model = ft.load_model(path, device=device, compute_dtype=compute_dtype, activation_checkpointing=checkpointing)
    model.padded_logprobs = padded_logprobs.__get__(model)
    register_fsdp_forward_method(model, "padded_logprobs")
    optimizer, _ = ft.make_optimizer(model, lr=1e-7)
    loss_fn = grpo.grpo_loss_fn(config.load_config(None, LOSS), grpo.policy_term)
    batch = grpo_batch(lengths, model.config.vocab_size)
    kw = dict(temperature=1.0, max_tokens=budget, chunk_size=ft.LOGPROB_CHUNK)
    passes = {
        "reference": lambda: ft.compute_logprobs(model, batch, **kw),
        "update": lambda: ft.train_step(model, optimizer, batch, loss_fn, entropy_fn=losses.entropy_from_logits, **kw),
    }
    paths = {"padded": lambda: padded(model), "packed": contextlib.nullcontext}
    results = {(p, k): [] for p in paths for k in passes}
    peaks = {(p, k): [] for p in paths for k in passes}
    for i in range(rounds + 1):  # round 0: the warm-up
        for p, context in paths.items():
            with context():
                for k, fn in passes.items():
                    seconds, peak = timed_peak(fn, device)
                    print(f"  round {i} {p} {k}: {seconds:.2f} s, peak {peak:.0f} MB", flush=True)
                    if i:
                        results[p, k].append(seconds)
                        peaks[p, k].append(peak)
    real = int(batch["attention_mask"].sum())
    with padded(model):
        padded_groups = ft.micro_batches(batch, budget)
    packed_groups = ft.micro_batches(batch, budget)
    print(f"\n{name}: {len(lengths)} rows, {real} real tokens, budget {budget} tokens, {rounds} rounds (medians)")
    print(
        f"{'path':<8} {'tokens computed':>16} {'micro-batches':>14} {'ref s':>8} {'update s':>9} {'sum s':>8} "
        f"{'step s':>8} {'ref peak MB':>12} {'update peak MB':>15}"
    )
    row = {}
    for p, groups in (("padded", padded_groups), ("packed", packed_groups)):
        ref, upd = statistics.median(results[p, "reference"]), statistics.median(results[p, "update"])
        ref_peak, upd_peak = statistics.median(peaks[p, "reference"]), statistics.median(peaks[p, "update"])
        step = 2 * ref + upd  # the trainer's share of a step: the old-log-prob pass (the reference's cost), ref, update
        row[p] = (ref, upd, ref + upd, step, ref_peak, upd_peak)
        tokens = computed_tokens(batch, groups, p == "packed")
        print(
            f"{p:<8} {tokens:>16} {len(groups):>14} {ref:>8.2f} {upd:>9.2f} {ref + upd:>8.2f} {step:>8.2f} "
            f"{ref_peak:>12.0f} {upd_peak:>15.0f}"
        )
    r = [row["packed"][k] / row["padded"][k] for k in range(6)]
    print(f"{'packed / padded':<40} {r[0]:>8.2f} {r[1]:>9.2f} {r[2]:>8.2f} {r[3]:>8.2f} {r[4]:>12.2f} {r[5]:>15.2f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", choices=["tiny", "0.5b"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rows", type=int, default=0, help="rows of the batch (default: 64 tiny, 16 at 0.5B)")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers at the 0.5B shape (Qwen2.5-0.5B: 24)")
    ap.add_argument("--budget", type=int, default=4096, help="actor.ppo_max_token_len_per_gpu")
    args = ap.parse_args()
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    compute_dtype = torch.bfloat16 if on_gpu else torch.float32
    tok = tiny.build_tokenizer([r["question"] for r in tiny.make_dataset(0, 400, 10)["train"]])
    with tempfile.TemporaryDirectory() as tmp:
        if args.only in (None, "tiny"):
            path = tiny.save_random_model(os.path.join(tmp, "tiny"), tok)
            lengths = gsm8k_like_lengths(args.rows or 64, random.Random(1))
            compare("tiny shape", path, lengths, args.budget, args.rounds, False, compute_dtype)
        if args.only in (None, "0.5b"):
            shape = dict(tiny.QWEN25_05B, num_hidden_layers=args.layers)
            path = tiny.save_random_model(os.path.join(tmp, "q05b"), tok, **shape)
            lengths = gsm8k_like_lengths(args.rows or 16, random.Random(2))
            name = f"Qwen2.5-0.5B shape, {args.layers} of its 24 layers, activation checkpointing"
            compare(name, path, lengths, args.budget, args.rounds, True, compute_dtype)


if __name__ == "__main__":
    main()
