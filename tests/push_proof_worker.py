"""Worker for test_push_proof: the exact proof of a push (sync.check_push) against planted faults, in the engines the
suite runs, one after another in this process. Prints one JSON line: {engine: {fault: the proof's message, or "" when
it passed}}.

python tests/push_proof_worker.py TINY_MODEL MOE_MODEL OUT_DIR

    engines  fp32 and bf16 (tiny.py's tied Qwen2), lora (LoRA's merged push into an fp32 engine), moe (a tiny
             Qwen3-MoE, its experts pushed as the checkpoint's per-expert tensors)
    faults   clean (a correct push), unsent (one tensor not sent: a linear weight the CPU engine packs away; in the
             MoE engine one expert's), stale_head (the tied head's packed copy left from the last push), behind (a
             layer pushed from the step before), buffer (a buffer the reload resets: the rotary table zeroed)
"""

import gc
import json
import sys

import torch

import fsdp_train
import lora
import rollout
import sync

CPU = torch.device("cpu")
UNSENT = {  # engine -> the tensor its push leaves out
    "fp32": "model.layers.0.mlp.down_proj.weight",
    "bf16": "model.layers.0.mlp.down_proj.weight",
    "lora": "model.layers.1.self_attn.q_proj.weight",
    "moe": "model.layers.0.mlp.experts.2.gate_proj.weight",
}


def pushed(llm, model, leave_out: str = "", behind: dict | None = None) -> dict:
    """grpo.push's stream with its bit sums (sync.with_bit_sums): the model's weights in the engine's dtype under the
    checkpoint's names, but `leave_out`; tensors named in `behind` sent from there (the step before) instead."""
    sums = {}
    tensors = sync.full_params(model, sync.engine_dtype(llm), model.checkpoint_names, model.checkpoint_split)
    sent = ((name, (behind or {}).get(name, t)) for name, t in sync.with_bit_sums(tensors, sums) if name != leave_out)
    sync.push_weights(llm, sent)
    return sums


def proof(llm, sums: dict, at_load: dict) -> str:
    try:
        sync.check_push(llm, sums, at_load)
        return ""
    except sync.PushMismatch as e:
        return str(e)


def move(model, seed: int) -> None:
    """A training step's stand-in: every trainable weight moved."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)


def faults(kind: str, path: str) -> dict:
    fsdp_train.init_distributed()  # again after the last engine's: vLLM's shutdown destroys the process group
    adapt = lora.adapter({"rank": 4, "alpha": 8, "target_modules": "all-linear", "seed": 0}) if kind == "lora" else None
    model = fsdp_train.load_model(path, device=CPU, adapt=adapt)
    dtype = "bfloat16" if kind == "bf16" else "float32"
    llm = rollout.make_engine(path, dtype=dtype, max_model_len=256, gpu_memory_utilization=0.5)
    at_load, out = sync.engine_buffers(llm), {}
    move(model, 1)
    out["clean"] = proof(llm, pushed(llm, model), at_load)
    move(model, 2)
    out["unsent"] = proof(llm, pushed(llm, model, leave_out=UNSENT[kind]), at_load)
    if sync._tied(llm) and kind != "lora":  # a LoRA run never moves the embedding, the head with it
        move(model, 3)
        repack, sync._repack_tied_lm_head = sync._repack_tied_lm_head, lambda m: None
        out["stale_head"] = proof(llm, pushed(llm, model), at_load)
        sync._repack_tied_lm_head = repack
    before = {
        name: t.clone()
        for name, t in sync.full_params(model, sync.engine_dtype(llm), model.checkpoint_names, model.checkpoint_split)
        if ".layers.1." in name
    }
    move(model, 4)
    out["behind"] = proof(llm, pushed(llm, model, behind=before), at_load)
    out["clean_again"] = proof(llm, pushed(llm, model), at_load)
    name = next(n for n in at_load if n.endswith("cos_sin_cache"))
    llm.apply_model(lambda m: m.get_buffer(name).zero_())
    out["buffer"] = proof(llm, pushed(llm, model), at_load)
    del llm, model
    gc.collect()
    return out


def main(tiny_model: str, moe_model: str, out: str) -> None:
    sync.record_cpu_packing()  # as grpo.start_engine: before any engine loads
    report = {
        kind: faults(kind, moe_model if kind == "moe" else tiny_model) for kind in ("fp32", "bf16", "lora", "moe")
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:4])
