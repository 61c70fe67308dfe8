"""Memory and time of the log-prob paths at Qwen2.5's vocabulary (V = 151,936): the chunked path
(fsdp_train.chunked_logprobs, the default) against the plain one (actor.logprob_chunk_size=0: [tokens, V]
logits kept for the backward, what flatgrpo did before).

    .venv/bin/python bench/memory.py                     # both parts, Qwen2.5-0.5B shape, ~20 min on 2 cores
    .venv/bin/python bench/memory.py --only memory --rows-plain 2,4 --rows-chunked 4,8
    .venv/bin/python bench/memory.py --only time --rounds 3
    .venv/bin/python bench/memory.py --only lora         # a LoRA train step beside the full one (3 points, ~10 min)

memory: one fsdp_train.train_step (GRPO loss with entropy and KL, activation checkpointing on, AdamW
        states already allocated) and one no-grad compute_logprobs pass (with entropy, as the old-log-prob
        pass), each in a FRESH process per point, over one micro-batch of ROWS x (100 prompt + 512 response)
        tokens. Printed: the step's peak above what was resident before it, and the marginal MB per
        micro-batch token between consecutive points (constants such as gradients cancel). On CPU the peak
        is the process's resident high-water mark (reset through /proc/self/clear_refs after loading; glibc
        returns every allocation >= 64 KiB to the OS, MALLOC_MMAP_THRESHOLD_); on GPU max_memory_allocated.
time:   the train step of both paths in ONE process, alternating (A B A B ...) after a warm-up of each, so
        the machine's drift hits both; median seconds per micro-batch token and the ratio.
lora:   the chunked train step with LoRA (rank 32, alpha 32, all-linear: gsm8k_lora.yaml's adapters on the fp32
        base) at two sizes, and the full step at the smaller one, each with what is resident before the step
        (model + AdamW states): the memory.json points "train/lora" and "train/full (resident)", which
        bench/fit_table.py's LoRA rows read.
Target: <= 0.3 MB per micro-batch token for the chunked train step; time within 10% of the plain.
"""

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

import config  # noqa: E402
import fsdp_train as ft  # noqa: E402
import grpo  # noqa: E402
import lora  # noqa: E402
import losses  # noqa: E402
import tiny  # noqa: E402

PROMPT, RESPONSE = 100, 512  # tokens per row: whole chunks of 512 or 1024 response positions at any row count
CONFIG = [
    "rollout.temperature=1.0",
    "actor.entropy_coeff=0.003",
    "actor.kl_loss_coef=0.001",
    "data.max_response_length=400",
]


def build_model(root: str) -> str:
    """A random Qwen2.5-0.5B-shaped model (tiny's tokenizer, vocabulary padded to 151,936), built once."""
    path = os.path.join(root, "qwen25-05b-shape")
    if not os.path.exists(os.path.join(path, "config.json")):
        tok = tiny.build_tokenizer([r["question"] for r in tiny.make_dataset(0, 400, 10)["train"]])
        tiny.save_random_model(path, tok, **tiny.QWEN25_05B)
    return path


def micro_batch(rows: int, vocab: int, prompt: int = PROMPT, response: int = RESPONSE) -> dict:
    g = torch.Generator().manual_seed(rows)
    b = ft.make_batch(
        [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)],
        [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(rows)],
        pad_id=0,
    )
    shape = b["response_mask"].shape  # [rows, R]
    b["old_logprobs"] = -torch.rand(shape, generator=g) * 3 - 10
    b["ref_logprobs"] = -torch.rand(shape, generator=g) * 3 - 10
    b["advantages"] = torch.randn(rows, 1, generator=g) * b["response_mask"]
    return b


def resident_mb(field: str) -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) / 1024


