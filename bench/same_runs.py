"""No change of behaviour, shown: the same seeded runs in two trees (before and after a restructuring) compared key
by key: every metric but the timings, every dumped batch, every validation generation and every console step line
(its seconds cut off).

    .venv/bin/python bench/same_runs.py record runs/after                          # this tree
    .venv/bin/python bench/same_runs.py record runs/before --tree /tmp/before      # another checkout of the repo
    .venv/bin/python bench/same_runs.py compare runs/before runs/after             # exit 1 on any difference

The runs (RUNS; 2 steps each, tiny.yaml's model, dumps and validation on): the default at 2 ranks, and at 1 rank
LoRA, multi-turn with the calculator, a tiny Qwen3-MoE with R2, DAPO (dynamic sampling and overlong shaping), the
rollout correction (a bf16 engine, IS weights and rejection), the GRPO family (GSPO with RLOO and the KL in the
reward), bypass mode, and the default's dumps replayed at 1 rank. A dump entry that only one side has (a new field)
is listed, not counted as a difference.
"""

import argparse
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    "trainer.total_steps=2",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "trainer.val_every=2",
    "data.val_max_samples=16",
    "trainer.export_hf=false",
    "trainer.plot=false",
    "trainer.save_every=0",
]
RUNS = {  # name: (ranks, overrides)
    "default": (2, []),
    "lora": (1, ["model.lora_rank=8", "actor.lr=1e-3"]),
    "multi_turn": (
        1,
        [
            "model.path=tiny_tools",
            "rollout.multi_turn.enable=true",
            "data.max_response_length=96",
            "rollout.multi_turn.max_assistant_turns=3",
        ],
    ),
    "moe_r2": (
        1,
        [
            "model.path={moe}",
            "actor.router_replay.mode=R2",
            "model.activation_checkpointing=true",
            "actor.entropy_coeff=0.01",
            "actor.lr=1e-3",
        ],
    ),
    "dapo": (
        1,
        [
            "algorithm.filter_groups.enable=true",
            "data.gen_batch_size=12",
            "reward.overlong_buffer.enable=true",
            "reward.overlong_buffer.len=16",
            "reward.overlong_buffer.penalty_factor=1.0",
        ],
    ),
    "correction": (
        1,
        [
            "rollout.dtype=bfloat16",
            "algorithm.rollout_correction.rollout_is=token",
            "algorithm.rollout_correction.rollout_rs=token_k1",
            "algorithm.rollout_correction.rollout_rs_threshold=0.5_2",
        ],
    ),
    "family": (
        1,
        [
            "actor.policy_loss.loss_mode=gspo",
            "algorithm.adv_estimator=rloo",
            "algorithm.use_kl_in_reward=true",
            "actor.use_kl_loss=false",
        ],
    ),
    "bypass": (1, ["rollout.dtype=bfloat16", "algorithm.rollout_correction.bypass_mode=true"]),
    "replay": (1, ["trainer.replay_batches={out}/default/dump"]),
}
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu")


