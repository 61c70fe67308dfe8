"""Clusters and faults: several nodes simulated on this machine (torchrun --nnodes 2 --node_rank 0/1 on
127.0.0.1), a node without the shared file system (a private mount namespace), stop signals, and a worker
killed under torchrun --max-restarts. The end-to-end runs are compared with an uninterrupted 2-rank run."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from test_grpo import SMALL, comparable, read_metrics, run_grpo

import fsdp_train
from conftest import ROOT, free_port, run_nodes


def reports(results_dir) -> list[dict]:
    return [json.load(open(os.path.join(results_dir, f))) for f in sorted(os.listdir(results_dir))]


@pytest.mark.parametrize("fail_node", [None, 1])
def test_node_first_fetches_once_per_node_without_a_shared_disk(tmp_path, fail_node):
    """2 nodes x 2 ranks, each node with its own disk: the node's first rank fetches, its other rank waits and
    reads the node's copy; a failure on one node stops every rank of both nodes with that node's line."""
    results = tmp_path / "results"
    results.mkdir()
    disks = [tmp_path / "node0", tmp_path / "node1"]
    for d in disks:
        d.mkdir()
    extra = [] if fail_node is None else ["--fail-node", str(fail_node)]
    procs = run_nodes(
        [os.path.join(ROOT, "tests", "cluster_worker.py")],
        2,
        [{"args": [str(d), *extra], "env": {"TEST_RESULTS": str(results)}} for d in disks],
        timeout=300,
    )
    assert all(p.returncode == 0 for p in procs), [p.stderr[-2000:] for p in procs]
    got = reports(results)
    assert sorted((r["node"], r["local_rank"]) for r in got) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for node, disk in enumerate(disks):
        first = [r["rank"] for r in got if r["node"] == node and r["local_rank"] == 0]
        assert (disk / "downloads").read_text().split() == [str(first[0])]  # once per node, by its first rank
    for r in got:
        if fail_node is None:
            first = next(x["rank"] for x in got if x["node"] == r["node"] and x["local_rank"] == 0)
            assert r["model"] == f"weights fetched by rank {first}"
        else:
            assert r["error"] == f"hub unreachable from node {fail_node}"


# ------------------------------------------------------------------------------ end to end
# 4 prompts x 4 samples per step in 2 mini-batches, DAPO's dynamic sampling on with generation batches of 2 prompts
# (several per step), checkpoints every 2 steps; a straight 2-rank run is what every interrupted run must equal.
CLUSTER = [
    "rollout.n=4",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "data.max_response_length=24",
    "trainer.total_steps=4",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "trainer.sync_check_every=0",
    "algorithm.filter_groups.enable=true",
    "data.gen_batch_size=2",
    "trainer.export_hf=false",
]


@pytest.fixture(scope="module")
def straight(tiny_build, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    run_grpo(out / "run", 2, *CLUSTER, f"trainer.dump_batches={out / 'dump'}")
    return out, read_metrics(out / "run")


def same_run(a: list[dict], b: list[dict]):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]


def test_dynamic_sampling_keeps_groups_with_signal_in_generation_order(straight, tiny_build):
    """Every step trains on exactly 4 groups whose 4 rewards differ (numpy's std > 0), which took several
    generation batches of 2 prompts; the groups are the first such ones in generation order: with the data
    in file order, their prompts come from consecutive generation batches, earlier steps first."""
    import numpy as np
    import torch
    from transformers import AutoTokenizer

    import reward
    import rollout

    out, rows = straight
    tokenizer = AutoTokenizer.from_pretrained(tiny_build["model"])
    with open(tiny_build["train"]) as f:
        prompts = {
            tuple(rollout.render_prompt(tokenizer, reward.make_prompt(json.loads(line)["question"]))): i
            for i, line in enumerate(f)
            if i < 200
        }
    used, order = 0, []
    for step in (1, 2, 3, 4):
        d = torch.load(out / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        groups = d["rewards"].reshape(4, 4).double().numpy()
        assert all(np.std(g) > 0 for g in groups)
        order += [
            prompts[tuple(d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist())]
            for k in range(0, 16, 4)
        ]
        assert rows[step - 1]["train/num_gen_batches"] >= 2
        used += rows[step - 1]["train/num_gen_batches"]
    assert order == sorted(order) and len(set(order)) == 16 and order[-1] < 2 * used  # generation order, no repeats
    assert used > 8  # some groups were dropped: more than the 8 generation batches 16 prompts need


def test_sigterm_checkpoints_the_step_and_a_resumed_run_continues(straight, tmp_path):
    """SIGTERM to torchrun (a scheduler's preemption notice), during step 2: the workers finish the step they are in,
    checkpoint it (no periodic checkpoints in this run), exit 143; trainer.resume=auto continues with the next step,
    and the run ends with the metrics of the uninterrupted run."""
    out = tmp_path / "run"
    proc = run_grpo(
        out, 2, *CLUSTER, "trainer.save_every=0", background=True
    )  # no periodic checkpoint: only the stop's
    wait_for_step(out, 1, proc)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=300) != 0
    stopped = max(r["step"] for r in read_metrics(out))
    assert [os.path.basename(p) for p in fsdp_train.list_checkpoints(str(out / "checkpoints"))] == [f"step_{stopped}"]
    resumed = run_grpo(out, 2, *CLUSTER, "trainer.save_every=0", "trainer.resume=auto")
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped}'}" in resumed.stdout
    same_run(read_metrics(out), straight[1])


def test_two_nodes_train_checkpoint_and_resume_like_one(straight, tmp_path):
    """torchrun --nnodes 2 (one rank each, 127.0.0.1): steps 1-2 and a checkpoint, then a resumed run for 3-4;
    the metrics equal the 2-rank run's."""
    out = tmp_path / "run"
    for steps in (2, 4):
        args = [
            "grpo.py",
            "--config",
            "tiny.yaml",
            *SMALL,
            *CLUSTER,
            f"trainer.output_dir={out}",
            f"trainer.total_steps={steps}",
            "trainer.resume=auto",
        ]
        procs = run_nodes(args, 1, [{}, {}], timeout=900)
        assert all(p.returncode == 0 for p in procs), [p.stderr[-3000:] for p in procs]
    same_run(read_metrics(out), straight[1])


def test_a_node_that_does_not_share_the_output_dir_stops_the_run_with_one_line(tiny_build, tmp_path):
    """Node 1 runs in a private mount namespace with an empty file system mounted on trainer.output_dir (a node
    without the shared file system): both nodes stop, before any model loads, with the one line naming it."""
    out = tmp_path / "out"
    out.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {out}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here (unshare -m needs root): {probe.stderr.strip()}")
    wrap = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs {out} && exec "$@"', "sh"]
    args = ["grpo.py", "--config", "tiny.yaml", *SMALL, f"trainer.output_dir={out}"]
    start = time.monotonic()
    procs = run_nodes(args, 1, [{}, {"wrap": wrap}], timeout=300)
    assert time.monotonic() - start < 60
    for p in procs:  # each node's rank: one line, no traceback of ours (torchrun then reports the failed worker)
        lines = [line for line in p.stderr.splitlines() if line.startswith("error: ")]
        assert p.returncode != 0 and len(lines) == 1 and "[rank" not in p.stderr, p.stderr[-3000:]
        assert (
            lines[0].startswith(
                f"error: config: trainer.output_dir = '{out}' is not one directory shared by all nodes: "
            )
            and "(rank 1) cannot see what rank 0 writes there" in lines[0]
        )
    assert not (out / "metrics.jsonl").exists()


def wait_for_step(out, step: int, proc, timeout: float = 600):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(out / "metrics.jsonl") and any(r["step"] >= step for r in read_metrics(out)):
            return
        assert proc.poll() is None, "the run ended before the step"
        time.sleep(0.2)
    raise AssertionError(f"step {step} not logged in {timeout} s")


def test_a_killed_worker_restarts_and_the_run_ends_like_an_uninterrupted_one(straight, tmp_path):
    """torchrun --max-restarts 1, trainer.resume=auto: one worker SIGKILLed after step 3 (checkpoint at 2); torchrun
    restarts both, they resume from step 2 and the run finishes with the uninterrupted run's steps and metrics."""
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--max-restarts",
        "1",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "grpo.py",
        "--config",
        "tiny.yaml",
        *SMALL,
        *CLUSTER,
        f"trainer.output_dir={out}",
        "trainer.resume=auto",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    wait_for_step(out, 3, proc)
    workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(workers) == 2, workers
    os.kill(int(workers[1]), signal.SIGKILL)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_2'}" in output
    same_run(read_metrics(out), straight[1])
