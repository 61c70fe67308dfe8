"""grpo.py with the weight push switched off: the engine keeps serving the initial weights while the
trainer moves on (the bug the run-time sync proof must catch). Used by tests/test_grpo.py.

    python tests/grpo_without_push.py --config tiny.yaml [key=value ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import cluster  # noqa: E402
import grpo  # noqa: E402
import sync  # noqa: E402

sync.push_weights = lambda llm, named_tensors: 0  # the injected fault: nothing reaches the engine
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends
