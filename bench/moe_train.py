"""The training side of a Mixture-of-Experts model at REAL Qwen3-30B-A3B layer shapes, few layers: one
fsdp_train.train_step (fp32 master weights, bf16 compute on GPU, GRPO loss, AdamW) per configuration of
activation checkpointing x transformers' experts implementation, all in one process; per configuration the median
seconds per step, tokens/s (prompt + response), MFU (fsdp_train's), peak and resident GPU memory (max_memory_allocated;
resident: weights + AdamW states before a step), and ratios to the first configuration (the baseline).

    .venv/bin/python bench/moe_train.py                      # 4 layers, 8 x (1024 + 2048) tokens: one GPU
    .venv/bin/python bench/moe_train.py --layers 2 --impls grouped_mm,eager --ac on --steps 2
    .venv/bin/python bench/moe_train.py --tiny               # hidden 128, 4 experts, top-2, 2 layers: CPU, seconds

The model: transformers.Qwen3MoeConfig at Qwen3-30B-A3B's shape (48 layers there; --layers here), random init,
save_pretrained into a temp dir (no tokenizer: load_model needs none), loaded with fsdp_train.load_model.
Also printed: parameters per layer, total and active per token (attention + router + top_k/E of the experts),
measured on the built model, and one layer's experts in fp32 bytes.

Experts implementations (transformers 5.19, integrations/moe.py, `@use_experts_implementation`): "eager" (the
class's own loop over the experts hit), "grouped_mm" (torch grouped_mm over tokens sorted by expert; the default
when none is set), "batched_mm" (gathers one [2I, H] weight per token-expert pair, for decoding: ~0.8 TB for a
16k-token micro-batch at this shape: OOM expected), hub kernels ("deepgemm", "sonicmoe", FP8 ones). Each experts module
reads `config._experts_implementation` at every forward. How to choose it with fsdp_train: the key
"experts_implementation" in the checkpoint's config.json (save_pretrained does NOT write it; AutoConfig reads it,
so load_model's modules get it). model.set_experts_implementation() on the loaded model does NOT reach the
experts: _empty_model replaces the top model.config by a fresh one, while the experts hold the decoder's config;
model.get_decoder().set_experts_implementation(impl) does (what this bench does, between configurations).
Not measured: the router's load-balancing loss (output_router_logits is off), expert parallelism.
"""

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, Qwen3MoeConfig  # noqa: E402

import fsdp_train as ft  # noqa: E402
import losses  # noqa: E402
import moe  # noqa: E402

