"""Running grpo.py as the tests do: run_grpo (tiny.yaml with SMALL, a small run, at 1 rank or under torchrun),
its metrics (read_metrics, comparable: without the timings), the one line a stopped run ends with (one_error_line,
error_line_of_call), and shared constants. Imported by the test modules (tests/helpers is on their sys.path)."""

import json
import os
import subprocess
import sys

from conftest import ROOT, free_port, threads

VAL_KEY = "val-core/openai/gsm8k/reward/mean@1"  # veRL's name of greedy validation accuracy on GSM8K


def error_line_of_call(result: dict) -> str:
    """The one line a cli_calls call that stopped with an error printed: status 1, nothing else on stderr."""
    assert result["exit"] == 1 and len(result["stderr"].splitlines()) == 1, result
    return result["stderr"].rstrip("\n")


def one_error_line(proc) -> str:
    """The single line a bad run ends with; no traceback from our ranks."""
    assert proc.returncode != 0 and "Traceback" not in proc.stderr.replace("torch.distributed.elastic", "")
    return proc.stderr.strip().splitlines()[-1]


# ------------------------------------------------------------------------------ end to end
SMALL = [
    "trainer.sync_check_every=1",
    "data.train_batch_size=8",
    "actor.ppo_mini_batch_size=4",
    "data.max_response_length=32",
    "data.val_max_samples=32",
    "trainer.val_every=2",
    "trainer.total_steps=3",
    "actor.lr=1e-4",
]
TIMING = ("timing_s/", "timing_per_token_ms/", "perf/time_per_step", "perf/throughput", "perf/mfu")


def run_grpo(
    out,
    nproc: int,
    *overrides: str,
    background: bool = False,
    check: bool = True,
    env: dict | None = None,
    script: str = "grpo.py",
):
    env = {**os.environ, "OMP_NUM_THREADS": threads(nproc), **(env or {})}
    launcher = (
        [sys.executable, script]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "--master_port",
            str(free_port()),
            script,
        ]
    )
    cmd = launcher + ["--config", "tiny.yaml", *SMALL, f"trainer.output_dir={out}", *overrides]
    if background:
        return subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


def read_metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def comparable(m: dict) -> dict:
    return {k: v for k, v in m.items() if not k.startswith(TIMING)}


# ------------------------------------------------------------------ evaluation and a user's reward (issue 20)
def read_jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


# the data files the tests write: GSM8K's layout (GSM) and veRL's preprocessed one (VERL)
GSM = [
    {"question": "Tom has 3 apples and gets 4 more. How many?", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
    {"question": "Ann has 1,200 coins.", "answer": "#### 1,200"},
]


VERL = [
    {
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": "Q? Let's think"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": "72"},
        "extra_info": {"split": "train", "index": 0},
    },
    {
        "data_source": "my/task",
        "prompt": [{"role": "user", "content": "Spell 3"}],
        "ability": "other",
        "reward_model": {"style": "rule", "ground_truth": "three"},
        "extra_info": {"split": "train", "index": 1},
    },
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)
