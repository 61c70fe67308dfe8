"""Does the seed recipe (gsm8k.yaml) fit on 80 GB GPUs? Per-GPU memory of Qwen2.5-0.5B, 1.5B and 7B on 1, 6
and 8 GPUs, computed from the model shapes and the figures bench/memory.py measured (bench/results/memory.json).

    .venv/bin/python bench/fit_table.py                    # the markdown table in docs/memory.md
    .venv/bin/python bench/fit_table.py --tokens 8192 --gpu-memory-utilization 0.3
    .venv/bin/python bench/fit_table.py --lora             # gsm8k_lora.yaml on ONE 24, 48 or 80 GB GPU
    .venv/bin/python bench/fit_table.py --moe              # Qwen3-30B-A3B (Mixture-of-Experts) on 80 and 141 GB GPUs

What is counted, per GPU, with FSDP2 sharding every parameter over all N GPUs (bytes; P parameters):
  model states     fp32 policy parameters 4P/N + fp32 gradients 4P/N + AdamW's two moments 8P/N
                   + the reference model in bf16 2P/N (no fp32 copy) + the root's unsharded bf16 embed_tokens
                   and lm_head during a forward/backward (2Vh, twice if untied); gradients are freed after the
                   optimizer step, so they do not count during generation.
  activations      at actor.ppo_max_token_len_per_gpu tokens in one micro-batch, scaled from the 0.5B-shape
                   fp32 measurements: (a) the inputs activation checkpointing keeps per layer, the measured
                   marginal MB/token of the chunked train step, scaled by h * L and by 2/4 for bf16; plus the
                   larger of (b) one decoder layer's recompute + backward, measured per token, scaled by the
                   MLP width I and 2/4, and (c) the chunked head's transient, an upper bound: six fp32
                   [logprob_chunk_size, V] tensors (logits, logits / T, log-softmax, softmax and their
                   gradients) plus one fp32 [V, h] weight gradient. The plain path's (c) is its measured
                   marginal per token, scaled by V, times the whole budget (the [tokens, V] logits).
  vLLM             during generation: gpu_memory_utilization x GPU memory (weights, KV cache, activations);
                   during the update it sleeps (level 1: weights to CPU, KV cache dropped): ~1 GB left.
  overhead         CUDA contexts and allocator slack of the two frameworks: 3 GB.
LoRA (--lora, gsm8k_lora.yaml, one GPU): the frozen base in bf16 2P (no gradients, no optimizer state); the adapters,
A = r (7h + 2Hd + 2Kd + 3I) parameters per layer on all-linear, 16 bytes each (fp32 weight, gradient, AdamW's
two moments; 12 during generation, the gradients freed); no reference model (the policy with its adapters off);
the same unsharded root; activations as above but from the measured LoRA train step's marginal (memory.json
"train/lora") when present, else the full step's (an upper bound: LoRA skips the base's weight gradients, not
the activations). vLLM must also hold its own bf16 weights (2P) plus at least 1 GB of KV cache within its share.
MoE (--moe, Qwen3-30B-A3B: 128 experts, top-8): as above with the TOTAL parameters P for every state (all experts
are trained and held: 30.5B) and the ACTIVE MLP width for the activations (top_k x moe_intermediate_size = 6,144,
what grouped_mm computes per token); the routing a replay carries, 2 x L x k bytes per token (int16), is on the
CPU. vLLM runs one engine per rank (tensor_parallel_size 1), so its share must hold the whole model in bf16 (2P)
plus at least 1 GB of KV cache: the knob is rollout.gpu_memory_utilization, and the trainer's states must fit
in what is left. LoRA would mislead here: lora.py adapts nn.Linear modules, and the experts (97% of the
parameters) are 3-D parameters it does not adapt, so it is not tabled.
A phase fits when its sum is below the GPU's memory. These are estimates from measured pieces, not a run
on GPUs (none could be used here); they say which knob to turn, not the last gigabyte.
"""