def measure(fn, device) -> float:
    """Peak MB above what is resident/allocated when fn starts."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = resident_mb("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset the resident high-water mark (VmHWM) to the current resident size
    fn()
    return resident_mb("VmHWM:") - base


def point(args) -> dict:
    """One measurement in this (fresh) process. train / logprobs: one fsdp_train pass over ROWS rows of the
    model at one chunk size; layer: forward + backward of ONE decoder layer of that shape (what activation
    checkpointing recomputes during the backward, used by bench/fit_table.py)."""
    _, _, device = ft.init_distributed()
    if args.point == "layer":
        return layer_point(args.model, int(args.rows), device)
    settings = {"rank": args.lora, "alpha": args.lora, "target_modules": "all-linear", "seed": 0}
    load = lora.loader(settings, {}) if args.lora else ft.load_model
    model = load(
        args.model,
        device=device,
        activation_checkpointing=args.point == "train",
        trainable=args.point == "train",
    )
    batch = micro_batch(int(args.rows), model.config.vocab_size)
    tokens, kw = int(batch["attention_mask"].sum()), dict(temperature=1.0, max_tokens=10**9, chunk_size=args.chunk)
    if args.point == "train":
        optimizer, _ = ft.make_optimizer(model, lr=1e-6)
        loss_fn = grpo.grpo_loss_fn(config.load_config(None, CONFIG), grpo.policy_term)
        step = lambda b: ft.train_step(model, optimizer, b, loss_fn, entropy_fn=losses.entropy_from_logits, **kw)  # noqa: E731
        step(micro_batch(1, model.config.vocab_size, 8, 8))  # warm-up: AdamW's states exist before the measurement
        run = lambda: step(batch)  # noqa: E731
    else:
        run = lambda: ft.compute_logprobs(model, batch, entropy_fn=losses.entropy_from_logits, **kw)  # noqa: E731
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    resident = resident_mb("VmRSS:") if device.type == "cpu" else torch.cuda.memory_allocated() / 2**20
    start = time.perf_counter()
    peak = measure(run, device)
    return {"tokens": tokens, "peak_mb": peak, "seconds": time.perf_counter() - start, "resident_mb": resident}


def layer_point(model_path: str, rows: int, device) -> dict:
    from transformers import AutoConfig
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

    config = AutoConfig.from_pretrained(model_path)
    layer, rope = Qwen2DecoderLayer(config, 0).to(device), Qwen2RotaryEmbedding(config).to(device)
    x = torch.randn(rows, PROMPT + RESPONSE, config.hidden_size, device=device, requires_grad=True)  # [b, S, h]
    positions = torch.arange(PROMPT + RESPONSE, device=device)[None].expand(rows, -1)  # [b, S]

    def run():
        out = layer(x, position_embeddings=rope(x, positions), attention_mask=None, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).sum().backward()

    return {"tokens": rows * (PROMPT + RESPONSE), "peak_mb": measure(run, device), "seconds": 0.0}


def lora_table(model: str, chunk: int, rank: int) -> dict:
    """The LoRA train step at 4 and 6 rows and the full one at 4, each in a fresh process; returns their points
    (peak above the resident model and states, and that resident size) and prints them."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    results = {}
    print(f"{'step':<24} {'tokens':>7} {'resident MB':>12} {'peak MB':>9} {'s':>7} {'marginal MB/token':>18}")
    for name, lora_rank, rows in (("train/full (resident)", 0, [4]), ("train/lora", rank, [4, 6])):
        points = results.setdefault(name, [])
        for r in rows:
            cmd = [sys.executable, __file__, "--point", "train", "--chunk", str(chunk), "--rows", str(r)]
            cmd += ["--model", model, "--lora", str(lora_rank)]
            run = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            out = json.loads(run.stdout.splitlines()[-1])
            marginal = None
            if points:
                marginal = (out["peak_mb"] - points[-1]["peak_mb"]) / (out["tokens"] - points[-1]["tokens"])
            points.append({**out, "marginal_mb_per_token": marginal})
            print(
                f"{name:<24} {out['tokens']:>7} {out['resident_mb']:>12.0f} {out['peak_mb']:>9.0f} "
                f"{out['seconds']:>7.1f} {'' if marginal is None else f'{marginal:.3f}':>18}",
                flush=True,
            )
    return results


