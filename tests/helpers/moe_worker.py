"""Worker for test_moe: Mixture-of-Experts models served by vLLM against the trainer, in one process (an engine
per model). Prints one JSON line.

python tests/helpers/moe_worker.py HF_DIR [DIR ...]
    HF_DIR, an exported model (hf/), served and loaded by the trainer: "sync": vLLM's sampled log-probs against the
    trainer's, max |difference|; "logits": the trainer's logits against transformers' from_pretrained, max |diff|.
    Each DIR, a model loaded as the loop loads it (grpo.choose_model_parts: its routers hooked), its weights moved (a
    step's stand-in) and pushed into a vLLM engine serving the checkpoint (grpo.push: the experts under the
    checkpoint's per-expert names): "pushed": {DIR's name: {"before": vLLM against the trainer before the push,
    "after": after it}}.
"""

import functools
import gc
import json
import os
import sys
import types

import torch
from transformers import AutoModelForCausalLM

import fsdp_train
import rollout
import sync

CPU = torch.device("cpu")


def served_export(path: str) -> dict:
    """The export served: vLLM's log-probs and transformers' logits against the trainer's."""
    model = fsdp_train.load_model(path, device=CPU, trainable=False)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[(3 + 11 * i) % 400 for i in range(24)]])
    with torch.no_grad():
        logits = (fsdp_train.trainer_logits(model, ids) - reference(input_ids=ids).logits).abs().max().item()
    llm = rollout.make_engine(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)
    gap = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model), max_tokens=32)
    del llm
    gc.collect()
    return {"sync": gap, "logits": logits}


def pushed(path: str) -> dict:
    """vLLM against the trainer (sync.check_sync) before and after the push of the trainer's moved weights."""
    import config
    import grpo

    fsdp_train.init_distributed()  # again after the last model's: vLLM's shutdown destroys the process group
    parts = grpo.choose_model_parts(config.load_config(["tiny.yaml"], []), path)  # as a run of this model chooses
    model = parts.load(path, device=CPU)
    assert hasattr(model, "moe_routing")  # hooked, as the loop's policy
    llm = rollout.make_engine(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    trainer = functools.partial(fsdp_train.sequence_logprobs, model)
    before = sync.check_sync(llm, trainer, max_tokens=32)
    grpo.push(types.SimpleNamespace(llm=llm, model=parts), model)
    after = sync.check_sync(llm, trainer, max_tokens=32)
    del llm
    gc.collect()
    return {"before": before, "after": after}


if __name__ == "__main__":
    fsdp_train.init_distributed()
    out = served_export(sys.argv[1])
    out["pushed"] = {os.path.basename(path): pushed(path) for path in sys.argv[2:]}
    print(json.dumps(out))
