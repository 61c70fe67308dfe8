"""How grpo.py's process ends, stressed (tests/test_config.py::test_every_end_of_a_run_is_clean): every documented
way a run stops, each repeated many times, in children forked from this process. It imports grpo once (a fresh
interpreter costs ~15 s of CPU here, most of the error paths a fraction of a second).

    torchrun --nproc_per_node 2 tests/helpers/exit_worker.py PLAN.json OUT_DIR

PLAN.json: a list of cases {"name", "argv", "world": 1 or 2, "reps", "stop": bool, "blind": bool}.
world 1: `python grpo.py` (torchrun's variables removed), the reps shared between the ranks, two at a time on
each. world 2: each rank forks its child of every rep; the two children join torchrun's store as a new attempt
(fsdp_train.init_distributed), one pair at a time. "stop": the child sends itself SIGTERM once its stop signals
are caught (rank 0's child; the end of grpo.setup), so the run stops after step 1 with a checkpoint. "blind": rank
1's child gets another trainer.output_dir (a node that does not see rank 0's), and the check's grace period for a
network file system is cut to 0.2 s.

Every child ends as `python grpo.py` does, cluster.end_process(grpo.main(argv)), while a daemon thread keeps
torch busy: a native thread that takes the GIL back after every op, as gloo's worker thread does when it drops a
finished collective's tensors (cluster.end_process). An end through the interpreter's finalization then aborts
("terminate called without an active exception", exit 134) in nearly every child, instead of once in tens of
runs when only gloo's worker is late. Writes OUT_DIR/rank{R}.json: {case name: [{"rep", "rank", "status",
"stdout", "stderr"}, ...]}, the status as os.waitstatus_to_exitcode gives it (-6: SIGABRT), stdout and stderr
tails.
"""

import functools
import json
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

import cluster  # noqa: E402
import grpo  # noqa: E402

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
PER_RANK = 2  # world-1 children running at once on each rank


def keep_torch_busy():
    """A daemon thread that runs small matmuls until the process ends: torch's binding releases the GIL for
    each kernel and takes it back after, from C++ (pybind11's gil_scoped_release)."""
    a = torch.ones(64, 64)

    def loop():
        while True:
            a.mm(a)

    threading.Thread(target=loop, daemon=True).start()


def send_sigterm_once_caught():
    """The scheduler's SIGTERM as soon as grpo.setup has installed its stop-signal handlers (rank 0)."""
    catch = cluster.catch_stop_signals

    def catch_then_signal():
        catch()
        keep_torch_busy()  # from here: the step, the checkpoint and the end
        if int(os.environ.get("RANK", 0)) == 0:
            os.kill(os.getpid(), signal.SIGTERM)

    cluster.catch_stop_signals = catch_then_signal


def child(case: dict, rank: int, run_dir: str, prefix: str):
    """Runs in the forked child and never returns: ends as `python grpo.py` does, cluster.end_process(grpo.main()).
    Output to prefix.out and prefix.err; the run's trainer.output_dir is run_dir."""
    for fd, suffix in ((1, "out"), (2, "err")):
        os.dup2(os.open(f"{prefix}.{suffix}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    if case["world"] == 1:
        for key in TORCHRUN_VARS:
            os.environ.pop(key, None)
    argv = [*case["argv"], f"trainer.output_dir={run_dir}"]
    if case.get("blind") and rank == 1:
        argv.append(f"trainer.output_dir={run_dir}-blind")
        cluster.check_shared_dir = functools.partial(cluster.check_shared_dir, wait_s=0.2)
    if case.get("stop"):
        send_sigterm_once_caught()
    else:
        keep_torch_busy()
    sys.argv = ["grpo.py", *argv]
    cluster.end_process(grpo.main(argv))


def run_children(jobs: list[tuple[dict, int]], rank: int, out_dir: str, at_once: int) -> dict:
    """Fork one child per (case, rep), at most `at_once` at a time; returns {case name: [results]}."""
    running, results = {}, {}

    def reap():
        pid, status = os.wait()
        case, rep, prefix = running.pop(pid)
        with open(f"{prefix}.out") as out, open(f"{prefix}.err") as err:
            result = {
                "rep": rep,
                "rank": rank,
                "status": os.waitstatus_to_exitcode(status),
                "stdout": out.read()[-2000:],
            }
            result["stderr"] = err.read()[-2000:]
        results.setdefault(case["name"], []).append(result)

    for case, rep in jobs:
        while len(running) >= at_once:
            reap()
        run_dir = os.path.join(out_dir, f"{case['name']}-{rep}")
        prefix = f"{run_dir}-rank{rank}"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            child(case, rank, run_dir, prefix)
        running[pid] = (case, rep, prefix)
    while running:
        reap()
    return results


def main():
    plan_file, out_dir = sys.argv[1], sys.argv[2]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    with open(plan_file) as f:
        plan = json.load(f)
    alone = [(c, r) for c in plan if c["world"] == 1 for r in range(c["reps"]) if r % world == rank]
    results = run_children(alone, rank, out_dir, PER_RANK)
    together = [(c, r) for c in plan if c["world"] == 2 for r in range(c["reps"])]
    results.update(run_children(together, rank, out_dir, 1))
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
