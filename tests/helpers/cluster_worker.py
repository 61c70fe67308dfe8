"""torchrun worker for tests/test_cluster.py: cluster.node_first on several (simulated) nodes.

    torchrun --nnodes 2 --node_rank K --nproc_per_node 2 ... tests/helpers/cluster_worker.py NODE_DIR [--fail-node K]

NODE_DIR is this node's own "disk" (each node process gets another one). fetch(first=True) "downloads":
it counts itself in NODE_DIR/downloads and writes NODE_DIR/model; fetch(first=False) only reads the file,
and fails if it is not there yet. With --fail-node K, the download fails on node K. Each rank reports
what it got (the model text or the error line).
"""

import argparse
import os

import torch.distributed as dist

import cluster
import fsdp_train
from config import ConfigError
from reporting import report, shut_down


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("node_dir")
    ap.add_argument("--fail-node", type=int, default=-1)
    args = ap.parse_args()
    rank, world, _ = fsdp_train.init_distributed()
    node = int(os.environ["GROUP_RANK"])  # torchrun's node rank
    model = os.path.join(args.node_dir, "model")

    def fetch(first: bool) -> str:
        if first:
            with open(os.path.join(args.node_dir, "downloads"), "a") as f:
                f.write(f"{rank}\n")
            if node == args.fail_node:
                raise OSError(f"hub unreachable from node {node}")
            with open(model, "w") as f:
                f.write(f"weights fetched by rank {rank}")
        with open(model) as f:  # raises (FileNotFoundError) if the node's first rank did not fetch first
            return f.read()

    try:
        result = {"model": cluster.node_first(fetch)}
    except ConfigError as e:
        result = {"error": str(e)}
    report(rank, {"node": node, "local_rank": int(os.environ["LOCAL_RANK"]), **result})
    dist.barrier()
    shut_down()


if __name__ == "__main__":
    main()
