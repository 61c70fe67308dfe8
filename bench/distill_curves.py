"""On-policy distillation against GRPO from the same student, same steps and seed, in one picture (docs/features.md,
"On-policy distillation"):

    make demo ARGS="trainer.output_dir=runs/tiny_grpo"
    make demo ARGS="--config recipes/tiny_distill.yaml"             # runs/tiny_distill
    .venv/bin/python bench/distill_curves.py runs/tiny_grpo runs/tiny_distill docs/distill-curves.png 0.920

Three panels over the steps: greedy validation accuracy of both runs with the teacher's (the last argument: its
val-core/openai/gsm8k/reward/mean@1, from `grpo.py --config tiny.yaml trainer.val_only=true model.path=tiny_teacher`),
the training score of both, and the distillation run's actor/distillation/loss (log scale) and overlap_ratio. Prints
the validation table the docs quote.
"""

import json
import os
import sys

VAL = "val-core/openai/gsm8k/reward/mean@1"


def read(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in rows if key in r]
    return [s for s, _ in points], [v for _, v in points]


def main(grpo_run: str, distill_run: str, png: str, teacher: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grpo, distill = read(grpo_run), read(distill_run)
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, (key, title) in zip(axes[:2], [(VAL, "validation accuracy (greedy)"), ("critic/score/mean",
                                           "training score (sampled)")], strict=True):  # fmt: skip
        ax.plot(*series(grpo, key), label="GRPO (the reward)", marker="o", markersize=3)
        ax.plot(*series(distill, key), label="distillation (the teacher, no reward)", marker="o", markersize=3)
        ax.set_title(title, fontsize=9)
    axes[0].axhline(float(teacher), color="gray", linestyle="--", linewidth=1, label=f"the teacher ({teacher})")
    for ax in axes[:2]:
        ax.legend(fontsize=8)
    axes[2].plot(*series(distill, "actor/distillation/loss"), label="distillation/loss (left, log)")
    axes[2].set_yscale("log")
    overlap = axes[2].twinx()
    overlap.plot(*series(distill, "actor/distillation/overlap_ratio"), color="C1", label="overlap_ratio (right)")
    overlap.set_ylim(0, 1.05)
    axes[2].set_title("distillation run: forward KL over the teacher's top-32", fontsize=9)
    lines = axes[2].get_lines() + overlap.get_lines()
    axes[2].legend(lines, [line.get_label() for line in lines], fontsize=8, loc="center right")
    for ax in axes:
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    for name, rows in (("GRPO", grpo), ("distillation", distill)):
        steps, values = series(rows, VAL)
        print(f"{name:<13}", " | ".join(f"{s}: {v:.3f}" for s, v in zip(steps, values, strict=True)))
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:5])
