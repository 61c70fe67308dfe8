"""flatgrpo vs TRL's GRPOTrainer on the same CPU workload, alternating A B C A B C ...

    make bench                                 # installs trl==1.16.0 (extra `bench`), runs this and phases.py
    .venv/bin/python bench/compare_trl.py     # both workloads; --rounds R --steps K --only small|large
    .venv/bin/python bench/compare_trl.py --model warm   # the demo's warm-started model (stops after ~17 tokens)

Same tiny Qwen2 and GSM8K-style data (tiny.py), same group size n=8, prompts per step, max response
length, learning rate, loss (TRL loss_type="dapo" is the global token-mean; beta = our KL coefficient,
k3 = low_var_kl, reference model in both), clip 0.2/0.28, temperature 1.0, one optimizer step per
generation. By default the model is tiny.py's RANDOM initialisation (`base`), whose responses run to
the length limit, so the workloads are what their names say: 1 prompt x 8 x 32 generated tokens and
16 prompts x 8 x 128. Three contenders, each using the whole machine (2 cores):
  flatgrpo 1x2   grpo.train in this process: one rank with 2 threads, vLLM in-process, FSDP2 code path;
  flatgrpo 2x1   torchrun --nproc_per_node 2, one thread per rank (how `make demo` runs);
  TRL            GRPOTrainer, HF generate (no vLLM), one process with 2 threads.
flatgrpo's run-time sync probe (check_sync) is off; its per-step sync metric (logprob_diff) stays on.
After one warm-up round each, R rounds of K optimizer steps alternate; every measured step counts.
Prints seconds per optimizer step (median, min, max), generated tokens per second, and the ratios.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))  # before vLLM freezes the thread count
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import torch  # noqa: E402

import config  # noqa: E402
import data  # noqa: E402
import grpo  # noqa: E402
import reward  # noqa: E402
import tiny  # noqa: E402

WORKLOADS = {"small": (1, 32), "large": (16, 128)}  # prompts per step, max response tokens
CONTENDERS = {"flatgrpo 1x2": 1, "flatgrpo 2x1": 2, "TRL": None}  # name -> flatgrpo ranks
LR, KL = 1e-4, 0.001


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def flatgrpo_round(
    model_path: str, prompts: int, max_tokens: int, steps: int, seed: int, ranks: int
) -> list[tuple[float, float]]:
    """(seconds, generated tokens) per optimizer step of grpo.py on the tiny set-up: in this process
    (ranks=1), or under torchrun with one thread per rank."""
    with tempfile.TemporaryDirectory() as out:
        overrides = [
            f"model.path={model_path}",
            f"data.train_batch_size={prompts}",
            f"actor.ppo_mini_batch_size={prompts}",
            f"data.max_response_length={max_tokens}",
            f"trainer.total_steps={steps}",
            f"actor.lr={LR}",
            f"actor.kl_loss_coef={KL}",
            "actor.entropy_coeff=0",
            "trainer.val_every=0",
            "trainer.save_every=0",
            "trainer.export_hf=false",
            "trainer.plot=false",
            "trainer.sync_check_every=0",
            "trainer.logger=[]",
            f"trainer.seed={seed}",
            f"trainer.output_dir={out}",
        ]
        if ranks == 1:
            cfg = config.load_config(os.path.join(ROOT, "tiny.yaml"), overrides)
            grpo.train(cfg, grpo.choose_parts(cfg))
        else:
            env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nproc_per_node",
                    str(ranks),
                    "--master_port",
                    "29731",
                    "grpo.py",
                    "--config",
                    "tiny.yaml",
                    *overrides,
                ],
                cwd=ROOT,
                env=env,
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                sys.exit(f"torchrun grpo.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    return [(r["perf/time_per_step"], r["response_length/mean"] * prompts * 8) for r in rows]


def trl_round(model_path: str, rows: list[dict], prompts: int, max_tokens: int, steps: int, seed: int):
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def gsm8k_reward(prompts, completions, ground_truth, **kwargs):
        return [reward.compute_score(c[0]["content"], t) for c, t in zip(completions, ground_truth, strict=True)]

    class StepClock(TrainerCallback):
        def __init__(self):
            self.times, self.lengths = [], []

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t0)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                self.lengths.append(logs["completions/mean_length"])

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out,
            per_device_train_batch_size=prompts * 8,
            num_generations=8,
            max_completion_length=max_tokens,
            learning_rate=LR,
            lr_scheduler_type="constant",
            warmup_steps=0,
            weight_decay=0.01,
            max_grad_norm=1.0,
            loss_type="dapo",
            beta=KL,
            epsilon=0.2,
            epsilon_high=0.28,
            temperature=1.0,
            top_p=1.0,
            num_iterations=1,
            max_steps=steps,
            logging_steps=1,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
            shuffle_dataset=False,
            seed=seed,
            log_completions=False,
        )
        clock = StepClock()
        dataset = Dataset.from_list([{"prompt": r["prompt"], "ground_truth": r["ground_truth"]} for r in rows])
        trainer = GRPOTrainer(
            model=model_path,
            reward_funcs=[gsm8k_reward],
            args=args,
            train_dataset=dataset,
            processing_class=AutoTokenizer.from_pretrained(model_path),
            callbacks=[clock],
        )
        trainer.train()
    return [(t, n * prompts * 8) for t, n in zip(clock.times, clock.lengths, strict=True)]


def report(name: str, results: dict[str, list[tuple[float, float]]], samples: int) -> None:
    print(f"\n{name}")
    med = {}
    for who, steps in results.items():
        secs = [s for s, _ in steps]
        med[who] = statistics.median(secs)
        tok_s = sum(n for _, n in steps) / sum(secs)
        mean_len = sum(n for _, n in steps) / len(steps) / samples
        print(
            f"  {who:<14} {len(secs):3d} steps  s/step median {med[who]:6.3f}  min {min(secs):6.3f}  "
            f"max {max(secs):6.3f}   generated tokens/s {tok_s:6.0f}   mean response {mean_len:5.1f} tokens"
        )
    for who in results:
        if who != "TRL":
            print(f"  {who} / TRL seconds per step: {med[who] / med['TRL']:.2f}x")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--only", choices=list(WORKLOADS))
    ap.add_argument(
        "--model",
        choices=["base", "warm"],
        default="base",
        help="base: tiny.py's random initialisation, whose responses run to the length limit "
        "(the workloads as named); warm: the demo's warm-started model (stops after ~17 tokens)",
    )
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    paths = tiny.build(os.path.join(ROOT, ".cache", "tiny"), seed=0)
    with open(paths["train"]) as f:
        rows = data._rows_from_records([json.loads(line) for line in f], paths["train"])
    model = paths["model" if args.model == "warm" else "base"]
    print(
        f"machine: {os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"model {model}"
    )
    for name in [args.only] if args.only else list(WORKLOADS):
        prompts, max_tokens = WORKLOADS[name]
        # each rank owns whole prompts: 1 prompt per step cannot be split over 2 ranks
        contenders = {who: r for who, r in CONTENDERS.items() if r is None or prompts % r == 0}
        results = {who: [] for who in contenders}
        for round_ in range(args.rounds + 1):  # round 0: warm-up, not counted
            for who, ranks in contenders.items():
                if ranks is None:
                    got = trl_round(model, rows, prompts, max_tokens, args.steps, round_)
                else:
                    got = flatgrpo_round(model, prompts, max_tokens, args.steps, round_, ranks)
                if round_:
                    results[who] += got
        report(f"{name}: {prompts} prompt(s) x 8 samples x <= {max_tokens} tokens per step", results, prompts * 8)


if __name__ == "__main__":
    main()
