"""Where flatgrpo's numbers and messages go: the step timer, metrics.jsonl (and wandb), the curves PNG, the
console (a progress bar in a terminal, one line per step in a log file) and the libraries' log file.
Plumbing for grpo.py, not the algorithm.

    with timed(t, "gen"): ...                      # t["gen"] += seconds (veRL's timing_s/gen)
    logger = MetricsLogger(cfg, rank, resume_step=0); logger.log(step, metrics); logger.close()
"""

import contextlib
import json
import logging
import os
import sys
import time

import torch
import yaml

VAL_CORE = "val-core/"  # veRL's prefix of the headline validation metrics (val-core/<data_source>/reward/mean@N)


@contextlib.contextmanager
def timed(timings: dict, key: str):
    """with timed(timings, "gen"): ...  adds the elapsed seconds to timings["gen"] (GPU work included)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    yield
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    timings[key] = timings.get(key, 0.0) + time.perf_counter() - start


def log0(rank: int, message: str):
    if rank == 0:
        print(message, flush=True)


class MetricsLogger:
    """Rank 0 writes one JSON object per step to <output_dir>/<file> (metrics.jsonl; a resumed run first drops
    the lines after its checkpoint), to wandb when trainer.logger has "wandb", and a PNG at the end."""

    def __init__(self, cfg: dict, rank: int, resume_step: int, file: str = "metrics.jsonl"):
        self.cfg, self.rank = cfg, rank
        out = cfg["trainer"]["output_dir"]
        self.path = os.path.join(out, file)
        self.wandb = None
        if rank != 0:
            return
        os.makedirs(out, exist_ok=True)
        kept = []
        if resume_step and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["step"] <= resume_step]
        with open(self.path, "w") as f:
            f.writelines(kept)
        if not cfg["trainer"]["val_only"]:
            with open(os.path.join(out, "config.yaml"), "w") as f:
                yaml.safe_dump(cfg, f, sort_keys=False)
        if "wandb" in cfg["trainer"]["logger"]:
            import wandb  # optional dependency: pip install wandb

            self.wandb = wandb.init(
                project=cfg["trainer"]["project"], name=cfg["trainer"]["experiment"], config=cfg, resume="allow"
            )

    def log(self, step: int, metrics: dict):
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if "console" in self.cfg["trainer"]["logger"]:
            for key in (k for k in metrics if k.startswith(VAL_CORE)):
                write_line(f"step {step}: {key} = {metrics[key]:.3f}")  # above the progress bar, not in it

    def close(self):
        if self.rank != 0:
            return
        with open(self.path) as f:
            rows = [json.loads(line) for line in f]
        key = next((k for r in rows for k in r if k.startswith(VAL_CORE)), None)
        vals = [(r["step"], r[key]) for r in rows if key in r]
        if len(vals) > 1:
            print(
                f"{key}: {vals[0][1]:.3f} at step {vals[0][0]} -> {vals[-1][1]:.3f} at step {vals[-1][0]} "
                f"(best {max(v for _, v in vals):.3f})",
                flush=True,
            )
        if self.cfg["trainer"]["plot"] and not self.cfg["trainer"]["val_only"]:
            png = plot_curves(rows, key, os.path.join(self.cfg["trainer"]["output_dir"], "curves.png"))
            print(f"metrics: {self.path}\ncurves:  {png}", flush=True)
        if self.wandb is not None:
            self.wandb.finish()


CURVES = ["critic/score/mean", None, "response_length/mean", "actor/entropy", "actor/kl_loss", "actor/grad_norm"]


def plot_curves(rows: list[dict], val_key: str | None, png_path: str) -> str:
    """Six panels over the steps: score, the headline validation metric, length, entropy, KL loss, grad norm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, key in zip(axes.flat, [k or val_key for k in CURVES], strict=True):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if points:
            ax.plot(*zip(*points, strict=True), marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def write_generations(folder: str, step: int, parts: list[tuple[list[dict], list[dict]]]) -> str:
    """veRL's trainer.validation_data_dir dump: <folder>/<step>.jsonl, one validation sample per line (input,
    output, gts, the reward and the scorer's extras, data_source, uid = the prompt's index). parts: each rank's
    (scores, generations), in rank order."""
    samples = [g | s for scores, generations in parts for g, s in zip(generations, scores, strict=True)]
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{step}.jsonl")
    with open(path, "w") as f:
        f.writelines(json.dumps({**r, "step": step}, default=str) + "\n" for r in samples)
    return path


def write_line(message: str):
    """A console line that does not break the progress bar (tqdm.write in a terminal, print otherwise)."""
    from tqdm import tqdm

    tqdm.write(message) if sys.stderr.isatty() else print(message, flush=True)


class Progress:
    """On rank 0: a line per step; in a terminal also a tqdm bar under it. In a log file (SLURM output,
    nohup, CI: stderr is not a terminal) no bar, whose every redraw would be a new line there."""

    def __init__(self, rank: int, start: int, total: int):
        from tqdm import tqdm

        self.bar = (
            tqdm(total=total, initial=start - 1, desc="grpo", dynamic_ncols=True)
            if rank == 0 and sys.stderr.isatty()
            else None
        )
        self.rank = rank

    def update(self, m: dict):
        if self.rank != 0:
            return
        kl = f"  kl {m['actor/kl_loss']:.2e}" if "actor/kl_loss" in m else ""
        proof = m.get("rollout/logprob_diff_max")  # none on a stale batch between sync checks (rollout ranks)
        write_line(
            f"step {m['training/global_step']:>4}  score {m['critic/score/mean']:.3f}  "
            f"len {m['response_length/mean']:.0f}  entropy {m['actor/entropy']:.3f}{kl}  "
            f"grad_norm {m['actor/grad_norm']:.3f}  logprob_diff_max {'-' if proof is None else f'{proof:.1e}'}  "
            f"{m['perf/time_per_step']:.2f} s/step"
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"score {m['critic/score/mean']:.3f} len {m['response_length/mean']:.0f} "
                f"{m['perf/time_per_step']:.2f}s/step"
            )

    def close(self):
        if self.bar is not None:
            self.bar.close()


# ------------------------------------------------------------------------------- the libraries' logs
LIBRARY_LOGGERS = ("vllm", "torch", "transformers", "accelerate", "huggingface_hub", "datasets", "py.warnings")


def route_library_logs(out_dir: str, rank: int, verbose: bool) -> str:
    """The console shows flatgrpo's own lines (print); the libraries' INFO/WARNING chatter (vLLM's engine,
    torch, transformers, the hub, Python warnings) goes to <out_dir>/engine.log, and with trainer.verbose
    also to the console, minus the expected lines below. Returns the log's path."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "engine.log")
    os.environ["VLLM_CONFIGURE_LOGGING"] = "0"  # else vLLM installs its own console handler when the engine starts
    logging.captureWarnings(True)  # warnings.warn(...) -> the "py.warnings" logger
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"))
    handlers = [to_file]
    if verbose:
        handlers.append(logging.StreamHandler())
        handlers[-1].addFilter(lambda record: not expected_reload_warning(record))
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = list(handlers), False
        logger.setLevel(logging.INFO if name == "vllm" else logging.WARNING)
    if not verbose:
        import huggingface_hub
        import transformers

        transformers.utils.logging.disable_progress_bar()  # "Loading weights", "Writing model shards"
        huggingface_hub.utils.disable_progress_bars()
    return path


def expected_reload_warning(record: logging.LogRecord) -> bool:
    """vLLM's in-place weight reload (sync.push_weights) warns on every push, and both are expected:
    "RotaryEmbedding: Failed to load weights": the rotary cos/sin cache is a buffer vLLM computes from the
    config, not a checkpoint tensor, so nothing is sent for it; "ParallelLMHead: Failed to load weights":
    with tied embeddings the head IS embed_tokens, so no lm_head tensor is sent (vLLM skips it too)."""
    return "Failed to load weights" in record.getMessage() and record.getMessage().split(":")[0] in (
        "RotaryEmbedding",
        "ParallelLMHead",
    )
