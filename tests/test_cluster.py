"""Clusters and faults: several nodes simulated on this machine (torchrun --nnodes 2 --node_rank 0/1 on
127.0.0.1), a node without the shared file system (a private mount namespace), stop signals, and a worker
killed under torchrun --max-restarts. The end-to-end runs are compared with an uninterrupted 2-rank run."""

import json
import os
import shutil
import subprocess

import pytest

from conftest import ROOT, run_nodes


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
    procs = run_nodes([os.path.join(ROOT, "tests", "cluster_worker.py")], 2,
                      [{"args": [str(d), *extra], "env": {"TEST_RESULTS": str(results)}} for d in disks], timeout=300)
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
