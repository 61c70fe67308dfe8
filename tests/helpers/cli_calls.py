"""Several grpo.py command lines in ONE process: the imports (vLLM's above all) cost seconds per process, and the
command lines of tests/test_config.py that stop before a model loads (--print-config, --help, a bad data file) need
them only once. Each call is grpo.main(argv), what `python grpo.py ARGV` runs.

    python tests/helpers/cli_calls.py CALLS.json      # CALLS.json: {"name": [argv, ...], ...}

prints one JSON object {"name": {"stdout", "stderr": what the call printed, "exit": the status grpo.main returned,
or argparse's SystemExit code (--help: 0)}} as its last line. Calls run in the file's order; a call that fails
with anything but SystemExit stops the script (a traceback, as a separate process would show).
"""

import contextlib
import io
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cluster  # noqa: E402
import grpo  # noqa: E402


def call(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = grpo.main(argv)
        except SystemExit as e:
            code = e.code
    return {"stdout": out.getvalue(), "stderr": err.getvalue(), "exit": code}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        calls = json.load(f)
    print(json.dumps({name: call(argv) for name, argv in calls.items()}))
    cluster.end_process(0)  # as grpo.py ends: calls that set up a process group leave gloo's threads behind
