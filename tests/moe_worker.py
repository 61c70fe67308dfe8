"""Worker for test_moe: an exported Mixture-of-Experts model (hf/) served by vLLM and loaded by the trainer; prints
one JSON line {"sync": vLLM's sampled log-probs against the trainer's, max |difference|, "logits": the trainer's
logits against transformers' from_pretrained, max |difference|}.

python tests/moe_worker.py HF_DIR
"""

import functools
import json
import sys

import torch
from transformers import AutoModelForCausalLM

import fsdp_train
import rollout
import sync

path = sys.argv[1]
fsdp_train.init_distributed()
model = fsdp_train.load_model(path, device=torch.device("cpu"), trainable=False)
reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
ids = torch.tensor([[(3 + 11 * i) % 400 for i in range(24)]])
with torch.no_grad():
    logits = (fsdp_train.trainer_logits(model, ids) - reference(input_ids=ids).logits).abs().max().item()
llm = rollout.make_engine(path, dtype="float32", max_model_len=256, gpu_memory_utilization=0.5)
gap = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model), max_tokens=32)
print(json.dumps({"sync": gap, "logits": logits}))
