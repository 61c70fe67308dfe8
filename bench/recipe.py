"""The recipe at real shapes, one shape per invocation: gsm8k.yaml's settings (gsm8k_lora.yaml's for 7b) on a
randomly initialised model of the shape (tiny.py's tokenizer, the vocabulary padded to the real one's size) and
tiny.py's GSM8K-format data, run by grpo.main in this process, one table printed:

    python bench/recipe.py --shape 1.5b [--steps 3] [--prompts 64] [--n 8] [--response 256]   # a GPU
    python bench/recipe.py --shape 1.5b --cudagraph-sizes run     # CUDA graphs only at the run's batch sizes
    .venv/bin/python bench/recipe.py --shape tiny --steps 2 --prompts 4 --n 4               # a CPU (the suite)

    shape   0.5b: Qwen2.5-0.5B   1.5b: Qwen2.5-1.5B   7b: Qwen2.5-7B with LoRA (gsm8k_lora.yaml)   tiny: tiny.py's
    columns engine start-up (s, the first step's row); per step: step s and its phases (gen, ref, update_actor,
            update_weights = the push, push_proof = its exact proof, sync_check), tokens/s/GPU (veRL's
            perf/throughput), MFU (perf/mfu/actor), the trainer's peak memory and the vLLM pool (GiB, on a GPU),
            rollout/logprob_diff_max / mean and rollout/sync_check

On a GPU: bf16 compute with fp32 master weights (LoRA: a bf16 base), activation checkpointing, torch.compile and
CUDA graphs, sleep level 1, as the recipe runs. On a CPU the tiny model in fp32 (the CPU engine's dtype).

--cudagraph-sizes (rollout.cudagraph_capture_sizes): "vllm" (the default: vLLM's ~50 sizes up to 512), "run" (the
sizes the run's engine starts with: the probe's one sequence and a rank's n x prompts; a decode step of fewer
sequences runs the next size's graph, padded), or a list "1,8,64,512". Compare the start-up and the gen seconds of
two invocations on the same card.
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

import config  # noqa: E402
import grpo  # noqa: E402
import tiny  # noqa: E402

SHAPES = {  # the released configs' shapes (Qwen2.5 0.5B, 1.5B and 7B: config.json), vocabulary 151,936 (7B: 152,064)
    "0.5b": tiny.QWEN25_05B,
    "1.5b": dict(
        tiny.QWEN25_05B,
        hidden_size=1536,
        intermediate_size=8960,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
    ),  # fmt: skip
    "7b": dict(
        tiny.QWEN25_05B,
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
    ),  # fmt: skip
}
PHASES = ("gen", "ref", "update_actor", "update_weights", "push_proof", "sync_check")  # timing_s/<phase>


def build_model(shape: str, out: str) -> str:
    """A random model of the shape with tiny.py's tokenizer (tiny: tiny.py's own warm-started model)."""
    paths = tiny.build(".cache/tiny")
    if shape == "tiny":
        return paths["model"]
    path = os.path.join(out, f"model-{shape}")
    if not os.path.exists(os.path.join(path, "config.json")):
        tokenizer = AutoTokenizer.from_pretrained(paths["model"])
        big = shape == "7b"  # written in bf16: the LoRA recipe's frozen base
        tiny.save_random_model(path, tokenizer, seed=0, tie_word_embeddings=shape != "7b",
                               dtype=torch.bfloat16 if big else torch.float32, **SHAPES[shape])  # fmt: skip
    return path


def capture_sizes(choice: str, prompts: int, n: int, world: int) -> list[int] | None:
    """rollout.cudagraph_capture_sizes for --cudagraph-sizes: None for "vllm"; for "run" the sync probe's one
    sequence and the most a rank's engine decodes at once, n x its prompts (64 prompts x 8 on one GPU: [1, 512]);
    else the listed sizes ("1,8,64,512")."""
    if choice == "vllm":
        return None
    if choice == "run":
        return sorted({1, n * prompts // world})
    return sorted({int(size) for size in choice.split(",")})


def recipe_args(shape: str, path: str, out: str, args) -> list[str]:
    """grpo.py's command line: the recipe's config at the bench's sizes, tiny.py's data."""
    sizes = []  # the batch: tiny.yaml's at the tiny shape but those given; main() fills them at a real shape
    if args.capture_sizes:
        sizes.append(f"rollout.cudagraph_capture_sizes={args.capture_sizes}")
    if args.prompts:
        sizes += [f"data.train_batch_size={args.prompts}", f"actor.ppo_mini_batch_size={args.prompts}"]
    if args.n:
        sizes.append(f"rollout.n={args.n}")
    if args.response:
        sizes.append(f"data.max_response_length={args.response}")
    if shape == "tiny":
        return ["--config", "tiny.yaml", *sizes, f"trainer.total_steps={args.steps}", "trainer.val_every=0",
                f"trainer.output_dir={out}/run", "trainer.export_hf=false", "trainer.save_every=0",
                "trainer.sync_check_every=1", "trainer.plot=false"]  # fmt: skip
    config = "gsm8k_lora.yaml" if shape == "7b" else "gsm8k.yaml"
    return [
        "--config", config, f"model.path={path}", "data.train=tiny", "data.val=tiny", *sizes,
        "data.max_prompt_length=256", f"trainer.total_steps={args.steps}",
        "trainer.val_every=0", "trainer.save_every=0", "trainer.export_hf=false", "trainer.resume=off",
        "trainer.sync_check_every=1", "trainer.plot=false", f"trainer.output_dir={out}/run",
    ]  # fmt: skip


def run(argv: list[str]) -> float:
    """grpo.main(argv) in this process; returns the engine's start-up seconds (the model parts' start_engine timed)."""
    choose, seconds = grpo.choose_model_parts, []

    def timed(cfg, model_path):
        model = choose(cfg, model_path)
        start = model.start_engine

        def timed_start(*a, **kw):
            begin = time.perf_counter()
            start(*a, **kw)
            seconds.append(time.perf_counter() - begin)

        model.start_engine = timed_start
        return model

    grpo.choose_model_parts = timed
    try:
        status = grpo.main(argv)
    finally:
        grpo.choose_model_parts = choose
    if status != 0:
        sys.exit(f"the run failed ({status})")
    return seconds[0]


def table(startup: float, metrics_file: str) -> str:
    """One row per step: start-up, step and phase seconds, throughput, MFU, memory, the sync figures."""
    rows = [json.loads(line) for line in open(metrics_file)]
    rows = [r for r in rows if "training/global_step" in r]
    head = ["step", "startup s", "step s", *(f"{p} s" for p in PHASES), "tokens/s/GPU", "MFU", "peak GiB",
            "vLLM pool GiB", "logprob_diff max", "mean", "rollout/sync_check"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k, r in enumerate(rows):
        cells = [str(r["training/global_step"]), f"{startup:.1f}" if k == 0 else "", f"{r['perf/time_per_step']:.2f}"]
        cells += [f"{r.get(f'timing_s/{p}', 0.0):.3f}" for p in PHASES]
        cells += [f"{r['perf/throughput']:,.0f}", f"{r['perf/mfu/actor']:.3f}"]
        cells += [f"{r.get('perf/max_memory_allocated_gb', 0.0):.1f}", f"{r.get('perf/vllm_pool_gb', 0.0):.1f}"]
        cells += [f"{r['rollout/logprob_diff_max']:.3g}", f"{r['rollout/logprob_diff_mean']:.3g}"]
        cells += [f"{r.get('rollout/sync_check', float('nan')):.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=["tiny", *SHAPES], default="tiny")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (data.train_batch_size; default 64)")
    ap.add_argument("--n", type=int, default=None, help="rollout.n (default 8)")
    ap.add_argument("--response", type=int, default=None, help="data.max_response_length (default 256)")
    ap.add_argument("--out", default=None, help="where the model and the run go (default: a temporary folder)")
    ap.add_argument("--cudagraph-sizes", default="vllm", help='vllm (default), run, or a list such as "1,8,64,512"')
    args = ap.parse_args()
    if args.shape != "tiny":  # the issue's figures' sizes; the tiny shape keeps tiny.yaml's but those given
        args.prompts, args.n, args.response = args.prompts or 64, args.n or 8, args.response or 256
    tiny_batch = config.load_config("tiny.yaml", [])  # the tiny shape's sizes where none are given
    prompts, n = args.prompts or tiny_batch["data"]["train_batch_size"], args.n or tiny_batch["rollout"]["n"]
    args.capture_sizes = capture_sizes(args.cudagraph_sizes, prompts, n, int(os.environ.get("WORLD_SIZE", "1")))
    out = args.out or tempfile.mkdtemp(prefix="recipe-")
    startup = run(recipe_args(args.shape, build_model(args.shape, out), out, args))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    graphs = f"CUDA graphs at {args.capture_sizes}" if args.capture_sizes else "vLLM's CUDA-graph sizes"
    print(f"\nthe recipe at the {args.shape} shape on {device} ({args.steps} steps, {graphs}):")
    print(table(startup, os.path.join(out, "run", "metrics.jsonl")))


if __name__ == "__main__":
    main()
