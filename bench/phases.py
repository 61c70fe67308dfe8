"""Where a step's time and memory go, from grpo.py's own timing_s/* metrics, in one process.

    .venv/bin/python bench/phases.py breakdown [--steps 20]   # the demo config (tiny.yaml), per phase
    .venv/bin/python bench/phases.py scaling                  # step time vs prompts/step and response length
    .venv/bin/python bench/phases.py correction [--steps 20]  # rollout correction's cost; what bypass_mode saves

breakdown: mean seconds and share of the step of every phase over N steps (the first step, with
its warm-up, is excluded); "everything else" = step - the timed phases, i.e. the loop's own overhead.
Target: everything outside generation + update + push <= 5% of the step.
correction: the demo with a bf16 engine, the old-log-prob pass forced on (actor.recompute_old_log_prob), with
and without algorithm.rollout_correction (rollout_is=sequence, rollout_rs=token_k3): the correction's own time
(timing_s/rollout_corr: gathering the batch, weights, mask, metrics) as a share of the step (target <= 1%); and
bypass_mode (old := vLLM's log-probs): the old-log-prob pass it saves, in seconds and share of the step.
scaling: the warm-started model stops after ~17 tokens whatever the limit, so this table uses the
tiny RANDOM model (tiny.py's `base`), whose responses run to the limit: step time and peak resident
memory of each phase for prompts per step in (1, 4, 16, 64) x max response tokens in (32, 128, 512).
Memory: the process's peak RSS sampled every 2 ms while a phase runs ("-": the phase did not run, e.g. the
old log-probs on-policy). RSS only grows (the allocator keeps freed pages), so a figure is the high-water
mark reached by the end of that phase; vLLM's KV cache (1 GiB) is allocated before the first step.
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import psutil  # noqa: E402  (a vLLM dependency)

import config  # noqa: E402
import grpo  # noqa: E402
import tiny  # noqa: E402

PHASES = [
    "gen",
    "reward",
    "old_log_prob",
    "ref",
    "rollout_corr",
    "adv",
    "update_actor",
    "update_weights",
    "sync_check",
    "logging",
    "testing",
    "save_checkpoint",
]


class PhaseMemory:
    """Peak RSS per phase: wraps grpo.timed so that a sampler thread knows the current phase."""

    def __init__(self):
        self.peak, self.phase, self.stop = {}, None, False
        proc, outer, timed = psutil.Process(), self, grpo.timed

        @contextlib.contextmanager
        def phase_timed(timings, key):
            if key != "step":
                outer.phase = key
            with timed(timings, key):
                yield
            if key != "step":
                outer.phase = None

        grpo.timed = phase_timed

        def sample():
            while not outer.stop:
                if outer.phase:
                    outer.peak[outer.phase] = max(outer.peak.get(outer.phase, 0), proc.memory_info().rss)
                time.sleep(0.002)

        threading.Thread(target=sample, daemon=True).start()


def run(overrides: list[str]) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        cfg = config.load_config(
            os.path.join(os.path.dirname(os.path.abspath(grpo.__file__)), "tiny.yaml"),
            overrides
            + [f"trainer.output_dir={out}", "trainer.logger=[]", "trainer.plot=false", "trainer.export_hf=false"],
        )
        grpo.train(cfg, grpo.choose_parts(cfg))
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
    return rows


def breakdown(steps: int) -> None:
    rows = run([f"trainer.total_steps={steps + 1}", "trainer.val_every=0"])[1:]  # drop the warm-up step
    step = statistics.mean(r["timing_s/step"] for r in rows)
    print(f"tiny.yaml, world size 1, {len(rows)} steps (after one warm-up), mean step {step:.3f} s")
    print(f"{'phase':<26}{'mean s':>9}{'share':>8}")
    timed = 0.0
    for p in PHASES:
        values = [r.get(f"timing_s/{p}", 0.0) for r in rows]
        if p == "old_log_prob" and not any(values):
            print(f"{p:<26}{'0':>9}  (on-policy: the update's own forward supplies them)")
        elif any(values):
            mean = statistics.mean(values)
            timed += mean
            print(f"{p:<26}{mean:>9.4f}{mean / step:>8.1%}")
    print(f"{'everything else':<26}{step - timed:>9.4f}{(step - timed) / step:>8.1%}")
    core = sum(
        statistics.mean(r.get(f"timing_s/{p}", 0.0) for r in rows) for p in ("gen", "update_actor", "update_weights")
    )
    old_and_ref = statistics.mean(r.get("timing_s/old_log_prob", 0) + r.get("timing_s/ref", 0) for r in rows)
    print(
        f"outside generation + update + push: {1 - core / step:.1%} of the step "
        f"(of which old/ref log-probs {old_and_ref / step:.1%})"
    )


def scaling() -> None:
    base = tiny.build(os.path.join(".cache", "tiny"), seed=0)["base"]
    mem = PhaseMemory()
    print("tiny random model (responses run to the limit), world size 1; s/step = median of 3 steps after a warm-up")
    print(
        f"{'prompts':>8}{'max tok':>8}{'s/step':>9}{'gen s':>8}{'upd s':>8}{'push s':>8}   peak RSS GiB: "
        "gen / old_log_prob / ref / update_actor / update_weights"
    )
    for length in (32, 128, 512):
        for prompts in (1, 4, 16, 64):
            mem.peak = {}
            rows = run(
                [
                    f"model.path={base}",
                    f"data.train_batch_size={prompts}",
                    f"actor.ppo_mini_batch_size={prompts}",
                    f"data.max_response_length={length}",
                    "trainer.total_steps=4",
                    "trainer.val_every=0",
                    "trainer.sync_check_every=0",
                    "actor.ppo_max_token_len_per_gpu=16384",
                ]
            )[1:]
            med = {
                k: statistics.median(r.get(f"timing_s/{k}", 0.0) for r in rows)
                for k in ("step", "gen", "update_actor", "update_weights")
            }
            peaks = " / ".join(
                f"{mem.peak[p] / 2**30:.2f}" if p in mem.peak else "-"
                for p in ("gen", "old_log_prob", "ref", "update_actor", "update_weights")
            )
            print(
                f"{prompts:>8}{length:>8}{med['step']:>9.3f}{med['gen']:>8.3f}{med['update_actor']:>8.3f}"
                f"{med['update_weights']:>8.3f}   {peaks}",
                flush=True,
            )
    mem.stop = True


def correction(steps: int) -> None:
    common = [f"trainer.total_steps={steps + 1}", "trainer.val_every=0", "rollout.dtype=bfloat16"]
    rc = "algorithm.rollout_correction."
    runs = {
        "old pass, no correction": common + ["actor.recompute_old_log_prob=true"],
        "old pass + IS + rejection": common
        + [f"{rc}rollout_is=sequence", f"{rc}rollout_rs=token_k3", f"{rc}rollout_rs_threshold=0.05"],
        "bypass_mode (no old pass)": common + [f"{rc}bypass_mode=true"],
    }
    means = {}
    for name, overrides in runs.items():
        rows = run(overrides)[1:]  # drop the warm-up step
        means[name] = {
            k: statistics.mean(r.get(f"timing_s/{k}", 0.0) for r in rows)
            for k in ("step", "old_log_prob", "rollout_corr")
        }
        m = means[name]
        print(
            f"{name:<28} step {m['step']:.3f} s   old_log_prob {m['old_log_prob']:.3f} s   "
            f"rollout_corr {m['rollout_corr'] * 1000:.1f} ms ({m['rollout_corr'] / m['step']:.2%} of the step)"
        )
    corrected, full = means["old pass + IS + rejection"], means["old pass, no correction"]
    print(f"correction overhead: {corrected['rollout_corr'] / corrected['step']:.2%} of the step (target <= 1%)")
    print(
        f"bypass_mode saves the old-log-prob pass: {full['old_log_prob']:.3f} s, "
        f"{full['old_log_prob'] / full['step']:.1%} of the step with it"
    )


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["breakdown", "scaling", "correction"])
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    {"breakdown": lambda: breakdown(args.steps), "scaling": scaling, "correction": lambda: correction(args.steps)}[
        args.what
    ]()