import argparse
import json
import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
GB, MB = 1024**3, 1024**2
MODELS = {  # Qwen2.5's config.json values
    "Qwen2.5-0.5B": dict(h=896, inter=4864, layers=24, heads=14, kv=2, vocab=151936, tied=True),
    "Qwen2.5-1.5B": dict(h=1536, inter=8960, layers=28, heads=12, kv=2, vocab=151936, tied=True),
    "Qwen2.5-7B": dict(h=3584, inter=18944, layers=28, heads=28, kv=4, vocab=152064, tied=False),
}
LORA_MODELS = {  # the LoRA table's rows: one GPU
    "Qwen2.5-0.5B": MODELS["Qwen2.5-0.5B"],
    "Qwen2.5-1.5B": MODELS["Qwen2.5-1.5B"],
    "Qwen2.5-3B": dict(h=2048, inter=11008, layers=36, heads=16, kv=2, vocab=151936, tied=True),
    "Qwen2.5-7B": MODELS["Qwen2.5-7B"],
}
MOE_MODELS = {  # Qwen3-30B-A3B's config.json values; head_dim is not h / heads there
    "Qwen3-30B-A3B": dict(h=2048, moe_inter=768, experts=128, top_k=8, layers=48, heads=32, kv=4, d=128, vocab=151936),
}
OVERHEAD_GB, VLLM_ASLEEP_GB = 3.0, 1.0
HEAD_COPIES = 6  # fp32 [chunk, V] tensors one chunk's backward holds at most: logits, / T, log-softmax, softmax, grads


def parameters(m: dict) -> int:
    """Qwen2 parameter count: attention (q, k, v with biases, o), MLP, two norms per layer, embeddings, head."""
    d = m["h"] // m["heads"]
    attn = m["h"] * (m["heads"] * d) * 2 + m["h"] * (m["kv"] * d) * 2 + (m["heads"] + 2 * m["kv"]) * d
    layer = attn + 3 * m["h"] * m["inter"] + 2 * m["h"]
    return m["layers"] * layer + m["h"] + m["vocab"] * m["h"] * (1 if m["tied"] else 2)


def moe_parameters(m: dict, experts: int) -> int:
    """Qwen3-MoE parameter count with `experts` experts per layer (all of them: the total; top_k: the active):
    attention (q, k, v, o; no biases), q_norm and k_norm, the router, the experts' gate, up and down, two norms
    per layer, the final norm, untied embeddings and head. Qwen3-30B-A3B: 30.53B total, 3.35B active."""
    attn = m["h"] * m["heads"] * m["d"] * 2 + m["h"] * m["kv"] * m["d"] * 2 + 2 * m["d"]
    layer = attn + m["h"] * m["experts"] + 3 * m["h"] * m["moe_inter"] * experts + 2 * m["h"]
    return m["layers"] * layer + m["h"] + 2 * m["vocab"] * m["h"]


def moe_rows(cfg: dict, measured: dict, gpus_gb: list[float]) -> list[dict]:
    """The MoE rows: see the docstring's MoE paragraph."""
    tokens, chunk = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["actor"]["logprob_chunk_size"]
    util = cfg["rollout"]["gpu_memory_utilization"]
    rows = []
    for name, m in MOE_MODELS.items():
        P, active = moe_parameters(m, m["experts"]), moe_parameters(m, m["top_k"])
        dense_shape = dict(h=m["h"], inter=m["top_k"] * m["moe_inter"], layers=m["layers"], vocab=m["vocab"])
        act = activations_gb(dense_shape, measured, tokens, chunk, chunked=chunk > 0)
        root, engine = 2 * m["vocab"] * m["h"] * 2 / GB, 2 * P / GB  # untied; vLLM's bf16 copy of the whole model
        for gpu_gb in gpus_gb:
            for n in (8, 16, 32):
                states, ref = 16 * P / n / GB, 2 * P / n / GB
                update = states + ref + root + act + VLLM_ASLEEP_GB + OVERHEAD_GB
                need = (engine + 1.0) / gpu_gb  # the smallest gpu_memory_utilization that holds the engine
                share = max(util, need) * gpu_gb
                generation = 12 * P / n / GB + ref + share + OVERHEAD_GB
                fits = max(update, generation) <= gpu_gb
                rows.append(
                    dict(model=name, total_b=P / 1e9, active_b=active / 1e9, gpu_gb=gpu_gb, gpus=n, states=states,
                         ref=ref, act=act, update=update, need=need, generation=generation, fits=fits)
                )  # fmt: skip
    return rows


