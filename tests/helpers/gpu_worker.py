"""Worker for test_gpu (a CUDA GPU): R3 against vLLM's own routing. A tiny Qwen3-MoE (4 experts, top-2) served by
vLLM with enable_return_routed_experts (its Model Runner V2, the GPU default), in fp32 and in bf16: samples of a few
prompts, their routing as the loop batches it (grpo.groups_to_batch: moe.routing_field, fsdp_train.add_fields),
then the trainer's log-probs (fsdp_train.compute_logprobs) with that routing replayed (moe.attach R3) and without
(the routing dropped: each router's own choice), each against vLLM's sampled log-probs. Prints one JSON line:
{"replayed": max |difference|, "own": max |difference|, "disagreement": share of (token, layer) pairs}.

python tests/helpers/gpu_worker.py OUT_DIR DTYPE      # float32 or bfloat16, one engine per process
"""

import json
import os
import sys

import torch
import transformers

import fsdp_train
import grpo
import moe
import rollout
import tiny


def main(out: str, dtype: str) -> None:
    fsdp_train.init_distributed()
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny.build(".cache/tiny")["model"])
    path = tiny.save_random_family_model(
        os.path.join(out, f"moe-{dtype}"), tokenizer, transformers.Qwen3MoeConfig, seed=1,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
    )  # fmt: skip
    prompts = [[{"role": "user", "content": f"Tom has {k} apples and {k + 3} pens."}] for k in range(4)]
    llm = rollout.make_engine(path, dtype=dtype, max_model_len=256, gpu_memory_utilization=0.3,
                              enable_return_routed_experts=True, enforce_eager=True)  # fmt: skip
    samples = moe.routed_generate(llm, prompts, n=4, temperature=1.0, max_tokens=32, seed=0)
    group = {"samples": samples, "rewards": torch.zeros(len(samples)), "extras": [{}] * len(samples)}
    batch = grpo.groups_to_batch([group], pad_id=tokenizer.pad_token_id)
    assert (batch["routed_experts"] >= 0).any(), "vLLM returned no routing"
    model = fsdp_train.load_model(path, device=torch.device("cuda"), trainable=False,
                                  param_dtype=grpo.DTYPES[dtype])  # fmt: skip
    moe.attach(model, "R3")
    report = {}
    for name in ("replayed", "own"):
        b = batch if name == "replayed" else {k: v for k, v in batch.items() if k != "routed_experts"}
        logp, _ = fsdp_train.compute_logprobs(model, b, temperature=1.0, max_tokens=4096)
        report[name] = ((logp - batch["rollout_logprobs"]).abs() * batch["response_mask"]).max().item()
    report["disagreement"] = moe.disagreement(moe.take_sums(model))["layers"]
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
