"""Worker for test_families: grpo.py's runs of every family, one after another in this process (the libraries
imported once; each family's modules are the trainer's own copies, fsdp_train.trainer_model_class, and vLLM's
Transformers backend decorates the shared ones in this same process, as in a real run). Writes one JSON file:
{family: {"first": {"returncode", "stderr"}, "resumed": {...} or null}}, the resumed run only after a good first.

python tests/helpers/families_worker.py RUNS_JSON OUT_JSON
    # RUNS_JSON: {family: {"first": argv, "resumed": argv or absent}}
"""

import contextlib
import io
import json
import sys
import traceback

import grpo


def run(argv: list[str]) -> dict:
    """grpo.main(argv) in process: its exit status and what it printed on stderr (a traceback if it raised)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            status = grpo.main(argv)
        except BaseException:
            status, _ = 1, traceback.print_exc()
    return {"returncode": status, "stderr": err.getvalue()}


def main(runs_file: str, out_file: str) -> None:
    results = {}
    for family, argvs in json.load(open(runs_file)).items():
        first = run(argvs["first"])
        resumed = run(argvs["resumed"]) if first["returncode"] == 0 and "resumed" in argvs else None
        results[family] = {"first": first, "resumed": resumed}
        with open(out_file, "w") as f:  # after each family: a crash keeps the families before it
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