def record(out: str, tree: str, only: list[str] | None = None) -> None:
    """Every RUNS entry in `tree` (or those named in only), its outputs under out/<name>: metrics.jsonl, dump/,
    generations/, console.txt."""
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    moe = os.path.join(out, "moe-model")
    if not os.path.exists(moe):
        subprocess.run([sys.executable, "-c", MOE_MODEL, moe], cwd=tree, check=True)
    for name, (ranks, overrides) in RUNS.items():
        if only and name not in only:
            continue
        run_dir = os.path.join(out, name)
        args = [o.format(moe=moe, out=out) for o in overrides]
        args += SMALL + [f"trainer.output_dir={run_dir}", f"trainer.validation_data_dir={run_dir}/generations"]
        if name != "replay":
            args.append(f"trainer.dump_batches={run_dir}/dump")
        launcher = (
            [sys.executable]
            if ranks == 1
            else [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks)]
        )
        env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
        print(f"{name}: {' '.join(args[: len(overrides)])}", flush=True)
        proc = subprocess.run(
            [*launcher, "grpo.py", "--config", "tiny.yaml", *args], cwd=tree, env=env, capture_output=True, text=True
        )
        if proc.returncode != 0:
            sys.exit(f"{name} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
        with open(os.path.join(run_dir, "console.txt"), "w") as f:
            f.write(proc.stdout)


MOE_MODEL = """import sys, transformers, tiny
data = tiny.make_dataset(seed=0, n_train=400, n_test=10)
corpus = [r["question"] + " " + tiny.INSTRUCTION for r in data["train"]]
corpus += [tiny.chat_response(r["answer"], h) for r in data["train"] for h in (True, False)]
tiny.save_random_family_model(sys.argv[1], tiny.build_tokenizer(corpus), transformers.Qwen3MoeConfig, seed=1,
                              num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
"""


def compare(before: str, after: str) -> int:
    """The number of differences between two recordings, each printed; added or removed dump entries listed."""
    import torch

    differences = 0
    for name in RUNS:
        a, b = os.path.join(before, name), os.path.join(after, name)
        if not (os.path.isdir(a) and os.path.isdir(b)):  # recorded with --only on one side
            print(f"{name}: not recorded in {before if not os.path.isdir(a) else after}: not compared")
            continue
        checked, notes = 0, []
        for x, y in zip(metrics(a), metrics(b), strict=True):
            for key in sorted(set(x) | set(y)):
                checked += 1
                if x.get(key) != y.get(key):
                    differences += 1
                    print(f"{name}: step {x.get('step')}: {key}: {x.get(key)!r} before, {y.get(key)!r} after")
        for step_file in sorted(os.listdir(os.path.join(a, "dump"))) if os.path.isdir(os.path.join(a, "dump")) else []:
            x, y = torch.load(os.path.join(a, "dump", step_file)), torch.load(os.path.join(b, "dump", step_file))
            notes += [f"dump entry {k!r} only {'before' if k in x else 'after'}" for k in set(x) ^ set(y)]
            for key in sorted(set(x) & set(y)):
                checked += 1
                if not same(x[key], y[key]):
                    differences += 1
                    print(f"{name}: {step_file}: {key} differs")
        for folder, pattern in (("generations", ".jsonl"), ("", "console.txt")):
            found = os.listdir(os.path.join(a, folder)) if os.path.isdir(os.path.join(a, folder)) else []
            for file in sorted(f for f in found if f.endswith(pattern)):
                x, y = lines(os.path.join(a, folder, file), before), lines(os.path.join(b, folder, file), after)
                checked += 1
                if x != y:
                    differences += 1
                    print(f"{name}: {os.path.join(folder, file)} differs")
        print(f"{name}: {checked} compared{'; ' + '; '.join(sorted(set(notes))) if notes else ''}")
    print(f"{differences} difference(s)")
    return differences


def metrics(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


def lines(path: str, root: str) -> list[str]:
    """A file's lines, the recording's own directory (root) written <root>; a console step line without its seconds
    per step."""
    with open(path) as f:
        return [re.sub(r"\s+[\d.]+ s/step$", "", line.rstrip("\n").replace(root, "<root>")) for line in f]


def same(x, y) -> bool:
    import torch

    if torch.is_tensor(x) or torch.is_tensor(y):
        return torch.is_tensor(x) and torch.is_tensor(y) and x.shape == y.shape and torch.equal(x, y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(same(a, b) for a, b in zip(x, y, strict=True))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(same(x[k], y[k]) for k in x)
    return x == y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="run RUNS, outputs under OUT")
    rec.add_argument("out")
    rec.add_argument("--tree", default=ROOT, help="the checkout to run (default: this one)")
    rec.add_argument("--only", nargs="+", choices=list(RUNS), help="these runs only (a replay needs default's dump)")
    cmp = sub.add_parser("compare", help="compare two recordings key by key")
    cmp.add_argument("before")
    cmp.add_argument("after")
    args = ap.parse_args()
    if args.command == "record":
        record(args.out, os.path.abspath(args.tree), args.only)
    else:
        sys.exit(1 if compare(args.before, args.after) else 0)


if __name__ == "__main__":
    main()
