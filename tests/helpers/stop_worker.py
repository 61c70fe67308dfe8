"""torchrun worker for tests/test_cluster.py: cluster.catch_stop_signals and stop_requested when a signal reaches ONE
rank (one node preempted, a Ctrl-C in one terminal).

    torchrun --nproc_per_node 2 tests/helpers/stop_worker.py

Each rank reports what stop_requested() returned in three rounds: no signal; after rank 1 got SIGINT twice; after
rank 1 also got SIGTERM.
"""

import os
import signal

import torch.distributed as dist

import cluster
import fsdp_train
from reporting import report, shut_down


def signal_rank(rank: int, target: int, *signals: signal.Signals) -> None:
    if rank == target:
        for sig in signals:
            os.kill(os.getpid(), sig)  # the handler runs before os.kill returns to the next bytecode
    dist.barrier()


def main():
    rank, _, _ = fsdp_train.init_distributed()
    cluster.catch_stop_signals()
    seen = [cluster.stop_requested()]
    signal_rank(rank, 1, signal.SIGINT, signal.SIGINT)
    seen.append(cluster.stop_requested())
    signal_rank(rank, 1, signal.SIGTERM)
    seen.append(cluster.stop_requested())
    report(rank, {"seen": seen})
    shut_down()


if __name__ == "__main__":
    main()