# intermediate_size: the dense MLP's, unused (no mlp_only_layers), as the real config's; fsdp_train.estimate_flops
# counts the active experts (top_k * moe_intermediate_size) and the router, as veRL's _estimate_qwen2_moe_flops.
QWEN3_30B_A3B = dict(hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768, num_experts=128)
QWEN3_30B_A3B.update(num_experts_per_tok=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128, rope_theta=1e6)
QWEN3_30B_A3B.update(vocab_size=151936, norm_topk_prob=True, tie_word_embeddings=False, rms_norm_eps=1e-6)
TINY = {**QWEN3_30B_A3B, "hidden_size": 128, "intermediate_size": 128, "moe_intermediate_size": 64}
TINY.update(num_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
TINY.update(vocab_size=512)
REAL_LAYERS = 48


def save_model(path: str, shape: dict, layers: int, device: torch.device) -> str:
    """A random Qwen3-MoE of this shape in `path` (built on `device`, saved in bf16 on GPU: half the bytes to read)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen3MoeConfig(num_hidden_layers=layers, **shape), dtype=dtype)
    model.save_pretrained(path)
    del model
    return path


def param_table(model, layers: int) -> None:
    c = model.config
    layer = model.get_decoder().layers[0]  # (under FSDP2 its class is FSDPQwen3MoeDecoderLayer)
    experts = sum(p.numel() for p in layer.mlp.experts.parameters())
    total = sum(p.numel() for p in layer.parameters())
    used = experts * c.num_experts_per_tok // c.num_experts  # top_k of the E experts per token
    outer = sum(p.numel() for p in model.parameters()) - layers * total  # embeddings, lm_head, final norm
    rows = [("one decoder layer", total, total - experts + used), ("its experts", experts, used)]
    for n in (layers, REAL_LAYERS) if c.hidden_size == QWEN3_30B_A3B["hidden_size"] else (layers,):
        rows.append((f"{n} layers + embeddings", outer + n * total, outer + n * (total - experts + used)))
    print("| parameters | total | active per token |\n|---|---:|---:|")
    for name, t, a in rows:
        print(f"| {name} | {t / 1e6:,.2f}M | {a / 1e6:,.2f}M |")
    print(f"\none layer's experts in fp32: {experts * 4 / 2**30:.3f} GiB ({experts * 4:,} bytes)\n")


def grpo_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    b = ft.make_batch(
        [torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)],
        [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(rows)],
        pad_id=0,
    )
    b["old_logprobs"] = -torch.rand(b["response_mask"].shape, generator=g) * 3 - 10
    b["advantages"] = torch.randn(rows, 1, generator=g) * b["response_mask"]
    return b


def random_routing(batch: dict, shape: dict, layers: int) -> torch.Tensor:
    """A routing as vLLM would return it, [B, S, L, k] int16: k distinct random experts per token and layer."""
    b, s = batch["input_ids"].shape
    scores = torch.rand(b, s, layers, shape["num_experts"], generator=torch.Generator().manual_seed(2))
    return scores.topk(shape["num_experts_per_tok"], dim=-1).indices.to(torch.int16)


def grpo_loss(logp, entropy, mb, counts):
    per_token, _ = losses.policy_loss(logp, mb["old_logprobs"], mb["advantages"], clip_high=0.28)
    pg = losses.agg_loss(per_token, mb["response_mask"], num_tokens=counts["num_tokens"])
    return pg, {"actor/pg_loss": pg.item()}


def set_impl(model, impl: str) -> None:
    model.get_decoder().set_experts_implementation(impl)  # the config the experts hold (see the docstring)
    got = {m.config._experts_implementation for m in model.modules() if type(m).__name__.endswith("Experts")}
    assert got == {impl}, f"experts implementation {got}, asked for {impl}"


def agreement(model, impls: list[str], vocab: int) -> dict[str, float]:
    """max |log-prob - the first implementation's| on one short row, same weights (before any step)."""
    probe, out = grpo_batch(1, 16, 48, vocab, seed=1), {}
    for impl in impls:
        set_impl(model, impl)
        try:
            logp, _ = ft.compute_logprobs(model, probe, temperature=1.0, max_tokens=64)
        except torch.OutOfMemoryError:
            out[impl] = float("nan")
            continue
        out.setdefault("_ref", logp)
        out[impl] = (logp - out["_ref"]).abs().max().item()
    return out


def measure(model, optimizer, batch, impl: str, steps: int, max_tokens: int, cuda: bool) -> dict:
    set_impl(model, impl)
    step = lambda: ft.train_step(model, optimizer, batch, grpo_loss, temperature=1.0, max_tokens=max_tokens)  # noqa: E731
    times = []
    try:
        step()  # warm-up: AdamW's states exist, kernels chosen
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated() / 2**30 if cuda else None
        for _ in range(steps):
            t0 = time.perf_counter()
            step()  # ends with .item() on the gradient norm: synchronised
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError:
        optimizer.zero_grad(set_to_none=True)
        if hasattr(model, "reshard"):
            model.reshard()
        gc.collect()
        torch.cuda.empty_cache()
        return {"oom": True}
    seconds, seqlens = statistics.median(times), batch["attention_mask"].sum(-1).tolist()
    flops = moe.estimate_flops(model.config, seqlens)
    return {
        "seconds": seconds,
        "tokens_s": sum(seqlens) / seconds,
        "mfu": ft.mfu(flops, seconds, 1, ft.peak_flops()),
        "peak_gb": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
        "resident_gb": resident,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="hidden 128, 4 experts, top-2, vocab 512 (CPU check)")
    ap.add_argument("--layers", type=int, help="decoder layers (default 4; --tiny 2)")
    ap.add_argument("--rows", type=int, help="sequences per step (default 8; --tiny 4)")
    ap.add_argument("--prompt", type=int, help="prompt tokens per sequence (default 1024; --tiny 32)")
    ap.add_argument("--response", type=int, help="response tokens per sequence (default 2048; --tiny 64)")
    ap.add_argument("--max-tokens", type=int, default=16384, help="micro-batch token budget (veRL's default)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per configuration, after one warm-up")
    ap.add_argument("--impls", default="grouped_mm,eager,batched_mm", help="experts implementations; first: baseline")
    ap.add_argument("--ac", default="on,off", help="activation checkpointing settings, in order")
    ap.add_argument("--no-replay", action="store_true", help="skip the R3 row (moe.py's hooks, a random routing)")
    args = ap.parse_args()
    small = dict(layers=2, rows=4, prompt=32, response=64) if args.tiny else {}
    for key, value in {**dict(layers=4, rows=8, prompt=1024, response=2048), **small}.items():
        setattr(args, key, getattr(args, key) or value)
    _, _, device = ft.init_distributed()
    cuda, impls = device.type == "cuda", args.impls.split(",")
    shape = TINY if args.tiny else QWEN3_30B_A3B
    name = torch.cuda.get_device_name() if cuda else f"CPU, {torch.get_num_threads()} threads"
    print(f"{'tiny' if args.tiny else 'Qwen3-30B-A3B'} shape, {args.layers} layers, {name}; fp32 master weights,")
    print(f"{'bf16' if cuda else 'fp32'} compute; {args.rows} x ({args.prompt} + {args.response}) tokens per step,")
    print(f"micro-batches of <= {args.max_tokens} tokens; median of {args.steps} steps after a warm-up\n")
    batch = grpo_batch(args.rows, args.prompt, args.response, shape["vocab_size"])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        path = save_model(tmp, shape, args.layers, device)
        for ac in args.ac.split(","):
            model = ft.load_model(
                path,
                device=device,
                compute_dtype=torch.bfloat16 if cuda else None,
                activation_checkpointing=ac == "on",
            )
            if not results:
                param_table(model, args.layers)
            optimizer, _ = ft.make_optimizer(model, lr=1e-6)
            diffs = agreement(model, impls, shape["vocab_size"])
            for impl in impls:
                r = measure(model, optimizer, batch, impl, args.steps, args.max_tokens, cuda)
                results.append({"ac": ac, "impl": impl, "diff": diffs[impl], **r})
                print(f"AC {ac}, {impl}: " + ("OOM" if r.get("oom") else f"{r['seconds']:.3f} s/step"), flush=True)
            if not args.no_replay:  # R3: moe.py's router hooks replaying a routing the batch carries (random here)
                moe.attach(model, "R3")
                replayed = {**batch, "routed_experts": random_routing(batch, shape, args.layers)}
                r = measure(model, optimizer, replayed, impls[0], args.steps, args.max_tokens, cuda)
                results.append({"ac": ac, "impl": f"{impls[0]} + R3 replay", "diff": float("nan"), **r})
            del model, optimizer
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    base = next((r for r in results if not r.get("oom")), None)
    print("\n| AC | experts | s/step | tokens/s | x base tok/s | MFU | peak GiB | resident GiB | x base peak |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if r.get("oom"):
            print(f"| {r['ac']} | {r['impl']} | OOM | | | | | | |")
            continue
        peak = "- | - | -"
        if cuda:
            peak = f"{r['peak_gb']:.1f} | {r['resident_gb']:.1f} | {r['peak_gb'] / base['peak_gb']:.2f}"
        print(
            f"| {r['ac']} | {r['impl']} | {r['seconds']:.3f} | {r['tokens_s']:,.0f} | "
            f"{r['tokens_s'] / base['tokens_s']:.2f} | {r['mfu']:.1%} | {peak} |"
        )
    print(f"\nmax |log-prob - {impls[0]}'s| on one probe row before training (AC {args.ac.split(',')[0]}): ", end="")
    print(", ".join(f"{r['impl']} {r['diff']:.2e}" for r in results if r["ac"] == args.ac.split(",")[0]))


if __name__ == "__main__":
    main()