def moe_table(rows: list[dict], cfg: dict) -> str:
    tokens, util = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["rollout"]["gpu_memory_utilization"]
    out = [
        f"| model | GPU GB | GPUs | model states (fp32 params + grads + AdamW) | reference (bf16) | activations at "
        f"{tokens} tokens | update peak | vLLM's share (its bf16 weights + 1 GB): gpu_memory_utilization | "
        f"generation at that share | fits |",
        "|" + "---|" * 10,
    ]
    for r in rows:
        share = f"{max(util, r['need']):.2f}" + (f" (> {util:g})" if r["need"] > util else "")
        if r["fits"]:
            verdict = f"fits with rollout.gpu_memory_utilization={max(util, r['need']):.2f}"
        elif r["need"] >= 1:
            verdict = "no: vLLM's bf16 copy alone exceeds the GPU (tensor-parallel rollouts are not supported)"
        else:
            verdict = "no: more GPUs (the trainer's states and vLLM's copy do not both fit)"
        out.append(
            f"| {r['model']} ({r['total_b']:.1f}B, {r['active_b']:.2f}B active) | {r['gpu_gb']:g} | {r['gpus']} | "
            f"{r['states']:.1f} | {r['ref']:.1f} | {r['act']:.1f} | {r['update']:.1f} | {share} | "
            f"{r['generation']:.1f} | {verdict} |"
        )
    return "\n".join(out)


def steady_marginal(points: list[dict]) -> float:
    """MB per token between the two largest points (the first interval can include one-off jumps)."""
    return points[-1]["marginal_mb_per_token"]


def activations_gb(m: dict, measured: dict, tokens: int, chunk: int, chunked: bool) -> float:
    """(a) saved layer inputs + max((b) one layer's recompute, (c) the head), GB; see the docstring."""
    s, p = measured["shape"], measured["points"]
    saved = (
        steady_marginal(p["train/chunked"]) * (m["h"] * m["layers"]) / (s["hidden_size"] * s["num_hidden_layers"]) / 2
    )
    layer = steady_marginal(p["layer/one decoder layer"]) * m["inter"] / s["intermediate_size"] / 2
    if chunked:
        head = (HEAD_COPIES * min(chunk, tokens) * m["vocab"] * 4 + 4 * m["vocab"] * m["h"]) / MB
    else:  # the plain path: its marginal per token is the [tokens, V] logits and their copies
        head = steady_marginal(p["train/plain"]) * m["vocab"] / s["vocab_size"] * tokens
    return (saved * tokens + max(layer * tokens, head)) / 1024


def fit_rows(cfg: dict, measured: dict, gpu_gb: float) -> list[dict]:
    tokens, chunk = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["actor"]["logprob_chunk_size"]
    util = cfg["rollout"]["gpu_memory_utilization"]
    rows = []
    for name, m in MODELS.items():
        P = parameters(m)
        for n in (1, 6, 8):
            root = 2 * m["vocab"] * m["h"] * (1 if m["tied"] else 2) / GB
            params, grads, adam, ref = 4 * P / n / GB, 4 * P / n / GB, 8 * P / n / GB, 2 * P / n / GB
            act = activations_gb(m, measured, tokens, chunk, chunked=chunk > 0)
            act_plain = activations_gb(m, measured, tokens, chunk, chunked=False)
            update = params + grads + adam + ref + root + act + VLLM_ASLEEP_GB + OVERHEAD_GB
            update_plain = update - act + act_plain
            generation = params + adam + ref + util * gpu_gb + OVERHEAD_GB
            rows.append(
                dict(
                    model=name,
                    params_b=P / 1e9,
                    gpus=n,
                    states=params + grads + adam,
                    ref=ref,
                    root=root,
                    act=act,
                    act_plain=act_plain,
                    update=update,
                    update_plain=update_plain,
                    vllm=util * gpu_gb,
                    generation=generation,
                    fits=max(update, generation) <= gpu_gb,
                )
            )
    return rows


