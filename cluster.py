"""Running on a cluster: what each node fetches, the checks that several nodes see one output directory,
the resume point chosen once, stop signals (preemption) turned into a clean checkpoint, how a rank's process
ends, and the RNG states a checkpoint carries. Plumbing for grpo.py, not the algorithm. The functions that
communicate are collective: call them on all ranks.

    model_dir = node_first(lambda first: resolve_model(path, download=first))   # one download per node
    check_shared_dir("runs/gsm8k")      # else one line: the nodes do not share trainer.output_dir
    catch_stop_signals(); ...; if stop_requested(): save, exit 128 + signal
    end_process(status)                 # the last call: the last line printed is the last thing that happens
"""

import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

import fsdp_train
from config import ConfigError
from logs import log0


def node_first(fetch):
    """fetch(first=True) on each node's local rank 0 (it downloads or builds into the node's own disk or
    cache), then fetch(first=False) on the node's other ranks (they read what it left there). Nodes need not
    share a file system. A failure on any node stops every rank with that one-line message."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    result, error = None, None
    if local_rank == 0:
        try:
            result = fetch(True)
        except (ValueError, OSError) as e:  # ConfigError is a ValueError
            error = str(e)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)  # also the barrier the other ranks wait at
    if any(errors):
        raise ConfigError(next(e for e in errors if e))
    if local_rank == 0:
        return result
    try:
        return fetch(False)
    except (ValueError, OSError) as e:
        raise ConfigError(str(e)) from None


def check_shared_dir(path: str, key: str = "trainer.output_dir", wait_s: float = 10.0) -> None:
    """Stop (one line, every rank) unless all ranks see the same directory at `path`: rank 0 writes a fresh
    marker file there and every rank looks for it (for up to wait_s, as a network file system may show a new
    file late). Checkpoints need it: every rank writes its DCP shards there, rank 0 the COMPLETE marker."""
    os.makedirs(path, exist_ok=True)
    token = [f".shared-check-{os.getpid()}-{time.time_ns()}" if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    marker = os.path.join(path, token[0])
    if dist.get_rank() == 0:
        open(marker, "w").close()
    dist.barrier()
    deadline = time.monotonic() + wait_s
    while not (seen := token[0] in os.listdir(path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    blind = [None] * dist.get_world_size()
    dist.all_gather_object(blind, None if seen else f"{os.uname().nodename} (rank {dist.get_rank()})")
    if dist.get_rank() == 0:
        os.remove(marker)
    if any(blind):
        raise ConfigError(
            f"config: {key} = {path!r} is not one directory shared by all nodes: "
            f"{', '.join(b for b in blind if b)} cannot see what rank 0 writes there; put it on a "
            "file system every node mounts"
        )


def broadcast(value, src: int = 0):
    """rank src's value, on every rank (e.g. the checkpoint to resume from, chosen once by rank 0)."""
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


# ---------------------------------------------------------------------------------- stop signals
_stop = {"signal": 0}


def catch_stop_signals() -> None:
    """SIGTERM (SLURM / Kubernetes preemption, torchrun's shutdown) and SIGINT (Ctrl-C) only set a flag; the
    loop finishes its step, checkpoints it and exits. Repeats are ignored: a terminal's Ctrl-C reaches torchrun
    and its workers, and torchrun then forwards it once more. torchrun SIGKILLs workers that are still running
    --shutdown-timeout seconds (default 30) after forwarding: give it a step and a checkpoint's time."""

    def handler(signum, frame):
        _stop["signal"] = _stop["signal"] or signum

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handler)


def stop_requested() -> int:
    """The stop signal any rank received (0: none), the same on every rank."""
    flag = torch.tensor([_stop["signal"]], dtype=torch.int64)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return int(flag.item())


def stop(run, step: int, signum: int, progress, save) -> int:
    """A stop signal arrived during `step` of grpo.train's run: the progress bar closed, a checkpoint of that step
    (save(step), unless just done), one line, the run closed; returns the exit status 128 + signal, a signalled
    process's; trainer.resume=auto continues at step + 1. No validation, export or curves."""
    progress.close()
    path = os.path.join(run.cfg["trainer"]["output_dir"], "checkpoints", f"step_{step}")
    if run.saved != step:
        path = save(step)
    log0(
        run.rank,
        f"stopped by {signal.Signals(signum).name} after step {step}: checkpoint {path}; run again with "
        "trainer.resume=auto to continue",
    )
    if run.logger.wandb is not None:  # its atexit hook does not run (cluster.end_process)
        run.logger.wandb.finish(exit_code=128 + signum)
    close(run)
    return 128 + signum


