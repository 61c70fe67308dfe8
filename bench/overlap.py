"""What one-step-off-policy training saves: the wall-clock per step at staleness k = 1 against k = 0, in the same
topology (rollout ranks, rollout_ranks.py), with the cores split between the roles.

    .venv/bin/python bench/overlap.py [--steps 8] [--trainers 1] [--prompts 16] [--response 48]

Two torchrun runs of the demo's model and data, T trainer ranks and 1 rollout rank, each process with
cores / (T + 1) threads; the same seeds; the rollout correction on in both (k = 1 needs it; at k = 0 it costs the
same). The first step (warm-up, and nothing to overlap yet) is left out of the means. Prints, per k, the mean
seconds per step, of the rollout rank's generation and scoring (gen), of the trainer's wait for its batch, of its
own work (the step less that wait) and of the k = 1 extra pass (the batch's log-probs under the weights that
sampled it, for rollout/logprob_diff_*); then the ratio k = 1 / k = 0, and what the phase times predict for any
machine: at k = 0 a step is the generation plus the training, at k = 1 the longer of the two.
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(k: int, args, out: str) -> list[dict]:
    """One run at staleness k; its metrics of steps 2..N."""
    world = args.trainers + 1
    threads = max(1, (os.cpu_count() or 1) // world)
    overrides = [
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        f"data.train_batch_size={args.prompts}",
        f"actor.ppo_mini_batch_size={args.prompts}",
        f"data.max_response_length={args.response}",
        "trainer.val_every=0",
        "trainer.save_every=0",
        "trainer.export_hf=false",
        "trainer.plot=false",
        "rollout.n_gpus_per_node=1",
        f"async_training.staleness_threshold={k}",
        "algorithm.rollout_correction.rollout_is=token",
    ]
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world), "--master_port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "VLLM_CPU_KVCACHE_SPACE": "1"}
    proc = subprocess.run(
        [*cmd, "grpo.py", "--config", "tiny.yaml", *overrides], cwd=ROOT, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(f"the k = {k} run failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [m for m in map(json.loads, f) if m["step"] >= 2]


def mean(steps: list[dict], key: str) -> float:
    return statistics.mean(m.get(key, 0.0) for m in steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--trainers", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--response", type=int, default=48)
    args = ap.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in (0, 1):
            steps = run(k, args, os.path.join(tmp, f"k{k}"))
            step, wait = mean(steps, "timing_s/step"), mean(steps, "fully_async/total_wait_time")
            rows[k] = {
                "step": step,
                "gen": mean(steps, "timing_s/gen") + mean(steps, "timing_s/reward"),
                "wait": wait,
                "train": step - wait,
                "sampler": mean(steps, "timing_s/sampler_log_prob"),
                "overlap": mean(steps, "fully_async/overlap"),
            }
    threads = max(1, (os.cpu_count() or 1) // (args.trainers + 1))
    print(
        f"{args.trainers} trainer rank(s) + 1 rollout rank, {threads} thread(s) each; {args.prompts} prompts x 8 "
        f"samples, <= {args.response} tokens; means of steps 2-{args.steps}"
    )
    print(f"{'k':>2} {'s/step':>8} {'gen':>8} {'wait':>8} {'train':>8} {'extra':>8} {'overlap':>8}")
    for k, r in rows.items():
        print(
            f"{k:>2} {r['step']:8.3f} {r['gen']:8.3f} {r['wait']:8.3f} {r['train']:8.3f} {r['sampler']:8.3f} "
            f"{r['overlap']:8.2f}"
        )
    base = rows[0]
    predicted = max(base["gen"], base["train"] + rows[1]["sampler"]) / base["step"]
    print(f"k = 1 / k = 0 wall-clock per step: {rows[1]['step'] / base['step']:.2f}")
    print(
        f"predicted from k = 0's phases, max(gen, train + extra) / step: {predicted:.2f} (at k = 1 the trainer "
        "waits only when generation takes longer than its own step)"
    )


if __name__ == "__main__":
    main()
