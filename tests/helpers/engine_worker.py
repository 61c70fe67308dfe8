"""torchrun worker for test_rollout_sync: FSDP2 model + one vLLM engine per rank, push and check; then
grpo.sample_groups (the training loop's sampling, seeded per generation batch and rank) on the SAME prompt on
every rank.

torchrun --nproc_per_node 2 tests/helpers/engine_worker.py MODEL_PATH
"""

import functools
import sys
import types

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

import config
import fsdp_train
import grpo
import rollout
import sync
from reporting import report

torch.set_num_threads(1)
dist.init_process_group("gloo")  # BEFORE the engine: each rank then owns one engine
rank = dist.get_rank()
path = sys.argv[1]

reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
state = reference.state_dict()
full_params_equal = all(torch.equal(t, state[n]) for n, t in sync.full_params(model))
bf16_full_params_equal = all(
    t.dtype == torch.bfloat16 and torch.equal(t, state[n].to(torch.bfloat16))
    for n, t in sync.full_params(model, torch.bfloat16)
)

llm = rollout.make_engine(path, dtype="float32", max_model_len=512, gpu_memory_utilization=0.3, seed=rank)
g = torch.Generator().manual_seed(100 + rank)
with torch.no_grad():
    for p in model.parameters():
        p.to_local().add_(torch.randn(p.to_local().shape, generator=g) * 0.05)
diff_before = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model))
sync.push_weights(llm, sync.full_params(model))
diff_after = sync.check_sync(llm, functools.partial(fsdp_train.sequence_logprobs, model))

samples = rollout.generate(
    llm, [[{"role": "user", "content": "Tom has 3 apples."}]], n=4, temperature=1.0, max_tokens=8, seed=7 + 1000 * rank
)
worst = 0.0
for s in samples:
    ids = torch.tensor([s.prompt_ids + s.response_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(s.prompt_ids) - 1 : -1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
    worst = max(worst, (lp - torch.tensor(s.logprobs)).abs().max().item())
# the loop's sampling: one prompt twice in generation batch 3, then alone in batch 3 and in batch 4
cfg = config.load_config(None, ["rollout.n=4", "data.max_response_length=8"])
parts = grpo.choose_parts(cfg)
parts.score = lambda row, text, settings: (0.0, {})
run = types.SimpleNamespace(cfg=cfg, llm=llm, rank=rank, gen_cursor=3, parts=parts)
prompt = {"prompt": [{"role": "user", "content": "Tom has 3 apples."}]}
loop_samples = {"batch 3": grpo.sample_groups(run, [prompt, prompt], {})}
loop_samples["batch 3 alone"] = grpo.sample_groups(run, [prompt], {})
run.gen_cursor = 4
loop_samples["batch 4"] = grpo.sample_groups(run, [prompt], {})
report(
    rank,
    {
        "loop_samples": {k: [[s.response_ids for s in g["samples"]] for g in v] for k, v in loop_samples.items()},
        "full_params_equal": full_params_equal,
        "bf16_full_params_equal": bf16_full_params_equal,
        "diff_before_push": diff_before,
        "diff_after_push": diff_after,
        "sample_logprob_diff": worst,
        "samples": [s.response_ids for s in samples],
    },
)
del llm
if dist.is_initialized():  # vLLM's shutdown may already have destroyed it
    dist.destroy_process_group()
