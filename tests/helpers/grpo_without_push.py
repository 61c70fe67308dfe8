"""grpo.py with the weight push switched off: the engine keeps serving the initial weights while the
trainer moves on (the bug the run-time proofs must catch). Used by tests/test_end_to_end.py and tests/test_gpu.py.

    python tests/helpers/grpo_without_push.py --config tiny.yaml [key=value ...]
    WITHOUT_PUSH_PROOF=1 python tests/helpers/grpo_without_push.py ...    # the exact proof off: the probe alone
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cluster  # noqa: E402
import grpo  # noqa: E402
import sync  # noqa: E402

choose = grpo.choose_model_parts


def choose_without_push(cfg, model_path):
    """The run's model parts, its push replaced: the fault, tensors sent and never loaded."""
    model = choose(cfg, model_path)
    model.push = lambda llm, tensors: sum(1 for _ in tensors)
    return model


grpo.choose_model_parts = choose_without_push
if os.environ.get("WITHOUT_PUSH_PROOF"):  # the log-prob probe alone: the exact proof switched off too
    sync.check_push = lambda *args, **kwargs: 0
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends
