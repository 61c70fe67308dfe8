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

choose = grpo.choose_model_parts


def reset(model):
    name = next(name for name, _ in model.named_buffers() if name.endswith("cos_sin_cache"))
    model.get_buffer(name).zero_()


def choose_resetting(cfg, model_path):
    """The run's model parts, its push followed by the rotary table zeroed: the fault, made in the engine, not in the
    code under test."""
    model = choose(cfg, model_path)
    push = model.push
    model.push = lambda llm, named_tensors: (push(llm, named_tensors), llm.apply_model(reset))[0]
    return model


grpo.choose_model_parts = choose_resetting
cluster.end_process(grpo.main(sys.argv[1:]))  # as grpo.py ends