def memory_table(model: str, rows: dict, chunk: int) -> dict:
    """Every point in a fresh process; returns {(pass, path): [points]} and prints the table."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    print(
        f"peak memory above the resident model, one micro-batch of rows x ({PROMPT} + {RESPONSE}) tokens, "
        f"AC on, a fresh process per point"
    )
    print(f"{'pass':<10} {'path':<22} {'tokens':>7} {'peak MB':>9} {'s':>7} {'marginal MB/token':>18}")
    results = {}
    for kind, paths in (
        ("train", {"plain": 0, "chunked": chunk}),
        ("logprobs", {"plain": 0, "chunked": chunk}),
        ("layer", {"one decoder layer": 0}),
    ):
        for name, c in paths.items():
            points = results.setdefault(f"{kind}/{name}", [])
            for r in rows[name]:
                cmd = [sys.executable, __file__, "--point", kind, "--chunk", str(c), "--rows", str(r), "--model", model]
                out = json.loads(
                    subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout.splitlines()[-1]
                )
                marginal = (
                    (out["peak_mb"] - points[-1]["peak_mb"]) / (out["tokens"] - points[-1]["tokens"])
                    if points
                    else None
                )
                points.append({**out, "marginal_mb_per_token": marginal})
                label = name + (f" ({c})" if c else "")
                print(
                    f"{kind:<10} {label:<22} {out['tokens']:>7} {out['peak_mb']:>9.0f} {out['seconds']:>7.1f} "
                    f"{'' if marginal is None else f'{marginal:.3f}':>18}",
                    flush=True,
                )
    return results


def time_table(model: str, rows: int, chunk: int, rounds: int) -> None:
    _, _, device = ft.init_distributed()
    policy = ft.load_model(model, device=device, activation_checkpointing=True)
    optimizer, _ = ft.make_optimizer(policy, lr=1e-6)
    loss_fn = grpo.grpo_loss_fn(config.load_config(None, CONFIG), grpo.policy_term)
    batch = micro_batch(rows, policy.config.vocab_size)
    tokens = int(batch["attention_mask"].sum())
    paths = {"plain (chunk 0)": 0, f"chunked ({chunk})": chunk}
    times = {k: [] for k in paths}
    for i in range(rounds + 1):  # round 0: warm-up
        for name, c in paths.items():
            t0 = time.perf_counter()
            ft.train_step(
                policy,
                optimizer,
                batch,
                loss_fn,
                temperature=1.0,
                max_tokens=10**9,
                chunk_size=c,
                entropy_fn=losses.entropy_from_logits,
            )
            if i:
                times[name].append(time.perf_counter() - t0)
    print(
        f"train step time, {rows} rows x ({PROMPT} + {RESPONSE}) = {tokens} tokens, AC on, {rounds} rounds alternating"
    )
    for name, ts in times.items():
        print(
            f"  {name:<20} median {statistics.median(ts):7.2f} s  ({min(ts):.2f}-{max(ts):.2f})  "
            f"{statistics.median(ts) / tokens * 1000:.2f} ms/token"
        )
    plain, chunked = (statistics.median(times[k]) for k in paths)
    print(f"  chunked / plain time: {chunked / plain:.3f}  (target <= 1.10)")


def save_results(results: dict, model: str, chunk: int) -> None:
    """bench/results/memory.json: what bench/fit_table.py scales to the real models (--only lora adds its points
    to the file's others)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model)
    out = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU, {os.cpu_count()} cores",
        "dtype": "float32",
        "chunk_size": chunk,
        "prompt": PROMPT,
        "response": RESPONSE,
        "shape": {
            k: getattr(c, k)
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
            )
        },
        "points": results,
        "command": "python bench/memory.py " + " ".join(sys.argv[1:]),
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "memory.json")
    if "train/lora" in results and os.path.exists(path):  # --only lora: beside the earlier measurements
        with open(path) as f:
            earlier = json.load(f)
        earlier["points"].update(results)
        earlier["lora_command"] = out["command"]
        out = earlier
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print(f"saved {path}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["memory", "time", "lora"])
    ap.add_argument("--lora", type=int, default=0, help="LoRA rank of a --point (--only lora: 32 when 0)")
    ap.add_argument("--rows-plain", default="2,4,6", help="rows per micro-batch at each memory point, plain path")
    ap.add_argument("--rows-chunked", default="4,6,8", help="the same for the chunked path (>= 2 chunks at each)")
    ap.add_argument("--chunk", type=int, default=ft.LOGPROB_CHUNK)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--time-rows", type=int, default=2)
    ap.add_argument("--point", choices=["train", "logprobs", "layer"], help=argparse.SUPPRESS)
    ap.add_argument("--rows", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.point:
        return print(json.dumps(point(args)))
    model = build_model(os.path.join(".cache", "bench"))
    if args.only in (None, "memory"):
        rows = {
            "plain": [int(r) for r in args.rows_plain.split(",")],
            "chunked": [int(r) for r in args.rows_chunked.split(",")],
            "one decoder layer": [2, 4],
        }
        results = memory_table(model, rows, args.chunk)
        save_results(results, model, args.chunk)
    if args.only in (None, "time"):
        time_table(model, args.time_rows, args.chunk, args.rounds)
    if args.only == "lora":
        save_results(lora_table(model, args.chunk, args.lora or 32), model, args.chunk)


if __name__ == "__main__":
    main()
