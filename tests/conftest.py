"""Shared fixtures: tiny offline models built by tiny.py, and a helper to run torchrun scripts (tests/helpers/: the
workers and helper modules the test modules run and import; on sys.path from here)."""

import json
import os
import subprocess
import sys
import tempfile

import pytest

# vLLM on CPU: in-process engine, a small KV cache (see docs/cpu-notes.md).
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HELPERS = os.path.join(ROOT, "tests", "helpers")  # the workers and shared helpers the test modules run and import
sys.path.insert(0, HELPERS)  # fp32_noise, reporting, the workers' shared constants
PYTHONPATH = os.pathsep.join([ROOT, HELPERS, os.path.join(ROOT, "tests")])  # what a process a test starts imports

# `make test` runs two pytest workers (pytest-xdist). Each worker gets its share of the cores, and every process
# a test starts gets its share of the worker's: OpenMP threads that outnumber the cores spin-wait, and a run
# then takes several times as long (docs/cpu-notes.md). Set before torch loads, for the tests' own torch too.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, (os.cpu_count() or 1) // WORKERS)
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(CORES)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU and vLLM's GPU build (tests/test_gpu.py; skipped on CPU)")


def threads(nproc: int = 1) -> str:
    """OMP_NUM_THREADS for each of the nproc ranks (or processes) a test starts at once."""
    return str(max(1, CORES // nproc))


@pytest.fixture(scope="session")
def tiny_tokenizer():
    import tiny

    data = tiny.make_dataset(seed=0, n_train=400, n_test=10)
    corpus = [r["question"] + " " + tiny.INSTRUCTION for r in data["train"]]
    corpus += [tiny.chat_response(r["answer"], h) for r in data["train"] for h in (True, False)]
    return tiny.build_tokenizer(corpus)


@pytest.fixture(scope="session")
def random_models(tiny_tokenizer, tmp_path_factory):
    """{"tied": path, "untied": path}: random tiny Qwen2 models (fp32) with the tiny tokenizer."""
    import tiny

    root = tmp_path_factory.mktemp("random-models")
    return {
        name: tiny.save_random_model(str(root / name), tiny_tokenizer, seed=1, tie_word_embeddings=tied)
        for name, tied in (("tied", True), ("untied", False))
    }


@pytest.fixture(scope="session")
def tiny_build():
    """The full tiny set-up (data, warm-started model): built once, cached in .cache/tiny. The pytest workers
    (`make test` runs two) take a lock: one builds, the other waits and reuses the build."""
    import fcntl

    import tiny

    cache = os.path.join(ROOT, ".cache", "tiny")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return tiny.build(cache, seed=0)


def run_python(*args: str, timeout: int = 600, check: bool = True) -> subprocess.CompletedProcess:
    """Run `python ARGS` in the repository, one thread of the worker's cores; check: it exits 0."""
    proc = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": threads(1)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert not check or proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc


def cli_calls(calls: dict, folder, env: dict | None = None) -> dict:
    """grpo.py command lines that stop before a model loads, run in ONE process (tests/helpers/cli_calls.py: importing
    vLLM costs seconds per process). calls: {name: argv}; returns {name: {"stdout", "stderr", "exit"}}."""
    path = os.path.join(folder, "calls.json")
    with open(path, "w") as f:
        json.dump(calls, f)
    proc = subprocess.run(
        [sys.executable, "tests/helpers/cli_calls.py", path],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_torchrun(script: str, nproc: int, *args: str, timeout: int = 600, killed: bool = False) -> list[dict]:
    """Run tests/helpers/<script> under torchrun; returns what each rank report()ed (tests/helpers/reporting.py).
    killed=True: the script is expected to die (SIGKILL) part-way; returns [] after checking it did."""
    results_dir = tempfile.mkdtemp(prefix="torchrun-results-")
    env = {**os.environ, "OMP_NUM_THREADS": threads(nproc), "PYTHONPATH": PYTHONPATH, "TEST_RESULTS": results_dir}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        os.path.join(HELPERS, script),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if killed:
        assert proc.returncode != 0, f"{script} was expected to be killed:\n{proc.stdout[-2000:]}"
        return []
    if proc.returncode != 0:
        raise AssertionError(
            f"torchrun {script} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    results = []
    for rank in range(nproc):
        with open(os.path.join(results_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_nodes(
    script: list[str], nproc: int, nodes: list[dict], timeout: int = 600
) -> list[subprocess.CompletedProcess]:
    """Several torchrun "nodes" on this machine (--nnodes len(nodes) --node_rank k, rendezvous on 127.0.0.1),
    started together; nodes[k] may give "args" (appended to script), "env" and "wrap" (a command prefix, e.g.
    a private mount namespace). Returns each node's finished process (stdout, stderr, returncode)."""
    port = free_port()
    procs = []
    for k, node in enumerate(nodes):
        env = {**os.environ, "OMP_NUM_THREADS": threads(nproc * len(nodes)), "PYTHONPATH": PYTHONPATH}
        env.update(node.get("env", {}))
        cmd = [
            *node.get("wrap", []),
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            str(len(nodes)),
            "--node_rank",
            str(k),
            "--nproc_per_node",
            str(nproc),
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            *script,
            *node.get("args", []),
        ]
        procs.append(
            subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr))
    return out


CONSTANT = 0.375  # a float32 number, as veRL's reward tensor holds it: the constant reward file's score


@pytest.fixture(scope="module")
def reward_files(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rewards")
    files = {
        "constant": f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        f"    return {CONSTANT}\n",
        "nan_at_row_2": "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float('nan') if extra_info['index'] == 2 else 1.0\n",
        "broken": "import no_such_module\n",
    }
    for name, text in files.items():
        (root / f"{name}.py").write_text(text)
    return {name: str(root / f"{name}.py") for name in files}