def lora_parameters(m: dict, rank: int) -> int:
    """Adapter parameters on every linear layer of the decoder: r * (in + out) per layer, summed."""
    d = m["h"] // m["heads"]
    per_layer = 7 * m["h"] + 2 * m["heads"] * d + 2 * m["kv"] * d + 3 * m["inter"]
    return m["layers"] * rank * per_layer


def lora_rows(cfg: dict, measured: dict, gpus_gb: list[float]) -> list[dict]:
    """gsm8k_lora.yaml on one GPU of each size: see the docstring's LoRA paragraph."""
    tokens, chunk = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["actor"]["logprob_chunk_size"]
    util, rank = cfg["rollout"]["gpu_memory_utilization"], cfg["model"]["lora_rank"]
    source = measured
    if "train/lora" in measured["points"]:  # activations from the LoRA step's own marginal
        source = {**measured, "points": {**measured["points"], "train/chunked": measured["points"]["train/lora"]}}
    rows = []
    for name, m in LORA_MODELS.items():
        P, A = parameters(m), lora_parameters(m, rank)
        base, root = 2 * P / GB, 2 * m["vocab"] * m["h"] * (1 if m["tied"] else 2) / GB
        act = activations_gb(m, source, tokens, chunk, chunked=chunk > 0)
        for gpu_gb in gpus_gb:
            update = base + 16 * A / GB + root + act + VLLM_ASLEEP_GB + OVERHEAD_GB
            generation = base + 12 * A / GB + util * gpu_gb + OVERHEAD_GB
            vllm_short = util * gpu_gb < base + 1.0  # its bf16 weights and a minimal KV cache
            fits = max(update, generation) <= gpu_gb and not vllm_short
            rows.append(
                dict(
                    model=name,
                    params_b=P / 1e9,
                    gpu_gb=gpu_gb,
                    base=base,
                    adapters_m=A / 1e6,
                    adapter_states=16 * A / GB,
                    act=act,
                    update=update,
                    generation=generation,
                    vllm=util * gpu_gb,
                    vllm_short=vllm_short,
                    fits=fits,
                )
            )
    return rows


def lora_verdict(r: dict) -> str:
    if r["fits"]:
        return "fits"
    if r["base"] + r["adapter_states"] + OVERHEAD_GB > r["gpu_gb"]:
        return "no: the base alone exceeds the GPU"
    if r["base"] * 2 + OVERHEAD_GB > r["gpu_gb"]:
        return "no: the trainer's and vLLM's bf16 copies of the base do not both fit"
    if r["vllm_short"]:
        needed = (r["base"] + 1.0) / r["gpu_gb"]
        return f"no: vLLM's share cannot hold its weights: rollout.gpu_memory_utilization >= {needed:.2f}"
    if r["generation"] > r["gpu_gb"]:
        return "no: lower rollout.gpu_memory_utilization"
    return "no: lower actor.ppo_max_token_len_per_gpu"