def close(run) -> None:
    """The end of a run: its engine, then the process group (vLLM's shutdown may already have destroyed it)."""
    run.llm = None
    if dist.is_initialized():
        dist.destroy_process_group()


def end_process(status: int):
    """Flush the console and end the process with `status` now, WITHOUT the interpreter's finalization (os._exit).

    Why: native threads can still be busy when the main thread is done, and some of them touch Python objects.
    gloo's worker thread hands a collective's result over, then drops the collective's work; its tensors keep
    their Python objects alive once Python has let go of them (as after all_gather_object), so dropping them
    takes the GIL. A thread that asks for the GIL after Python's finalization has begun is ended with
    pthread_exit (CPython 3.11-3.13), whose unwinding cannot pass a C++ noexcept destructor (here
    ~AsyncAllgatherWork): std::terminate, "terminate called without an active exception" after our last line,
    exit 134 instead of 1 or 143. It takes a thread scheduled late (a loaded machine), and any native thread
    running then (the engine's, torch's, NCCL's) can do the same. Ending here leaves no finalization to race
    with, and spares the ~8 s it takes with vLLM and torch loaded. Nothing is lost: flatgrpo closes every file
    it writes when written and the log handlers flush each record; the libraries' atexit hooks do not run."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def resume(cfg: dict, load_checkpoint, rank: int, world: int) -> tuple[int, dict]:
    """Load the checkpoint trainer.resume names (auto: the newest complete one, chosen by rank 0 for all) with
    load_checkpoint(path) -> the saved loop state (the model record's resume: fsdp_train.load_checkpoint on the run's
    model, optimizer and schedule). Returns the first step to run and this rank's saved loop state: step, generation
    cursor, RNG states (dropped when the checkpoint was written at another world size)."""
    trainer = cfg["trainer"]
    path = trainer["resume"] if trainer["resume"] not in ("off", "auto") else None
    if trainer["resume"] == "auto":
        newest = None
        if rank == 0:
            complete = fsdp_train.list_checkpoints(os.path.join(trainer["output_dir"], "checkpoints"))
            newest = complete[-1] if complete else None
        path = broadcast(newest)  # rank 0's choice, for all: ranks must not resume different steps
    if not path:
        return 1, {}
    extra = load_checkpoint(path)
    log0(rank, f"resumed from {path} (step {extra['step']})")
    if extra["saved_world_size"] != world:
        extra.pop("rng", None)
    return extra["step"] + 1, extra


# ---------------------------------------------------------------------------------- RNG states
def seed_everything(seed: int):
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def restore_rng(state: dict):
    random.setstate(state["python"])
    if "numpy" in state:  # checkpoints from before it was saved lack it
        np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def global_rows(
    tensors: list[torch.Tensor], positions: list[int], groups: list[int]
) -> tuple[list[torch.Tensor], list[int]]:
    """Each rank's [b, R_rank] tensors -> the WHOLE batch's [B, R] tensors on every rank (the rows of the prompt at
    position p of the step's prompt list before those of position p + 1, a prompt's rows in their order; R is the
    widest rank's, zero-padded), and the rows that are this rank's. The same tensors at any world size, so
    whole-batch statistics (rollout correction) do not depend on it. groups: each local row's prompt, its index among
    this rank's prompts (batch["uid"]), whose position is positions[group]."""
    keys = [positions[group] for group in groups]  # each row's prompt's place
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, (keys, [t.cpu() for t in tensors]))
    width = max(t.shape[1] for _, ts in parts for t in ts)
    every_key = [key for part_keys, _ in parts for key in part_keys]
    order = sorted(range(len(every_key)), key=every_key.__getitem__)  # stable: a prompt's rows stay in order
    place = {row: i for i, row in enumerate(order)}  # gathered row -> its row in the whole batch
    offset = sum(len(part_keys) for part_keys, _ in parts[: dist.get_rank()])
    out = []
    for k in range(len(tensors)):
        stacked = torch.cat([torch.nn.functional.pad(ts[k], (0, width - ts[k].shape[1])) for _, ts in parts])
        out.append(stacked[order])  # [B, R]
    return out, [place[offset + k] for k in range(len(keys))]
