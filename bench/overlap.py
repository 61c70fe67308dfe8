"""What one-step-off-policy training saves: the wall-clock per step at staleness k = 1 against k = 0, in the same
topology (rollout ranks, rollout_ranks.py), with the cores split between the roles.

    .venv/bin/python bench/overlap.py [--steps 8] [--trainers 1] [--prompts 16] [--response 48] [--rounds 1]

Three torchrun runs of the demo's model and data, T trainer ranks and 1 rollout rank, each process with
cores / (T + 1) threads; the same seeds; the rollout correction on in all (k = 1 needs it; at k = 0 it costs the
same): k = 0, k = 1, and k = 1 with the sync proof's pass every step (trainer.sync_check_every = 1: the batch's
log-probs under the kept weights that sampled it, for rollout/logprob_diff_*; the first two run it every
trainer.sync_check_every = 10 steps, as rollout/sync_check elsewhere, so not in --steps 8). The first step
(warm-up, and nothing to overlap yet) is left out of the means. Prints, per run, the mean seconds per step, of the
rollout rank's generation and scoring (gen), of the trainer's wait for its batch, of its own work (the step less
that wait) and of the proof's pass (extra); then each k = 1 run's ratio to k = 0, and what k = 0's phase times
predict for any machine: at k = 0 a step is the generation plus the training, at k = 1 the longer of the two.
On a machine that others load too, --rounds N runs the three N times, interleaved, and keeps each one's fastest
round (best of N: the load only ever slows a run down).
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


def run(k: int, every: int, args, out: str) -> list[dict]:
    """One run at staleness k, the sync proof every `every` steps; its metrics of steps 2..N."""
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
        f"trainer.sync_check_every={every}",
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
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    runs = {"k = 0": (0, 10), "k = 1": (1, 10), "k = 1, proof every step": (1, 1)}
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for name, (k, every) in runs.items():
                steps = run(k, every, args, os.path.join(tmp, f"k{k}_every{every}_{round_}"))
                step, wait = mean(steps, "timing_s/step"), mean(steps, "fully_async/total_wait_time")
                row = {
                    "step": step,
                    "gen": mean(steps, "timing_s/gen") + mean(steps, "timing_s/reward"),
                    "wait": wait,
                    "train": step - wait,
                    "sampler": mean(steps, "timing_s/sampler_log_prob"),
                    "overlap": mean(steps, "fully_async/overlap"),
                }
                if name not in rows or row["step"] < rows[name]["step"]:
                    rows[name] = row
    threads = max(1, (os.cpu_count() or 1) // (args.trainers + 1))
    print(
        f"{args.trainers} trainer rank(s) + 1 rollout rank, {threads} thread(s) each; {args.prompts} prompts x 8 "
        f"samples, <= {args.response} tokens; means of steps 2-{args.steps}, the fastest of {args.rounds} round(s)"
    )
    print(f"{'':<24} {'s/step':>8} {'gen':>8} {'wait':>8} {'train':>8} {'extra':>8} {'overlap':>8}")
    for name, r in rows.items():
        print(
            f"{name:<24} {r['step']:8.3f} {r['gen']:8.3f} {r['wait']:8.3f} {r['train']:8.3f} {r['sampler']:8.3f} "
            f"{r['overlap']:8.2f}"
        )
    base = rows["k = 0"]
    for name in ("k = 1", "k = 1, proof every step"):
        predicted = max(base["gen"], base["train"] + rows[name]["sampler"]) / base["step"]
        print(
            f"{name} / k = 0 wall-clock per step: {rows[name]['step'] / base['step']:.2f} (predicted from k = 0's "
            f"phases, max(gen, train + extra) / step: {predicted:.2f})"
        )
    print("at k = 1 the trainer waits only when generation takes longer than its own step")


if __name__ == "__main__":
    main()
