"""bench/recipe.py, the recipe at real shapes on a GPU, runs at the tiny shape on a CPU: one table, a row per step,
every column filled from the run's own metrics (the exact proof's seconds included)."""

from conftest import run_python


def test_the_recipe_bench_prints_its_table_at_the_tiny_shape(tiny_build, tmp_path):
    """--cudagraph-sizes run: the engine is asked for graphs at the probe's 1 sequence and 4 prompts x 4 (a CPU
    engine runs eagerly and keeps none: docs/cpu-notes.md); the run goes on as with vLLM's own sizes."""
    proc = run_python(
        "bench/recipe.py", "--shape", "tiny", "--steps", "2", "--prompts", "4", "--n", "4", "--out", str(tmp_path),
        "--cudagraph-sizes", "run",
    )  # fmt: skip
    assert "(2 steps, CUDA graphs at [1, 16]):" in proc.stdout
    table = proc.stdout[proc.stdout.index("| step |") :].strip().splitlines()
    head = [c.strip() for c in table[0].strip("|").split("|")]
    assert head[:4] == ["step", "startup s", "step s", "gen s"] and "push_proof s" in head and "MFU" in head
    rows = [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True)) for line in table[2:]]
    assert [r["step"] for r in rows] == ["1", "2"]
    assert float(rows[0]["startup s"]) > 0 and rows[1]["startup s"] == ""
    for r in rows:
        assert float(r["update_weights s"]) > 0 and float(r["push_proof s"]) > 0 and float(r["gen s"]) > 0
        assert float(r["logprob_diff max"]) < 1e-3 and float(r["rollout/sync_check"]) < 1e-3  # fp32 on a CPU
        assert float(r["tokens/s/GPU"].replace(",", "")) > 0


def test_the_runs_cudagraph_sizes_reach_the_engine(tiny_build):
    """rollout.cudagraph_capture_sizes, as grpo.start_engine builds the rank's engine: vLLM's record of the arguments
    it was given (its "non-default args" line) holds the sizes, sorted, in its compilation config."""
    code = (
        "import config, grpo, types\n"
        "cfg = config.load_config('tiny.yaml', ['rollout.cudagraph_capture_sizes=[16, 1]'])\n"
        f"grpo.start_engine(types.SimpleNamespace(cfg=cfg, rank=0), {tiny_build['model']!r})\n"
    )
    proc = run_python("-c", code)
    given = [line for line in (proc.stdout + proc.stderr).splitlines() if "non-default args:" in line]
    assert given and "'cudagraph_capture_sizes': [1, 16]" in given[0], given