def lora_table(rows: list[dict], cfg: dict) -> str:
    tokens, util = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["rollout"]["gpu_memory_utilization"]
    out = [
        f"| model | GPU GB | base (bf16, frozen) | adapters r={cfg['model']['lora_rank']} (fp32 + grads + AdamW) | "
        f"activations at {tokens} tokens | update peak | generation (vLLM {util:g} x GPU) | one GPU |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        out.append(
            f"| {r['model']} ({r['params_b']:.2f}B) | {r['gpu_gb']:g} | {r['base']:.1f} | {r['adapters_m']:.1f} M: "
            f"{r['adapter_states']:.2f} | {r['act']:.1f} | {r['update']:.1f} | {r['generation']:.1f} | "
            f"{lora_verdict(r)} |"
        )
    return "\n".join(out)


def knob(r: dict, gpu_gb: float) -> str:
    if r["fits"]:
        return "fits"
    if r["states"] + r["ref"] + OVERHEAD_GB > gpu_gb:
        return "no: model states alone exceed the GPU; more GPUs"
    if r["generation"] > gpu_gb:
        return "no: lower rollout.gpu_memory_utilization"
    return "no: lower actor.ppo_max_token_len_per_gpu"


def table(rows: list[dict], gpu_gb: float, tokens: int, util: float) -> str:
    out = [
        f"| model | GPUs | model states (fp32 params + grads + AdamW) | reference (bf16) | activations at "
        f"{tokens} tokens: chunked / plain | update peak: chunked / plain | generation (vLLM {util:g} x "
        f"{gpu_gb:g} GB = {util * gpu_gb:g} GB) | fits in {gpu_gb:g} GB |",
        "|" + "---|" * 8,
    ]
    for r in rows:
        plain_fits = "" if r["update_plain"] <= gpu_gb else " (plain: no)"
        out.append(
            f"| {r['model']} ({r['params_b']:.2f}B) | {r['gpus']} | {r['states']:.1f} | {r['ref']:.1f} | "
            f"{r['act']:.1f} / {r['act_plain']:.1f} | {r['update']:.1f} / {r['update_plain']:.1f} | "
            f"{r['generation']:.1f} | {knob(r, gpu_gb)}{plain_fits if r['fits'] else ''} |"
        )
    return "\n".join(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(HERE, "..", "gsm8k.yaml"))
    ap.add_argument("--measured", default=os.path.join(HERE, "results", "memory.json"))
    ap.add_argument("--gpu-gb", type=float, default=80.0)
    ap.add_argument("--tokens", type=int, help="override actor.ppo_max_token_len_per_gpu")
    ap.add_argument("--gpu-memory-utilization", type=float, help="override rollout.gpu_memory_utilization")
    ap.add_argument("--lora", action="store_true", help="gsm8k_lora.yaml on one 24, 48 or 80 GB GPU")
    ap.add_argument("--moe", action="store_true", help="Qwen3-30B-A3B under gsm8k.yaml on 80 and 141 GB GPUs")
    args = ap.parse_args()
    if args.lora and args.config.endswith("gsm8k.yaml"):
        args.config = os.path.join(HERE, "..", "gsm8k_lora.yaml")
    with open(args.config) as f:
        cfg = yaml.safe_load(f)
    if args.tokens:
        cfg["actor"]["ppo_max_token_len_per_gpu"] = args.tokens
    if args.gpu_memory_utilization:
        cfg["rollout"]["gpu_memory_utilization"] = args.gpu_memory_utilization
    with open(args.measured) as f:
        measured = json.load(f)
    if args.lora:
        print(lora_table(lora_rows(cfg, measured, [24.0, 48.0, 80.0]), cfg))
    elif args.moe:
        print(moe_table(moe_rows(cfg, measured, [80.0, 141.0]), cfg))
    else:
        rows = fit_rows(cfg, measured, args.gpu_gb)
        tokens, util = cfg["actor"]["ppo_max_token_len_per_gpu"], cfg["rollout"]["gpu_memory_utilization"]
        print(table(rows, args.gpu_gb, tokens, util))
    print(
        f"\nGB per GPU; measured figures from {os.path.relpath(args.measured)} ({measured['device']}, "
        f"`{measured['command'].strip()}`); the sums and scalings are in bench/fit_table.py's docstring."
    )


if __name__ == "__main__":
    main()
