"""The CPU demo with and without the calculator, side by side (docs/features.md, "Multi-turn with tools").

    make demo ARGS="trainer.output_dir=runs/tiny_plain"
    make demo ARGS="--config recipes/tiny_calculator.yaml"          # runs/tiny_calculator
    .venv/bin/python bench/multi_turn_curves.py runs/tiny_plain runs/tiny_calculator docs/multi-turn-curves.png

Four panels over the steps: greedy validation accuracy and the training score of both runs, and the tool run's
tool metrics (the share of samples that call the calculator, the error rate) and turns per sample. Prints the
validation table the docs quote.
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


def main(plain_run: str, tool_run: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plain, tools = read(plain_run), read(tool_run)
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [
        (VAL, "validation accuracy (greedy)"),
        ("critic/score/mean", "training score (sampled)"),
    ]
    for ax, (key, title) in zip(axes[:2], panels, strict=True):
        ax.plot(*series(plain, key), label="no tool", marker="o", markersize=3)
        ax.plot(*series(tools, key), label="calculator", marker="o", markersize=3)
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    for key in ("tool_calls/sample_share", "tool_calls/error_rate"):
        axes[2].plot(*series(tools, key), label=key)
    axes[2].set_title("calculator run: tool calls", fontsize=9)
    axes[2].legend(fontsize=8)
    axes[3].plot(*series(tools, "num_turns/mean"))
    axes[3].set_title("calculator run: num_turns/mean", fontsize=9)
    for ax in axes:
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    for name, rows in (("no tool", plain), ("calculator", tools)):
        steps, values = series(rows, VAL)
        print(name, " | ".join(f"{s}: {v:.3f}" for s, v in zip(steps, values, strict=True)))
    print(f"wrote {png}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
