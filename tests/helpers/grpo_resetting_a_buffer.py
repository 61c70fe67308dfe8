"""grpo.py whose engine resets a buffer at every push, as vLLM's in-place reload resets a persistent buffer it is not
sent (Apertus's xIELU beta and eps, before the push sent them): after each real push, the engine's rotary table
(cos_sin_cache) is zeroed. Used by tests/test_push_proof.py: the exact proof, against the buffers as the engine
loaded them, must stop the run at step 1's push, naming the step and the buffer.

    python tests/helpers/grpo_resetting_a_buffer.py --config tiny.yaml [key=value ...]
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import cluster  # noqa: E402
import grpo  # noqa: E402
import sync  # noqa: E402

push = sync.push_weights


def push_then_reset(llm, named_tensors, after_load=None) -> int:
    """sync.push_weights, then the rotary table zeroed: the fault, made in the engine, not in the code under test."""
    count = push(llm, named_tensors, after_load)

    def reset(model):
        name = next(name for name, _ in model.named_buffers() if name.endswith("cos_sin_cache"))
        model.get_buffer(name).zero_()

    llm.apply_model(reset)
    return count


sync.push_weights = push_then_reset
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends
