"""What a default run reads: the demo's configuration under coverage, and the share of the mission files it runs.

    .venv/bin/python bench/default_path.py                    # tiny.yaml, 2 ranks, 2 steps
    .venv/bin/python bench/default_path.py --list             # and each entered function's skipped lines
    .venv/bin/python bench/default_path.py actor.lr=3e-5      # more overrides (a feature on: what it adds)

Runs `torchrun --nproc_per_node 2 grpo.py --config tiny.yaml trainer.total_steps=2 ...` with each rank under
coverage (coverage.py, a dev-only dependency), joins the ranks' data and prints, for the mission files
(grpo.py, rollout.py, reward.py, losses.py, fsdp_train.py, sync.py):
  executed   the share of their statements the run executes (module-level imports and definitions included);
  skipped    inside the functions the run enters (at least one statement of their own ran), the share of
             their statements it never runs: the lines a reader of the default path reads for nothing;
  not errors the same without the error paths (raise statements, except clauses and their bodies).
A feature that is off should cost the default path nothing: run this before and after adding one (`--list` names
each skipped line). A report, not a check: its former targets (90% executed, 6% skipped) rewarded moving a branch
into a helper the run never enters; the check of the default path is now bench/learner_read.py (a learner's read:
the lines read, and the share of them that serves a feature that is off).
"""

import ast
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MISSION = ["grpo.py", "rollout.py", "reward.py", "losses.py", "fsdp_train.py", "sync.py"]
DEFAULT_RUN = ["--config", "tiny.yaml", "trainer.total_steps=2"]


def run_rank(data_file: str, argv: list[str]) -> None:
    """One torchrun rank: grpo.main(argv) under coverage, the data saved before the process ends (grpo.py ends
    with os._exit, which runs no atexit hook)."""
    import coverage

    sys.path.insert(0, ROOT)
    cov = coverage.Coverage(data_file=data_file, data_suffix=True, include=[os.path.join(ROOT, f) for f in MISSION])
    cov.start()
    import grpo

    status = grpo.main(argv)
    cov.stop()
    cov.save()
    grpo.cluster.end_process(status)


def error_lines(path: str) -> set[int]:
    """The lines of error paths: raise statements, except clauses and their bodies."""
    lines = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Raise):
            lines.update(range(node.lineno, node.end_lineno + 1))
        elif isinstance(node, ast.ExceptHandler):
            lines.update(range(node.lineno, node.end_lineno + 1))
    return lines


def own_statements(path: str, statements: list[int]) -> dict[str, list[int]]:
    """{function: its statements' lines}, each statement given to the innermost function around it (its
    docstring and decorators excluded); "<module>": the rest."""
    tree = ast.parse(open(path).read())
    spans = []  # (first body line, last line, qualified name)

    def visit(node, prefix: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    body = child.body
                    first = body[0]
                    doc = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
                    start = body[1].lineno if doc and len(body) > 1 else first.lineno
                    spans.append((start, child.end_lineno, name))
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(tree, "")
    owned: dict[str, list[int]] = {}
    for line in statements:
        inside = [(start, name) for start, end, name in spans if start <= line <= end]
        owner = max(inside)[1] if inside else "<module>"  # the innermost: the latest start
        owned.setdefault(owner, []).append(line)
    return owned


def report(data_file: str, show: bool) -> tuple[float, float]:
    import coverage

    cov = coverage.Coverage(data_file=data_file)
    cov.combine()
    cov.load()
    total = executed = entered_total = entered_skipped = error_skipped = 0
    rows = []
    for name in MISSION:
        path = os.path.join(ROOT, name)
        _, statements, _, missing, _ = cov.analysis2(path)
        missing, errors = set(missing), error_lines(path)
        file_skipped, file_entered, file_errors, listing = 0, 0, 0, []
        for function, lines in own_statements(path, statements).items():
            ran = [line for line in lines if line not in missing]
            if function != "<module>" and not ran:
                listing.append(f"    {function}: not entered ({len(lines)} statements)")
            if function == "<module>" or not ran:
                continue
            skipped = [line for line in lines if line in missing]
            file_entered += len(lines)
            file_skipped += len(skipped)
            file_errors += sum(line in errors for line in skipped)
            if skipped:
                listing.append(f"    {function}: {len(skipped)} of {len(lines)} skipped, lines {skipped}")
        total += len(statements)
        executed += len(statements) - len(missing)
        entered_total += file_entered
        entered_skipped += file_skipped
        error_skipped += file_errors
        rows.append(
            f"{name:14s} {len(statements):6d} {100 * (len(statements) - len(missing)) / len(statements):8.1f}% "
            f"{file_entered:9d} {100 * file_skipped / max(1, file_entered):8.1f}% "
            f"{100 * (file_skipped - file_errors) / max(1, file_entered):10.1f}%"
        )
        if show:
            rows += listing
    print(f"{'file':14s} {'stmts':>6s} {'executed':>9s} {'in entered':>9s} {'skipped':>9s} {'not errors':>11s}")
    print("\n".join(rows))
    print(
        f"{'all':14s} {total:6d} {100 * executed / total:8.2f}% {entered_total:9d} "
        f"{100 * entered_skipped / max(1, entered_total):8.1f}% "
        f"{100 * (entered_skipped - error_skipped) / max(1, entered_total):10.1f}%"
    )
    return 100 * executed / total, 100 * entered_skipped / max(1, entered_total)


def main() -> None:
    if os.environ.get("DEFAULT_PATH_DATA"):  # a rank started below
        run_rank(os.environ["DEFAULT_PATH_DATA"], sys.argv[1:])
        return
    show = "--list" in sys.argv
    overrides = [a for a in sys.argv[1:] if a != "--list"]
    with tempfile.TemporaryDirectory() as tmp:
        data_file = os.path.join(tmp, ".coverage")
        env = {**os.environ, "DEFAULT_PATH_DATA": data_file, "OMP_NUM_THREADS": "1"}
        argv = [*DEFAULT_RUN, f"trainer.output_dir={os.path.join(tmp, 'run')}", *overrides]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", os.path.abspath(__file__)]
        print("running: torchrun --nproc_per_node 2 grpo.py", " ".join([*DEFAULT_RUN, *overrides]))
        proc = subprocess.run([*cmd, *argv], cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the run failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        executed, skipped = report(data_file, show)
    print(f"executed {executed:.1f}%, skipped {skipped:.1f}% of the entered functions' statements")


if __name__ == "__main__":
    main()
