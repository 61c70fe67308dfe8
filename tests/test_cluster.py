"""Clusters and faults: several nodes simulated on this machine (torchrun --nnodes 2 --node_rank 0/1 on
127.0.0.1), a node without the shared file system (a private mount namespace), stop signals, and a worker
killed under torchrun --max-restarts. The end-to-end runs are compared with an uninterrupted 2-rank run."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import fsdp_train
from conftest import HELPERS, ROOT, free_port, run_nodes, run_torchrun
from grpo_runs import SMALL, comparable, read_metrics, run_grpo


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
        [os.path.join(HELPERS, "cluster_worker.py")],
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
# 4 prompts x 4 samples per step in 2 mini-batches, DAPO's dynamic sampling on with generation batches of 3 prompts
# (more than the 2 ranks, an uneven split: 2 and 1; 2 or 3 batches per step), rewards from
# tests/helpers/parity_reward.py (which prompts have no signal is set by their index), checkpoints every 2 steps; a
# straight 2-rank run is what every interrupted run must equal.
GEN_BATCH, N = 3, 4
CLUSTER = [
    f"rollout.n={N}",
    "data.train_batch_size=4",
    "actor.ppo_mini_batch_size=2",
    "data.max_response_length=24",
    "trainer.total_steps=4",
    "trainer.save_every=2",
    "trainer.val_every=0",
    "trainer.sync_check_every=0",
    "algorithm.filter_groups.enable=true",
    f"data.gen_batch_size={GEN_BATCH}",
    "custom_reward_function.path=tests/helpers/parity_reward.py",
    "trainer.export_hf=false",
]


@pytest.fixture(scope="module")
def straight(tiny_build, tmp_path_factory):
    """(out dir, metrics) of the straight run; it dumps its batches and logs every reward it hands out."""
    out = tmp_path_factory.mktemp("straight")
    (out / "rewards").mkdir()
    run_grpo(out / "run", 2, *CLUSTER, f"trainer.dump_batches={out / 'dump'}", env={"REWARD_LOG": str(out / "rewards")})
    return out, read_metrics(out / "run")


def handed_out(folder) -> dict[int, list[float]]:
    """{prompt index: its rewards} from tests/helpers/parity_reward.py's logs (every rank's)."""
    scores = {}
    for name in os.listdir(folder):
        with open(os.path.join(folder, name)) as f:
            for line in f:
                call = json.loads(line)
                scores.setdefault(call["index"], []).append(call["score"])
    return scores


def dapo_steps(scores: dict[int, list[float]], steps: int, batch: int) -> list[tuple[list[int], int]]:
    """DAPO's classic loop worked out from the rewards handed out: per step, (the prompts it trains on, the
    generation batches it took). Generation batches of GEN_BATCH consecutive prompts (file order), from where the
    previous step stopped, until `batch` prompts whose rewards differ (numpy's std > 0) are kept: the first `batch`
    of them, in prompt order (a batch's surplus is dropped)."""
    import numpy as np

    cursor, out = 0, []
    for _ in range(steps):
        kept, taken = [], 0
        while len(kept) < batch:
            kept += [p for p in range(cursor, cursor + GEN_BATCH) if np.std(scores[p]) > 0]
            cursor, taken = cursor + GEN_BATCH, taken + 1
        out.append((kept[:batch], taken))
    assert sorted(scores) == list(range(cursor)), "the run generated other prompts than these batches"
    return out


def same_run(a: list[dict], b: list[dict]):
    assert [r["step"] for r in a] == [r["step"] for r in b]
    assert [comparable(r) for r in a] == [comparable(r) for r in b]


def test_dynamic_sampling_keeps_the_first_groups_with_signal_in_generation_order(straight, tiny_build):
    """Each step trains on exactly the groups worked out from the rewards the run handed out (dapo_steps): the first
    4 with a signal in generation order, over generation batches of 3 prompts split 2 + 1 over the 2 ranks, in that
    order (the dump is in prompt-position order), each with its 4 rewards; train/num_gen_batches counts the batches."""
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
    scores = handed_out(out / "rewards")
    assert all(len(s) == N for s in scores.values())
    expected = dapo_steps(scores, 4, 4)
    assert len(scores) > 4 * 4 and {taken for _, taken in expected} == {2, 3}  # groups were dropped
    for step, (kept, taken) in enumerate(expected, 1):
        d = torch.load(out / "dump" / f"step_{step}.pt")
        width = d["response_mask"].shape[1]
        trained = [
            prompts[tuple(d["input_ids"][k, :-width][d["attention_mask"][k, :-width].bool()].tolist())]
            for k in range(0, 4 * N, N)
        ]
        assert trained == kept, step
        for g, prompt in enumerate(kept):
            assert sorted(d["rewards"][g * N : (g + 1) * N].tolist()) == sorted(scores[prompt])
        assert rows[step - 1]["train/num_gen_batches"] == taken


def test_max_num_gen_batches_stops_after_exactly_that_many(tiny_build, tmp_path):
    """algorithm.filter_groups.max_num_gen_batches=2 with prompts that never have a signal
    (tests/helpers/parity_reward.py scores the samples of a prompt whose index is a multiple of 3 alike): the run stops
    with its one line after exactly 2 generation batches of 2 prompts (the rewards handed out: 2 x 2 x 4)."""
    import reward

    data_file = tmp_path / "no_signal.jsonl"
    with open(data_file, "w") as f:
        for i in range(6):
            row = {"prompt": reward.make_prompt(f"What is {i} + 3?"), "reward_model": {"ground_truth": str(i + 3)}}
            f.write(json.dumps(row | {"extra_info": {"index": 3 * i}}) + "\n")
    (tmp_path / "rewards").mkdir()
    proc = run_grpo(
        tmp_path / "run",
        1,
        *CLUSTER,
        f"data.train={data_file}",
        "data.gen_batch_size=2",
        "algorithm.filter_groups.max_num_gen_batches=2",
        check=False,
        env={"REWARD_LOG": str(tmp_path / "rewards")},
    )
    error = (
        "error: algorithm.filter_groups: 2 generation batches (max_num_gen_batches) gave 0 of 4 prompts whose "
        "rewards differ; raise it (0: no limit), or use data the policy neither always solves nor always fails"
    )
    assert proc.returncode != 0 and proc.stderr.splitlines().count(error) == 1, proc.stderr[-3000:]
    assert sum(len(s) for s in handed_out(tmp_path / "rewards").values()) == 2 * 2 * N


def torchrun_cmd(*args: str) -> list[str]:
    """torchrun, 2 ranks, grpo.py on tiny.yaml with SMALL + CLUSTER and `args`."""
    launcher = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
    ]
    return [*launcher, "grpo.py", "--config", "tiny.yaml", *SMALL, *CLUSTER, *args]


def worker_of_rank(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker process with RANK=rank (read from its environment)."""
    for pid in subprocess.run(["pgrep", "-P", str(torchrun_pid)], capture_output=True, text=True).stdout.split():
        with open(f"/proc/{pid}/environ", "rb") as f:
            if f"RANK={rank}".encode() in f.read().split(b"\0"):
                return int(pid)
    raise AssertionError(f"no worker with RANK={rank}")


def test_a_stop_signal_to_one_rank_stops_every_rank_after_the_step(straight, tmp_path):
    """SIGTERM to ONE worker, rank 1 (one node preempted; rank 0, which logs and writes the checkpoint's COMPLETE
    marker, gets nothing), during step 2: every rank finishes that step, the step is checkpointed (the only
    checkpoint: no periodic ones in this run) and every worker exits 143 (128 + SIGTERM); trainer.resume=auto
    continues with the next step, and the run ends with the metrics of the uninterrupted run."""
    out = tmp_path / "run"
    with open(tmp_path / "torchrun.log", "w") as log:
        proc = subprocess.Popen(
            torchrun_cmd(f"trainer.output_dir={out}", "trainer.save_every=0"),
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_for_step(out, 1, proc)
            os.kill(worker_of_rank(proc.pid, 1), signal.SIGTERM)
            assert proc.wait(timeout=300) != 0
        finally:  # a rank that never learns of the stop waits in a collective: leave no run behind
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    # The first worker to end exits 143 from stop(); torchrun then SIGTERMs the others, and one that is past
    # stop() already, in the interpreter's shutdown (Python's handlers are gone), may end by that signal (-15).
    report = (tmp_path / "torchrun.log").read_text()
    assert re.search(r"Root Cause.*?exitcode\s*:\s*143\b", report, re.DOTALL), report[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", report)) <= {"143", "-15"}, report[-3000:]
    stopped = max(r["step"] for r in read_metrics(out))
    assert stopped < 4
    assert [os.path.basename(p) for p in fsdp_train.list_checkpoints(str(out / "checkpoints"))] == [f"step_{stopped}"]
    resumed = run_grpo(out, 2, *CLUSTER, "trainer.save_every=0", "trainer.resume=auto")
    assert f"resumed from {out / 'checkpoints' / f'step_{stopped}'}" in resumed.stdout
    same_run(read_metrics(out), straight[1])


def test_a_signal_on_one_rank_is_seen_by_every_rank():
    """tests/helpers/stop_worker.py, 2 ranks: cluster.stop_requested() on every rank returns the first stop signal that
    ANY rank caught: 0 before; SIGINT (Ctrl-C, caught like SIGTERM, not a KeyboardInterrupt) sent to rank 1 twice: 2 on
    both ranks; then SIGTERM to rank 1: still 2 (a repeat is ignored: torchrun forwards a Ctrl-C once more)."""
    reports = run_torchrun("stop_worker.py", 2)
    assert [r["seen"] for r in reports] == [[0, 2, 2], [0, 2, 2]]


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
    without the shared file system): both nodes stop with the one line naming it, and no step runs."""
    out = tmp_path / "out"
    out.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {out}"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here (unshare -m needs root): {probe.stderr.strip()}")
    wrap = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs {out} && exec "$@"', "sh"]
    args = ["grpo.py", "--config", "tiny.yaml", *SMALL, f"trainer.output_dir={out}"]
    procs = run_nodes(args, 1, [{}, {"wrap": wrap}], timeout=300)  # no wall-clock bound: CI machines are loaded
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
