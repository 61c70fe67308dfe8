"""How torchrun test workers hand their results back (report: one JSON file per rank; stdout lines of
two ranks can interleave) and end (shut_down)."""

import json
import os


def report(rank: int, result: dict) -> None:
    path = os.path.join(os.environ["TEST_RESULTS"], f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump({"rank": rank, **result}, f)
    os.replace(path + ".tmp", path)


def shut_down() -> None:
    """The workers' last call: barrier, destroy the process group, then leave WITHOUT the interpreter's
    finalization (cluster.end_process: a gloo worker thread still dropping a collective's tensors then aborts
    the exit, "terminate called without an active exception", about one 2-rank run in 15-30 here)."""
    import torch.distributed as dist

    import cluster

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    cluster.end_process(0)
